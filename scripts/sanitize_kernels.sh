#!/usr/bin/env bash
# Run the small-shape GPU kernel tests under NVIDIA compute-sanitizer (GPU machine, after `source scripts/gpu_env.sh`):
# memcheck (out-of-bounds / misaligned global and shared accesses, e.g. a gather past the KV rows), racecheck
# (shared-memory hazards between threads: the class of run 19's lock-step attention bug) and synccheck (invalid
# barrier use). One small configuration of every TileLang kernel family; the sanitizer slows kernels 10-100x.
#   bash scripts/sanitize_kernels.sh [memcheck racecheck synccheck]      (default: all three)
# Prints each tool's summary; exits non-zero if any tool reported an error. PyTorch's caching allocator is off
# (PYTORCH_NO_CUDA_MEMORY_CACHING=1): each tensor is its own allocation, so memcheck sees a write past a kernel's
# output that would otherwise land silently in a neighbouring tensor of the same pool.
set -u
CS=${CS:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
TESTS=(
  "tests/test_gpu_sparse_attn.py::test_sparse_attn_fwd[2x5x16x64x90x70]"
  "tests/test_gpu_sparse_attn.py::test_sparse_attn_fwd_impl[1x33x64x128x300x200-ws-64]"
  "tests/test_gpu_sparse_attn.py::test_sparse_attn_fwd_impl[1x33x64x128x300x200-ws-128]"
  "tests/test_gpu_sparse_attn.py::test_sparse_attn_fwd_impl[1x33x64x128x300x200-lockstep-64]"
  "tests/test_gpu_sparse_attn.py::test_sparse_attn_fwd_impl[1x33x64x128x300x200-seesaw-64]"
  "tests/test_gpu_sparse_attn_bwd.py::test_sparse_attn_bwd[2x5x16x64x90x70]"
  "tests/test_gpu_sparse_attn_bwd.py::test_sparse_attn_bwd_split[2x5x16x64x90x70]"
  "tests/test_gpu_indexer.py::test_index_scores[2x37x300x32x128]"
  "tests/test_gpu_indexer.py::test_index_scores_backward[2x37x300x32x128]"
  "tests/test_gpu_indexer.py::test_index_topk_exact[2x33x300]"
  "tests/test_gpu_indexer.py::test_index_candidates_exact[2x40x333]"
  "tests/test_gpu_indexer.py::test_index_candidates_packed_exact[2x40x333]"
  "tests/test_gpu_hc.py::test_hc_split_sinkhorn_fwd[(2,37)-4-20]"
  "tests/test_gpu_hc.py::test_hc_split_sinkhorn_bwd[2x37]"
  "tests/test_gpu_gemm.py::test_fp8_gemm[5x70x96]"
  "tests/test_gpu_gemm.py::test_fp8_gemm_cfg[5x70x96-kernel=pingpong,BN=128]"
  "tests/test_gpu_gemm.py::test_fp8_gemm_cfg[5x70x96-kernel=ws]"
  "tests/test_gpu_gemm.py::test_fp8_gemm_cfg[5x70x96-kernel=ws,cluster=2]"
  "tests/test_gpu_gemm.py::test_fp4_gemm[5x70x96]"
  "tests/test_gpu_quant.py::test_fp4_act_quant_bit_exact[(7,96)-32-e8m0]"
  "tests/test_gpu_quant.py::test_act_quant_bit_exact[shape0]"
)
TOOLS=("$@"); [ ${#TOOLS[@]} -eq 0 ] && TOOLS=(memcheck racecheck synccheck)
fail=0
for tool in "${TOOLS[@]}"; do
  echo "== compute-sanitizer --tool $tool"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$CS" --tool "$tool" --print-limit 20 --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider "${TESTS[@]}" 2>&1 \
    | grep -v "DeprecationWarning\|deprecated_warning" | tail -40
  rc=${PIPESTATUS[0]}
  echo "== $tool exit code $rc"
  [ "$rc" -ne 0 ] && fail=1
done
exit $fail
