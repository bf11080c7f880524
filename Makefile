# mountplan build and test entry points. Root is needed for `test` and
# `test-vm` (real loop devices, mounts, namespaces, containers, qemu);
# .ci/run installs the packages (hack/install-deps.sh), then runs
# `make verify test test-vm`.
export PATH := /usr/local/go/bin:$(PATH)
SHELL     := /bin/bash
GO        ?= go
BIN       := bin
PKGS      := ./...
# Root tests share the kernel's loop devices and mount table: run test
# packages one at a time so their leak checks see only their own work.
TESTFLAGS ?= -p 1 -count=1 -timeout 80m
# The VM test and its guest build only with these tags (make test-vm), so
# that `go test ./...` neither runs nor skips them; verify checks them too.
VMTAGS    := vmtest,vmguest
# The cluster test builds only with its tag (make test-cluster).
CLUSTERTAGS := clustertest

.PHONY: all build image test test-unit test-crash test-sanity test-vm test-cluster bench-cluster verify bench bench-io demo clean codegen deploy fuzz

all: build

# What --version, the CSI vendor_version and mountplan_build_info say
# (internal/version); `make build VERSION=v0.2.0` names a release.
VERSION    ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo devel)
REVISION   ?= $(shell git rev-parse HEAD 2>/dev/null)
BUILD_DATE ?= $(shell date -u +%Y-%m-%dT%H:%M:%SZ)
VERSIONPKG := github.com/mountplan/mountplan/internal/version
LDFLAGS    := -X $(VERSIONPKG).version=$(VERSION) -X $(VERSIONPKG).revision=$(REVISION) -X $(VERSIONPKG).buildDate=$(BUILD_DATE)

build:
	$(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/ ./cmd/mountplan-plugin ./cmd/mountplan-sidecar ./cmd/mountplan-resizer ./cmd/kubectl-mountplan ./hack/csictl

# The container image (Dockerfile) with docker, else podman, stamped with the
# version the binaries report: `make image IMAGE=REGISTRY/mountplan:TAG`.
IMAGE ?= mountplan:$(VERSION)
image:
	@tool=$$(command -v docker || command -v podman) || { echo "make image: needs docker or podman on PATH; neither is there" >&2; exit 1; }; \
	set -x; $$tool build --build-arg VERSION=$(VERSION) --build-arg REVISION=$(REVISION) --build-arg BUILD_DATE=$(BUILD_DATE) -t $(IMAGE) .

# Every test but the VM's and the cluster's. hack/testreport prints go
# test's usual lines, then the counts of passed, failed and skipped tests
# with the reason of each skip, and fails the run when under CI=true
# anything skipped. Then every fuzzer tries TEST_FUZZTIME inputs beyond its
# seed corpus (which the go test run above replays): a count, not a
# duration (see hack/fuzz.sh), about 30 s for all of them.
TEST_FUZZTIME ?= 20000x
test: build
	set -o pipefail; $(GO) test -json $(TESTFLAGS) $(PKGS) | $(GO) run ./hack/testreport
	hack/fuzz.sh $(TEST_FUZZTIME)

# Every Go fuzz test for FUZZTIME seconds each (default 5).
FUZZTIME ?= 5
fuzz:
	hack/fuzz.sh $(FUZZTIME)

# The tests that need no root, no device, no external tool and no server,
# as any user: in -short mode every internal/testenv Require* skips.
test-unit:
	set -o pipefail; $(GO) test -json -short -vet=off -count=1 $(PKGS) | $(GO) run ./hack/testreport

# The crash test at length: N kills of the plugin, its mounter or a
# one-shot sidecar inside every kind of operation (make test runs 88).
N ?= 1000
test-crash: build
	$(GO) test -count=1 -v -timeout 0 -run '^TestCrash$$' ./test/e2e/ -crash.kills=$(N)

# Boots Debian's kernel (it has nbd and iscsi_tcp) under qemu (on KVM where
# the host's is hardware-assisted, TCG elsewhere; the output says which) and runs
# the NBD and iSCSI flows inside it, then resets it and checks NBD and iSCSI
# volumes after the reboot; about 85 s once the kernel package is cached
# under /var/cache/mountplan-vm. Built only with its tag: `make test`
# does not see it.
test-vm:
	$(GO) test -tags vmtest -count=1 -v -timeout 20m ./test/vm/

# A real Kubernetes cluster of three nodes (built from the module proxy into
# /var/cache/mountplan-tools, each node started in namespaces of its own), the chart
# installed with helm, and the flows of test/cluster; see hack/cluster/test.sh.
test-cluster:
	hack/cluster/test.sh

# Pod start-up on the same cluster (not a timed test): rounds of 30 pods
# per node started at once (emptyDir, a fresh claim each, a fresh NRI claim each)
# and one pod with 20 claims; the table and a plot under bench-results/.
bench-cluster:
	MOUNTPLAN_CLUSTER_BENCH=1 hack/cluster/test.sh -test.run '^TestCluster$$'

test-sanity: build
	$(GO) test -count=1 -v ./test/sanity/...

verify:
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt: files above need formatting"; exit 1; }
	$(GO) vet -tags $(VMTAGS),$(CLUSTERTAGS) $(PKGS)
	$(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2 -tags $(VMTAGS),$(CLUSTERTAGS) $(PKGS)
	hack/verify-codegen.sh
	hack/verify-deploy.sh

codegen:
	hack/update-codegen.sh

deploy:
	hack/update-deploy.sh

bench: build
	hack/bench.sh

# The data path (issue 38): fio on every volume kind as published through
# the plugin and its mounter, against its raw backing, in turn; a table and
# JSON under bench-results/. BENCHIO_FLAGS lengthens it, e.g.
# BENCHIO_FLAGS='-io-runtime 30 -io-rounds 3'. Needs root and fio.
BENCHIO_FLAGS ?=
bench-io: build
	hack/bench-io.sh $(BENCHIO_FLAGS)

demo: build
	hack/demo.sh

clean:
	rm -rf $(BIN)
