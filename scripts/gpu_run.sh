#!/usr/bin/env bash
# Run commands on the GPU machine so that a hang costs one command, not the call's output:
#   bash scripts/gpu_run.sh SECONDS "python3 -m pytest -q tests/test_gpu_sparse_attn.py" "python3 -m functional_dsv41.kernels.bench --only attnfwd"
# Each command runs under `timeout SECONDS` (python unbuffered), its output goes to the terminal as it comes and to
# $OUT/gpu_run.log when $OUT is set (the device call brings that folder back even when the call itself times out),
# and a summary line per command says its exit status (124: timed out). (A first run 2026-12-03 lost 500 s of
# output to one hung kernel: everything had been piped through one grep that never flushed.)
set -u
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 SECONDS COMMAND [COMMAND ...]" >&2; exit 2; }
limit=$1; shift
case $limit in ''|*[!0-9]*|0) echo "gpu_run.sh: SECONDS must be a whole number >= 1, got '$limit' (timeout 0 would mean no limit)" >&2; exit 2;; esac
source scripts/gpu_env.sh >/dev/null || { echo "gpu_run.sh: the GPU environment is not set up (above); nothing run" >&2; exit 1; }
export PYTHONUNBUFFERED=1
log=${OUT:+$OUT/gpu_run.log}
summary=(); failed=0
cmd_log=$(mktemp); trap 'rm -f "$cmd_log"' EXIT
for cmd in "$@"; do
  echo "== $(date -u +%H:%M:%S) $cmd" | tee -a ${log:-/dev/null}
  start=$(date +%s)
  # TileLang's log lines are dropped (one "Found kernel" a cache load), except "begins to compile": a kernel missing
  # from the carried cache costs 10-20 s here, and run 160 lost its bench to 16 of them unseen
  timeout "$limit" bash -c "$cmd" 2>&1 | awk '!/TileLang:tilelang/ || /begins to compile/ { print; fflush() }' \
    | tee "$cmd_log" | tee -a ${log:-/dev/null}
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  compiled=$(grep -c "begins to compile" "$cmd_log" || true)
  note=""
  [ "$compiled" -eq 0 ] || note=" ($compiled kernel(s) compiled here: not in the carried cache)"
  summary+=("rc=$rc $(( $(date +%s) - start ))s$note  $cmd")
done
echo "== summary" | tee -a ${log:-/dev/null}
printf '%s\n' "${summary[@]}" | tee -a ${log:-/dev/null}
# the call's own status says whether every command passed (each one's is in the summary above)
[ "$failed" -eq 0 ] || { echo "gpu_run.sh: $failed of $# command(s) failed" | tee -a ${log:-/dev/null}; exit 1; }
