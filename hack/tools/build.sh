#!/usr/bin/env bash
# Builds pinned third-party tools that the tests run (and that Debian does not
# package at the version needed) from the Go module proxy, into a cache that
# survives between runs:
#
#   hack/tools/build.sh TOOL...     prints one bin directory per TOOL
#
# Cache: $MOUNTPLAN_TOOLS_CACHE (default /var/cache/mountplan-tools), one
# directory per tool and version, plus the Go build cache of these builds.
# A tool whose directory is complete is not rebuilt. Nothing is downloaded but
# Go modules.
set -euo pipefail
export PATH="/usr/local/go/bin:$PATH"
here=$(cd "$(dirname "$0")" && pwd)
cache=${MOUNTPLAN_TOOLS_CACHE:-/var/cache/mountplan-tools}
mkdir -p "$cache"
export GOCACHE="$cache/go-build" GOFLAGS="-trimpath" CGO_ENABLED=0 GOWORK=off

# tool -> "HOW module@version packages... [-- KEY=VALUE...]"
#   HOW install: `go install module@version/package` (the module has no replace directives)
#   HOW copy:    build in a writable copy of the module. Its replace directives
#                that point into its own tree (Kubernetes' staging/, not part of
#                the published module) are dropped and those modules required at
#                local=VERSION instead; every other directive stays.
#   HOW local:   a module of ours under hack/tools/ (module is its directory name)
#   KEYS tags=a,b (build tags), local=VERSION, version=PKG.VAR (-X PKG.VAR=version),
#        cgo=1 (a copy built with cgo: needs gcc and the C libraries it links),
#        c=DIR:NAME (a C program of the module besides, gcc -static DIR/*.c -o NAME)
k8sversion=k8s.io/component-base/version
declare -A tools=(
  # containerd 2 with CRI and NRI; no snapshotters that need cgo or kernel modules.
  [containerd]="install github.com/containerd/containerd/v2@v2.4.2 cmd/containerd cmd/containerd-shim-runc-v2 cmd/ctr -- tags=no_btrfs,no_devmapper,no_zfs"
  [crictl]="install sigs.k8s.io/cri-tools@v1.37.0 cmd/crictl"
  [helm]="install helm.sh/helm/v3@v3.22.0 cmd/helm"
  # The control plane, kubelet and kubectl; staging modules (k8s.io/api, ...) come
  # from the proxy at the matching v0 version.
  [kubernetes]="copy k8s.io/kubernetes@v1.37.2 cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler cmd/kubelet cmd/kubectl -- local=v0.37.2 version=$k8sversion.gitVersion"
  # etcd's own main module has replace directives; ours calls etcdmain.
  [etcd]="local etcd@v3.7.3 ."
  [external-provisioner]="copy github.com/kubernetes-csi/external-provisioner/v6@v6.4.0 cmd/csi-provisioner"
  # CRI-O for the NRI tests on a second runtime: cgo for seccomp (libseccomp-dev),
  # no btrfs, ostree or gpgme; pinns is its C helper. conmon and runc are Debian's.
  [crio]="copy github.com/cri-o/cri-o@v1.34.0 cmd/crio -- cgo=1 c=pinns/src:pinns tags=containers_image_ostree_stub,exclude_graphdriver_btrfs,btrfs_noversion,containers_image_openpgp,seccomp"
  # runc for both runtimes (containerd's shim and CRI-O): Debian bookworm's 1.1.5
  # cannot run a pod with a user namespace (hostUsers: false) nor idmap a bind
  # mount; 1.2 can. cgo for nsexec and seccomp (libseccomp-dev); without
  # libpathrs (a Rust library), which runc replaces by its Go fallback.
  [runc]="copy github.com/opencontainers/runc@v1.5.3 . -- cgo=1 tags=seccomp,urfave_cli_no_docs version=main.version"
  [external-snapshotter]="copy github.com/kubernetes-csi/external-snapshotter/v8@v8.7.0 cmd/csi-snapshotter cmd/snapshot-controller -- local=v8.7.0"
)

# opt KEY "KEY=VALUE..." prints VALUE.
opt() {
  local kv
  for kv in $2; do [ "${kv%%=*}" = "$1" ] && { echo "${kv#*=}"; return; }; done
  return 0
}

# writable_copy MODULE@VERSION DIR LOCALVERSION: the module's source in DIR with
# replace directives into its own tree dropped and those modules required at
# LOCALVERSION.
writable_copy() {
  local modver=$1 dir=$2 localver=$3 src
  src=$(cd "$cache" && GOFLAGS=-mod=mod go mod download -json "$modver" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [ -d "$src" ] || { echo "hack/tools/build.sh: go mod download $modver gave no directory" >&2; return 1; }
  rm -rf "$dir"
  cp -r "$src" "$dir"
  chmod -R u+w "$dir"
  local old new edits=()
  while read -r old new; do
    [[ $new == ./* || $new == ../* ]] || continue
    [ -n "$localver" ] || { echo "hack/tools/build.sh: $modver replaces $old by $new: give local=VERSION" >&2; return 1; }
    edits+=("-dropreplace=$old" "-require=$old@$localver")
  done < <(cd "$dir" && go mod edit -json | awk -F'"' '
    /"Old": /  { side = "old" }
    /"New": /  { side = "new" }
    /"Path": / { if (side == "old") o = $4; else if (side == "new") { print o, $4; side = "" } }')
  [ ${#edits[@]} -eq 0 ] || (cd "$dir" && go mod edit "${edits[@]}")
}

build() {
  local name=$1 spec=${tools[$1]:-}
  [ -n "$spec" ] || { echo "hack/tools/build.sh: unknown tool $name (known: ${!tools[*]})" >&2; return 2; }
  local how modver rest pkgs opts=""
  read -r how modver rest <<<"$spec"
  pkgs=${rest%% -- *}
  [[ $rest == *" -- "* ]] && opts=${rest#* -- }
  local mod=${modver%@*} ver=${modver#*@}
  local tags ldflags="" var
  tags=$(opt tags "$opts")
  var=$(opt version "$opts")
  [ -z "$var" ] || ldflags="-X $var=$ver"
  local key=$ver
  # A module of ours rebuilds when its files change.
  [ "$how" != local ] || key=$ver-$(cat "$here/$mod"/go.mod "$here/$mod"/go.sum "$here/$mod"/*.go | sha256sum | cut -c1-12)
  local dir="$cache/$name-$key"
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir"
    mkdir -p "$dir/bin"
    echo "hack/tools/build.sh: building $name $ver" >&2
    local p args=() start=$SECONDS
    case $how in
    install)
      for p in $pkgs; do args+=("$mod/$p@$ver"); done
      GOBIN="$dir/bin" go install ${tags:+-tags "$tags"} "${args[@]}" >&2 ;;
    copy)
      writable_copy "$modver" "$dir/src" "$(opt local "$opts")"
      for p in $pkgs; do args+=("./$p"); done
      local cgo
      cgo=$(opt cgo "$opts")
      # cgo only when asked: the images' single binaries have no libc.
      (cd "$dir/src" && CGO_ENABLED=${cgo:-0} GOFLAGS="$GOFLAGS -mod=mod" \
        go build ${tags:+-tags "$tags"} -ldflags "-s -w $ldflags" -o "$dir/bin/" "${args[@]}") >&2
      local c
      c=$(opt c "$opts")
      [ -z "$c" ] || (cd "$dir/src/${c%%:*}" && gcc -std=c99 -O2 -static -o "$dir/bin/${c#*:}" ./*.c && strip -s "$dir/bin/${c#*:}") >&2
      rm -rf "$dir/src" ;;
    local)
      for p in $pkgs; do args+=("./$p"); done
      (cd "$here/$mod" && go build ${tags:+-tags "$tags"} -ldflags "-s -w $ldflags" -o "$dir/bin/$name" "${args[@]}") >&2 ;;
    *) echo "hack/tools/build.sh: $name: unknown kind $how" >&2; return 2 ;;
    esac
    echo "hack/tools/build.sh: built $name $ver in $((SECONDS - start))s" >&2
    touch "$dir/.complete"
  fi
  echo "$dir/bin"
}

[ $# -gt 0 ] || { echo "usage: hack/tools/build.sh TOOL... (${!tools[*]})" >&2; exit 2; }
for t in "$@"; do build "$t"; done
