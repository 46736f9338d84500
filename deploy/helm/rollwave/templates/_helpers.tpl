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
{{- $keys := list .Values.secrets.apiTokenKey .Values.secrets.checkpointTokenKey .Values.secrets.redisPasswordKey -}}
{{- if ne (len ($keys | uniq)) 3 -}}
{{- fail (printf "secrets: apiTokenKey, checkpointTokenKey and redisPasswordKey (%s) must be three different keys: a shared key makes two secrets one (the API clients' token the checkpoint token, which pushes weights; the Redis password, which every container holds, the API token)" (join ", " $keys)) -}}
{{- end -}}
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

{{/* The run config (core/config.py) every component reads from /config/run.yaml. runConfig may not set a secret
(this is a ConfigMap; each secret reaches its containers from the Secret) nor a key the chart wires from a value. */}}
{{- define "rollwave.runConfig" -}}
{{- $secret := "a secret never goes in runConfig, which the chart writes to a ConfigMap; it belongs in the Secret" }}
{{- $port := "the chart sets it from %s, which the container port, Service and NetworkPolicy use: set that value" }}
{{- $refused := dict
  "api.token" (printf "%s (key secrets.apiTokenKey)" $secret)
  "checkpoint.token" (printf "%s (key secrets.checkpointTokenKey)" $secret)
  "redis.password" (printf "%s (key secrets.redisPasswordKey)" $secret)
  "engine.api_key" (printf "%s; the chart's engines need none: they listen on the pod's loopback" $secret)
  "rollout.grpc_port" (printf $port "rollout.grpcPort")
  "rollout.stage_port" (printf $port "rollout.stagePort")
  "rollout.metrics_port" (printf $port "rollout.metricsPort")
  "trainer.metrics_port" (printf $port "trainer.metricsPort")
  "rollout.metrics_host" "the chart binds metrics on 0.0.0.0 so that Prometheus can scrape them"
  "trainer.metrics_host" "the chart binds metrics on 0.0.0.0 so that Prometheus can scrape them"
  "engine.port" "the chart sets it from engine.port, which the SGLang sidecar listens on: set that value"
  "model.path" "the chart sets it from model.path, which the SGLang sidecar loads: set that value"
  "redis.url" "the chart sets it from redis.url (also REDIS_URL, which wins): set that value"
  "redis.username" "the chart sets it from redis.auth.username (the ACL user the bundled Redis lets in): set that value"
  "run.dir" "the chart sets /runs, the trainer's volume (elsewhere is the read-only root)"
  "checkpoint.stage_dir" "the chart sets the staging emptyDir's mount, sized by rollout.stageSize"
  "checkpoint.tls_server_name" "the chart sets it from checkpointTLS.serverName, which its certificates carry: set that value"
  "checkpoint.tls_client_name" "the chart sets it from checkpointTLS.clientName, which its certificates carry: set that value"
  "checkpoint.tls_cert" "the chart sets the files of checkpointTLS, mounted at /tls (checkpointTLS.existingSecret brings your own)"
  "checkpoint.tls_key" "the chart sets the files of checkpointTLS, mounted at /tls (checkpointTLS.existingSecret brings your own)"
  "checkpoint.tls_ca" "the chart sets the files of checkpointTLS, mounted at /tls (checkpointTLS.existingSecret brings your own)"
  "trainer.device" "the chart sets it from trainer.gpusPerNode (cuda above 0), which requests the GPUs: set that value"
  "api.data_root" "the chart sets /data, where api.dataClaim is mounted"
  "api.host" "the API's command line sets 0.0.0.0, for its Service: this would do nothing"
  "api.port" "the API's command line sets it from api.port, which its Service and probes use: set that value"
  "engine.backend" "the rollout servers' command line sets it from engine.backend, which adds the SGLang sidecar: set that value"
  "rollout.server_id" "each rollout server's command line sets its pod's name: this would do nothing"
  "rollout.grpc_host" "each rollout server's command line sets its pod's IP, which the trainer reaches: this would do nothing"
}}
{{- if eq .Values.engine.backend "sglang" }}
{{- $_ := set $refused "engine.urls" "the rollout servers' command line sets the SGLang sidecar's: this would do nothing" }}
{{- $_ := set $refused "engine.ready_timeout_s" "the rollout servers' command line sets it from engine.sglang.startupSeconds: set that value" }}
{{- end }}
{{- range $dotted, $why := $refused }}
{{- $key := splitList "." $dotted }}
{{- if hasKey (dig (first $key) dict $.Values.runConfig) (last $key) }}
{{- fail (printf "runConfig.%s: %s" $dotted $why) }}
{{- end }}
{{- end -}}
{{- /* The pods mount the model claim, or else an emptyDir the tiny model is built into, at /models. */}}
{{- if .Values.model.existingClaim }}
{{- if not (or (eq .Values.model.path "/models") (hasPrefix "/models/" .Values.model.path)) }}
{{- fail (printf "model.path: %s is not under /models, where the pods mount model.existingClaim" .Values.model.path) }}
{{- end }}
{{- else if not .Values.model.initTiny }}
{{- fail "model.existingClaim: empty, with model.initTiny false, leaves /models an empty emptyDir: give a claim that holds model.path" }}
{{- else if ne .Values.model.path "/models/tiny" }}
{{- fail (printf "model.path: %s is not in the pods' emptyDir, which holds only the tiny model (/models/tiny): give model.existingClaim, a claim that holds it" .Values.model.path) }}
{{- end }}
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
{{- $chartHosts := $base.api.allowed_hosts -}}
{{- $merged := mergeOverwrite $base (deepCopy .Values.runConfig) -}}
{{- $_ := set $merged.api "allowed_hosts" (concat $chartHosts ($merged.api.allowed_hosts | default list) | uniq) -}}
{{- toYaml $merged -}}
{{- end -}}

{{/* A Kubernetes quantity in bytes, to compare sizes: (dict "key" VALUE-NAME "value" QUANTITY), a whole number
with an optional unit (k, M, G, T, Ki, Mi, Gi, Ti); anything else fails naming the value. */}}
{{- define "rollwave.bytes" -}}
{{- $q := ternary (int64 .value | toString) (toString .value) (kindIs "float64" .value) -}}
{{- $bytes := 0 -}}
{{- range $unit, $scale := dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 -}}
{{- if and (hasSuffix $unit $q) (regexMatch "^[0-9]+$" (trimSuffix $unit $q)) }}{{ $bytes = mul (trimSuffix $unit $q | int64) $scale }}{{ end -}}
{{- end -}}
{{- if not $bytes }}{{ fail (printf "%s: %q is not a size this chart can compare: a whole number with an optional unit k, M, G, T, Ki, Mi, Gi or Ti" .key $q) }}{{ end -}}
{{- $bytes -}}
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
