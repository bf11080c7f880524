#!/usr/bin/env bash
# The data path of every volume kind against its raw backing (issue 38):
# fio against a loop ext4, a loop xfs, an overlay chain and a squashfuse
# volume, each staged and published through mountplan-plugin's socket with
# the mounter (mountplan-sidecar serve) as a process of its own, as
# deployed, and against the thing underneath it (a file on the image's
# filesystem with O_DIRECT, a file on the chain's upper filesystem, the
# kernel's squashfs of the same image), in turn, round after round. Prints
# a markdown table (IOPS, MB/s, p50/p99 latency, the ratio to the backing,
# CPU per I/O of plugin, mounter and daemon), writes the JSON under
# bench-results/, then tears everything down and checks that nothing
# leaked (also on error and on Ctrl-C). About 7 minutes with the defaults.
#
#   make bench-io                              # builds bin/ first
#   hack/bench-io.sh [-io-runtime 5] [-io-rounds 2] [-io-size 256M] \
#       [-io-kinds loop-ext4,loop-xfs,chain,squashfuse] [-state-dir /var/tmp] [-v]
#
# Needs root and fio (hack/install-deps.sh --bench). On a shared machine:
#   flock /run/mountplan-tests.lock make bench-io
set -euo pipefail

cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/go/bin"

if [[ $EUID -ne 0 ]]; then
	echo "hack/bench-io.sh: needs root (loop devices, mounts, FUSE)" >&2
	exit 2
fi
for tool in fio mksquashfs squashfuse mkfs.ext4 mkfs.xfs mount; do
	command -v "$tool" >/dev/null || { echo "hack/bench-io.sh: $tool not found (hack/install-deps.sh --bench)" >&2; exit 2; }
done
for b in mountplan-plugin mountplan-sidecar; do
	[[ -x bin/$b ]] || go build -trimpath -o bin/ ./cmd/$b
done
go run ./hack/bench -io -plugin bin/mountplan-plugin -sidecar bin/mountplan-sidecar "$@"
