{{/*
Names, labels and the pieces every tiergate pod shares. Templates take labels only from
here so that selectors, Services, PDBs and ServiceMonitors always agree.
*/}}

{{- define "tiergate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Resource name prefix. Truncated to leave room for the longest suffix we add ("-migrate").
*/}}
{{- define "tiergate.fullname" -}}
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

{{- define "tiergate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels of one component. Call with (dict "root" $ "component" "gateway").
These never change after install: Deployment selectors are immutable.
*/}}
{{- define "tiergate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tiergate.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
All labels of one component's resources. Call with (dict "root" $ "component" "gateway").
*/}}
{{- define "tiergate.labels" -}}
helm.sh/chart: {{ include "tiergate.chart" .root }}
{{ include "tiergate.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: tiergate
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/* The Secret holding the database URL, Redis URL and admin token. */}}
{{- define "tiergate.secretName" -}}
{{- if .Values.existingSecret.name }}
{{- .Values.existingSecret.name }}
{{- else }}
{{- include "tiergate.fullname" . }}
{{- end }}
{{- end }}

{{/*
Image reference. Call with (dict "root" $ "repository" "" "tag" "" "variant" "cpu"); empty
repository and tag fall back to image.repository and "<appVersion>-<variant>".
*/}}
{{- define "tiergate.image" -}}
{{- $repository := .repository | default .root.Values.image.repository }}
{{- $tag := .tag | default (printf "%s-%s" .root.Chart.AppVersion .variant) }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}

{{/*
The admin token the chart stores: the configured one, else the one already in the release's
Secret (so upgrades keep it), else a new random one.
*/}}
{{- define "tiergate.adminToken" -}}
{{- if .Values.adminToken }}
{{- /* What the processes accept (gateway/settings.py): a pod would not start on it. */}}
{{- if not (regexMatch "^[!-~]{16,}$" .Values.adminToken) }}
{{- fail "adminToken must be at least 16 printable ASCII characters with no spaces" }}
{{- end }}
{{- .Values.adminToken }}
{{- else }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "tiergate.fullname" .) }}
{{- if and $existing $existing.data (index $existing.data "admin-token") }}
{{- index $existing.data "admin-token" | b64dec }}
{{- else }}
{{- randAlphaNum 48 }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Key of one setting (databaseUrl, redisUrl, adminToken) in the Secret: the chart's own keys,
or the configured ones of an existing Secret. Call with (dict "root" $ "setting" "redisUrl").
*/}}
{{- define "tiergate.secretKey" -}}
{{- if .root.Values.existingSecret.name }}
{{- index .root.Values.existingSecret (printf "%sKey" .setting) }}
{{- else }}
{{- .setting | kebabcase }}
{{- end }}
{{- end }}

{{/*
Connection settings read from the Secret, one env var each; a process gets only the ones
it uses (workers never see the database or the admin token). Call with
(dict "root" $ "settings" (list "databaseUrl" "redisUrl")), plus "secretName" to read a
Secret other than the release's (with the chart's own key names).
*/}}
{{- define "tiergate.secretEnv" -}}
{{- $root := .root }}
{{- $vars := dict "databaseUrl" "TIERGATE_DATABASE_URL" "redisUrl" "TIERGATE_REDIS_URL" "adminToken" "TIERGATE_ADMIN_TOKEN" }}
{{- $secretName := .secretName | default (include "tiergate.secretName" $root) }}
{{- $env := list }}
{{- range .settings }}
{{- $ref := dict "name" $secretName "key" (include "tiergate.secretKey" (dict "root" $root "setting" .)) }}
{{- $env = append $env (dict "name" (get $vars .) "valueFrom" (dict "secretKeyRef" $ref)) }}
{{- end }}
{{- toYaml $env }}
{{- end }}

{{/*
Environment of a long-running tiergate container besides the ConfigMap: its secrets, its
OpenTelemetry service name, then the chart-wide extraEnv. Call with
(dict "root" $ "component" "gateway" "settings" (list ...)).
*/}}
{{- define "tiergate.env" -}}
{{- include "tiergate.secretEnv" (dict "root" .root "settings" .settings) }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "tiergate-%s" .component | quote }}
{{- with .root.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Checksums that roll the pods when their configuration changes. */}}
{{- define "tiergate.configChecksums" -}}
checksum/config: {{ include (print $.Template.BasePath "/configmap-env.yaml") . | sha256sum }}
checksum/secret: {{ list .Values.existingSecret .Values.database.url .Values.redis.url .Values.adminToken | toJson | sha256sum }}
{{- end }}

{{/* Volumes every long-running pod has: /tmp scratch (the root filesystem is read-only)
and the model volume, when one is configured. */}}
{{- define "tiergate.volumes" -}}
- name: scratch
  emptyDir:
    sizeLimit: {{ .Values.scratchSizeLimit }}
{{- with .Values.model.volume }}
- name: model
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "tiergate.volumeMounts" -}}
- name: scratch
  mountPath: /tmp
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}
