#!/usr/bin/env bash
# Pack TileLang's local kernel cache (kernels compiled here for sm_90a with DSV41_TL_TARGET set, see
# BENCHMARKS.md) as .tl/tlcache.tar.xz, and copy the kernels' golden fixtures to .tl/fixtures,, so the GPU machine loads them instead of compiling (scripts/gpu_env.sh).
# Only the newest entries are kept under a size cap: a device call carries at most 64 MiB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}
CAP_MB=${CAP_MB:-20}
mkdir -p .tl/fixtures
FIX=${DSV41_FIXTURES:-../shared/fixtures}
[ -d "$FIX/kernels" ] && cp -r "$FIX/kernels" .tl/fixtures/      # 68 KiB: the kernels' golden tensors
rm -f .tl/tlcache.tar.xz
XZ_OPT="-6 -T0" tar cJf .tl/tlcache.tar.xz -C "$SRC" .
ls -la .tl/tlcache.tar.xz
size=$(( $(stat -c %s .tl/tlcache.tar.xz) / 1048576 ))
if [ "$size" -gt "$CAP_MB" ]; then echo "tlcache is ${size} MiB > ${CAP_MB} MiB: prune $SRC" >&2; exit 1; fi
