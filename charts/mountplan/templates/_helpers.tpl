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

{{/* kubelet's plugin registration directory (the mounter or node-driver-registrar; never the plugin). */}}
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
Host directories the admin config lets volumes name, as YAML: path -> the
kinds of root it is (image: config.imageRoots, loop images the mounter
opens below the root and attaches, read-write for a writable volume, and
the plugin reads; fuse: source.roots
of config.fuseProfiles, which the plugin checks and the daemons in the
mounter's container read and write; nbd: config.nbd.socketRoots, unix
sockets the plugin connects to). Roots under the state dir are left out: the
state dir is mounted already. The plugin's container mounts every root
read-only.
*/}}
{{- define "mountplan.adminRoots" -}}
{{- $stateDir := include "mountplan.stateDir" . -}}
{{- $roots := dict -}}
{{- range $i, $r := .Values.config.imageRoots -}}
{{- $p := include "mountplan.root" (dict "name" (printf "config.imageRoots[%d]" $i) "value" $r) -}}
{{- include "mountplan.addRoot" (dict "roots" $roots "path" $p "kind" "image") -}}
{{- end -}}
{{- range $i, $prof := .Values.config.fuseProfiles -}}
{{- range $j, $r := (dig "source" "roots" list $prof) -}}
{{- $p := include "mountplan.root" (dict "name" (printf "config.fuseProfiles[%d].source.roots[%d]" $i $j) "value" $r) -}}
{{- include "mountplan.addRoot" (dict "roots" $roots "path" $p "kind" "fuse") -}}
{{- end -}}
{{- end -}}
{{- range $i, $r := (dig "nbd" "socketRoots" list .Values.config) -}}
{{- $p := include "mountplan.root" (dict "name" (printf "config.nbd.socketRoots[%d]" $i) "value" $r) -}}
{{- include "mountplan.addRoot" (dict "roots" $roots "path" $p "kind" "nbd") -}}
{{- end -}}
{{- range $p, $_ := $roots -}}
{{- if or (eq $p $stateDir) (hasPrefix (printf "%s/" $stateDir) $p) -}}{{- $_ := unset $roots $p -}}{{- end -}}
{{- end -}}
{{- toYaml $roots -}}
{{- end -}}

{{/* Marks .path in .roots as a root of .kind (see mountplan.adminRoots). */}}
{{- define "mountplan.addRoot" -}}
{{- $kinds := get .roots .path -}}
{{- if not $kinds -}}
{{- $kinds = dict -}}
{{- $_ := set .roots .path $kinds -}}
{{- end -}}
{{- $_ := set $kinds .kind true -}}
{{- end -}}

{{/*
Host paths the mounter's container needs for iSCSI volumes, as YAML: path ->
hostPath type. Empty unless config.iscsi.allowedPortals allows some portal.
The mounter runs iscsiadm, which writes the node records (CHAP included) and
talks to the host's iscsid through an abstract unix socket of the host's
network namespace: the mounter's pod always runs in it.
*/}}
{{- define "mountplan.iscsiHostPaths" -}}
{{- $i := .Values.config.iscsi | default dict -}}
{{- $paths := dict -}}
{{- if $i.allowedPortals -}}
{{- /* Node records (CHAP written by the mounter), iscsid.conf, the initiator name. */ -}}
{{- $_ := set $paths "/etc/iscsi" "Directory" -}}
{{- /* iscsiadm's lock of the node records, shared with the host's iscsiadm and iscsid. */ -}}
{{- $_ := set $paths "/run/lock/iscsi" "DirectoryOrCreate" -}}
{{- with $i.nodeDBDir -}}
{{- $p := include "mountplan.root" (dict "name" "config.iscsi.nodeDBDir" "value" .) -}}
{{- if not (or (eq $p "/etc/iscsi") (hasPrefix "/etc/iscsi/" $p)) -}}{{- $_ := set $paths $p "Directory" -}}{{- end -}}
{{- end -}}
{{- with $i.initiatorNameFile -}}
{{- $p := include "mountplan.root" (dict "name" "config.iscsi.initiatorNameFile" "value" .) -}}
{{- if not (or (eq $p "/etc/iscsi") (hasPrefix "/etc/iscsi/" $p)) -}}{{- $_ := set $paths $p "File" -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml $paths -}}
{{- end -}}

{{/*
The one iSCSI file the plugin's container reads: this node's initiator name,
for the plugin's own SendTargets discovery (read-only; it runs no iscsiadm
and writes nothing under /etc/iscsi). Empty unless iSCSI is allowed.
*/}}
{{- define "mountplan.iscsiInitiatorNameFile" -}}
{{- $i := .Values.config.iscsi | default dict -}}
{{- if $i.allowedPortals -}}
{{- with $i.initiatorNameFile -}}
{{- include "mountplan.root" (dict "name" "config.iscsi.initiatorNameFile" "value" .) -}}
{{- else -}}
/etc/iscsi/initiatorname.iscsi
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Whether path .a is .b or lies below it. */}}
{{- define "mountplan.within" -}}
{{- if or (eq .a .b) (hasPrefix (printf "%s/" (trimSuffix "/" .b)) .a) -}}true{{- end -}}
{{- end -}}

{{/*
Host directory of the mounter's socket (mounter.socketDir; empty:
<kubeletDir>/plugins/<driverName>-mounter). Only the plugin's and the
mounter's containers mount it; the mounter makes it mode 0700 at start.
Refused where another container, or the plugin with write access, would see
it: in the state dir, the plugin's CSI socket dir, kubelet's pods, CSI or
registration dirs.
*/}}
{{- define "mountplan.mounterSocketDir" -}}
{{- $d := include "mountplan.pluginDir" . | printf "%s-mounter" -}}
{{- with .Values.mounter.socketDir -}}
{{- $d = include "mountplan.root" (dict "name" "mounter.socketDir" "value" (trimSuffix "/" (toString .))) -}}
{{- end -}}
{{- range $name, $p := dict "stateDir" (include "mountplan.stateDir" .) "the plugin's CSI socket dir" (include "mountplan.pluginDir" .) "kubelet's pods dir" (include "mountplan.podsDir" .) "kubelet's CSI dir" (include "mountplan.kubeletCSIDir" .) "kubelet's registration dir" (include "mountplan.registrationDir" .) -}}
{{- if or (include "mountplan.within" (dict "a" $d "b" $p)) (include "mountplan.within" (dict "a" $p "b" $d)) -}}
{{- fail (printf "mounter.socketDir %q must lie apart from %s %q: other containers see that" $d $name $p) -}}
{{- end -}}
{{- end -}}
{{- $d -}}
{{- end -}}

{{/*
Host directory of the mounter's own records (mounter.recordsDir; empty:
<stateDir>-mounter): which devices and mounts it set up. Mounted into the
mounter's container only; refused inside (or around) the state dir or
kubelet's directory, which the plugin's container sees.
*/}}
{{- define "mountplan.mounterRecordsDir" -}}
{{- $state := include "mountplan.stateDir" . -}}
{{- $d := printf "%s-mounter" $state -}}
{{- with .Values.mounter.recordsDir -}}
{{- $d = include "mountplan.root" (dict "name" "mounter.recordsDir" "value" (trimSuffix "/" (toString .))) -}}
{{- end -}}
{{- range $name, $p := dict "stateDir" $state "kubeletDir" (include "mountplan.kubeletDir" .) "mounter.socketDir" (include "mountplan.mounterSocketDir" .) -}}
{{- if or (include "mountplan.within" (dict "a" $d "b" $p)) (include "mountplan.within" (dict "a" $p "b" $d)) -}}
{{- fail (printf "mounter.recordsDir %q must lie apart from %s %q: the plugin must not see or write the mounter's records" $d $name $p) -}}
{{- end -}}
{{- end -}}
{{- range $p, $_ := include "mountplan.adminRoots" . | fromYaml -}}
{{- if or (include "mountplan.within" (dict "a" $d "b" $p)) (include "mountplan.within" (dict "a" $p "b" $d)) -}}
{{- fail (printf "mounter.recordsDir %q must lie apart from the admin root %q, which the plugin's container mounts" $d $p) -}}
{{- end -}}
{{- end -}}
{{- $d -}}
{{- end -}}

{{/* Where the Secret nbdTLSSecret is mounted in the plugin's container (the plugin makes NBD's TLS connections). */}}
{{- define "mountplan.nbdTLSDir" -}}/etc/mountplan-nbd-tls{{- end -}}

{{/*
The Secret that holds config.nbd.tls's files, validated: set when config.nbd.tls
is, and every file config.nbd.tls names inside its mount.
*/}}
{{- define "mountplan.nbdTLSSecret" -}}
{{- $tls := dig "nbd" "tls" dict .Values.config -}}
{{- $dir := include "mountplan.nbdTLSDir" . -}}
{{- if $tls -}}
{{- if not .Values.nbdTLSSecret -}}
{{- fail "config.nbd.tls names files the plugin's container reads: set nbdTLSSecret to the Secret that holds them" -}}
{{- end -}}
{{- range $k := list "caFile" "certFile" "keyFile" -}}
{{- with get $tls $k -}}
{{- if not (hasPrefix (printf "%s/" $dir) (toString .)) -}}
{{- fail (printf "config.nbd.tls.%s %q must lie in %s, where nbdTLSSecret is mounted" $k (toString .) $dir) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- .Values.nbdTLSSecret -}}
{{- end -}}

{{/* A table of the config without its empty values (unset settings keep the plugin's defaults). */}}
{{- define "mountplan.compact" -}}
{{- $out := dict -}}
{{- range $k, $v := . -}}
{{- if $v -}}{{- $_ := set $out $k $v -}}{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* registration, validated: builtin or sidecar. */}}
{{- define "mountplan.registration" -}}
{{- $r := .Values.registration | toString -}}
{{- if not (has $r (list "builtin" "sidecar")) -}}
{{- fail (printf "registration %q must be builtin or sidecar" $r) -}}
{{- end -}}
{{- $r -}}
{{- end -}}

{{/*
A Go duration of one unit ("60s", "2m", "1500ms"), greater than zero, as
given: anything else fails the install with the value's name.
*/}}
{{- define "mountplan.duration" -}}
{{- $v := toString .value -}}
{{- if not (regexMatch "^[1-9][0-9]*(ms|s|m|h)$" $v) -}}
{{- fail (printf "%s %q must be a duration such as 60s or 2m" .name $v) -}}
{{- end -}}
{{- $v -}}
{{- end -}}

{{/*
The updateStrategy of one DaemonSet: its own (.own: plugin.updateStrategy or
mounter.updateStrategy) when set, replacing the shared one (.shared:
updateStrategy) whole, else the shared one.
*/}}
{{- define "mountplan.updateStrategy" -}}
{{- toYaml (default .shared .own) -}}
{{- end -}}
