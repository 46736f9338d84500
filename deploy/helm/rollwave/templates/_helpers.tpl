{{/* Names, labels and the pieces every workload shares. */}}

{{- define "rollwave.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rollwave.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "rollwave.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "rollwave.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "rollwave.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rollwave.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rollwave.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{- define "rollwave.gpuImage" -}}
{{ .Values.gpuImage.repository }}:{{ .Values.gpuImage.tag }}
{{- end -}}

{{- define "rollwave.checkpointTLSSecretName" -}}
{{- .Values.checkpointTLS.existingSecret | default (printf "%s-checkpoint-tls" (include "rollwave.fullname" .)) -}}
{{- end -}}

{{/* The checkpoint plane's TLS files of one side (dict "root" $ "side" "receiver"|"trainer") as /tls/tls.crt,
/tls/tls.key and /tls/ca.crt: a volume for the pod, mounted by its rollwave container (checkpointTLS.enabled). */}}
{{- define "rollwave.checkpointTLSVolume" -}}
{{- if .root.Values.checkpointTLS.enabled }}
- name: checkpoint-tls
  secret:
    secretName: {{ include "rollwave.checkpointTLSSecretName" .root }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: {{ .side }}.crt, path: tls.crt}
      - {key: {{ .side }}.key, path: tls.key}
{{- end }}
{{- end -}}

{{- define "rollwave.checkpointTLSMount" -}}
{{- if .Values.checkpointTLS.enabled }}
- name: checkpoint-tls
  mountPath: /tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "rollwave.secretName" -}}
{{- if .Values.secrets.existingSecret -}}
{{- .Values.secrets.existingSecret -}}
{{- else -}}
{{- printf "%s-secrets" (include "rollwave.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "rollwave.redisUrl" -}}
{{- if .Values.redis.url -}}
{{- .Values.redis.url -}}
{{- else -}}
{{- printf "redis://%s-redis:%d/0" (include "rollwave.fullname" .) (int .Values.redis.bundled.port) -}}
{{- end -}}
{{- end -}}

{{/* The run config (core/config.py) every component reads from /config/run.yaml. */}}
{{- define "rollwave.runConfig" -}}
{{- $base := dict
  "run" (dict "name" .Values.run.name "dir" "/runs")
  "model" (dict "path" .Values.model.path "init_if_missing" false)
  "redis" (dict "url" (include "rollwave.redisUrl" .) "username" .Values.redis.auth.username)
  "engine" (dict "backend" .Values.engine.backend "port" (int .Values.engine.port))
  "rollout" (dict "grpc_port" (int .Values.rollout.grpcPort) "stage_port" (int .Values.rollout.stagePort) "metrics_port" (int .Values.rollout.metricsPort) "metrics_host" "0.0.0.0")
  "trainer" (dict "metrics_port" (int .Values.trainer.metricsPort) "metrics_host" "0.0.0.0" "device" (ternary "cuda" "cpu" (gt (int .Values.trainer.gpusPerNode) 0)))
  "checkpoint" (dict "stage_dir" "/dev/shm/rollwave")
  "api" (dict "host" "0.0.0.0" "port" (int .Values.api.port) "data_root" "/data" "allowed_hosts" (include "rollwave.apiHosts" . | fromYamlArray))
-}}
{{- $tls := dict "tls_cert" "/tls/tls.crt" "tls_key" "/tls/tls.key" "tls_ca" "/tls/ca.crt" "tls_server_name" .Values.checkpointTLS.serverName "tls_client_name" .Values.checkpointTLS.clientName -}}
{{- if .Values.checkpointTLS.enabled }}{{ $_ := mergeOverwrite $base.checkpoint $tls }}{{ end -}}
{{- toYaml (mergeOverwrite $base (deepCopy .Values.runConfig)) -}}
{{- end -}}

{{/* Host names the API answers: its Service's in-cluster names, and loopback for kubectl port-forward. */}}
{{- define "rollwave.apiHosts" -}}
{{- $svc := printf "%s-api" (include "rollwave.fullname" .) -}}
{{- list "127.0.0.1" "localhost" $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $svc .Release.Namespace) | toYaml -}}
{{- end -}}

{{/* One secret of the chart's Secret as an environment variable: (dict "root" $ "name" VAR "key" KEY). */}}
{{- define "rollwave.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "rollwave.secretName" .root }}
      key: {{ .key }}
{{- end -}}

{{/* Environment every rollwave container gets (secrets are added per container, each only its own). */}}
{{- define "rollwave.env" -}}
- name: HOME
  value: /tmp
- name: OMP_WAIT_POLICY  # placement is empty: idle OpenMP threads sleep, not spin (docs/DECISIONS.md)
  value: PASSIVE
{{- if .Values.inspectable }}
- name: ROLLWAVE_INSPECTABLE  # dumpable, for debugging: py-spy, gdb (docs/SECURITY.md)
  value: "1"
{{- end }}
- name: REDIS_URL
  value: {{ include "rollwave.redisUrl" . | quote }}
{{- if .Values.redis.auth.enabled }}
{{ include "rollwave.secretEnv" (dict "root" . "name" "ROLLWAVE_REDIS_PASSWORD" "key" .Values.secrets.redisPasswordKey) }}
{{- end }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}

{{/* Volumes shared by the workloads: the run config, the model, and /tmp (the root filesystem is read-only). */}}
{{- define "rollwave.volumes" -}}
- name: config
  configMap:
    name: {{ include "rollwave.fullname" . }}-config
- name: tmp
  emptyDir: {}
- name: models
{{- if .Values.model.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.existingClaim }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{/* Builds the tiny model into the models emptyDir when no model claim is given. */}}
{{- define "rollwave.modelInit" -}}
{{- if and (not .Values.model.existingClaim) .Values.model.initTiny }}
initContainers:
  - name: model-init
    image: {{ include "rollwave.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["rollwave", "model", "init", "--out", "/models/tiny", "--seed", "0"]
    env:
      - name: HOME
        value: /tmp
    securityContext:
      {{- toYaml .Values.containerSecurityContext | nindent 6 }}
    volumeMounts:
      - name: models
        mountPath: /models
      - name: tmp
        mountPath: /tmp
{{- end }}
{{- end -}}

{{/* The pod securityContext of a rollwave workload; (dict "root" $ "seccomp" PROFILE) overrides its seccomp. */}}
{{- define "rollwave.podSecurityContext" -}}
{{- $ctx := deepCopy .root.Values.podSecurityContext -}}
{{- if .seccomp }}{{- $_ := set $ctx "seccompProfile" .seccomp -}}{{- end -}}
securityContext:
  {{- toYaml $ctx | nindent 2 }}
{{- end -}}

{{- define "rollwave.scheduling" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
