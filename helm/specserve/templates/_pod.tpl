{{/* The pods: specserve's (a Deployment's, or a multi-node replica's leader) and a multi-node
replica's Ray workers, and what they share. */}}

{{/* specserve's pod: the server and its engine. */}}
{{- define "specserve.serverPodTemplate" -}}
metadata:
  annotations:
    {{- if and .Values.apiKeys.enabled (not .Values.apiKeys.existingSecret) }}
    # Roll the pods when the chart's key file changes.
    checksum/api-keys: {{ include (print $.Template.BasePath "/secret.yaml") . | sha256sum }}
    {{- end }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  labels:
    {{- include "specserve.labels" . | nindent 4 }}
    {{- if .Values.multiNode.enabled }}
    app.kubernetes.io/component: server
    {{- end }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- include "specserve.podCommon" . | nindent 2 }}
  containers:
    - name: specserve
      image: {{ include "specserve.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      {{- if .Values.multiNode.enabled }}
      # This replica's Ray head, then the server: it waits for every worker to join
      # (SPECSERVE_RAY_NODES) before the engine places its ranks on the cluster.
      command: ["tini", "--", "sh", "-c"]
      args:
        - ray start --head --port={{ .Values.multiNode.rayPort }} --disable-usage-stats && exec specserve serve
      {{- else }}
      args: ["serve"]
      {{- end }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      ports:
        - name: http
          containerPort: {{ .Values.server.port }}
          protocol: TCP
        - name: metrics
          containerPort: {{ .Values.metrics.port }}
          protocol: TCP
      env:
        - name: SPECSERVE_HOST
          value: "0.0.0.0"
        - name: SPECSERVE_PORT
          value: {{ .Values.server.port | quote }}
        - name: SPECSERVE_METRICS_PORT
          value: {{ .Values.metrics.port | quote }}
        - name: SPECSERVE_CACHE_DIR
          value: /models
        - name: HF_HOME
          value: /models/huggingface
        - name: SPECSERVE_LOG_FORMAT
          value: {{ .Values.server.logFormat | quote }}
        - name: SPECSERVE_DRAIN_TIMEOUT_SECONDS
          value: {{ .Values.server.drainTimeoutSeconds | quote }}
        {{- with .Values.server.maxConcurrentRequests }}
        - name: SPECSERVE_MAX_CONCURRENT_REQUESTS
          value: {{ . | quote }}
        {{- end }}
        {{- with .Values.server.maxQueuedRequests }}
        - name: SPECSERVE_MAX_QUEUED_REQUESTS
          value: {{ . | quote }}
        {{- end }}
        {{- with include "specserve.rateLimitStore" . }}
        - name: SPECSERVE_RATE_LIMIT_STORE
          value: {{ . | quote }}
        - name: SPECSERVE_RATE_LIMIT_ON_STORE_FAILURE
          value: {{ $.Values.rateLimits.onStoreFailure | quote }}
        {{- end }}
        {{- with .Values.model.target }}
        - name: SPECSERVE_MODEL
          value: {{ . | quote }}
        {{- end }}
        {{- with .Values.model.draft }}
        - name: SPECSERVE_DRAFT_MODEL
          value: {{ . | quote }}
        {{- end }}
        {{- with .Values.model.servedModelName }}
        - name: SPECSERVE_SERVED_MODEL_NAME
          value: {{ . | quote }}
        {{- end }}
        {{- if .Values.speculation.enabled }}
        - name: SPECSERVE_SPECULATIVE_METHOD
          value: {{ .Values.speculation.method | quote }}
        - name: SPECSERVE_SPECULATION
          value: {{ .Values.speculation.mode | quote }}
        {{- with .Values.speculation.numSpeculativeTokens }}
        - name: SPECSERVE_NUM_SPECULATIVE_TOKENS
          value: {{ . | quote }}
        {{- end }}
        {{- with .Values.speculation.maxBatchSize }}
        - name: SPECSERVE_SPECULATION_MAX_BATCH_SIZE
          value: {{ . | quote }}
        {{- end }}
        {{- else }}
        - name: SPECSERVE_NO_SPECULATION
          value: "true"
        {{- end }}
        {{- if and .Values.gpu.enabled .Values.gpu.enginePatches }}
        - name: SPECSERVE_GPU_ENGINE_PATCHES
          value: "true"
        {{- end }}
        - name: SPECSERVE_DTYPE
          value: {{ .Values.engine.dtype | quote }}
        {{- with .Values.engine.maxModelLen }}
        - name: SPECSERVE_MAX_MODEL_LEN
          value: {{ . | quote }}
        {{- end }}
        {{- with .Values.engine.kvCacheGiB }}
        - name: SPECSERVE_KV_CACHE_GIB
          value: {{ . | quote }}
        {{- end }}
        - name: SPECSERVE_MAX_NUM_SEQS
          value: {{ .Values.engine.maxNumSeqs | quote }}
        {{- with .Values.engine.blockSize }}
        - name: SPECSERVE_BLOCK_SIZE
          value: {{ . | quote }}
        {{- end }}
        {{- if not .Values.engine.prefixCaching }}
        - name: SPECSERVE_NO_PREFIX_CACHING
          value: "true"
        {{- end }}
        {{- if .Values.engine.sharedPrefixCache }}
        - name: SPECSERVE_SHARED_PREFIX_CACHE
          value: "true"
        {{- end }}
        {{- if gt (int .Values.engine.tensorParallelSize) 1 }}
        - name: SPECSERVE_TENSOR_PARALLEL_SIZE
          value: {{ .Values.engine.tensorParallelSize | quote }}
        {{- end }}
        {{- if gt (int .Values.engine.pipelineParallelSize) 1 }}
        - name: SPECSERVE_PIPELINE_PARALLEL_SIZE
          value: {{ .Values.engine.pipelineParallelSize | quote }}
        {{- end }}
        {{- if .Values.multiNode.enabled }}
        - name: SPECSERVE_DISTRIBUTED_EXECUTOR_BACKEND
          value: ray
        - name: RAY_ADDRESS
          value: 127.0.0.1:{{ .Values.multiNode.rayPort }}
        - name: SPECSERVE_RAY_NODES
          value: {{ .Values.multiNode.size | quote }}
        - name: SPECSERVE_RAY_JOIN_TIMEOUT_SECONDS
          value: {{ .Values.multiNode.joinTimeoutSeconds | quote }}
        {{- end }}
        {{- if .Values.apiKeys.enabled }}
        - name: SPECSERVE_API_KEY_FILE
          value: /etc/specserve/api-keys/{{ .Values.apiKeys.secretKey }}
        {{- else }}
        # apiKeys.enabled is false: open access on every interface, by choice (see NOTES).
        - name: SPECSERVE_ALLOW_UNAUTHENTICATED
          value: "true"
        {{- end }}
        {{- if .Values.server.metricsNeedKey }}
        - name: SPECSERVE_METRICS_NEED_KEY
          value: "true"
        {{- end }}
        {{- with .Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      startupProbe:
        httpGet:
          path: /health
          port: http
        periodSeconds: {{ .Values.probes.startup.periodSeconds }}
        failureThreshold: {{ .Values.probes.startup.failureThreshold }}
        timeoutSeconds: {{ .Values.probes.startup.timeoutSeconds }}
      readinessProbe:
        httpGet:
          path: /ready
          port: http
        periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
        failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
        timeoutSeconds: {{ .Values.probes.readiness.timeoutSeconds }}
      livenessProbe:
        httpGet:
          path: /health
          port: http
        periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
        failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
        timeoutSeconds: {{ .Values.probes.liveness.timeoutSeconds }}
      lifecycle:
        preStop:
          # Endpoints and load balancers drop the pod before SIGTERM starts the drain.
          exec:
            command: ["sleep", "{{ .Values.lifecycle.preStopSleepSeconds }}"]
      resources:
        {{- include "specserve.resources" . | nindent 8 }}
      volumeMounts:
        {{- include "specserve.engineVolumeMounts" . | nindent 8 }}
        {{- if .Values.apiKeys.enabled }}
        - name: api-keys
          mountPath: /etc/specserve/api-keys
          readOnly: true
        {{- end }}
  volumes:
    {{- include "specserve.engineVolumes" . | nindent 4 }}
    {{- if .Values.apiKeys.enabled }}
    - name: api-keys
      secret:
        secretName: {{ include "specserve.apiKeySecretName" . }}
        items:
          - key: {{ .Values.apiKeys.secretKey }}
            path: {{ .Values.apiKeys.secretKey }}
    {{- end }}
  {{- include "specserve.scheduling" . }}
{{- end }}

{{/* A Ray worker of a multi-node replica: joins the leader's Ray head (LWS_LEADER_ADDRESS,
set by the LeaderWorkerSet controller) and runs the engine ranks Ray places on its GPUs. */}}
{{- define "specserve.rayWorkerPodTemplate" -}}
metadata:
  labels:
    {{- include "specserve.labels" . | nindent 4 }}
    app.kubernetes.io/component: ray-worker
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  {{- include "specserve.podCommon" . | nindent 2 }}
  containers:
    - name: ray-worker
      image: {{ include "specserve.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command: ["tini", "--", "sh", "-c"]
      args:
        - exec ray start --address="$LWS_LEADER_ADDRESS:{{ .Values.multiNode.rayPort }}" --block --disable-usage-stats
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      env:
        # The engine ranks here read the same model files at the same path as the leader.
        - name: SPECSERVE_CACHE_DIR
          value: /models
        - name: HF_HOME
          value: /models/huggingface
        {{- with .Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      resources:
        {{- include "specserve.resources" . | nindent 8 }}
      volumeMounts:
        {{- include "specserve.engineVolumeMounts" . | nindent 8 }}
  volumes:
    {{- include "specserve.engineVolumes" . | nindent 4 }}
  {{- include "specserve.scheduling" . }}
{{- end }}

{{/* Pod settings every pod of the chart has. */}}
{{- define "specserve.podCommon" -}}
serviceAccountName: {{ include "specserve.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
# Covers the preStop pause and the server's drain of in-flight requests.
terminationGracePeriodSeconds: {{ include "specserve.terminationGracePeriodSeconds" . }}
{{- end }}

{{/* The engine container's resources: the chart's, plus gpu.count GPUs. */}}
{{- define "specserve.resources" -}}
{{- $resources := deepCopy .Values.resources }}
{{- if .Values.gpu.enabled }}
{{- $gpu := dict .Values.gpu.resourceName (int .Values.gpu.count) }}
{{- $_ := set $resources "limits" (merge (default dict $resources.limits) $gpu) }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{- define "specserve.engineVolumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
{{- if ne .Values.modelCache.type "image" }}
- name: models
  mountPath: /models
{{- end }}
{{- end }}

{{- define "specserve.engineVolumes" -}}
# vLLM's processes exchange tensors through shared memory; the
# container runtime's default /dev/shm is 64 MiB.
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shmSizeLimit }}
{{- if eq .Values.modelCache.type "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ include "specserve.modelCacheClaimName" . }}
{{- else if eq .Values.modelCache.type "emptyDir" }}
- name: models
  emptyDir:
    sizeLimit: {{ .Values.modelCache.size }}
{{- end }}
{{- end }}

{{/* Where pods may run (indented for a pod spec). */}}
{{- define "specserve.scheduling" -}}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
