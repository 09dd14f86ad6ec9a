#!/usr/bin/env bash
# Pack TileLang's local kernel cache (kernels compiled here for sm_90a with DSV41_TL_TARGET set, see
# BENCHMARKS.md) as .tl/tlcache.tar.xz, so the GPU machine loads them instead of compiling (scripts/gpu_env.sh),
# and pack the golden fixtures the GPU tests read (kernels, tiny-bf16, tiny-fp8: 15 MB, 11 MB as xz) as
# .tl/fixtures.tar.xz (gpu_env.sh unpacks it there).
# It fails above CAP_MB (default 20): a device call carries at most 64 MiB in all (site.tar.xz takes 37).
# KEEP=FILE packs only the kernels FILE lists; TLCACHE_OUT (default .tl/tlcache.tar.xz) is where the archive goes.
set -euo pipefail
# (paths given relative to where the script is called from, before it moves to the repository root)
[ -z "${KEEP:-}" ] || KEEP=$(realpath -m -- "$KEEP")
[ -z "${TLCACHE_OUT:-}" ] || TLCACHE_OUT=$(realpath -m -- "$TLCACHE_OUT")
cd "$(dirname "$0")/.."
OUTA=${TLCACHE_OUT:-.tl/tlcache.tar.xz}
SRC=${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}
CAP_MB=${CAP_MB:-20}
FIX=${DSV41_FIXTURES:-../shared/fixtures}
# (their README.md files stay behind: no test reads them, and a call's 64 MiB has no room to spare; the archive
# is xz, not a folder, for the same reason: carried as a folder they took 4.4 MB more and the call no longer fit)
stage=$(mktemp -d); trap 'rm -rf "$stage"' EXIT
for f in kernels tiny-bf16 tiny-fp8; do
  [ -d "$FIX/$f" ] || continue
  mkdir -p "$stage/$f"
  find "$FIX/$f" -maxdepth 1 -type f ! -name README.md -exec cp {} "$stage/$f/" \;
done
if [ -n "$(ls -A "$stage")" ]; then
  XZ_OPT="-6 -T0" tar cJf .tl/fixtures.tar.xz.tmp -C "$stage" . \
    || { rm -f .tl/fixtures.tar.xz.tmp; echo "pack_tl_cache.sh: packing the fixtures failed" >&2; exit 1; }
  mv .tl/fixtures.tar.xz.tmp .tl/fixtures.tar.xz && rm -rf .tl/fixtures   # (the folder form of older packs)
else
  echo "pack_tl_cache.sh: no fixtures under $FIX; .tl/fixtures.tar.xz left as it was" >&2
fi
# a missing or empty cache would replace a good archive with one that breaks gpu_env.sh: refuse, keep the old one
if ! find "$SRC" -name executable.so -print -quit 2>/dev/null | grep -q .; then
  echo "pack_tl_cache.sh: no compiled kernels in $SRC (set TILELANG_CACHE_DIR, or compile with" \
       "scripts/precompile_kernels.py first); $OUTA left as it was" >&2
  exit 1
fi
# cuda-binaries/ is TileLang's nvcc-output cache, read only when a kernel is compiled; the kernels themselves
# (linux-x86_64/kernels/*/executable.so) load without it, so it stays here (it was a third of the archive)
# KEEP=FILE: only the kernels whose cache keys FILE lists (scripts/precompile_kernels.py --keys-out FILE), each of
# which must be in the cache
what=(.)
if [ -n "${KEEP:-}" ]; then
  [ -f "$KEEP" ] || { echo "pack_tl_cache.sh: KEEP=$KEEP is not a file; $OUTA left as it was" >&2; exit 1; }
  # every compiled kernel's folder, by its key (one walk of the cache, not one a key)
  declare -A dir_of=()
  while read -r so; do
    d=${so%/executable.so}; dir_of[${d##*/}]=$d
  done < <(cd "$SRC" && find . -mindepth 5 -maxdepth 5 -path "*/kernels/*/executable.so")
  what=(); missing=0
  while read -r key; do
    [ -n "$key" ] || continue
    if [ -z "${dir_of[$key]:-}" ]; then
      echo "pack_tl_cache.sh: kernel $key (KEEP) is not compiled in $SRC" >&2; missing=$((missing + 1))
    else
      what+=("${dir_of[$key]}")
    fi
  done < "$KEEP"
  [ "$missing" -eq 0 ] || { echo "pack_tl_cache.sh: $missing kernel(s) missing; $OUTA left as it was" >&2; exit 1; }
  [ ${#what[@]} -gt 0 ] || { echo "pack_tl_cache.sh: KEEP=$KEEP lists no kernels; $OUTA left as it was" >&2; exit 1; }
  echo "pack_tl_cache.sh: ${#what[@]} kernels (KEEP=$KEEP)"
fi
XZ_OPT="-6 -T0" tar cJf "$OUTA.tmp" -C "$SRC" --exclude='*/cuda-binaries' "${what[@]}" \
  || { rm -f "$OUTA.tmp"; echo "pack_tl_cache.sh: tar failed; $OUTA left as it was" >&2; exit 1; }
# the cap is checked before the archive replaces the old one, which an oversized one must not do
size=$(( $(stat -c %s "$OUTA.tmp") / 1048576 ))
if [ "$size" -gt "$CAP_MB" ]; then
  rm -f "$OUTA.tmp"
  echo "pack_tl_cache.sh: the kernel cache packs to ${size} MiB > ${CAP_MB} MiB: prune $SRC or pack a KEEP list;" \
       "$OUTA left as it was" >&2
  exit 1
fi
mv "$OUTA.tmp" "$OUTA"
ls -la "$OUTA"
