{{/* Names and labels. */}}
{{- define "codecage.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "codecage.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "codecage.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "codecage.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "codecage.selectorLabels" -}}
app.kubernetes.io/name: {{ include "codecage.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "codecage.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "codecage.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "codecage.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "codecage.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "codecage.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The environment variable that holds a named client's token. */}}
{{- define "codecage.clientTokenEnv" -}}
{{- printf "CODECAGE_CLIENT_%s_TOKEN" (.name | upper | replace "-" "_") -}}
{{- end -}}

{{/* The TCP ports the egress proxy connects to: each allowHost's port, else 443 and 80. */}}
{{- define "codecage.egressPorts" -}}
{{- $ports := dict -}}
{{- range .Values.server.allowHosts -}}
{{- $parts := splitList ":" . -}}
{{- if and (eq (len $parts) 2) (regexMatch "^[0-9]+$" (last $parts)) -}}
{{- $_ := set $ports (last $parts) true -}}
{{- else -}}
{{- $_ := set $ports "443" true -}}
{{- $_ := set $ports "80" true -}}
{{- end -}}
{{- end -}}
{{- keys $ports | sortAlpha | join "," -}}
{{- end -}}

{{/* Whether to render a ServiceMonitor: true, or auto and the cluster serves its CRD. */}}
{{- define "codecage.serviceMonitor" -}}
{{- $want := toString .Values.metrics.serviceMonitor.enabled -}}
{{- if or (eq $want "true") (and (eq $want "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor")) -}}
true
{{- end -}}
{{- end -}}

{{/*
The pod template, shared by the Deployment and the sessions StatefulSet. The security
settings and why each is there: docs/kubernetes.md.
*/}}
{{- define "codecage.podTemplate" -}}
metadata:
  labels:
    {{- include "codecage.selectorLabels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
    {{- if and .Values.metrics.public .Values.metrics.annotations }}
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ .Values.server.port | quote }}
    prometheus.io/path: /metrics
    {{- end }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "codecage.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
  enableServiceLinks: false
  {{- if .Values.runtimeClassName }}
  runtimeClassName: {{ .Values.runtimeClassName }}
  {{- end }}
  {{- if not .Values.hostUsers }}
  hostUsers: false
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  containers:
    - name: codecage
      image: {{ include "codecage.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args:
        - serve
        - --http
        - --host=0.0.0.0
        - --port={{ .Values.server.port }}
        - --config=/etc/codecage/config.toml
        - --max-concurrent={{ .Values.server.maxConcurrent }}
        - --max-queued={{ .Values.server.maxQueued }}
        - --max-timeout={{ .Values.server.maxTimeout }}
        - --max-memory-mb={{ .Values.server.maxMemoryMb }}
        {{- if not .Values.server.pool }}
        - --no-pool
        {{- end }}
        {{- if .Values.server.replyMaxTokens }}
        - --reply-max-tokens={{ .Values.server.replyMaxTokens }}
        {{- end }}
        {{- if .Values.metrics.public }}
        - --metrics-public
        {{- end }}
        {{- range .Values.server.allowHosts }}
        - --allow-host={{ . }}
        {{- end }}
        {{- if eq .Values.audit.mode "off" }}
        - --audit=off
        {{- end }}
        {{- range .Values.server.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        - name: CODECAGE_TOKEN
          valueFrom:
            secretKeyRef:
              name: {{ required "auth.existingSecret: name the Secret that holds the bearer token" .Values.auth.existingSecret }}
              key: {{ .Values.auth.tokenKey }}
        {{- range .Values.clients }}
        - name: {{ include "codecage.clientTokenEnv" . }}
          valueFrom:
            secretKeyRef:
              name: {{ required "clients[].existingSecret: name the Secret that holds this client's token" .existingSecret }}
              key: {{ default .name .tokenKey }}
        {{- end }}
        {{- if eq .Values.audit.mode "postgres" }}
        - name: CODECAGE_AUDIT
          valueFrom:
            secretKeyRef:
              name: {{ required "audit.postgres.existingSecret: name the Secret that holds the postgresql:// URL" .Values.audit.postgres.existingSecret }}
              key: {{ .Values.audit.postgres.urlKey }}
        {{- end }}
        - name: HOME
          value: /var/lib/codecage
        - name: XDG_STATE_HOME
          value: /var/lib/codecage/state
        - name: TMPDIR
          value: /tmp
        {{- with .Values.server.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with .Values.server.extraEnvFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      ports:
        - name: http
          containerPort: {{ .Values.server.port }}
          protocol: TCP
      startupProbe:
        httpGet:
          path: /healthz
          port: http
        {{- toYaml .Values.probes.startup | nindent 8 }}
      livenessProbe:
        httpGet:
          path: /healthz
          port: http
        {{- toYaml .Values.probes.liveness | nindent 8 }}
      readinessProbe:
        httpGet:
          path: /readyz
          port: http
        {{- toYaml .Values.probes.readiness | nindent 8 }}
      resources:
        {{- toYaml .Values.resources | nindent 8 }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: config
          mountPath: /etc/codecage
          readOnly: true
        - name: tmp
          mountPath: /tmp
        - name: state
          mountPath: /var/lib/codecage
  volumes:
    - name: config
      configMap:
        name: {{ include "codecage.fullname" . }}
        defaultMode: 0444
    - name: tmp
      emptyDir:
        sizeLimit: {{ .Values.volumes.tmpSizeLimit }}
    - name: state
      emptyDir:
        sizeLimit: {{ .Values.volumes.stateSizeLimit }}
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
{{- end -}}
