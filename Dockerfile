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
# Both binaries run as root on purpose, with very different privileges: the chart
# runs the plugin as uid 0 and gid 0 with no capability at all (it owns its state dir
# and kubelet's targets, and asks the mounter for everything else), and the mounter
# (mountplan-sidecar serve) privileged in a pod of its own: it attaches loop devices,
# hands NBD sockets to the kernel, logs in to iSCSI targets, formats, starts the FUSE
# daemons and performs every mount.
# test/chart/dockerfile_test.go checks that every tool the code execs is installed here.

FROM golang:1.26-bookworm AS builder
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# What --version, the CSI vendor_version and mountplan_build_info say
# (internal/version). The context has no .git (.dockerignore), so Go cannot
# stamp the revision itself: pass them, as `make build` sets them:
#   docker build --build-arg VERSION=$(git describe --tags --always --dirty) \
#     --build-arg REVISION=$(git rev-parse HEAD) \
#     --build-arg BUILD_DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ) -t REGISTRY/mountplan:TAG .
ARG VERSION=devel
ARG REVISION=
ARG BUILD_DATE=
RUN CGO_ENABLED=0 go build -trimpath -buildvcs=false -ldflags="-s -w -X github.com/mountplan/mountplan/internal/version.version=${VERSION} -X github.com/mountplan/mountplan/internal/version.revision=${REVISION} -X github.com/mountplan/mountplan/internal/version.buildDate=${BUILD_DATE}" \
        -o /out/mountplan-plugin ./cmd/mountplan-plugin && \
    CGO_ENABLED=0 go build -trimpath -buildvcs=false -ldflags="-s -w -X github.com/mountplan/mountplan/internal/version.version=${VERSION} -X github.com/mountplan/mountplan/internal/version.revision=${REVISION} -X github.com/mountplan/mountplan/internal/version.buildDate=${BUILD_DATE}" \
        -o /out/mountplan-sidecar ./cmd/mountplan-sidecar && \
    CGO_ENABLED=0 go build -trimpath -buildvcs=false -ldflags="-s -w -X github.com/mountplan/mountplan/internal/version.version=${VERSION} -X github.com/mountplan/mountplan/internal/version.revision=${REVISION} -X github.com/mountplan/mountplan/internal/version.buildDate=${BUILD_DATE}" \
        -o /out/mountplan-resizer ./cmd/mountplan-resizer

FROM debian:bookworm-slim
# Tools the mounter execs (see the table in test/chart/dockerfile_test.go):
#   util-linux  blkid, fsck            mount       mount, umount, losetup
#   e2fsprogs   mkfs.ext4, resize2fs,  xfsprogs    mkfs.xfs, xfs_growfs, xfs_repair,
#               e2fsck                             xfs_admin
#   fuse3       fusermount3            sshfs, rclone, squashfuse: FUSE daemons
#   open-iscsi  iscsiadm (talks to the host's iscsid); NBD needs no tool (netlink)
RUN apt-get update && \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        ca-certificates \
        e2fsprogs \
        fuse3 \
        mount \
        open-iscsi \
        rclone \
        squashfuse \
        sshfs \
        util-linux \
        xfsprogs && \
    rm -rf /var/lib/apt/lists/*
COPY --from=builder /out/mountplan-plugin /out/mountplan-sidecar /out/mountplan-resizer /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/mountplan-plugin"]
