#!/usr/bin/env bash
# Installs, from Debian's packages, every tool mountplan's tests and demo
# use. Idempotent; needs root. With --bench, also what the benchmarks
# alone use (fio for make bench-io); no test needs them.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
pkgs=(
  e2fsprogs xfsprogs util-linux mount   # mkfs, resize, blkid, losetup
  squashfs-tools erofs-utils            # read-only images for chains
  containerd runc busybox-static        # real containers in end-to-end tests
  protobuf-compiler libprotobuf-dev     # make verify regenerates the protos (protoc, and the well-known .protos under /usr/include)
  fuse3 sshfs rclone squashfuse openssh-server openssh-client  # FUSE volumes: the daemons, and an sshd for their tests
  nbdkit tgt open-iscsi qemu-system-x86 kmod xz-utils  # NBD and iSCSI volumes: servers and initiators on loopback; make test-vm boots Debian's kernel under qemu (modprobe --show-depends, vmlinux from xz)
  checkpolicy  # make test-vm compiles the tiny SELinux policy (test/vm/selinux.te.conf) its guest loads to show context= labels
  conmon skopeo gcc libc6-dev pkg-config libseccomp-dev  # CRI-O as the NRI tests' second runtime: its monitor, the image import, and its build (cgo, seccomp; pinns linked static); make test-cluster's runc >= 1.2 (cgo, seccomp)
  mmdebstrap containernetworking-plugins iproute2  # make test-cluster: the image's Debian root, pod networking (bridge, host-local), the node's network namespace
)
if [[ ${1:-} == --bench ]]; then
  pkgs+=(fio)  # make bench-io
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
