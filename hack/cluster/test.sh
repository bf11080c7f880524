#!/usr/bin/env bash
# make test-cluster: a real Kubernetes cluster of three nodes on this machine,
# mountplan installed on it with helm, and the flows of test/cluster.
#
# 1. Builds (cached under $MOUNTPLAN_TOOLS_CACHE, default
#    /var/cache/mountplan-tools) Kubernetes, etcd, containerd, crictl, helm
#    external-provisioner, external-snapshotter, CRI-O and runc from the Go module proxy (hack/tools/build.sh),
#    and the images (hack/cluster/images: the Dockerfile's runtime stage from
#    a Debian root made by mmdebstrap, and single-binary images).
# 2. Runs test/cluster (build tag clustertest) holding the shared test lock:
#    it starts etcd, the control plane, containerd and kubelet in PID, mount
#    and network namespaces of their own under /var/lib/mountplan-cluster,
#    and two more nodes (containerd and kubelet) in namespaces of theirs,
#    installs charts/mountplan with chart values only, runs the flows, tears
#    everything down and checks that nothing leaked.
#
# Needs root and the packages of hack/install-deps.sh. Under CI=true a
# missing prerequisite fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH="/usr/local/go/bin:$PATH"
cache=${MOUNTPLAN_TOOLS_CACHE:-/var/cache/mountplan-tools}
start=$SECONDS

dirs=$(hack/tools/build.sh containerd crictl helm kubernetes etcd external-provisioner external-snapshotter crio runc)
path=$(tr '\n' ':' <<<"$dirs")
provisioner=$(grep external-provisioner <<<"$dirs")/csi-provisioner
snapshotter=$(grep external-snapshotter <<<"$dirs")/csi-snapshotter
# The snapshot CRDs of the same release (its client module, from the
# module proxy), for the snapshot flow.
crds=$(go mod download -json github.com/kubernetes-csi/external-snapshotter/client/v8@v8.7.0 | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')/config/crd
[[ -f $crds/snapshot.storage.k8s.io_volumesnapshots.yaml ]] || { echo "snapshot CRDs not found in $crds" >&2; exit 1; }
# This run's images and test binary in a directory of its own: another
# checkout's run may build while this one waits for the lock.
run=$(mktemp -d "$cache/run.XXXXXX")
trap 'rm -rf "$run"' EXIT
go run ./hack/cluster/images -out "$run/images" -cache "$cache/images" -provisioner "$provisioner" -snapshotter "$snapshotter" -tag test
go test -c -tags clustertest -o "$run/cluster.test" ./test/cluster
# The operator's kubectl plugin, which flows run against the cluster.
go build -o "$run/bin/kubectl-mountplan" ./cmd/kubectl-mountplan
path="$path$run/bin:"
echo "test-cluster: built in $((SECONDS - start))s"

# The shared test lock, unless the caller holds it already (`flock
# /run/mountplan-tests.lock make test-cluster`): flock(1) leaves its
# descriptor open in the command, and a second flock on a new descriptor
# would wait for the caller forever.
lock=/run/mountplan-tests.lock
locked=()
for fd in /proc/$$/fd/*; do
  if [[ $(readlink "$fd" 2>/dev/null) == "$lock" ]] && flock -n "${fd##*/}"; then
    locked=(env)
    break
  fi
done
((${#locked[@]})) || locked=(flock "$lock")

cd test/cluster
"${locked[@]}" env MOUNTPLAN_CLUSTER_PATH="${path%:}" \
  MOUNTPLAN_CLUSTER_IMAGES="$run/images" MOUNTPLAN_CLUSTER_TAG=test MOUNTPLAN_CLUSTER_SNAPSHOT_CRDS="$crds" \
  "$run/cluster.test" -test.v -test.count=1 -test.timeout 45m "$@"
echo "test-cluster: done in $((SECONDS - start))s"
