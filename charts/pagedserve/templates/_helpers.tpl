{{/*
Names. Component suffixes (-scheduler is the longest, 10 characters) are appended to the full name,
so it is cut at 52 characters to keep every Service name a valid 63-character DNS label.
*/}}
{{- define "pagedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 52 | trimSuffix "-" }}
{{- end }}

{{- define "pagedserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pagedserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pagedserve.routerName" -}}{{ include "pagedserve.fullname" . }}-router{{- end }}
{{- define "pagedserve.replicaName" -}}{{ include "pagedserve.fullname" . }}-replica{{- end }}
{{/* One model's replicas (Deployment or LeaderWorkerSet, autoscaler): <fullname>-replica, or with a
`models:` list <fullname>-replica-<name>. Called with a model's context (pagedserve.forEachModel). */}}
{{- define "pagedserve.modelReplicaName" -}}{{ include "pagedserve.replicaName" . }}{{ with .modelKey }}-{{ . }}{{ end }}{{- end }}
{{/* Headless Service of the schedulers: Kubernetes discovery and metrics scraping. */}}
{{- define "pagedserve.schedulerServiceName" -}}{{ include "pagedserve.fullname" . }}-scheduler{{- end }}
{{- define "pagedserve.redisName" -}}{{ include "pagedserve.fullname" . }}-redis{{- end }}
{{- define "pagedserve.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "pagedserve.fullname" .)) .Values.router.apiKeys.existingSecret }}
{{- end }}
{{- define "pagedserve.internalTokenSecretName" -}}
{{- default (printf "%s-internal" (include "pagedserve.fullname" .)) .Values.internalToken.existingSecret }}
{{- end }}
{{- define "pagedserve.internalTokenSecretKey" -}}
{{- if .Values.internalToken.existingSecret }}{{ .Values.internalToken.existingSecretKey }}{{ else }}internal-token{{ end }}
{{- end }}
{{- define "pagedserve.internalTokenDir" -}}/etc/pagedserve/internal-token{{- end }}

{{/* The internal token as a file: the volume (pods) and its mount (routers, schedulers). */}}
{{- define "pagedserve.internalTokenVolume" -}}
- name: internal-token
  secret:
    secretName: {{ include "pagedserve.internalTokenSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ include "pagedserve.internalTokenSecretKey" . }}
        path: internal-token
{{- end }}
{{- define "pagedserve.internalTokenMount" -}}
- name: internal-token
  mountPath: {{ include "pagedserve.internalTokenDir" . }}
  readOnly: true
{{- end }}

{{- define "pagedserve.apiKeysSecretKey" -}}
{{- if .Values.router.apiKeys.existingSecret }}{{ .Values.router.apiKeys.existingSecretKey }}{{ else }}api-keys{{ end }}
{{- end }}

{{/*
Labels. Call with (dict "ctx" $ "component" "router").
*/}}
{{- define "pagedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- with .ctx.modelKey }}
pagedserve.dev/model: {{ . }}
{{- end }}
{{- end }}

{{/*
Several base models (`models:`): each entry renders the replica templates with a context of its own,
whose Values are the release's with that model's source, replicas, GPUs, resources, LoRA and autoscaler laid
over them, and whose modelKey names its objects and labels its pods. Without a list: the release's own
context, so a single-model release renders exactly as before. Called with (dict "root" $ "template" NAME).
*/}}
{{- define "pagedserve.forEachModel" -}}
{{- $root := .root }}
{{- if not $root.Values.models }}
{{- include .template $root }}
{{- else }}
{{- range $i, $m := $root.Values.models }}
{{- $v := deepCopy $root.Values }}
{{- $model := $v.model }}
{{- $_ := set $model "servedModelName" $m.name }}
{{- range $k := list "source" "pvc" "hostPath" "path" "dtype" "maxModelLen" "convert" }}
{{- if hasKey $m $k }}{{ $_ := set $model $k (get $m $k) }}{{ end }}
{{- end }}
{{- $r := $v.replica }}
{{- if hasKey $m "replicas" }}{{ $_ := set $r "replicaCount" $m.replicas }}{{ end }}
{{- if hasKey $m "nodes" }}{{ $_ := set $r "nodes" $m.nodes }}{{ end }}
{{- if hasKey $m "gpus" }}{{ $_ := set $r.engine "gpus" $m.gpus }}{{ end }}
{{- if hasKey $m "resources" }}{{ $_ := set $r.engine "resources" $m.resources }}{{ end }}
{{- if hasKey $m "kvCacheMemory" }}{{ $_ := set $r.engine "kvCacheMemory" $m.kvCacheMemory }}{{ end }}
{{- if hasKey $m "numKvBlocks" }}{{ $_ := set $r.engine "numKvBlocks" $m.numKvBlocks }}{{ end }}
{{- with $m.lora }}
{{- /* Key by key, not mergeOverwrite: that would skip the entry's false and empty values (enabled: false). */}}
{{- range $k, $val := . }}
{{- $was := get $v.lora $k }}
{{- if and (kindIs "map" $val) (kindIs "map" $was) }}
{{- $_ := set $v.lora $k (merge (deepCopy $val) $was) }}
{{- else }}
{{- $_ := set $v.lora $k $val }}
{{- end }}
{{- end }}
{{- end }}
{{- with $m.autoscaling }}
{{- $kind := default "none" .kind }}
{{- $_ := set $v.autoscaling "enabled" (eq $kind "hpa") }}
{{- $_ := set $v.keda "enabled" (eq $kind "keda") }}
{{- $_ := mergeOverwrite $v.autoscaling (omit . "kind") }}
{{- end }}
{{- $ctx := dict "Values" $v "Release" $root.Release "Chart" $root.Chart "Capabilities" $root.Capabilities
      "Files" $root.Files "Template" $root.Template "modelKey" $m.name }}
{{- with include $.template $ctx }}
---
{{ . }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pagedserve.labels" -}}
{{ include "pagedserve.selectorLabels" . }}
helm.sh/chart: {{ include "pagedserve.chart" .ctx }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: pagedserve
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Image reference. Call with (dict "ctx" $ "image" .Values.images.router "prefix" true).
*/}}
{{- define "pagedserve.image" -}}
{{- $repo := .image.repository }}
{{- if and .prefix .ctx.Values.images.registry }}
{{- $repo = printf "%s/%s" (trimSuffix "/" .ctx.Values.images.registry) .image.repository }}
{{- end }}
{{- if .image.digest }}
{{- printf "%s@%s" $repo .image.digest }}
{{- else }}
{{- printf "%s:%s" $repo (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}
{{- end }}

{{- define "pagedserve.imagePullSecrets" -}}
{{- with .Values.images.pullSecrets -}}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Model. The bundled model is converted into every image at build time (docker/*.Dockerfile), at a
fixed path, so no pod converts or downloads anything at start.
*/}}
{{- define "pagedserve.bundledModelPath" -}}/opt/pagedserve/default-model{{- end }}
{{- define "pagedserve.modelMountPath" -}}/models{{- end }}

{{- define "pagedserve.modelArg" -}}
{{- if eq .Values.model.source "bundled" }}
{{- include "pagedserve.bundledModelPath" . }}
{{- else if .Values.model.path }}
{{- printf "%s/%s" (include "pagedserve.modelMountPath" .) (trimPrefix "/" .Values.model.path) }}
{{- else }}
{{- include "pagedserve.modelMountPath" . }}
{{- end }}
{{- end }}

{{/*
GGUF models are converted once per pod, before the services start, by init containers running
`pagedserve convert` from the engine image (the only image with torch and the model formats): the
replica pod converts the whole model for its engine and scheduler, the router pod extracts the
tokenizer alone. "true" when that happens.
*/}}
{{- define "pagedserve.converting" -}}
{{- $c := .Values.model.convert }}
{{- if and (ne .Values.model.source "bundled") (or (eq $c.mode "always") (and (eq $c.mode "auto") (hasSuffix ".gguf" .Values.model.path))) }}true{{ end }}
{{- end }}
{{- define "pagedserve.convertedMountPath" -}}/converted{{- end }}

{{/*
--speculative-config of the engine and the scheduler (both get the same JSON); a draft model's path is
inside the model volume. Empty when speculativeConfig is {}.
*/}}
{{- define "pagedserve.speculativeConfigArg" -}}
{{- $s := deepCopy (default (dict) .Values.speculativeConfig) }}
{{- if $s }}
{{- if hasKey $s "model" }}
{{- if eq .Values.model.source "bundled" }}
{{- fail "speculativeConfig.model: a draft model is read from the model volume; set model.source to pvc or hostPath" }}
{{- end }}
{{- $_ := set $s "model" (printf "%s/%s" (include "pagedserve.modelMountPath" .) (trimPrefix "/" $s.model)) }}
{{- end }}
- --speculative-config={{ toJson $s }}
{{- end }}
{{- end }}

{{/* --model of the engine and the scheduler: the source, or its conversion. */}}
{{- define "pagedserve.servingModelArg" -}}
{{- if include "pagedserve.converting" . }}{{ include "pagedserve.convertedMountPath" . }}/model{{ else }}{{ include "pagedserve.modelArg" . }}{{ end }}
{{- end }}

{{/* --model of the router: the source, or its extracted tokenizer. */}}
{{- define "pagedserve.routerModelArg" -}}
{{- if include "pagedserve.converting" . }}{{ include "pagedserve.convertedMountPath" . }}/tokenizer{{ else }}{{ include "pagedserve.modelArg" . }}{{ end }}
{{- end }}

{{/*
The init container that converts the model. Call with (dict "ctx" $ "output" "model" "tokenizerOnly" false
"resources" dict "securityContext" dict).
*/}}
{{- define "pagedserve.convertContainer" -}}
{{- $ctx := .ctx }}
- name: {{ if .tokenizerOnly }}extract-tokenizer{{ else }}convert-model{{ end }}
  image: {{ include "pagedserve.image" (dict "ctx" $ctx "image" $ctx.Values.images.engine "prefix" true) }}
  imagePullPolicy: {{ $ctx.Values.images.pullPolicy }}
  command: ["pagedserve"]
  args:
    - convert
    - --model={{ include "pagedserve.modelArg" $ctx }}
    - --output={{ include "pagedserve.convertedMountPath" $ctx }}/{{ .output }}
    {{- if .tokenizerOnly }}
    - --tokenizer-only
    {{- end }}
    - --log-level={{ $ctx.Values.logLevel }}
  env:
    {{- include "pagedserve.cacheEnv" $ctx | nindent 4 }}
  resources:
    {{- toYaml .resources | nindent 4 }}
  securityContext:
    {{- toYaml .securityContext | nindent 4 }}
  volumeMounts:
    {{- include "pagedserve.cacheMounts" (dict "ctx" $ctx "container" "convert") | nindent 4 }}
    {{- include "pagedserve.modelVolumeMount" $ctx | nindent 4 }}
    - name: converted
      mountPath: {{ include "pagedserve.convertedMountPath" $ctx }}
{{- end }}

{{- define "pagedserve.convertedVolume" -}}
{{- if include "pagedserve.converting" .ctx }}
- name: converted
  emptyDir:
    sizeLimit: {{ .sizeLimit }}
{{- end }}
{{- end }}

{{- define "pagedserve.convertedMount" -}}
{{- if include "pagedserve.converting" . }}
- name: converted
  mountPath: {{ include "pagedserve.convertedMountPath" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "pagedserve.servedModelName" -}}
{{- if .Values.model.servedModelName }}
{{- .Values.model.servedModelName }}
{{- else if eq .Values.model.source "bundled" }}
{{- "SmolLM2-135M-Instruct" }}
{{- else if .Values.model.path }}
{{- base (trimSuffix "/" .Values.model.path) | trimSuffix ".gguf" }}
{{- else }}
{{- "model" }}
{{- end }}
{{- end }}

{{/* The model volume (pvc or hostPath); nothing for the bundled model. */}}
{{- define "pagedserve.modelVolume" -}}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" .Values.model.hostPath.path }}
    type: Directory
{{- end }}
{{- end }}

{{- define "pagedserve.modelVolumeMount" -}}
{{- if ne .Values.model.source "bundled" }}
- name: model
  mountPath: {{ include "pagedserve.modelMountPath" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "pagedserve.cacheVolume" -}}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.cache.sizeLimit }}
    {{- with .Values.cache.medium }}
    medium: {{ . }}
    {{- end }}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
{{- end }}

{{/*
Mounts of the writable scratch space. Each container gets its own subPath of the cache, so two
containers of one pod never convert the same GGUF file into the same directory at the same time.
Call with (dict "ctx" $ "container" "engine").
*/}}
{{- define "pagedserve.cacheMounts" -}}
- name: cache
  mountPath: /cache
  subPath: {{ .container }}
- name: tmp
  mountPath: /tmp
  subPath: {{ .container }}
{{- end }}

{{/* Env every pagedserve container gets: where its cache is (read by services.model_files.model_source). */}}
{{- define "pagedserve.cacheEnv" -}}
- name: PAGEDSERVE_CACHE_DIR
  value: /cache
{{- end }}

{{/* Redis: the Secret and key that hold the client URL (bundled or external). */}}
{{- define "pagedserve.redisUrlSecretName" -}}
{{- if .Values.redis.enabled }}
{{- default (include "pagedserve.redisName" .) .Values.redis.auth.existingSecret }}
{{- else if .Values.redis.external.existingSecret }}
{{- .Values.redis.external.existingSecret }}
{{- else }}
{{- include "pagedserve.redisName" . }}
{{- end }}
{{- end }}

{{- define "pagedserve.redisUrlSecretKey" -}}
{{- if .Values.redis.enabled }}
{{- .Values.redis.auth.urlKey }}
{{- else if .Values.redis.external.existingSecret }}
{{- .Values.redis.external.existingSecretKey }}
{{- else }}
{{- "redis-url" }}
{{- end }}
{{- end }}

{{/* Env that hands the Redis URL (with its password) to routers and schedulers, from a Secret. */}}
{{- define "pagedserve.redisEnv" -}}
- name: PAGEDSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "pagedserve.redisUrlSecretName" . }}
      key: {{ include "pagedserve.redisUrlSecretKey" . }}
{{- end }}

{{/*
Probes: the chart's defaults with the user's timing overrides (component.probes.<kind>) merged over them.
Call with (dict "probe" (dict ...defaults...) "override" .Values.router.probes.liveness).
*/}}
{{- define "pagedserve.probe" -}}
{{- toYaml (mergeOverwrite (deepCopy .probe) (default (dict) .override)) }}
{{- end }}

{{/*
The engine's exec probe: a real `health` round trip on the step protocol (a TCP connect succeeds even
when the engine is hung). Its own timeout stays under the probe's, so a slow answer is reported by the
command rather than cut off by the kubelet. Call with (dict "port" 7000 "probe" ... "override" ...).
*/}}
{{- define "pagedserve.engineProbe" -}}
{{- $merged := mergeOverwrite (deepCopy .probe) (default (dict) .override) }}
{{- $timeout := max 1 (sub (int (default 5 $merged.timeoutSeconds)) 1) }}
{{- $_ := set $merged "exec" (dict "command" (list "pagedserve" "probe" "engine" (printf "--engine=tcp://127.0.0.1:%d" (int .port)) (printf "--timeout=%d" $timeout))) }}
{{- toYaml $merged }}
{{- end }}

{{/* A container's securityContext: containerSecurityContext with the component's overrides. */}}
{{- define "pagedserve.containerSecurityContext" -}}
{{- toYaml (mergeOverwrite (deepCopy .ctx.Values.containerSecurityContext) (default (dict) .override)) }}
{{- end }}

{{/* A pod's securityContext: podSecurityContext with the component's overrides. */}}
{{- define "pagedserve.podSecurityContext" -}}
{{- toYaml (mergeOverwrite (deepCopy .ctx.Values.podSecurityContext) (default (dict) .override)) }}
{{- end }}

{{/* The ServiceAccount a component's pods run as: serviceAccount.name for all, else one per component. */}}
{{- define "pagedserve.serviceAccountName" -}}
{{- default .name .ctx.Values.serviceAccount.name }}
{{- end }}

{{/*
Scale to zero: KEDA with minReplicas 0, or an idleReplicaCount of 0. Routers then hold requests while
no replica is ready (--cold-start-timeout) instead of refusing them.
*/}}
{{- define "pagedserve.scalesToZero" -}}
{{- $idle := and (not (kindIs "invalid" .Values.keda.idleReplicaCount)) (eq (int .Values.keda.idleReplicaCount) 0) }}
{{- $global := and .Values.keda.enabled (or (eq (int .Values.autoscaling.minReplicas) 0) $idle) }}
{{- if not .Values.models }}
{{- if $global }}true{{ end }}
{{- else }}
{{- /* Any model that may scale to zero: KEDA of its own, or the release's it inherits. */}}
{{- range $m := .Values.models }}
{{- with $m.autoscaling }}
{{- if and (eq (default "none" .kind) "keda") (or (eq (int (ternary .minReplicas $.Values.autoscaling.minReplicas (hasKey . "minReplicas"))) 0) $idle) }}true{{ end }}
{{- else }}
{{- if $global }}true{{ end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pagedserve.coldStartTimeout" -}}
{{- if not (kindIs "invalid" .Values.router.coldStartTimeoutSeconds) }}
{{- .Values.router.coldStartTimeoutSeconds }}
{{- else if include "pagedserve.scalesToZero" . }}
{{- 300 }}
{{- else }}
{{- 0 }}
{{- end }}
{{- end }}

{{/*
Who may connect to the router's port, as {"sources": [{"why": ..., "peers": [NetworkPolicyPeer...]}]}:
what follows from how the router is exposed, then networkPolicy.routerFrom, Prometheus and the helm test
pod. The NetworkPolicy and NOTES.txt both read it, so what NOTES says is what the policy allows.
*/}}
{{- define "pagedserve.routerSources" -}}
{{- $np := .Values.networkPolicy }}
{{- $rt := .Values.router }}
{{- $sources := list }}
{{- if $rt.ingress.enabled }}
{{- $sources = append $sources (dict "why" "the ingress controller (networkPolicy.ingressControllerFrom; a hostNetwork controller needs the nodes' CIDRs there)" "peers" $np.ingressControllerFrom) }}
{{- end }}
{{- if $rt.httpRoute.enabled }}
{{- $peers := $np.gatewayFrom }}
{{- if not $peers }}
{{- $namespaces := list }}
{{- range $rt.httpRoute.parentRefs }}{{ $namespaces = append $namespaces (default $.Release.Namespace .namespace) }}{{ end }}
{{- range uniq $namespaces }}
{{- $peers = append $peers (dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .))) }}
{{- end }}
{{- end }}
{{- $sources = append $sources (dict "why" "the Gateway of router.httpRoute.parentRefs (its namespace; networkPolicy.gatewayFrom overrides)" "peers" $peers) }}
{{- end }}
{{- if has $rt.service.type (list "LoadBalancer" "NodePort") }}
{{- $peers := $np.externalFrom }}
{{- if and (not $peers) $rt.service.loadBalancerSourceRanges (eq $rt.service.externalTrafficPolicy "Local") }}
{{- range $rt.service.loadBalancerSourceRanges }}{{ $peers = append $peers (dict "ipBlock" (dict "cidr" .)) }}{{ end }}
{{- end }}
{{- if not $peers }}
{{- $peers = list (dict "ipBlock" (dict "cidr" "0.0.0.0/0")) (dict "ipBlock" (dict "cidr" "::/0")) }}
{{- end }}
{{- $sources = append $sources (dict "why" (printf "clients of the %s Service (networkPolicy.externalFrom; with externalTrafficPolicy Local, router.service.loadBalancerSourceRanges)" $rt.service.type) "peers" $peers) }}
{{- end }}
{{- with $np.routerFrom }}
{{- $sources = append $sources (dict "why" "networkPolicy.routerFrom" "peers" .) }}
{{- end }}
{{- with $np.metricsFrom }}
{{- $sources = append $sources (dict "why" "Prometheus (networkPolicy.metricsFrom)" "peers" .) }}
{{- end }}
{{- $test := dict "podSelector" (dict "matchLabels" (include "pagedserve.selectorLabels" (dict "ctx" $ "component" "test") | fromYaml)) }}
{{- $sources = append $sources (dict "why" "this release's helm test pod" "peers" (list $test)) }}
{{- toJson (dict "sources" $sources) }}
{{- end }}

{{/* Every address but the cloud metadata endpoints, as NetworkPolicyPeers (egress). */}}
{{- define "pagedserve.anywhereButMetadata" -}}
- ipBlock:
    cidr: 0.0.0.0/0
    except: ["169.254.169.254/32"]
- ipBlock:
    cidr: ::/0
    except: ["fd00:ec2::254/128"]
{{- end }}

{{- define "pagedserve.secretsChecksum" -}}
{{- toJson (list .Values.router.apiKeys .Values.redis.auth .Values.redis.external .Values.internalToken) | sha256sum }}
{{- end }}

{{/* Probe timings: the startup probe polls every 10 s for startupTimeoutSeconds. */}}
{{- define "pagedserve.startupFailureThreshold" -}}
{{- max 1 (div (add . 9) 10) }}
{{- end }}

{{/*
Grace periods. Router: preStop sleep + drain + margin. Replica: the same for the scheduler, and the
engine (which waits for its scheduler to exit) fits inside it.
*/}}
{{- define "pagedserve.routerGracePeriod" -}}
{{- add (int .Values.router.preStopSleepSeconds) (int .Values.router.drainTimeoutSeconds) 15 }}
{{- end }}
{{- define "pagedserve.replicaGracePeriod" -}}
{{- add (int .Values.replica.preStopSleepSeconds) (int .Values.replica.drainTimeoutSeconds) 30 }}
{{- end }}

{{/*
Checks across values that the JSON schema cannot express; each fails with the value to change.
*/}}
{{- define "pagedserve.validate" -}}
{{- $a := .Values.autoscaling }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail (printf "autoscaling.minReplicas (%v) must not exceed autoscaling.maxReplicas (%v)" $a.minReplicas $a.maxReplicas) }}
{{- end }}
{{- if and $a.enabled (not .Values.keda.enabled) (lt (int $a.minReplicas) 1) }}
{{- fail "autoscaling.minReplicas must be at least 1 for the HPA; scale to zero needs keda.enabled=true" }}
{{- end }}
{{- if and .Values.keda.enabled (not .Values.keda.serverAddress) }}
{{- fail "keda.serverAddress is required when keda.enabled=true (the Prometheus KEDA queries, e.g. http://prometheus-operated.monitoring.svc:9090)" }}
{{- end }}
{{- if and (not .Values.redis.enabled) (not .Values.redis.external.url) (not .Values.redis.external.existingSecret) }}
{{- fail "redis.enabled=false needs redis.external.url or redis.external.existingSecret" }}
{{- end }}
{{- if and .Values.router.ingress.enabled .Values.router.ingress.tls.enabled (not .Values.router.ingress.host) }}
{{- fail "router.ingress.host is required when router.ingress.tls.enabled=true (the certificate is for a host)" }}
{{- end }}
{{- if and .Values.router.ingress.tls.enabled (not .Values.router.ingress.tls.secretName) }}
{{- fail "router.ingress.tls.secretName is required when router.ingress.tls.enabled=true" }}
{{- end }}
{{- if and .Values.router.httpRoute.enabled (not .Values.router.httpRoute.parentRefs) }}
{{- fail "router.httpRoute.parentRefs must name at least one Gateway when router.httpRoute.enabled=true" }}
{{- end }}
{{- $idle := .Values.keda.idleReplicaCount }}
{{- if and .Values.keda.enabled (not (kindIs "invalid" $idle)) (ge (int $idle) (int $a.minReplicas)) }}
{{- fail (printf "keda.idleReplicaCount (%v) must be below autoscaling.minReplicas (%v): KEDA scales idle deployments down to it" $idle $a.minReplicas) }}
{{- end }}
{{- if and (eq .Values.router.cacheIsolation "per-key") (not .Values.router.apiKeys.enabled) }}
{{- fail "router.cacheIsolation=per-key isolates API keys from each other: it needs router.apiKeys.enabled=true" }}
{{- end }}
{{- $r := .Values.replica }}
{{- if and (gt (int $r.engine.gpus) 1) (not $r.engine.shmSize) }}
{{- fail "replica.engine.shmSize is required when replica.engine.gpus > 1: the ranks of a pod pass data to each other through /dev/shm" }}
{{- end }}
{{- range $m := .Values.models }}
{{- with $m.autoscaling }}
{{- $kind := default "none" .kind }}
{{- $min := ternary .minReplicas $a.minReplicas (hasKey . "minReplicas") }}
{{- $max := ternary .maxReplicas $a.maxReplicas (hasKey . "maxReplicas") }}
{{- if gt (int $min) (int $max) }}
{{- fail (printf "models[%s].autoscaling.minReplicas (%v) must not exceed its maxReplicas (%v)" $m.name $min $max) }}
{{- end }}
{{- if and (eq $kind "keda") (not $.Values.keda.serverAddress) }}
{{- fail (printf "models[%s].autoscaling.kind=keda needs keda.serverAddress (the Prometheus KEDA queries)" $m.name) }}
{{- end }}
{{- if and (eq $kind "hpa") (lt (int $min) 1) }}
{{- fail (printf "models[%s].autoscaling.minReplicas must be at least 1 for the HPA; scale to zero needs kind keda" $m.name) }}
{{- end }}
{{- end }}
{{- if and (gt (int (ternary $m.gpus $r.engine.gpus (hasKey $m "gpus"))) 1) (not $r.engine.shmSize) }}
{{- fail (printf "replica.engine.shmSize is required when models[%s].gpus > 1" $m.name) }}
{{- end }}
{{- end }}
{{- $ra := .Values.router.autoscaling }}
{{- if and $ra.enabled (gt (int $ra.minReplicas) (int $ra.maxReplicas)) }}
{{- fail (printf "router.autoscaling.minReplicas (%v) must not exceed router.autoscaling.maxReplicas (%v)" $ra.minReplicas $ra.maxReplicas) }}
{{- end }}
{{- if and $ra.enabled (kindIs "invalid" $ra.targetCPUUtilizationPercentage) (kindIs "invalid" $ra.targetRequestsPerSecond) }}
{{- fail "router.autoscaling.enabled=true needs router.autoscaling.targetCPUUtilizationPercentage or targetRequestsPerSecond" }}
{{- end }}
{{- end }}
