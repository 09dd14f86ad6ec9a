"""Block-scaled fp8 GEMM C = A @ B^T with the release's 32-wide e8m0 blocks (SPEC §10.3), TileLang/Hopper.

a e4m3 [..., K] + a_s [..., K/32]; b e4m3 [N, K] + b_s [ceil(N/32), K/32] (32x32 weight blocks; the kernel
reads them expanded per column). Hopper's fp8 tensor cores take no block scales, so every 32-deep slice of K
is one WGMMA (k=32) into a temporary accumulator, promoted into the fp32 result with the product of its two
power-of-two scales (the release kernel's order: sum each K block, scale, accumulate in fp32). The main loop
is ``_gemm.promote_loop``, shared with the fp4 GEMM (FullRow warpgroups, scale product precomputed per
(row, 32-column block): one FFMA per accumulator element per slice).

Measured (H200, runs 9-10, 4096x5120x5120): this loop at BN=192 with synchronous promotion 549 TFLOP/s
(BN=128 477, async promotion + BK=256 518). Removed after run 10: the first loop (two scale loads + FMUL +
FFMA per element, 359-386) and an explicitly warp-specialised ping-pong kernel (408-526, never faster).
Limit now: the promotion FMAs run on the same warpgroups that issue the WGMMAs (one FFMA per element per
32-deep slice); the enforced ping-pong did not hide them in TileLang 0.1.15. Next step: overlap promotion
with the tensor cores below TileLang's pipeliner (hand-scheduled WGMMA waits / a newer TileLang's ping-pong).
"""
import functools

import torch
import tilelang.language as T

from functional_dsv41 import quant

from ._common import compile_kernel
from ._gemm import promote_loop

BF16, F32, FP8 = "bfloat16", "float32", "float8_e4m3fn"


@functools.lru_cache(maxsize=None)
def fp8_gemm_kernel(N: int, K: int, BM: int = 128, BN: int = 192, BK: int = 128, stages: int = 4,
                    threads: int = 256, async_promote: bool = False, swizzle: int = 8):
    """The compiled kernel for one (N, K) and configuration; BM = 64 rows per consumer warpgroup
    (``threads = 2 * BM``). Defaults = the measured best (run 10, H200: BN=192 sync promotion 549
    TFLOP/s at 4096x5120x5120; stages=3 equal there, 555 vs 541 at N=2304)."""
    M = T.dynamic("M")
    KB, SB = K // 32, BK // 32
    assert K % BK == 0 and BK % 32 == 0 and BN % 32 == 0 and BM == 64 * (threads // 128)
    body = promote_loop(BM, BN, SB, async_promote)

    @T.prim_func
    def fp8_gemm(
        A: T.Tensor([M, K], FP8),
        As: T.Tensor([M, KB], F32),
        Bm: T.Tensor([N, K], FP8),
        Bs: T.Tensor([N, KB], F32),
        C: T.Tensor([M, N], BF16),
    ):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), threads=threads) as (bx, by):
            a_s = T.alloc_shared([BM, BK], FP8)
            b_s = T.alloc_shared([BN, BK], FP8)
            sa = T.alloc_shared([BM, SB], F32)
            sb = T.alloc_shared([BN, SB], F32)
            acc = T.alloc_fragment([BM, BN], F32)
            tmp0 = T.alloc_fragment([BM, BN], F32)
            tmp1 = T.alloc_fragment([BM, BN], F32) if async_promote else tmp0
            sp = T.alloc_fragment([BM, BN // 32], F32)
            c_s = T.alloc_shared([BM, BN], BF16)
            T.use_swizzle(swizzle)
            T.clear(acc)
            for k in T.Pipelined(K // BK, num_stages=stages):
                T.copy(A[by * BM, k * BK], a_s)
                T.copy(Bm[bx * BN, k * BK], b_s)
                T.copy(As[by * BM, k * SB], sa)
                T.copy(Bs[bx * BN, k * SB], sb)
                body(a_s, b_s, sa, sb, acc, tmp0, tmp1, sp)
            T.copy(acc, c_s)
            T.copy(c_s, C[by * BM, bx * BN])

    return compile_kernel(fp8_gemm, out_idx=[4])


def _scales(s: torch.Tensor) -> torch.Tensor:
    return (quant.e8m0_to_float(s) if s.dtype == quant.E8M0 else s.float()).contiguous()


def _col_scales(b_s: torch.Tensor, N: int) -> torch.Tensor:
    """[ceil(N/32), K/32] block scales -> fp32 [N, K/32] per output column (a TMA tile of it is
    >= 128 bytes per pipeline stage; the [BN/32, 4] block tile is 64 bytes, which TMA refuses)."""
    return _scales(b_s).repeat_interleave(32, 0)[:N].contiguous()


def _pick_bk(K: int) -> int:
    for bk in (128, 64, 32):
        if K % bk == 0:
            return bk
    raise ValueError(f"fp8_gemm (tilelang): K={K} is not a multiple of 32")


def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
             scale_dtype=quant.E8M0, block_size: int = 32, out_dtype=torch.bfloat16, **cfg) -> torch.Tensor:
    """Same contract as ``reference.fp8_gemm`` (block_size 32 only)."""
    if block_size != 32:
        raise NotImplementedError("fp8_gemm (tilelang): block_size 32 only")
    K = a.shape[-1]
    N = b.shape[0]
    lead = a.shape[:-1]
    a2 = a.reshape(-1, K).contiguous()
    sa = _scales(a_s).reshape(-1, K // 32)
    bk = cfg.pop("BK", _pick_bk(K))
    kern = fp8_gemm_kernel(N, K, BK=bk, **cfg)
    c = kern(a2, sa, b.contiguous(), _col_scales(b_s, N))
    return c.reshape(*lead, N).to(out_dtype)
