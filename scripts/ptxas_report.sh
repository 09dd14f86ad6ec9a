#!/usr/bin/env bash
# Registers and spills of TileLang kernels as ptxas sees them (sm_90a), on a machine without a GPU:
#   source scripts/local_tilelang_env.sh; bash scripts/ptxas_report.sh [NAME_PATTERN [NEWEST_N]]
# For each kernel in TileLang's cache whose generated CUDA defines a __global__ matching NAME_PATTERN (a grep -E
# pattern, default: every kernel; NEWEST_N: only the N most recently compiled kernels), compiles device_kernel.cu
# to a cubin with `ptxas --verbose` and prints the kernel's cache folder, name, registers, stack frame and spill
# bytes, its setmaxnreg budgets and ptxas's C75xx performance warning (e.g. C7512: WGMMAs serialised for lack of
# registers), which TileLang's own build hides. Spills in a WGMMA kernel usually mean a register budget
# (setmaxnreg, 65536 / threads) below what the accumulators and descriptors need.
set -euo pipefail
cd "$(dirname "$0")/.."
pat=${1:-.}
newest=${2:-0}
CACHE=${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}
case ${1:-} in -h|--help) sed -n 2,9p "$0" | sed 's/^# \{0,1\}//'; exit 0;; esac
TL=$(.venv/bin/python -c "import tilelang.env as e; print(e.TILELANG_TEMPLATE_PATH, e.CUTLASS_INCLUDE_DIR)" \
     2>/dev/null) || { echo "ptxas_report.sh: tilelang is not importable by .venv/bin/python;" \
                            "source scripts/local_tilelang_env.sh first" >&2; exit 1; }
read -r TPL CUT <<<"$TL"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
files=$(ls -t "$CACHE"/*/linux-x86_64/kernels/*/device_kernel.cu)
[ "$newest" -gt 0 ] && files=$(head -n "$newest" <<<"$files")
for f in $files; do
  name=$(grep -oE "__global__ void __launch_bounds__\([0-9, ]+\) [A-Za-z_0-9]+" "$f" | awk '{print $NF}' | head -1 || true)
  [[ -n "$name" && "$name" =~ $pat ]] || continue
  key=$(basename "$(dirname "$f")")
  nreg=$(grep -oE "reg_(de)?alloc<[0-9]+>" "$f" | tr '\n' ' ' || true)
  out=$(nvcc -cubin -gencode arch=compute_90a,code=sm_90a -std=c++20 --use_fast_math -I"$TPL" -I"$CUT" -I"$CUDA_HOME/include" \
        -DENABLE_BF16 -Xptxas -v -o "$tmp/k.cubin" "$f" 2>&1 | grep -E "Used|spill|stack|C75[0-9][0-9]" | tr '\n' ' ' || true)
  regs=$(grep -oE "Used [0-9]+ registers" <<<"$out" | head -1 | awk '{print $2}')
  frame=$(grep -oE "[0-9]+ bytes stack frame" <<<"$out" | head -1 | awk '{print $1}')
  st=$(grep -oE "[0-9]+ bytes spill stores" <<<"$out" | head -1 | awk '{print $1}')
  ld=$(grep -oE "[0-9]+ bytes spill loads" <<<"$out" | head -1 | awk '{print $1}')
  warn=$(grep -oE "\(C75[0-9]+\)[^']*" <<<"$out" | head -1 | cut -c1-80 || true)
  printf '%s  %-32s regs %4s  frame %5s B  spill st/ld %5s / %5s B  %s %s\n' "${key:0:12}" "$name" "${regs:-?}" \
    "${frame:-?}" "${st:-?}" "${ld:-?}" "$nreg" "$warn"
done
