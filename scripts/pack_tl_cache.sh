#!/usr/bin/env bash
# Pack TileLang's local kernel cache (kernels compiled here for sm_90a with DSV41_TL_TARGET set, see
# BENCHMARKS.md) as .tl/tlcache.tar.xz, so the GPU machine loads them instead of compiling (scripts/gpu_env.sh),
# and copy the golden fixtures the GPU tests read (kernels, tiny-bf16, tiny-fp8: ~15 MiB) to .tl/fixtures.
# It fails above CAP_MB (default 20): a device call carries at most 64 MiB in all (site.tar.xz takes 37).
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}
CAP_MB=${CAP_MB:-20}
mkdir -p .tl/fixtures
FIX=${DSV41_FIXTURES:-../shared/fixtures}
# (their README.md files stay behind: no test reads them, and a call's 64 MiB has no room to spare)
for f in kernels tiny-bf16 tiny-fp8; do
  [ -d "$FIX/$f" ] || continue
  rm -rf ".tl/fixtures/$f" && mkdir -p ".tl/fixtures/$f"
  find "$FIX/$f" -maxdepth 1 -type f ! -name README.md -exec cp {} ".tl/fixtures/$f/" \;
done
# a missing or empty cache would replace a good archive with one that breaks gpu_env.sh: refuse, keep the old one
if ! find "$SRC" -name executable.so -print -quit 2>/dev/null | grep -q .; then
  echo "pack_tl_cache.sh: no compiled kernels in $SRC (set TILELANG_CACHE_DIR, or compile with" \
       "scripts/precompile_kernels.py first); .tl/tlcache.tar.xz left as it was" >&2
  exit 1
fi
# cuda-binaries/ is TileLang's nvcc-output cache, read only when a kernel is compiled; the kernels themselves
# (linux-x86_64/kernels/*/executable.so) load without it, so it stays here (it was a third of the archive)
XZ_OPT="-6 -T0" tar cJf .tl/tlcache.tar.xz.tmp -C "$SRC" --exclude='*/cuda-binaries' . \
  || { rm -f .tl/tlcache.tar.xz.tmp; echo "pack_tl_cache.sh: tar failed; .tl/tlcache.tar.xz left as it was" >&2; exit 1; }
mv .tl/tlcache.tar.xz.tmp .tl/tlcache.tar.xz
ls -la .tl/tlcache.tar.xz
size=$(( $(stat -c %s .tl/tlcache.tar.xz) / 1048576 ))
if [ "$size" -gt "$CAP_MB" ]; then echo "tlcache is ${size} MiB > ${CAP_MB} MiB: prune $SRC" >&2; exit 1; fi
