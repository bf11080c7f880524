#!/usr/bin/env bash
# Fails (exit 1) when deploy/ differs from a fresh render of charts/mountplan.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
hack/update-deploy.sh "$tmp/deploy"
# deploy/grafana/ is written by hand, not rendered (internal/metrics checks it).
if ! diff -ru --exclude=grafana deploy "$tmp/deploy"; then
  echo "deploy/ is out of date with charts/mountplan: run hack/update-deploy.sh" >&2
  exit 1
fi
echo "deploy/ is up to date"
