#!/usr/bin/env bash
# Prepare one device call that runs the whole GPU suite: compile (or load from the local cache) every kernel the GPU
# tests and the GPU training/model paths build, then pack just those kernels as .tl/tlcache.tar.xz, beside the
# fixtures (.tl/fixtures.tar.xz). The whole cache holds every kernel ever compiled here and, with the fixtures and
# the working tree, no longer fits in the 64 MiB a call carries; the suite's own kernels do (~7 MB of ~14).
#   bash scripts/pack_gpu_suite.sh          # 18-25 min on 2 cores when the cache already has the kernels
# then (carry .tl/site.tar.xz, .tl/tlcache.tar.xz and .tl/fixtures.tar.xz):
#   bash scripts/gpu_run.sh 540 "python3 -m pytest -q -p no:cacheprovider $(echo tests/test_gpu_*.py) tests/test_func.py -rfEs"
# The key list is kept in .tl/keys-gpu-suite.txt (rebuilt from scratch each run, so it holds no stale kernel).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/local_tilelang_env.sh
py=.venv/bin/python
keys=.tl/keys-gpu-suite.txt
rm -f "$keys.new"
# (the tests "fail" here by design: their launches are stubbed; what matters is the kernels they build)
"$py" scripts/precompile_kernels.py tests tests/test_gpu_*.py tests/test_func.py -q --keys-out "$keys.new" \
  > .tl/pack_gpu_suite.log 2>&1 || true
grep -q "cache keys from this run" .tl/pack_gpu_suite.log \
  || { echo "pack_gpu_suite.sh: the tests' precompile did not finish (.tl/pack_gpu_suite.log)" >&2; exit 1; }
for mode in train-run train-gpu release-layers; do
  "$py" scripts/precompile_kernels.py "$mode" --keys-out "$keys.new" >> .tl/pack_gpu_suite.log 2>&1 \
    || { echo "pack_gpu_suite.sh: precompile $mode failed (.tl/pack_gpu_suite.log)" >&2; exit 1; }
done
mv "$keys.new" "$keys"
echo "pack_gpu_suite.sh: $(wc -l < "$keys") kernels"
KEEP="$keys" bash scripts/pack_tl_cache.sh
