# mountplan: the CSI node plugin and the mounter sidecar in one image.
#
# Build (from the repository root):
#   docker build -t mountplan:dev .
# The chart runs /usr/local/bin/mountplan-plugin, mountplan-sidecar and
# mountplan-resizer from it (values image.plugin and image.mounter).
#
# Base images are pinned by tag. Pin them by digest as well (name:tag@sha256:...)
# when publishing: no image registry is reachable from the environment this file
# was written in, so the digests could not be resolved here.
#
# Both binaries run as root on purpose: the plugin attaches loop/NBD/iSCSI devices,
# formats them and starts FUSE daemons, the mounter calls fsmount/move_mount in other
# mount namespaces; both need CAP_SYS_ADMIN (the chart runs them privileged). The
# kubernetes-csi sidecars in the same pod drop every capability instead.
# test/chart/dockerfile_test.go checks that every tool the code execs is installed here.

FROM golang:1.26-bookworm AS builder
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -buildvcs=false -ldflags='-s -w' \
        -o /out/mountplan-plugin ./cmd/mountplan-plugin && \
    CGO_ENABLED=0 go build -trimpath -buildvcs=false -ldflags='-s -w' \
        -o /out/mountplan-sidecar ./cmd/mountplan-sidecar && \
    CGO_ENABLED=0 go build -trimpath -buildvcs=false -ldflags='-s -w' \
        -o /out/mountplan-resizer ./cmd/mountplan-resizer

FROM debian:bookworm-slim
# Tools the plugin execs (see the table in test/chart/dockerfile_test.go):
#   util-linux  blkid, fsck            mount       mount, umount, losetup
#   e2fsprogs   mkfs.ext4, resize2fs,  xfsprogs    mkfs.xfs, xfs_growfs, xfs_repair,
#               e2fsck                             xfs_admin
#   fuse3       fusermount3            sshfs, rclone, squashfuse: FUSE daemons
#   nbd-client  nbd-client             open-iscsi  iscsiadm (talks to the host's iscsid)
RUN apt-get update && \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        ca-certificates \
        e2fsprogs \
        fuse3 \
        mount \
        nbd-client \
        open-iscsi \
        rclone \
        squashfuse \
        sshfs \
        util-linux \
        xfsprogs && \
    rm -rf /var/lib/apt/lists/*
COPY --from=builder /out/mountplan-plugin /out/mountplan-sidecar /out/mountplan-resizer /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/mountplan-plugin"]
