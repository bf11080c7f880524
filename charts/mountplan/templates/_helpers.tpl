{{/* Chart name, truncated to the 63 characters of a label value. */}}
{{- define "mountplan.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified app name: the release name, prefixed with the chart name unless it contains it. */}}
{{- define "mountplan.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "mountplan.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mountplan.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mountplan.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "mountplan.labels" -}}
helm.sh/chart: {{ include "mountplan.chart" . }}
{{ include "mountplan.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: mountplan
{{- end -}}

{{- define "mountplan.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (printf "%s-node" (include "mountplan.fullname" .)) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The driver name, validated: it names the CSIDriver and a directory under kubeletDir. */}}
{{- define "mountplan.driverName" -}}
{{- $n := required "driverName is required" .Values.driverName -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$" $n) -}}
{{- fail (printf "driverName %q must be a DNS-1123 subdomain (lower case, digits, '-' and '.')" $n) -}}
{{- end -}}
{{- $n -}}
{{- end -}}

{{/* An absolute host directory without its trailing slash. */}}
{{- define "mountplan.absDir" -}}
{{- $d := trimSuffix "/" (required (printf "%s is required" .name) .value) -}}
{{- if not (hasPrefix "/" $d) -}}
{{- fail (printf "%s %q must be an absolute path" .name .value) -}}
{{- end -}}
{{- $d -}}
{{- end -}}

{{/* An admin root of the config: as the plugin wants it, clean, absolute, not /. */}}
{{- define "mountplan.root" -}}
{{- $r := toString .value -}}
{{- if or (not (hasPrefix "/" $r)) (ne (clean $r) $r) (eq $r "/") -}}
{{- fail (printf "%s %q must be a clean absolute path other than /" .name $r) -}}
{{- end -}}
{{- $r -}}
{{- end -}}

{{- define "mountplan.kubeletDir" -}}
{{- include "mountplan.absDir" (dict "name" "kubeletDir" "value" .Values.kubeletDir) -}}
{{- end -}}

{{- define "mountplan.stateDir" -}}
{{- include "mountplan.absDir" (dict "name" "stateDir" "value" .Values.stateDir) -}}
{{- end -}}

{{/* Host directory of the driver's CSI socket, mounted at /csi. */}}
{{- define "mountplan.pluginDir" -}}
{{- printf "%s/plugins/%s" (include "mountplan.kubeletDir" .) (include "mountplan.driverName" .) -}}
{{- end -}}

{{/* kubelet's plugin registration directory (the plugin or node-driver-registrar). */}}
{{- define "mountplan.registrationDir" -}}
{{- printf "%s/plugins_registry" (include "mountplan.kubeletDir" .) -}}
{{- end -}}

{{/* kubelet's pods directory: NodePublish targets of filesystem volumes. */}}
{{- define "mountplan.podsDir" -}}
{{- printf "%s/pods" (include "mountplan.kubeletDir" .) -}}
{{- end -}}

{{/* kubelet's CSI directory: staging paths and raw block publish targets. */}}
{{- define "mountplan.kubeletCSIDir" -}}
{{- printf "%s/plugins/kubernetes.io/csi" (include "mountplan.kubeletDir" .) -}}
{{- end -}}

{{/* repository:tag of an image value; ctx: root context, image: the image value. */}}
{{- define "mountplan.image" -}}
{{- $tag := default .ctx.Chart.AppVersion .image.tag -}}
{{- printf "%s:%s" (required "image repository is required" .image.repository) (toString $tag) -}}
{{- end -}}

{{/*
Host directories the admin config lets volumes name (config.imageRoots, and the
source.roots of config.fuseProfiles), as YAML: path -> "image" (loop images:
the plugin attaches them, the mounter checks that a loop device's backing file
is one it sees too) or "fuse" (FUSE sources: the plugin checks them, the
daemons in the mounter's container read and write them). Roots under the
state dir are left out: the state dir is mounted already.
*/}}
{{- define "mountplan.adminRoots" -}}
{{- $stateDir := include "mountplan.stateDir" . -}}
{{- $roots := dict -}}
{{- range $i, $r := .Values.config.imageRoots -}}
{{- $p := include "mountplan.root" (dict "name" (printf "config.imageRoots[%d]" $i) "value" $r) -}}
{{- if not (get $roots $p) -}}{{- $_ := set $roots $p "image" -}}{{- end -}}
{{- end -}}
{{- range $i, $prof := .Values.config.fuseProfiles -}}
{{- range $j, $r := (dig "source" "roots" list $prof) -}}
{{- $p := include "mountplan.root" (dict "name" (printf "config.fuseProfiles[%d].source.roots[%d]" $i $j) "value" $r) -}}
{{- $_ := set $roots $p "fuse" -}}
{{- end -}}
{{- end -}}
{{- range $p, $_ := $roots -}}
{{- if or (eq $p $stateDir) (hasPrefix (printf "%s/" $stateDir) $p) -}}{{- $_ := unset $roots $p -}}{{- end -}}
{{- end -}}
{{- toYaml $roots -}}
{{- end -}}

{{/* registration, validated: builtin or sidecar. */}}
{{- define "mountplan.registration" -}}
{{- $r := .Values.registration | toString -}}
{{- if not (has $r (list "builtin" "sidecar")) -}}
{{- fail (printf "registration %q must be builtin or sidecar" $r) -}}
{{- end -}}
{{- $r -}}
{{- end -}}
