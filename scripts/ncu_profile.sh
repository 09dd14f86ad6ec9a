#!/usr/bin/env bash
# Nsight Compute profiles of single kernel launches at the release shape (kernels/ncu_one.py), on the GPU machine
# after scripts/gpu_env.sh:
#   bash scripts/ncu_profile.sh NAME "ncu_one ARGS" [NAME "ARGS" ...]
#   e.g. bash scripts/ncu_profile.sh pp "attn" pp_compute "attn --diag compute" gemm "gemm"
# ARGS are split on whitespace (no quoting inside them): give ncu_one's --kw JSON without spaces, '{"lazy":8.0}'.
# Per NAME it writes into $OUT/ncu (or ./ncu_out): the report, its details page, its raw metrics and its SASS source
# page with per-instruction counters (warp stall samples, shared wavefronts), as text; then packs the text as
# $OUT/ncu.tar.xz (a device call brings back only a few files: one archive, not a dozen files).
# The full section set (~40 replays) takes well under a minute a kernel. Clocks are left alone
# (--clock-control none), as the device notes ask: so the clocks under ncu run lower than in a bench.
set -u
out=${OUT:-ncu_out}; dir=$out/ncu; mkdir -p "$dir"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "ncu_profile.sh: ncu not found" >&2; exit 1; }
[ $(( $# % 2 )) -eq 0 ] && [ $# -gt 0 ] || { echo "usage: $0 NAME 'ARGS' [NAME 'ARGS' ...]" >&2; exit 2; }
rc=0
while [ $# -gt 0 ]; do
  name=$1; a=$2; shift 2
  if "$ncu" --clock-control none --profile-from-start off --set full --import-source no -f -o "$dir/$name" \
       python3 -m functional_dsv41.kernels.ncu_one $a; then
    "$ncu" --import "$dir/$name.ncu-rep" --page details --print-units base > "$dir/$name.details.txt"
    "$ncu" --import "$dir/$name.ncu-rep" --page raw --print-units base > "$dir/$name.raw.txt"
    "$ncu" --import "$dir/$name.ncu-rep" --page source --csv --print-source sass > "$dir/$name.sass.csv"
    grep -E " Duration|Elapsed Cycles|SM Frequency|highest-utilized" "$dir/$name.details.txt"
  else
    echo "ncu_profile.sh: $name failed" >&2; rc=1
  fi
done
tar cJf "$out/ncu.tar.xz" -C "$dir" --exclude='*.ncu-rep' . && ls -la "$out/ncu.tar.xz"
rm -f "$dir"/*.txt "$dir"/*.csv
exit $rc
