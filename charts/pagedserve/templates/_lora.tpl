{{/*
LoRA adapters of one model's replicas (`lora`, or a `models:` entry's `lora` laid over it): the engine's
slot flags, the scheduler's adapters at start, its run-time directory and admin key, and the adapter
volume both containers mount read-only at the same path (the scheduler checks an adapter's files, the
engine reads the very same ones). Each helper renders nothing while lora.enabled is false.
*/}}
{{- define "pagedserve.loraMountPath" -}}/adapters{{- end }}

{{- define "pagedserve.loraAdminSecretName" -}}
{{- .Values.lora.adminKey.existingSecret | default (printf "%s-lora-admin" (include "pagedserve.fullname" .)) }}
{{- end }}

{{/* Flags of every engine rank: its fixed slot buffers and host LRU. */}}
{{- define "pagedserve.loraEngineArgs" -}}
{{- $l := .Values.lora }}
{{- if $l.enabled }}
- --max-loras={{ int64 $l.maxLoras }}
- --max-lora-rank={{ int64 $l.maxLoraRank }}
{{- with $l.maxCpuLoras }}
- --max-cpu-loras={{ int64 . }}
{{- end }}
{{- end }}
{{- end }}

{{/* Scheduler flags: the adapters loaded at start, and the one directory run-time and on-demand loads
read from. */}}
{{- define "pagedserve.loraSchedulerArgs" -}}
{{- $l := .Values.lora }}
{{- if $l.enabled }}
- --lora-dir={{ include "pagedserve.loraMountPath" . }}
{{- with $l.modules }}
- --lora-modules
{{- range . }}
- {{ printf "%s=%s/%s" .name (include "pagedserve.loraMountPath" $) (trimPrefix "/" .path) | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The admin key reaches the scheduler through its environment (never argv), from the Secret. */}}
{{- define "pagedserve.loraSchedulerEnv" -}}
{{- $l := .Values.lora }}
{{- if and $l.enabled $l.adminKey.enabled }}
- name: PAGEDSERVE_LORA_ADMIN_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "pagedserve.loraAdminSecretName" . }}
      key: {{ $l.adminKey.existingSecretKey }}
{{- end }}
{{- end }}

{{- define "pagedserve.loraMount" -}}
{{- if .Values.lora.enabled }}
- name: lora-adapters
  mountPath: {{ include "pagedserve.loraMountPath" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "pagedserve.loraVolume" -}}
{{- $l := .Values.lora }}
{{- if $l.enabled }}
- name: lora-adapters
  {{- if eq $l.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "lora.pvc.claimName is required when lora.source is pvc" $l.pvc.claimName }}
    readOnly: true
  {{- else if eq $l.source "hostPath" }}
  hostPath:
    path: {{ required "lora.hostPath.path is required when lora.source is hostPath" $l.hostPath.path }}
    type: Directory
  {{- else }}
  emptyDir:
    sizeLimit: {{ $l.sizeLimit }}
  {{- end }}
{{- end }}
{{- end }}

{{/* The init container that fills the emptyDir: the user's image and command, the chart's name, mount
and security context. */}}
{{- define "pagedserve.loraInitContainer" -}}
{{- $l := .Values.lora }}
{{- if and $l.enabled (eq $l.source "emptyDir") $l.init }}
- name: lora-adapters
  image: {{ $l.init.image }}
  imagePullPolicy: {{ .Values.images.pullPolicy }}
  {{- with $l.init.command }}
  command:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $l.init.args }}
  args:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  env:
    - name: LORA_DIR
      value: {{ include "pagedserve.loraMountPath" . }}
    {{- with $l.init.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  resources:
    {{- toYaml (default (dict) $l.init.resources) | nindent 4 }}
  securityContext:
    {{- include "pagedserve.containerSecurityContext" (dict "ctx" . "override" (dict)) | nindent 4 }}
  volumeMounts:
    - name: lora-adapters
      mountPath: {{ include "pagedserve.loraMountPath" . }}
    - name: tmp
      mountPath: /tmp
      subPath: lora-init
{{- end }}
{{- end }}

{{/* Values no schema can check: names unique and none the base model's own. */}}
{{- define "pagedserve.loraValidate" -}}
{{- $l := .Values.lora }}
{{- if $l.enabled }}
{{- $served := include "pagedserve.servedModelName" . }}
{{- $seen := dict }}
{{- range $l.modules }}
{{- if eq .name $served }}
{{- fail (printf "lora.modules: the adapter name %q is the base model's own (%s)" .name $served) }}
{{- end }}
{{- if hasKey $seen .name }}
{{- fail (printf "lora.modules: the adapter name %q is given twice" .name) }}
{{- end }}
{{- $_ := set $seen .name true }}
{{- end }}
{{- if and (eq $l.source "emptyDir") (not $l.init) $l.modules }}
{{- fail "lora.modules are loaded from /adapters, which stays empty: set lora.init (the container filling it) or lora.source pvc or hostPath" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "true" when some model's replicas read the admin key from the Secret the chart creates (enabled, with
no existingSecret of its own), else nothing. */}}
{{- define "pagedserve.loraAdminSecretNeeded" -}}
{{- $top := .Values.lora }}
{{- $entries := .Values.models | default (list (dict)) }}
{{- range $entries }}
{{- $key := merge (deepCopy (default (dict) (default (dict) .lora).adminKey)) (deepCopy $top.adminKey) }}
{{- $enabled := ternary (default (dict) .lora).enabled $top.enabled (hasKey (default (dict) .lora) "enabled") }}
{{- $keyOn := ternary (default (dict) (default (dict) .lora).adminKey).enabled $top.adminKey.enabled (hasKey (default (dict) (default (dict) .lora).adminKey) "enabled") }}
{{- if and $enabled $keyOn (not $key.existingSecret) }}true{{ end }}
{{- end }}
{{- end }}
