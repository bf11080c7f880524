#!/usr/bin/env bash
# Renders charts/mountplan with its default values into deploy/ (one file per
# template), with the Helm v3 library: no helm binary needed.
# hack/verify-deploy.sh checks that deploy/ is up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-deploy}
go run ./test/chart/cmd/render-deploy -chart charts/mountplan -out "$out"
