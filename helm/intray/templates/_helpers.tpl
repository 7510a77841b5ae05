{{/* Chart name, truncated to the 63 characters Kubernetes names allow. */}}
{{- define "intray.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: the release name, with the chart name unless it already holds it. */}}
{{- define "intray.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "intray.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "intray.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "intray.selectorLabels" -}}
app.kubernetes.io/name: {{ include "intray.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "intray.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "intray.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Secret holding the database URL: an existing one, or the chart's. */}}
{{- define "intray.databaseSecret" -}}
{{- default (include "intray.fullname" .) .Values.database.existingSecret }}
{{- end }}

{{- define "intray.databaseSecretKey" -}}
{{- if .Values.database.existingSecret }}{{ .Values.database.existingSecretKey }}{{ else }}DATABASE_URL{{ end }}
{{- end }}

{{- define "intray.authSecret" -}}
{{- default (include "intray.fullname" .) .Values.auth.existingSecret }}
{{- end }}

{{- define "intray.authSecretKey" -}}
{{- if .Values.auth.existingSecret }}{{ .Values.auth.existingSecretKey }}{{ else }}tokens{{ end }}
{{- end }}

{{- define "intray.hasDatabase" -}}
{{- if or .Values.database.url .Values.database.existingSecret }}true{{ end }}
{{- end }}

{{- define "intray.hasAuth" -}}
{{- if or .Values.auth.tokens .Values.auth.existingSecret }}true{{ end }}
{{- end }}

{{/* Whether the store is PostgreSQL. An existing Secret is taken to hold a
PostgreSQL URL: it is what lets the schema allow several replicas. */}}
{{- define "intray.postgres" -}}
{{- if or (hasPrefix "postgres://" .Values.database.url) (hasPrefix "postgresql://" .Values.database.url) .Values.database.existingSecret }}true{{ end }}
{{- end }}

{{- define "intray.createsDatabaseSecret" -}}
{{- if and .Values.database.url (not .Values.database.existingSecret) }}true{{ end }}
{{- end }}

{{- define "intray.persistence" -}}
{{- if .Values.persistence.enabled }}true{{ end }}
{{- end }}

{{- define "intray.claimName" -}}
{{- .Values.persistence.existingClaim | default (printf "%s-data" (include "intray.fullname" .)) }}
{{- end }}

{{/* The Deployment strategy. On a persistent SQLite volume always Recreate:
two pods must never open one SQLite file, and a rolling update of a
ReadWriteOnce volume's pod hangs on Multi-Attach when the new pod lands on
another node. */}}
{{- define "intray.strategy" -}}
{{- if include "intray.persistence" . }}
{{- toYaml (dict "type" "Recreate") }}
{{- else if .Values.strategy }}
{{- toYaml .Values.strategy }}
{{- end }}
{{- end }}

{{/* The Services' port names and appProtocols. A mesh takes a port for what
these say (Istio reads the name up to its first "-" when appProtocol is
absent): with TLS, calling the ports grpc and http would have it parse TLS
as cleartext HTTP/2 and HTTP. */}}
{{- define "intray.grpcPortName" -}}
{{- if .Values.tls.enabled }}tls-grpc{{ else }}grpc{{ end }}
{{- end }}

{{- define "intray.grpcAppProtocol" -}}
{{- if .Values.tls.enabled }}tls{{ else }}grpc{{ end }}
{{- end }}

{{- define "intray.httpPortName" -}}
{{- if .Values.tls.enabled }}https{{ else }}http{{ end }}
{{- end }}

{{/* A Prometheus duration ("1m30s", "500ms") in milliseconds, to compare a
scrape timeout with its interval: Prometheus refuses a timeout above the
interval, and prometheus-operator then drops the whole ServiceMonitor with
no more than an event to show for it. */}}
{{- define "intray.promDurationMs" -}}
{{- $units := dict "y" 31536000000 "w" 604800000 "d" 86400000 "h" 3600000 "m" 60000 "s" 1000 "ms" 1 }}
{{- $ms := 0 }}
{{- range regexFindAll "[0-9]+(ms|[ywdhms])" . -1 }}
{{- $ms = add $ms (mul (regexReplaceAll "[a-z]+$" . "" | int64) (get $units (regexReplaceAll "^[0-9]+" . ""))) }}
{{- end }}
{{- $ms }}
{{- end }}
