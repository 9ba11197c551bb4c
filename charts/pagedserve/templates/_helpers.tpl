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
{{/* Headless Service of the schedulers: Kubernetes discovery and metrics scraping. */}}
{{- define "pagedserve.schedulerServiceName" -}}{{ include "pagedserve.fullname" . }}-scheduler{{- end }}
{{- define "pagedserve.redisName" -}}{{ include "pagedserve.fullname" . }}-redis{{- end }}
{{- define "pagedserve.apiKeysSecretName" -}}
{{- default (printf "%s-api-keys" (include "pagedserve.fullname" .)) .Values.router.apiKeys.existingSecret }}
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

{{/* Env every pagedserve container gets: where its cache is (read by services.model_source). */}}
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

{{- define "pagedserve.secretsChecksum" -}}
{{- toJson (list .Values.router.apiKeys .Values.redis.auth .Values.redis.external) | sha256sum }}
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
{{- end }}

{{/*
Exec probe for the engine, which listens on loopback only: connect to its port from inside the
container. Call with the port number.
*/}}
{{- define "pagedserve.tcpCheck" -}}
{{- $script := printf "import socket; socket.create_connection(('127.0.0.1', %d), 3).close()" (int .) }}
{{- toYaml (list "python" "-c" $script) }}
{{- end }}

{{/*
Engine preStop: wait while any established TCP connection to the engine's port remains (its
scheduler holds one for as long as it runs), for at most .seconds. Reads /proc/net/tcp of the pod's
network namespace, so it needs neither a shared process namespace nor any tool in the image.
Call with (dict "port" 7000 "seconds" 150).
*/}}
{{- define "pagedserve.waitForSchedulerExit" -}}
{{- $lines := list
  "import time"
  (printf "port, deadline = ':%04X', time.monotonic() + %d" (int .port) (int .seconds))
  "def connected():"
  "    for table in ('/proc/net/tcp', '/proc/net/tcp6'):"
  "        try:"
  "            rows = open(table).read().splitlines()[1:]"
  "        except OSError:"
  "            continue"
  "        if any(r.split()[1].endswith(port) and r.split()[3] == '01' for r in rows):"
  "            return True"
  "    return False"
  "while connected() and time.monotonic() < deadline:"
  "    time.sleep(1)"
}}
{{- toYaml (list "python" "-c" (join "\n" $lines)) }}
{{- end }}
