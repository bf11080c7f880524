#!/usr/bin/env bash
# Runs every Go fuzz test of the module for a while each and prints how many
# inputs each one ran. Usage: hack/fuzz.sh [SECONDS or COUNTx] (default 5 s; FUZZTIME
# overrides). A failing fuzzer prints its failure (go test saves the input
# under the package's testdata/fuzz/, to commit as a regression seed once
# fixed); the others still run, and the script fails at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/go/bin:$PATH
# A duration ("5" or "5s") or a number of inputs ("20000x"). A count is what
# make test uses: with a duration, go test fails a fuzzer with "context
# deadline exceeded" when the time runs out while its workers still start
# (seen on a loaded 2-core machine), which says nothing about the code.
budget=${FUZZTIME:-${1:-5}}
[[ $budget == *x ]] || budget=${budget%s}s

# Every "func FuzzXxx(f *testing.F)" in a _test.go file, with its package dir.
mapfile -t targets < <(git ls-files -co --exclude-standard '*_test.go' | xargs grep -l '^func Fuzz' | while read -r f; do
  grep -o '^func Fuzz[A-Za-z0-9_]*' "$f" | sed "s|^func |$(dirname "$f") |"
done | sort -u)
[ "${#targets[@]}" -gt 0 ] || { echo "no fuzz tests found"; exit 1; }

failed=()
printf '%-32s %-24s %10s\n' package fuzzer execs
for t in "${targets[@]}"; do
  read -r dir name <<<"$t"
  if ! out=$(go test -run '^$' -fuzz "^${name}\$" -fuzztime "$budget" "./$dir" 2>&1); then
    echo "$out" | grep -v '^fuzz: elapsed' >&2
    failed+=("$name (./$dir)")
    printf '%-32s %-24s %10s\n' "./$dir" "$name" FAIL
    continue
  fi
  execs=$(grep -o 'execs: [0-9]*' <<<"$out" | tail -1 | awk '{print $2}')
  printf '%-32s %-24s %10s\n' "./$dir" "$name" "${execs:-?}"
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "failed: ${failed[*]}" >&2
  exit 1
fi
