#!/usr/bin/env bash
# Fails when the committed generated code differs from a fresh generation.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
hack/update-codegen.sh "$tmp" >/dev/null
# A file generated now but not committed (or the reverse) is drift too.
if ! diff <(cd pkg/api/v1alpha1 && ls *.pb.go) <(cd "$tmp/pkg/api/v1alpha1" && ls *.pb.go); then
  echo "generated files differ from the committed ones: run hack/update-codegen.sh" >&2
  exit 1
fi
for f in pkg/api/v1alpha1/*.pb.go; do
  if ! diff -u "$f" "$tmp/$f"; then
    echo "generated code is stale: run hack/update-codegen.sh" >&2
    exit 1
  fi
done
echo "generated code is up to date"
