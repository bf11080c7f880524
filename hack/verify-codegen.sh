#!/usr/bin/env bash
# Fails when the committed generated code differs from a fresh generation.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
hack/update-codegen.sh "$tmp" >/dev/null
for f in pkg/api/v1alpha1/*.pb.go; do
  if ! diff -u "$f" "$tmp/$f"; then
    echo "generated code is stale: run hack/update-codegen.sh" >&2
    exit 1
  fi
done
echo "generated code is up to date"
