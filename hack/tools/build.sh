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
cache=${MOUNTPLAN_TOOLS_CACHE:-/var/cache/mountplan-tools}
mkdir -p "$cache"
export GOCACHE="$cache/go-build" GOFLAGS="-trimpath" CGO_ENABLED=0

# tool -> "module@version packages... [-- build tags]"
declare -A tools=(
  # containerd 2 with CRI and NRI; no snapshotters that need cgo or kernel modules.
  [containerd]="github.com/containerd/containerd/v2@v2.4.2 cmd/containerd cmd/containerd-shim-runc-v2 cmd/ctr -- no_btrfs no_devmapper no_zfs"
  [crictl]="sigs.k8s.io/cri-tools@v1.37.0 cmd/crictl"
  [helm]="helm.sh/helm/v3@v3.22.0 cmd/helm"
)

build() {
  local name=$1 spec=${tools[$1]:-}
  [ -n "$spec" ] || { echo "hack/tools/build.sh: unknown tool $name (known: ${!tools[*]})" >&2; return 2; }
  local modver pkgs tags="" rest
  read -r modver rest <<<"$spec"
  pkgs=${rest%% -- *}
  [[ $rest == *" -- "* ]] && tags=${rest#* -- }
  local mod=${modver%@*} ver=${modver#*@}
  local dir="$cache/$name-$ver"
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir"
    mkdir -p "$dir/bin"
    local p args=()
    for p in $pkgs; do args+=("$mod/$p@$ver"); done
    echo "hack/tools/build.sh: building $name $ver" >&2
    GOBIN="$dir/bin" go install ${tags:+-tags "$tags"} "${args[@]}" >&2
    touch "$dir/.complete"
  fi
  echo "$dir/bin"
}

[ $# -gt 0 ] || { echo "usage: hack/tools/build.sh TOOL... (${!tools[*]})" >&2; exit 2; }
for t in "$@"; do build "$t"; done
