#!/usr/bin/env bash
# Latency of a volume cycle through mountplan-plugin's socket against the
# kernel work it asks for (direct syscalls) and against util-linux tools, on
# a 64 MiB ext4 loop volume, with the plugin beside its mounter
# (mountplan-sidecar serve, --mounter-endpoint) as deployed; -alone runs the
# plugin alone (its mounter in process). A lean CSI node server
# (hack/bench/leancsi: the same RPCs over grpc-go, syscalls only, state in
# memory) takes turns with the plugin's publish and prepare cycles: the floor
# plus the transport, the plugin's goal being 1.2× of it (issue 23); -lean ''
# leaves it out. Then (measurement 9) container start latency with and
# without the NRI hook and the hook's time per container (BenchmarkContainerStart
# in test/nri, median of 20, run and read by the bench). Prints markdown tables
# and a leak check. Then the time of a snapshot by reflink and by sparse copy
# (BenchmarkSnapshot in internal/driver).
#
#   make bench                      # builds bin/ first
#   hack/bench.sh [-n 50] [-warmup 5] [-state-dir /var/tmp] [-phases 1,2,3,4,5,9] [-strace FILE] [-v]
#   hack/bench.sh -phases 8 [-scale 10,100,1000,10000]   # scale: about 4 minutes
#   hack/bench.sh -phases 1,2,4,5 -compare /tmp/mp-before-plugin   # against another plugin binary, alone
#   hack/bench.sh -alone            # the plugin alone, as before the split
#
# With -phases only the chosen measurements of hack/bench run: the
# snapshot benchmark below runs with the default phases.
#
# Needs root. Everything is made in a fresh temp dir under -state-dir and
# removed at the end, also on error and on Ctrl-C.
set -euo pipefail

cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/go/bin"

if [[ $EUID -ne 0 ]]; then
	echo "hack/bench.sh: needs root (loop devices, mounts, mount namespaces)" >&2
	exit 2
fi
for tool in losetup mount umount unshare mkfs.ext4 blkid; do
	command -v "$tool" >/dev/null || { echo "hack/bench.sh: $tool not found (hack/install-deps.sh)" >&2; exit 2; }
done

plugin=${PLUGIN:-bin/mountplan-plugin}
if [[ ! -x $plugin ]]; then
	echo "hack/bench.sh: $plugin missing; building it" >&2
	go build -trimpath -o bin/ ./cmd/mountplan-plugin
fi
sidecar=${SIDECAR:-bin/mountplan-sidecar}
if [[ ! -x $sidecar ]]; then
	echo "hack/bench.sh: $sidecar missing; building it" >&2
	go build -trimpath -o bin/ ./cmd/mountplan-sidecar
fi

# The lean server is the bench's own: built each time, as the bench is.
lean=${LEAN:-bin/mpbench-leancsi}
go build -trimpath -o "$lean" ./hack/bench/leancsi

go run ./hack/bench -plugin "$plugin" -sidecar "$sidecar" -lean "$lean" "$@"
for arg in "$@"; do
	[[ $arg == -phases || $arg == -phases=* || $arg == --phases || $arg == --phases=* ]] && exit 0
done

# Snapshot time of a published 1 GiB ext4 volume holding 100 MiB: state dir
# on xfs (reflink) and on ext4 (sparse copy), each on a loop device of its own.
go test -count=1 -run '^$' -bench '^BenchmarkSnapshot$' -benchtime 5x ./internal/driver
