#!/usr/bin/env bash
# Regenerates pkg/api/v1alpha1 from its proto with pinned generators.
# protoc comes from Debian (protobuf-compiler); the Go plugins from the module proxy.
set -euo pipefail
cd "$(dirname "$0")/.."

PROTOC_GEN_GO_VERSION=v1.36.12
PROTOC_GEN_GO_GRPC_VERSION=v1.6.2

command -v protoc >/dev/null || { echo "protoc not found: apt-get install -y protobuf-compiler" >&2; exit 1; }

out=${1:-.}
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
GOBIN=$tools go install "google.golang.org/protobuf/cmd/protoc-gen-go@${PROTOC_GEN_GO_VERSION}"
GOBIN=$tools go install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@${PROTOC_GEN_GO_GRPC_VERSION}"

spec_dir=$(go list -m -f '{{.Dir}}' github.com/container-storage-interface/spec)
mkdir -p "$out/pkg/api/v1alpha1"
PATH="$tools:$PATH" protoc \
  -I pkg/api/v1alpha1 -I "$spec_dir" -I /usr/include \
  --go_out="$out/pkg/api/v1alpha1" --go_opt=paths=source_relative \
  --go-grpc_out="$out/pkg/api/v1alpha1" --go-grpc_opt=paths=source_relative \
  pkg/api/v1alpha1/mountplan.proto
