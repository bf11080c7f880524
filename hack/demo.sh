#!/usr/bin/env bash
# The mountplan demo, as root on a fresh machine (after hack/install-deps.sh
# and `make build`): starts the mounter (the node's privileged part) and the
# plugin without a single capability, provisions a loop volume, stages it,
# prepares it and mounts it inside a throwaway container's mount namespace
# with the sidecar, shows the mount inside and its absence outside, then
# tears everything down and shows that nothing leaked.
#
# The container is a real one (a private containerd + runc running busybox)
# when those are installed, else a mount namespace from unshare(1).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "demo: run as root" >&2; exit 1; }
export PATH="/usr/local/go/bin:$PATH"

BIN=$PWD/bin
go build -o "$BIN/" ./cmd/mountplan-plugin ./cmd/mountplan-sidecar ./hack/csictl
TMP=$(mktemp -d /tmp/mountplan-demo.XXXXXX)
EP="unix://$TMP/csi.sock"
MEP="unix://$TMP/mounter.sock"
VOL=demo-vol
STAGING=$TMP/staging
PLUGIN_PID="" MOUNTER_PID="" CTRD_PID="" NS_PID="" CONTAINER=""
ctl() { "$BIN/csictl" -endpoint "$EP" "$@"; }
ctr_() { ctr --address "$TMP/ctrd/containerd.sock" -n mountplan-demo "$@"; }
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

cleanup() {
  set +e
  [ -n "$CONTAINER" ] && { ctr_ task kill -s SIGKILL "$CONTAINER" >/dev/null 2>&1; sleep 0.3
    ctr_ task delete "$CONTAINER" >/dev/null 2>&1; ctr_ container delete "$CONTAINER" >/dev/null 2>&1; }
  [ -n "$NS_PID" ] && kill "$NS_PID" 2>/dev/null && wait "$NS_PID" 2>/dev/null
  [ -n "$PLUGIN_PID" ] && { ctl unstage "$VOL" "$STAGING" >/dev/null 2>&1; ctl delete "$VOL" >/dev/null 2>&1
    kill -TERM "$PLUGIN_PID"; wait "$PLUGIN_PID" 2>/dev/null; }
  [ -n "$MOUNTER_PID" ] && { kill -TERM "$MOUNTER_PID"; wait "$MOUNTER_PID" 2>/dev/null; }
  [ -n "$CTRD_PID" ] && { kill -TERM "$CTRD_PID"; wait "$CTRD_PID" 2>/dev/null
    for c in /sys/fs/cgroup/*/mountplan-demo /sys/fs/cgroup/mountplan-demo; do rmdir "$c" 2>/dev/null; done; }
  grep -F "$TMP" /proc/self/mountinfo | awk '{print $5}' | sort -r | xargs -r -n1 umount -l 2>/dev/null
  rm -rf "$TMP"
}
trap cleanup EXIT

step "start the mounter on $MEP: every privileged act of the plugin happens there"
"$BIN/mountplan-sidecar" serve --endpoint "$MEP" --state-dir "$TMP/state" --records-dir "$TMP/mounter" \
  --kubelet-dir "$TMP" --v=2 >"$TMP/mounter.log" 2>&1 &
MOUNTER_PID=$!
for _ in $(seq 100); do [ -S "$TMP/mounter.sock" ] && break; sleep 0.1; done

step "start the plugin on $EP, as root with no capability at all (setpriv: empty bounding set, no_new_privs)"
setpriv --bounding-set=-all --inh-caps=-all --ambient-caps=-all --no-new-privs -- \
  "$BIN/mountplan-plugin" --endpoint "$EP" --node-id demo-node --state-dir "$TMP/state" --kubelet-dir "$TMP" \
  --mounter-endpoint "$MEP" --v=2 >"$TMP/plugin.log" 2>&1 &
PLUGIN_PID=$!
for _ in $(seq 100); do ctl -timeout 1s probe >/dev/null 2>&1 && break; sleep 0.1; done
ctl probe
grep -E '^(CapEff|NoNewPrivs)' /proc/$PLUGIN_PID/status

step "provision and stage a 64 MiB ext4 loop volume"
ctl create "$VOL" $((64 << 20))
ctl stage "$VOL" "$STAGING"
DEV=$(grep -o '"device":"/dev/[a-z0-9]*"' "$TMP/state/volumes/$VOL.json" | head -1 | cut -d'"' -f4)
echo "staged on $DEV (backed by $(cat /sys/block/${DEV#/dev/}/loop/backing_file)); mounted in the host namespace: $(grep -c " $DEV " /proc/self/mountinfo || true) times"

if command -v containerd >/dev/null && command -v runc >/dev/null && [ -x /bin/busybox ]; then
  step "start a throwaway busybox container (private containerd)"
  mkdir -p "$TMP/ctrd" "$TMP/rootfs"/{bin,proc,sys,dev,tmp,data,run,etc}
  cp /bin/busybox "$TMP/rootfs/bin/busybox"
  for a in sh cat ls echo grep sleep mount; do ln -s busybox "$TMP/rootfs/bin/$a"; done
  cat >"$TMP/ctrd/config.toml" <<CFG
version = 2
root = "$TMP/ctrd/root"
state = "$TMP/ctrd/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$TMP/ctrd/containerd.sock"
[ttrpc]
  address = "$TMP/ctrd/containerd.sock.ttrpc"
CFG
  containerd --config "$TMP/ctrd/config.toml" >"$TMP/ctrd/log" 2>&1 &
  CTRD_PID=$!
  for _ in $(seq 100); do ctr_ version >/dev/null 2>&1 && break; sleep 0.1; done
  CONTAINER=demo-$$
  ctr_ run --detach --env PATH=/bin --fifo-dir "$TMP/ctrd/fifo" --runc-root "$TMP/ctrd/runc" \
    --pid-file "$TMP/ctrd/pid" --rootfs "$TMP/rootfs" "$CONTAINER" sleep 3600
  for _ in $(seq 100); do [ -s "$TMP/ctrd/pid" ] && break; sleep 0.1; done
  PID=$(cat "$TMP/ctrd/pid")
  inside() { ctr_ task exec --exec-id "x$RANDOM" "$CONTAINER" sh -c "$1"; }
else
  step "containerd not installed: a throwaway mount namespace from unshare"
  mkdir -p "$TMP/data"
  unshare --mount --propagation private sleep 3600 &
  NS_PID=$!
  sleep 0.2
  PID=$NS_PID
  inside() { nsenter -t "$PID" -m -- sh -c "$1"; }
fi
TARGET=/data
[ -n "$NS_PID" ] && TARGET=$TMP/data
echo "consumer pid $PID, mount namespace $(readlink /proc/$PID/ns/mnt)"

step "mountplan-sidecar mount: NodePrepareVolume, then the plan inside pid $PID's namespace at $TARGET"
"$BIN/mountplan-sidecar" mount --plugin-endpoint "$EP" --volume-id "$VOL" --staging-path "$STAGING" \
  --pid "$PID" --target "$TARGET" --state-dir "$TMP/state" --records-dir "$TMP/mounter"

step "inside the container"
inside "echo 'hello from inside' > $TARGET/hello.txt; grep ' $TARGET ' /proc/self/mountinfo; cat $TARGET/hello.txt"
step "outside (host namespace): the device is not mounted here"
if grep -q " $DEV " /proc/self/mountinfo; then echo "UNEXPECTED: $DEV is mounted on the host"; exit 1; fi
echo "$DEV: not in /proc/self/mountinfo"

step "mountplan-sidecar unmount, then tear everything down"
"$BIN/mountplan-sidecar" unmount --plugin-endpoint "$EP" --volume-id "$VOL" --pid "$PID" --target "$TARGET"
inside "if grep -q ' $TARGET ' /proc/self/mountinfo; then echo 'UNEXPECTED: still mounted at $TARGET'; else echo 'no mount at $TARGET any more'; fi"
ctl unstage "$VOL" "$STAGING"
ctl delete "$VOL"
echo "volume unstaged and deleted"
cleanup
trap - EXIT

step "leak check"
leaks=0
if losetup -a | grep -F "$TMP"; then leaks=1; fi
if grep -F "$TMP" /proc/self/mountinfo; then leaks=1; fi
if pgrep -af "$TMP"; then leaks=1; fi
[ -e "$TMP" ] && { echo "$TMP still exists"; leaks=1; }
if [ $leaks = 0 ]; then echo "nothing leaked: no loop device, mount or process refers to $TMP"; else echo "LEAKS above"; exit 1; fi
