{{/*
Chart name, truncated to the 63 characters of a label value.
*/}}
{{- define "agent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name, the prefix of every object name. A release name that contains the
chart name is used as is, so that the release "tokenbroker-agent" names its
objects as deploy/agent does. Truncated to leave room for the "-identity"
suffix within 63 characters.
*/}}
{{- define "agent.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Labels of every object.
*/}}
{{- define "agent.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "agent.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tokenbroker
{{- end }}

{{/*
Selector labels (the Deployment's selector is immutable).
*/}}
{{- define "agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "agent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The ServiceAccount the agent runs as.
*/}}
{{- define "agent.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "agent.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false: the name of an existing ServiceAccount" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The join token Secret.
*/}}
{{- define "agent.joinSecret" -}}
{{- default (printf "%s-join" (include "agent.fullname" .)) .Values.joinToken.secret }}
{{- end }}

{{/*
Where the join token Secret is mounted.
*/}}
{{- define "agent.joinDir" -}}
/var/run/tokenbroker/join
{{- end }}

{{/*
Where the agent's own pod certificate is mounted (podCertificate.signerName).
*/}}
{{- define "agent.podCertificateDir" -}}
/var/run/tokenbroker/pod-identity
{{- end }}

{{/*
The agent's configuration as the ConfigMap holds it: config with the
identity Secret, the join token file and the ops address filled in (see
values.yaml). Fails rendering without targets.
*/}}
{{- define "agent.config" -}}
{{- $c := deepCopy .Values.config }}
{{- if and (not $c.targets) (not $c.jwksUpload) (not $c.podSigner) (not .Values.existingConfigMap) }}
{{- required "config.targets is required (or config.jwksUpload, config.podSigner): the brokers, requests and outputs of the agent (docs/agent.md)" nil }}
{{- end }}
{{- $id := default dict $c.identity }}
{{- if .Values.podCertificate.signerName }}
{{- if or $id.dir $id.secret $id.enroll $id.renewBroker }}
{{- fail "podCertificate.signerName makes the agent's identity its Pod's certificate: config.identity takes only trustBundleFrom then (no dir, secret, enroll or renewBroker)" }}
{{- end }}
{{- if $c.jwksUpload }}
{{- fail "podCertificate.signerName and config.jwksUpload exclude each other: brokers take the key set and the live Pods from a client certificate only; let the signer's release upload them" }}
{{- end }}
{{- if $c.podSigner }}
{{- fail "podCertificate.signerName and config.podSigner exclude each other: the kubelet starts the signer's Pod only once its certificate is signed; install the signer as another release with a client certificate (docs/agent.md)" }}
{{- end }}
{{- $_ := required "podCertificate.caConfigMap is required with podCertificate.signerName: a ConfigMap whose ca.crt verifies the brokers" .Values.podCertificate.caConfigMap }}
{{- $_ := set $id "podCertificate" (dict "dir" (include "agent.podCertificateDir" .)) }}
{{- else if not $id.dir }}
{{- $s := default dict $id.secret }}
{{- $_ := set $s "namespace" (default .Release.Namespace $s.namespace) }}
{{- $_ := set $s "name" (default (printf "%s-identity" (include "agent.fullname" .)) $s.name) }}
{{- $_ := set $id "secret" $s }}
{{- end }}
{{- if $id.enroll }}
{{- $_ := set $id.enroll "tokenFile" (default (printf "%s/%s" (include "agent.joinDir" .) .Values.joinToken.key) $id.enroll.tokenFile) }}
{{- end }}
{{- $_ := set $c "identity" $id }}
{{- $_ := set $c "opsAddress" (printf ":%d" (int .Values.containerPorts.ops)) }}
{{- toYaml $c }}
{{- end }}

{{/*
The output Secrets of the configuration, as a dict from namespace to the
list of Secret names there.
*/}}
{{- define "agent.outputSecrets" -}}
{{- $out := dict }}
{{- range .Values.config.targets }}
{{- range .outputs }}
{{- if .secret }}
{{- $names := get $out .secret.namespace | default list }}
{{- if not (has .secret.name $names) }}
{{- $_ := set $out .secret.namespace (append $names .secret.name) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end }}
