{{/*
Chart name, truncated to the 63 characters of a label value.
*/}}
{{- define "tokenbroker.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name, the prefix of every object name. A release name that contains the
chart name is used as is, so that the release "tokenbroker" names its objects
as deploy/base does. Truncated to leave room for the "-policy" and "-metrics"
suffixes within 63 characters.
*/}}
{{- define "tokenbroker.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 55 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version for the helm.sh/chart label.
*/}}
{{- define "tokenbroker.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of every object.
*/}}
{{- define "tokenbroker.labels" -}}
helm.sh/chart: {{ include "tokenbroker.chart" . }}
{{ include "tokenbroker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tokenbroker
{{- end }}

{{/*
Selector labels: the Deployment's selector (immutable), the Services', the
PodDisruptionBudget's, the NetworkPolicy's and the pod anti-affinity's.
*/}}
{{- define "tokenbroker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tokenbroker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The ServiceAccount the broker runs as.
*/}}
{{- define "tokenbroker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tokenbroker.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false: the name of an existing ServiceAccount" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Image tag: image.tag, else the chart's appVersion.
*/}}
{{- define "tokenbroker.imageTag" -}}
{{- default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{/*
Name of the ConfigMap holding policy.yaml.
*/}}
{{- define "tokenbroker.policyConfigMap" -}}
{{- default (printf "%s-policy" (include "tokenbroker.fullname" .)) .Values.existingPolicyConfigMap }}
{{- end }}

{{/*
Name of the kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt. Fails
rendering when it is not set.
*/}}
{{- define "tokenbroker.tlsSecret" -}}
{{- required "pki.tlsSecret is required: the name of a kubernetes.io/tls Secret in the release namespace with tls.crt, tls.key and ca.crt (e.g. --set pki.tlsSecret=tokenbroker-tls; see docs/operations.md, \"Deploying with Helm\")" .Values.pki.tlsSecret }}
{{- end }}

{{/*
Path of the client CA bundle (--client-ca-file).
*/}}
{{- define "tokenbroker.clientCAFile" -}}
{{- $ca := .Values.pki.clientCA }}
{{- if and $ca.secret $ca.configMap }}
{{- fail "pki.clientCA: set secret or configMap, not both" }}
{{- end }}
{{- if or $ca.secret $ca.configMap }}
{{- printf "/etc/tokenbroker/client-ca/%s" $ca.key }}
{{- else }}
{{- print "/etc/tokenbroker/tls/ca.crt" }}
{{- end }}
{{- end }}

{{/*
Whether the pod mounts the signing CA (--ca-cert-file, --ca-key-file):
enrollment issues certificates with it, the lease gateway lease
certificates. "true" or empty.
*/}}
{{- define "tokenbroker.signingCA" -}}
{{- if or .Values.enrollment.enabled .Values.gateway.enabled }}true{{ end }}
{{- end }}

{{/*
The signing CA Secret. Fails rendering when enrollment or the gateway is
enabled without it.
*/}}
{{- define "tokenbroker.signingCASecret" -}}
{{- required "enrollment.caSecret is required when enrollment.enabled or gateway.enabled is true: the name of a Secret with the signing CA's certificate and key (see enrollment.caSecretKeys)" .Values.enrollment.caSecret }}
{{- end }}

{{/*
Where audit events go (--audit-log). Fails rendering for "off".
*/}}
{{- define "tokenbroker.auditLog" -}}
{{- if eq .Values.audit.log "off" }}
{{- fail "audit.log: audit cannot be turned off; use stdout, stderr or a file path" }}
{{- end }}
{{- .Values.audit.log }}
{{- end }}

{{/*
Container port of the enrollment listener. Fails rendering when it collides
with the API or ops port.
*/}}
{{- define "tokenbroker.enrollmentPort" -}}
{{- $port := int .Values.enrollment.port }}
{{- if has $port (list (int .Values.containerPorts.https) (int .Values.containerPorts.ops)) }}
{{- fail "enrollment.port must differ from containerPorts.https (the API) and containerPorts.ops (the ops listener)" }}
{{- end }}
{{- $port }}
{{- end }}

{{/*
Container port of the lease gateway's listener. Fails rendering when it
collides with the API, ops or enrollment port.
*/}}
{{- define "tokenbroker.gatewayPort" -}}
{{- $port := int .Values.gateway.containerPort }}
{{- $taken := list (int .Values.containerPorts.https) (int .Values.containerPorts.ops) }}
{{- if .Values.enrollment.enabled }}
{{- $taken = append $taken (int .Values.enrollment.port) }}
{{- end }}
{{- if has $port $taken }}
{{- fail "gateway.containerPort must differ from containerPorts.https (the API), containerPorts.ops (the ops listener) and, with enrollment, enrollment.port" }}
{{- end }}
{{- $port }}
{{- end }}

{{/*
The lease gateway's URL as the peers reach it (--gateway-url). Fails
rendering when the gateway is enabled without it.
*/}}
{{- define "tokenbroker.gatewayURL" -}}
{{- required "gateway.url is required when gateway.enabled is true: the gateway's https://host[:port] as the peers reach it (--gateway-url, the server of every gateway kubeconfig), e.g. https://tokenbroker.east.example:8445" .Values.gateway.url }}
{{- end }}

{{/*
The broker's --shutdown-delay in seconds: shutdownDelay, else 30 on the
node's network (the longest the old pod waits for its successor to serve)
and 5 on a pod network (for the Service's endpoints to drop the pod).
*/}}
{{- define "tokenbroker.shutdownDelaySeconds" -}}
{{- if .Values.shutdownDelay -}}
{{- int .Values.shutdownDelay -}}
{{- else if .Values.hostNetwork -}}
30
{{- else -}}
5
{{- end -}}
{{- end }}

{{/*
The ops port as probes and Services name it: by name, but by number with
hostNetwork, where the container declares no port.
*/}}
{{- define "tokenbroker.opsProbePort" -}}
{{- if .Values.hostNetwork -}}
{{- .Values.containerPorts.ops -}}
{{- else -}}
ops
{{- end -}}
{{- end }}
