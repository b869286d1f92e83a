{{/* Names. Every user string below is inserted with toJson (valid YAML, escaped), never as raw text. */}}
{{- define "paratrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "paratrain.fullname" -}}
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

{{- define "paratrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "paratrain.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespace whose jobs a namespaced install runs. */}}
{{- define "paratrain.watchNamespace" -}}
{{- default .Release.Namespace .Values.watchNamespace -}}
{{- end -}}

{{- define "paratrain.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "paratrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "paratrain.name" . | toJson }}
app.kubernetes.io/instance: {{ .Release.Name | toJson }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "paratrain.labels" -}}
{{ include "paratrain.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | toJson }}
app.kubernetes.io/part-of: paratrain
app.kubernetes.io/managed-by: {{ .Release.Service | toJson }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | toJson }}
{{- end -}}

{{- /* The trainer's contract (paratrain.contract: PROGRESS_PORT, LABEL_JOB); tests/delivery/test_chart.py holds
these to it. */ -}}
{{- define "paratrain.progressPort" -}}29400{{- end }}
{{- define "paratrain.jobLabel" -}}paratrain.dev/job-name{{- end }}
