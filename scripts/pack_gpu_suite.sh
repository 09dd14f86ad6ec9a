#!/usr/bin/env bash
# Prepare one device call that runs the whole GPU suite: compile (or load from the local cache) every kernel the GPU
# tests and the GPU training/model paths build, then pack just those kernels as .tl/tlcache.tar.xz, beside the
# fixtures (.tl/fixtures.tar.xz). The whole cache holds every kernel ever compiled here and, with the fixtures and
# the working tree, no longer fits in the 64 MiB a call carries; the suite's own kernels do (~7 MB of ~14).
#   bash scripts/pack_gpu_suite.sh          # the suite's kernels (~410)
#   BENCH=1 bash scripts/pack_gpu_suite.sh  # and the kernels.bench sections' (attn-pp, gemm, attn-bench modes):
#                                           # 502 kernels, 9.1 MB, one archive for the suite and the bench
# (2026-12-07, 2 cores: BENCH=1 took 11.5 min with all but 16 of its kernels already in the cache; the tests'
# precompile alone took 18-25 min before it ran beside the modes)
# then (carry .tl/site.tar.xz, .tl/tlcache.tar.xz and .tl/fixtures.tar.xz):
#   bash scripts/gpu_run.sh 540 "python3 -m pytest -q -p no:cacheprovider $(echo tests/test_gpu_*.py) tests/test_func.py -rfEs"
# The tests' precompile (the longest part) runs beside the other modes, two processes for two cores; each writes its
# own key list and the two are merged. The key list is kept in .tl/keys-gpu-suite.txt (rebuilt from scratch each
# run, so it holds no stale kernel). Do not edit kernel files while it runs: TileLang re-reads a kernel's source as
# it compiles, and a kernel compiled from a half-edited file lands under a key no later run asks for.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/local_tilelang_env.sh
py=.venv/bin/python
keys=.tl/keys-gpu-suite.txt
modes="train-run train-gpu release-layers"
case ${BENCH:-0} in
  0) ;;
  1) modes="$modes attn-pp gemm attn-bench" ;;
  *) echo "pack_gpu_suite.sh: BENCH must be 0 or 1, got '${BENCH}'" >&2; exit 2 ;;
esac
rm -f "$keys.tests" "$keys.modes"
# (the tests "fail" here by design: their launches are stubbed; what matters is the kernels they build)
"$py" scripts/precompile_kernels.py tests tests/test_gpu_*.py tests/test_func.py -q --keys-out "$keys.tests" \
  > .tl/pack_gpu_suite.tests.log 2>&1 &
tests_pid=$!
trap 'kill "$tests_pid" 2>/dev/null || true' EXIT
: > .tl/pack_gpu_suite.log
failed=""
for mode in $modes; do
  "$py" scripts/precompile_kernels.py "$mode" --keys-out "$keys.modes" >> .tl/pack_gpu_suite.log 2>&1 \
    || { failed=$mode; break; }
done
# (on a failed mode the EXIT trap stops the tests' precompile too: the pack would be incomplete either way)
[ -z "$failed" ] || { echo "pack_gpu_suite.sh: precompile $failed failed (.tl/pack_gpu_suite.log)" >&2; exit 1; }
wait "$tests_pid" || true                           # (its exit status is the failing tests', by design)
trap - EXIT
grep -q "cache keys from this run" .tl/pack_gpu_suite.tests.log \
  || { echo "pack_gpu_suite.sh: the tests' precompile did not finish (.tl/pack_gpu_suite.tests.log)" >&2; exit 1; }
sort -u "$keys.tests" "$keys.modes" > "$keys.new"
mv "$keys.new" "$keys" && rm -f "$keys.tests" "$keys.modes"
echo "pack_gpu_suite.sh: $(wc -l < "$keys") kernels (modes: $modes)"
KEEP="$keys" bash scripts/pack_tl_cache.sh
