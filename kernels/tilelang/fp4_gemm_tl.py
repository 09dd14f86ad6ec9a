"""Block-scaled fp8 x fp4 GEMM C = A @ fp4(B)^T (SPEC §10.4), TileLang/Hopper.

a e4m3 [..., K] + a_s [..., K/act_block_size]; b packed e2m1 float4_e2m1fn_x2 [N, K/2] (element 2j in the
low nibble of byte j) + e8m0 [N, K/32]. Hopper has no fp4 tensor-core input, so each K tile of packed B is
loaded to shared memory (half the bytes of fp8), converted there to e4m3 and fed to the fp8 GEMM's
structure: every 32-deep slice of K is one WGMMA (k=32) into a temporary, promoted into the fp32 result
with its two power-of-two scales (the release's order: sum each K block, scale, accumulate in fp32).

Conversion: e2m1 code ``s e1 e0 m`` -> e4m3 byte ``s 000 e1 e0 m 00`` = value * 2^-6 exactly (code 1 = 0.5
lands on the e4m3 subnormal 2^-7, the normal codes keep their exponent offset), so the per-element work is
two masks and two shifts; the 2^6 is folded into B's fp32 scales on the host (exact: powers of two).

The main loop is ``_gemm.promote_loop`` (shared with the fp8 GEMM) with ``per_col=True``: fp4 weight
scales are per output column (not per 32x32 block as fp8's), so promotion is ``acc += (tmp * sb[col]) *
sa[row]`` (FMUL + FFMA per element per 32-deep slice; run 9: fp8's per-32-column product form is wrong here).

Measured (H200, run 10, 4096x2304x5120 / 4096x5120x2304 TFLOP/s): this loop with the 8-codes-per-step
conversion and BN=192 294/279 (BM=192/384 threads 301/278, async promotion 245/266, BN=128 240/259).
Removed after run 10: the byte-wise conversion (179/195) and the first loop (176/194). Limit now: the
promotion FMAs (twice fp8's) on the WGMMA warpgroups plus the conversion and its two block barriers per K
tile; next step: convert in a producer warpgroup (warp specialisation) so consumers only run WGMMA+promote.
"""
import functools

import torch
import tilelang.language as T

from functional_dsv41 import quant

from ._common import compile_kernel
from ._gemm import dequant_bf16, promote_loop
from .fp8_gemm_tl import _scales

BF16, F32, FP8, U8 = "bfloat16", "float32", "float8_e4m3fn", "uint8"

# Conversion, 8 codes per thread step with 32-bit ops (4 packed bytes -> 8 e4m3 bytes): the even and odd
# nibbles are separated with two masks, each byte mapped ``s e1 e0 m`` -> ``s 0 0 e1 e0 m 0 0`` (the formula
# above, on four bytes at once), then interleaved back into element order with two byte permutes.
# One 4-byte shared load and one 8-byte shared store per 8 elements (a byte loop: 8 loads, 4 stores).
_CONV_X8_SRC = r"""
__device__ __forceinline__ void dsv41_fp4x8_to_e4m3(const void* src, void* dst) {
  const unsigned w = *reinterpret_cast<const unsigned*>(src);
  unsigned lo = w & 0x0F0F0F0Fu;          // elements 0, 2, 4, 6 (low nibbles)
  unsigned hi = (w >> 4) & 0x0F0F0F0Fu;   // elements 1, 3, 5, 7 (high nibbles)
  lo = ((lo & 0x07070707u) << 2) | ((lo & 0x08080808u) << 4);
  hi = ((hi & 0x07070707u) << 2) | ((hi & 0x08080808u) << 4);
  uint2 o;
  o.x = __byte_perm(lo, hi, 0x5140);      // lo.b0 hi.b0 lo.b1 hi.b1 = elements 0..3
  o.y = __byte_perm(lo, hi, 0x7362);      // lo.b2 hi.b2 lo.b3 hi.b3 = elements 4..7
  *reinterpret_cast<uint2*>(dst) = o;
}
"""


@functools.lru_cache(maxsize=None)
def fp4_gemm_kernel(N: int, K: int, BM: int = 128, BN: int = 192, BK: int = 128, stages: int = 3,
                    threads: int = 256, async_promote: bool = False, swizzle: int = 8,
                    swizzle128: bool | None = None):
    """The compiled kernel for one (N, K) and configuration; BM = 64 rows per consumer warpgroup
    (``threads = 2 * BM``). Defaults = the fp8 GEMM's tile (BN=192, sync promotion), 3 stages (the run-10
    measurement; the converted b_s tile adds shared memory per stage). ``swizzle128`` (default where BK = 128):
    the A and B stage tiles in one 128-byte-swizzled layout (run 26: 310 / 289 TFLOP/s against 292 / 277,
    bitwise-equal output)."""
    swizzle128 = BK == 128 if swizzle128 is None else swizzle128
    M = T.dynamic("M")
    KB, SB = K // 32, BK // 32
    assert K % BK == 0 and BK % 32 == 0 and BN % 32 == 0 and BM == 64 * (threads // 128)
    body = promote_loop(BM, BN, SB, async_promote, per_col=True)   # fp4: per-column scales

    @T.macro
    def tile_loop(a_s, b_s, A, As, Bp, Bs, C, bx, by):
        bp_s = T.alloc_shared([BN, BK // 2], U8)
        sa = T.alloc_shared([BM, SB], F32)
        sb = T.alloc_shared([BN, SB], F32)
        acc = T.alloc_fragment([BM, BN], F32)
        tmp = T.alloc_fragment([BM, BN], F32)
        tmp1 = T.alloc_fragment([BM, BN], F32) if async_promote else tmp
        c_s = T.alloc_shared([BM, BN], BF16)
        T.use_swizzle(swizzle)
        T.clear(acc)
        for k in T.Pipelined(K // BK, num_stages=stages):
            T.copy(A[by * BM, k * BK], a_s)
            T.copy(Bp[bx * BN, k * (BK // 2)], bp_s)
            T.copy(As[by * BM, k * SB], sa)
            T.copy(Bs[bx * BN, k * SB], sb)
            T.import_source(_CONV_X8_SRC)
            T.sync_threads()     # the previous tile's WGMMAs have read b_s (the extern write is opaque)
            for i, q in T.Parallel(BN, BK // 8):
                T.call_extern("handle", "dsv41_fp4x8_to_e4m3", T.address_of(bp_s[i, q * 4]),
                              T.address_of(b_s[i, q * 8]))
            T.fence_proxy_async()   # generic-proxy writes -> visible to the WGMMA (async proxy)
            T.sync_threads()     # all of b_s is written before either warpgroup's WGMMA reads it
            body(a_s, b_s, sa, sb, acc, tmp, tmp1, None)   # per_col: no sp fragment
        T.copy(acc, c_s)
        T.copy(c_s, C[by * BM, bx * BN])

    @T.prim_func
    def fp4_gemm(
        A: T.Tensor([M, K], FP8),
        As: T.Tensor([M, KB], F32),
        Bp: T.Tensor([N, K // 2], U8),
        Bs: T.Tensor([N, KB], F32),
        C: T.Tensor([M, N], BF16),
    ):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), threads=threads) as (bx, by):
            if swizzle128:  # one 128-byte-swizzled [rows, BK] tile per operand (_common._install_wide_swizzle)
                a_sw128 = T.alloc_shared([BM, BK], FP8)
                b_sw128 = T.alloc_shared([BN, BK], FP8)
                tile_loop(a_sw128, b_sw128, A, As, Bp, Bs, C, bx, by)
            else:
                a_s = T.alloc_shared([BM, BK], FP8)
                b_s = T.alloc_shared([BN, BK], FP8)
                tile_loop(a_s, b_s, A, As, Bp, Bs, C, bx, by)

    return compile_kernel(fp4_gemm, out_idx=[4])


def _pick_bk(K: int) -> int:
    for bk in (128, 64, 32):
        if K % bk == 0:
            return bk
    raise ValueError(f"fp4_gemm (tilelang): K={K} is not a multiple of 32")


def operands(a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor, K: int, act_block_size: int = 32):
    """Kernel operands: fp32 per-32 A scales [M, K/32], B bytes [N, K/2], fp32 B scales * 2^6 [N, K/32]."""
    sa = _scales(a_s)
    if act_block_size != 32:
        sa = sa.repeat_interleave(act_block_size // 32, -1)
    sa = sa.reshape(-1, K // 32).contiguous()
    sb = (_scales(b_s) * 64.0).contiguous()
    return sa, b.contiguous().view(torch.uint8), sb


# Rows from which the bf16 path replaces the block-scaled kernel (run 26, N = 2304, K = 5120: 0.085 ms against
# 0.111 at M = 1024, 0.177 against 0.312 at 4096; at M = 256 0.21 against 0.111): e2m1 values need an FMUL
# and an FFMA per element to reach the fp8 WGMMA (``promote_loop(per_col=True)``), while their exact bf16 copy
# feeds cuBLAS's bf16 GEMM at ~750 TFLOP/s; below it the dequantisation of B (N x K, fixed) dominates.
BF16_MIN_M = 1024


def default_config(M: int) -> dict:
    """The path ``fp4_gemm`` takes for M rows when the caller names none: "bf16" from ``BF16_MIN_M`` rows,
    else the block-scaled kernel ("loop")."""
    return dict(kernel="bf16" if M >= BF16_MIN_M else "loop")


def fp4_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
             scale_dtype=quant.E8M0, act_block_size: int = 32, out_dtype=torch.bfloat16, **cfg) -> torch.Tensor:
    """Same contract as ``reference.fp4_gemm`` (act_block_size a multiple of 32). ``kernel``: "loop"
    (``fp4_gemm_kernel``; other cfg keys go to it) or "bf16" (both operands dequantised exactly to bf16, then
    torch's bf16 matmul); with no cfg at all ``default_config`` picks by the number of rows."""
    K = a.shape[-1]
    N = b.shape[0]
    if b.shape[-1] * 2 != K or K % 32 or act_block_size % 32:
        raise ValueError(f"fp4_gemm (tilelang): a has K={K}, b has K={b.shape[-1] * 2}, act block {act_block_size}")
    lead = a.shape[:-1]
    a2 = a.reshape(-1, K).contiguous()
    if not cfg:
        cfg = default_config(a2.shape[0])
    kernel = cfg.pop("kernel", "loop")
    if kernel == "bf16":                # exact bf16 operands (dequant_bf16), then torch's bf16 matmul (cuBLAS)
        if cfg:
            raise ValueError(f"fp4_gemm (tilelang): the bf16 path takes no kernel options, got {sorted(cfg)}")
        ab = dequant_bf16(a2, a_s.reshape(-1, K // act_block_size), "e4m3", kblock=act_block_size)
        c = torch.mm(ab, dequant_bf16(b, b_s, "e2m1").t())
        return c.reshape(*lead, N).to(out_dtype)
    if kernel != "loop":
        raise ValueError(f"fp4_gemm (tilelang): kernel must be 'loop' or 'bf16', got {kernel!r}")
    sa, bp, sb = operands(a_s, b, b_s, K, act_block_size)
    bk = cfg.pop("BK", _pick_bk(K))
    kern = fp4_gemm_kernel(N, K, BK=bk, **cfg)
    c = kern(a2, sa, bp, sb)
    return c.reshape(*lead, N).to(out_dtype)
