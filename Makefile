# mountplan build and test entry points. Root is needed for `test` and
# `test-vm` (real loop devices, mounts, namespaces, containers, qemu);
# .ci/run installs the packages (hack/install-deps.sh), then runs
# `make verify test test-vm`.
export PATH := /usr/local/go/bin:$(PATH)
GO        ?= go
BIN       := bin
PKGS      := ./...
# Root tests share the kernel's loop devices and mount table: run test
# packages one at a time so their leak checks see only their own work.
TESTFLAGS ?= -p 1 -count=1 -timeout 80m

.PHONY: all build test test-unit test-sanity test-vm verify bench demo clean codegen deploy

all: build

build:
	$(GO) build -trimpath -o $(BIN)/ ./cmd/mountplan-plugin ./cmd/mountplan-sidecar ./hack/csictl

test: build
	$(GO) test $(TESTFLAGS) $(PKGS)

test-unit:
	$(GO) test -count=1 -short $(PKGS)

# Boots Debian's kernel (it has nbd and iscsi_tcp) under qemu TCG and runs
# the NBD and iSCSI flows inside it; about 25 s once the kernel package is
# cached under /var/cache/mountplan-vm. `make test` skips it.
test-vm:
	MOUNTPLAN_VM_TEST=1 $(GO) test -count=1 -v -timeout 20m ./test/vm/

test-sanity: build
	$(GO) test -count=1 -v ./test/sanity/...

verify:
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt: files above need formatting"; exit 1; }
	$(GO) vet $(PKGS)
	$(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2 $(PKGS)
	hack/verify-codegen.sh
	hack/verify-deploy.sh

codegen:
	hack/update-codegen.sh

deploy:
	hack/update-deploy.sh

bench: build
	hack/bench.sh

demo: build
	hack/demo.sh

clean:
	rm -rf $(BIN)
