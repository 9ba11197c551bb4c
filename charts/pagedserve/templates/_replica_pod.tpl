{{/*
The pods of a model replica. "leader" (also the one pod of a replica on one node): the engine (rank 0
of its tensor-parallel group when it has more than one GPU) and its scheduler; it is the Deployment's
pod template and each LeaderWorkerSet group's leader. "worker" (replica.nodes > 1): the next
replica.engine.gpus ranks of the group on another node. Called with (dict "root" $ "role" ...).
*/}}
{{- define "pagedserve.replicaPod" -}}
{{- $root := .root }}
{{- $worker := eq .role "worker" }}
{{- $component := ternary "replica-worker" "replica" $worker }}
{{- $schedulerPort := 8100 }}
{{- $r := $root.Values.replica }}
{{- $gpus := int $r.engine.gpus }}
{{- $grace := int (include "pagedserve.replicaGracePeriod" $root) }}
{{- $converting := include "pagedserve.converting" $root -}}
{{- $loraInit := include "pagedserve.loraInitContainer" $root -}}
{{- include "pagedserve.loraValidate" $root -}}
metadata:
  labels:
    {{- include "pagedserve.selectorLabels" (dict "ctx" $root "component" $component) | nindent 4 }}
    {{- with $r.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/secrets: {{ include "pagedserve.secretsChecksum" $root }}
    # `kubectl logs` and `kubectl exec` pick this container unless told otherwise.
    kubectl.kubernetes.io/default-container: {{ ternary "engine-worker" "scheduler" $worker }}
    {{- if and $root.Values.metrics.podAnnotations (not $worker) }}
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ $schedulerPort | quote }}
    prometheus.io/path: /metrics
    {{- end }}
    {{- with $r.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "pagedserve.serviceAccountName" (dict "ctx" $root "name" (include "pagedserve.replicaName" $root)) }}
  # No container talks to the Kubernetes API.
  automountServiceAccountToken: false
  {{- with include "pagedserve.imagePullSecrets" $root }}
  {{- . | nindent 2 }}
  {{- end }}
  terminationGracePeriodSeconds: {{ $grace }}
  securityContext:
    {{- include "pagedserve.podSecurityContext" (dict "ctx" $root "override" $r.podSecurityContext) | nindent 4 }}
  {{- with $r.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with $r.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $r.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if or $r.tolerations (and (gt $gpus 0) $r.engine.tolerateGpuTaint) }}
  tolerations:
    {{- if and (gt $gpus 0) $r.engine.tolerateGpuTaint }}
    # The NVIDIA GPU operator taints GPU nodes with this key, MIG nodes included (whatever the
    # resource name the pod requests, e.g. nvidia.com/mig-1g.10gb).
    - key: nvidia.com/gpu
      operator: Exists
      effect: NoSchedule
    {{- end }}
    {{- with $r.tolerations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
  {{- with $r.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  topologySpreadConstraints:
    {{- if $r.topologySpreadConstraints }}
    {{- toYaml $r.topologySpreadConstraints | nindent 4 }}
    {{- else }}
    # Prefer spreading replicas over nodes, but never leave a pod pending for it.
    - maxSkew: 1
      topologyKey: kubernetes.io/hostname
      whenUnsatisfiable: ScheduleAnyway
      labelSelector:
        matchLabels:
          {{- include "pagedserve.selectorLabels" (dict "ctx" $root "component" $component) | nindent 10 }}
    {{- end }}
  {{- if or $converting $loraInit }}
  initContainers:
  {{- end }}
  {{- if $converting }}
    {{- $convertResources := deepCopy (default (dict) $root.Values.model.convert.resources) }}
    {{- if not $convertResources }}
    {{- /* The engine's own resources (the dequantized model is about as large), without the GPU. */}}
    {{- $convertResources = deepCopy (default (dict) $r.engine.resources) }}
    {{- end }}
    {{- include "pagedserve.convertContainer" (dict "ctx" $root "output" "model" "tokenizerOnly" false
          "resources" $convertResources
          "securityContext" (mergeOverwrite (deepCopy $root.Values.containerSecurityContext) (default (dict) $r.engine.securityContext))) | nindent 4 }}
  {{- end }}
  {{- with $loraInit }}
    {{- . | nindent 4 }}
  {{- end }}
  containers:
    {{- include "pagedserve.engineContainer" (dict "root" $root "role" .role) | nindent 4 }}
    {{- if not $worker }}
    - name: scheduler
      image: {{ include "pagedserve.image" (dict "ctx" $root "image" $root.Values.images.scheduler "prefix" true) }}
      imagePullPolicy: {{ $root.Values.images.pullPolicy }}
      command: ["pagedserve"]
      args:
        - scheduler
        - --host=0.0.0.0
        - --port={{ $schedulerPort }}
        - --engine=tcp://127.0.0.1:{{ include "pagedserve.enginePort" $root }}
        - --model={{ include "pagedserve.servingModelArg" $root }}
        - --served-model-name={{ include "pagedserve.servedModelName" $root }}
        - --max-num-seqs={{ int64 $r.scheduler.maxNumSeqs }}
        - --max-num-batched-tokens={{ int64 $r.scheduler.maxNumBatchedTokens }}
        {{- with $r.scheduler.maxWaiting }}
        - --max-waiting={{ int64 . }}
        {{- end }}
        - {{ if $r.scheduler.enablePrefixCaching }}--enable-prefix-caching{{ else }}--no-enable-prefix-caching{{ end }}
        {{- with $root.Values.model.maxModelLen }}
        - --max-model-len={{ int64 . }}
        {{- end }}
        - --heartbeat-interval={{ $r.scheduler.heartbeatIntervalSeconds }}
        - --max-body-bytes={{ int64 $root.Values.router.maxBodyBytes }}
        - --drain-timeout={{ $r.drainTimeoutSeconds }}
        # Only callers presenting it (the routers) are served; it signs the registry records.
        - --internal-token-file={{ include "pagedserve.internalTokenDir" $root }}/internal-token
        {{- with include "pagedserve.loraSchedulerArgs" $root }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with include "pagedserve.speculativeConfigArg" $root }}
        {{- . | nindent 8 }}
        {{- end }}
        - --log-level={{ $root.Values.logLevel }}
        {{- range $r.scheduler.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        {{- include "pagedserve.redisEnv" $root | nindent 8 }}
        {{- include "pagedserve.cacheEnv" $root | nindent 8 }}
        # The pod's name is its replica id in the registry (the hostname is not always the pod's:
        # hostNetwork pods carry the node's).
        - name: PAGEDSERVE_REPLICA_ID
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        # Routers reach this scheduler at its pod IP. POD_IP is not read by the service: only
        # Kubernetes reads it, to expand $(POD_IP) in the next variable.
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        - name: PAGEDSERVE_ADVERTISE_URL
          value: "http://$(POD_IP):{{ $schedulerPort }}"
        {{- with include "pagedserve.loraSchedulerEnv" $root }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $r.scheduler.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: http
          containerPort: {{ $schedulerPort }}
          protocol: TCP
      # /live answers while the scheduler's own event loop runs: its liveness, never the engine's
      # (a restarting engine must not get its scheduler killed). /health answers 503 until the
      # engine's handshake (weights loaded) and whenever the engine fails: the readiness of the
      # chain, which takes the pod out of the Service's endpoints.
      startupProbe:
        {{- include "pagedserve.probe" (dict "override" $r.scheduler.probes.startup
              "probe" (dict "httpGet" (dict "path" "/live" "port" "http") "periodSeconds" 5 "timeoutSeconds" 3 "failureThreshold" 60)) | nindent 8 }}
      readinessProbe:
        {{- include "pagedserve.probe" (dict "override" $r.scheduler.probes.readiness
              "probe" (dict "httpGet" (dict "path" "/health" "port" "http") "periodSeconds" 5 "timeoutSeconds" 3 "failureThreshold" 2)) | nindent 8 }}
      livenessProbe:
        {{- include "pagedserve.probe" (dict "override" $r.scheduler.probes.liveness
              "probe" (dict "httpGet" (dict "path" "/live" "port" "http") "periodSeconds" 20 "timeoutSeconds" 5 "failureThreshold" 6)) | nindent 8 }}
      lifecycle:
        preStop:
          sleep:
            seconds: {{ $r.preStopSleepSeconds }}
      resources:
        {{- toYaml (default (dict) $r.scheduler.resources) | nindent 8 }}
      securityContext:
        {{- include "pagedserve.containerSecurityContext" (dict "ctx" $root "override" $r.scheduler.securityContext) | nindent 8 }}
      volumeMounts:
        {{- include "pagedserve.cacheMounts" (dict "ctx" $root "container" "scheduler") | nindent 8 }}
        {{- if not $converting }}
        {{- with include "pagedserve.modelVolumeMount" $root }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- end }}
        {{- with include "pagedserve.convertedMount" $root }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- include "pagedserve.internalTokenMount" $root | nindent 8 }}
        {{- with include "pagedserve.loraMount" $root }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $r.scheduler.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    {{- end }}
  volumes:
    {{- include "pagedserve.cacheVolume" $root | nindent 4 }}
    {{- if not $worker }}
    {{- include "pagedserve.internalTokenVolume" $root | nindent 4 }}
    {{- end }}
    {{- with include "pagedserve.modelVolume" $root }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with include "pagedserve.convertedVolume" (dict "ctx" $root "sizeLimit" $root.Values.model.convert.sizeLimit) }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with $r.engine.shmSize }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ . }}
    {{- end }}
    {{- with include "pagedserve.loraVolume" $root }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with $r.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/*
The engine container: rank 0 (`pagedserve engine`, beside its scheduler) or, in a LeaderWorkerSet's
worker pod, the ranks of that node (`pagedserve engine-worker`). Both get the same engine flags
(pagedserve.engineRankArgs): the ranks of one group must agree on everything rank 0 checks.
*/}}
{{- define "pagedserve.engineContainer" -}}
{{- $root := .root }}
{{- $worker := eq .role "worker" }}
{{- $enginePort := int (include "pagedserve.enginePort" $root) }}
{{- $r := $root.Values.replica }}
{{- $gpus := int $r.engine.gpus }}
{{- $multiNode := gt (int $r.nodes) 1 }}
{{- $grace := int (include "pagedserve.replicaGracePeriod" $root) }}
{{- $converting := include "pagedserve.converting" $root -}}
- name: {{ ternary "engine-worker" "engine" $worker }}
  image: {{ include "pagedserve.image" (dict "ctx" $root "image" $root.Values.images.engine "prefix" true) }}
  imagePullPolicy: {{ $root.Values.images.pullPolicy }}
  command: ["pagedserve"]
  args:
    {{- if $worker }}
    # Ranks node_rank * gpus onwards of the group (the pod's LeaderWorkerSet worker index is the
    # node rank, PAGEDSERVE_TP_NODE_RANK below); it opens no port for anyone but its group.
    - engine-worker
    {{- else }}
    - engine
    # Only its scheduler, in this pod, talks to the engine: listen on loopback only.
    - --host=127.0.0.1
    - --port={{ $enginePort }}
    {{- end }}
    {{- include "pagedserve.engineRankArgs" $root | nindent 4 }}
  env:
    {{- include "pagedserve.cacheEnv" $root | nindent 4 }}
    {{- if eq $gpus 0 }}
    # The image sets NVIDIA_VISIBLE_DEVICES=all for its GPU use; on a node whose default
    # runtime is NVIDIA's that would hand this CPU replica every GPU of the node.
    - name: NVIDIA_VISIBLE_DEVICES
      value: void
    {{- end }}
    {{- with include "pagedserve.rankEnv" $root }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- if $worker }}
    # The LeaderWorkerSet controller labels each pod of a group with its index (the leader is 0).
    - name: PAGEDSERVE_TP_NODE_RANK
      valueFrom:
        fieldRef:
          fieldPath: metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']
    {{- end }}
    {{- with $r.engine.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- if not $worker }}
  ports:
    # Declared for documentation only: nothing outside the pod may connect (NetworkPolicy).
    - name: engine
      containerPort: {{ $enginePort }}
      protocol: TCP
    {{- if $multiNode }}
    # Rank 0's rendezvous: the ranks of the group's worker pods connect here (then to each other).
    - name: tp-rendezvous
      containerPort: {{ int $r.multiNode.rendezvousPort }}
      protocol: TCP
    {{- end }}
  # The engine speaks ZeroMQ on loopback, which the kubelet cannot reach, so every probe runs
  # `pagedserve probe engine` inside the container: a real `health` round trip through the
  # engine's loop. Liveness is the engine's own; the pod's readiness is the chain (the
  # scheduler's readiness covers its engine). A hung engine is killed fast (probe-level grace):
  # its preStop would otherwise wait for a scheduler that never leaves.
  startupProbe:
    {{- include "pagedserve.engineProbe" (dict "port" $enginePort "override" $r.engine.probes.startup
          "probe" (dict "periodSeconds" 10 "timeoutSeconds" 5 "failureThreshold" (int (include "pagedserve.startupFailureThreshold" $r.startupTimeoutSeconds)))) | nindent 4 }}
  readinessProbe:
    {{- include "pagedserve.engineProbe" (dict "port" $enginePort "override" $r.engine.probes.readiness
          "probe" (dict "periodSeconds" 10 "timeoutSeconds" 5 "failureThreshold" 3)) | nindent 4 }}
  livenessProbe:
    {{- include "pagedserve.engineProbe" (dict "port" $enginePort "override" $r.engine.probes.liveness
          "probe" (dict "periodSeconds" 20 "timeoutSeconds" 5 "failureThreshold" 6 "terminationGracePeriodSeconds" 10)) | nindent 4 }}
  lifecycle:
    # Kubernetes stops both containers at once; the engine must outlive its scheduler, which
    # still runs in-flight requests after SIGTERM. Hold the engine's SIGTERM until the
    # scheduler's connection to it is gone (it has exited), bounded by the grace period.
    preStop:
      exec:
        command: ["pagedserve", "wait-for-disconnect", "--engine=tcp://127.0.0.1:{{ $enginePort }}", "--timeout={{ sub $grace 5 }}"]
  {{- end }}
  resources:
    {{- $res := deepCopy (default (dict) $r.engine.resources) }}
    {{- $requests := default (dict) $res.requests }}
    {{- if not (hasKey $requests "ephemeral-storage") }}
    {{- /* The pod writes the converted model (or, without conversion, its caches) to emptyDirs:
      reserve that space on the node, so the pod is not evicted for filling it. */}}
    {{- $_ := set $requests "ephemeral-storage" (ternary $root.Values.model.convert.sizeLimit $root.Values.cache.sizeLimit (eq $converting "true")) }}
    {{- end }}
    {{- if gt $gpus 0 }}
    {{- $limits := default (dict) $res.limits }}
    {{- $_ := set $limits $r.engine.gpuResourceName $gpus }}
    {{- $_ := set $res "limits" $limits }}
    {{- $_ := set $requests $r.engine.gpuResourceName $gpus }}
    {{- end }}
    {{- $_ := set $res "requests" $requests }}
    {{- toYaml $res | nindent 4 }}
  securityContext:
    {{- include "pagedserve.containerSecurityContext" (dict "ctx" $root "override" $r.engine.securityContext) | nindent 4 }}
  volumeMounts:
    {{- include "pagedserve.cacheMounts" (dict "ctx" $root "container" "engine") | nindent 4 }}
    {{- with include "pagedserve.modelVolumeMount" $root }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with include "pagedserve.convertedMount" $root }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- if $r.engine.shmSize }}
    - name: dshm
      mountPath: /dev/shm
    {{- end }}
    {{- with include "pagedserve.loraMount" $root }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with $r.engine.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{- define "pagedserve.enginePort" -}}7000{{- end }}

{{/* GPUs one model replica is split across: its tensor-parallel size (1 on the CPU). */}}
{{- define "pagedserve.tensorParallelSize" -}}
{{- max 1 (mul (int .Values.replica.engine.gpus) (int .Values.replica.nodes)) }}
{{- end }}

{{/*
The engine flags every rank of a replica gets (rank 0's `engine` and the workers' `engine-worker`).
*/}}
{{- define "pagedserve.engineRankArgs" -}}
{{- $r := .Values.replica }}
{{- $gpus := int $r.engine.gpus }}
{{- $tp := int (include "pagedserve.tensorParallelSize" .) -}}
- --model={{ include "pagedserve.servingModelArg" . }}
- --dtype={{ .Values.model.dtype }}
- --device={{ if gt $gpus 0 }}cuda{{ else }}cpu{{ end }}
- --block-size={{ .Values.model.blockSize }}
# The largest batch its scheduler sends: the engine sizes its decode CUDA graphs by it.
- --max-num-seqs={{ int64 $r.scheduler.maxNumSeqs }}
{{- if $r.engine.numKvBlocks }}
- --num-kv-blocks={{ int64 $r.engine.numKvBlocks }}
{{- else }}
- --kv-cache-memory={{ $r.engine.kvCacheMemory }}
{{- end }}
{{- with .Values.model.maxModelLen }}
- --max-model-len={{ int64 . }}
{{- end }}
{{- if gt $tp 1 }}
# Tensor parallel: {{ $tp }} ranks, one process per GPU; rank 0 starts the other ranks of its pod.
- --tensor-parallel-size={{ $tp }}
- --tp-timeout={{ $r.engine.tensorParallelTimeoutSeconds }}
{{- if gt (int $r.nodes) 1 }}
- --tp-local-ranks={{ $gpus }}
# Rank 0's rendezvous on the group's leader pod (LWS_LEADER_ADDRESS: set by the LeaderWorkerSet controller).
- --tp-rendezvous=tcp://$(LWS_LEADER_ADDRESS):{{ int $r.multiNode.rendezvousPort }}
{{- end }}
{{- end }}
{{- with include "pagedserve.loraEngineArgs" . }}
{{ . }}
{{- end }}
{{- with include "pagedserve.speculativeConfigArg" . }}
{{ . }}
{{- end }}
- --log-level={{ .Values.logLevel }}
{{- range $r.engine.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* Env of every rank: the network interface gloo and NCCL use between the pods of a group. */}}
{{- define "pagedserve.rankEnv" -}}
{{- with .Values.replica.multiNode.socketInterface }}
{{- if gt (int $.Values.replica.nodes) 1 }}
- name: GLOO_SOCKET_IFNAME
  value: {{ . | quote }}
- name: NCCL_SOCKET_IFNAME
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* What an autoscaler scales: the replica Deployment, or the LeaderWorkerSet (its scale subresource
counts groups) when a replica spans nodes. */}}
{{- define "pagedserve.replicaScaleTarget" -}}
{{- if gt (int .Values.replica.nodes) 1 -}}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
{{- else -}}
apiVersion: apps/v1
kind: Deployment
{{- end }}
name: {{ include "pagedserve.modelReplicaName" . }}
{{- end }}
