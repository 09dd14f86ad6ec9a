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
conversion and BN=192 294/279 (BM=192/384 threads 301/278, async promotion 245/266, BN=128 240/259); run 26
with the 128-byte-swizzled stage tiles (``swizzle128``, the default) 310/289. The promotion costs an FMUL and
an FFMA per element per slice (twice fp8's), so from ``BF16_MIN_M`` rows ``fp4_gemm`` takes the bf16 path
instead (exact dequantisation of both operands, then cuBLAS: 545/558 at 4096 rows).

``fp4_gemm_grouped`` (the routed experts): one launch of ``fp4_gemm_grouped_kernel`` over all experts' rows
from a tile table, the experts' weights read in place where ``moe.pack_experts`` laid a layer's experts out as
views of one buffer. Run 28, 384 experts x ~64 rows: 4.5-4.6 ms per projection against 45-46 ms for one
``fp4_gemm`` per expert.
"""
import functools

import torch
import tilelang.language as T

from functional_dsv41 import quant

from .. import reference

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


def _tile_loop_macro(N: int, K: int, BM: int, BN: int, BK: int, stages: int, async_promote: bool, swizzle: int):
    """The block-scaled main loop of one output tile (shared by the plain and the grouped fp4 GEMM)."""
    SB = BK // 32
    body = promote_loop(BM, BN, SB, async_promote, per_col=True)   # fp4: per-column scales

    # One output tile: rows [r0, r0 + BM) x columns [bx BN, bx BN + BN), from B rows n0 + bx BN on; r1 = None:
    # stored with T.copy (rows >= M masked), else rows >= r1 (the end of a group, fp4_gemm_grouped_kernel) and
    # columns >= N (another group's weight rows) are not stored.
    @T.macro
    def tile_loop(a_s, b_s, A, As, Bp, Bs, C, bx, r0, n0, r1):
        bp_s = T.alloc_shared([BN, BK // 2], U8)
        sa = T.alloc_shared([BM, SB], F32)
        sb = T.alloc_shared([BN, SB], F32)
        acc = T.alloc_fragment([BM, BN], F32)
        tmp = T.alloc_fragment([BM, BN], F32)
        tmp1 = T.alloc_fragment([BM, BN], F32) if async_promote else tmp
        c_s = T.alloc_shared([BM, BN], BF16)
        if swizzle:      # block rasterization (it remaps blockIdx: the grouped kernel reads its tile table by it)
            T.use_swizzle(swizzle)
        T.clear(acc)
        for k in T.Pipelined(K // BK, num_stages=stages):
            T.copy(A[r0, k * BK], a_s)
            T.copy(Bp[n0 + bx * BN, k * (BK // 2)], bp_s)
            T.copy(As[r0, k * SB], sa)
            T.copy(Bs[n0 + bx * BN, k * SB], sb)
            T.import_source(_CONV_X8_SRC)
            T.sync_threads()     # the previous tile's WGMMAs have read b_s (the extern write is opaque)
            for i, q in T.Parallel(BN, BK // 8):
                T.call_extern("handle", "dsv41_fp4x8_to_e4m3", T.address_of(bp_s[i, q * 4]),
                              T.address_of(b_s[i, q * 8]))
            T.fence_proxy_async()   # generic-proxy writes -> visible to the WGMMA (async proxy)
            T.sync_threads()     # all of b_s is written before either warpgroup's WGMMA reads it
            body(a_s, b_s, sa, sb, acc, tmp, tmp1, None)   # per_col: no sp fragment
        T.copy(acc, c_s)
        if r1 is None:
            T.copy(c_s, C[r0, bx * BN])
        else:
            for i, j in T.Parallel(BM, BN):
                if i < r1 - r0 and j < N - bx * BN:
                    C[r0 + i, bx * BN + j] = c_s[i, j]

    return tile_loop


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
    KB = K // 32
    assert K % BK == 0 and BK % 32 == 0 and BN % 32 == 0 and BM == 64 * (threads // 128)
    tile_loop = _tile_loop_macro(N, K, BM, BN, BK, stages, async_promote, swizzle)

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
                tile_loop(a_sw128, b_sw128, A, As, Bp, Bs, C, bx, by * BM, 0, None)
            else:
                a_s = T.alloc_shared([BM, BK], FP8)
                b_s = T.alloc_shared([BN, BK], FP8)
                tile_loop(a_s, b_s, A, As, Bp, Bs, C, bx, by * BM, 0, None)

    return compile_kernel(fp4_gemm, out_idx=[4])


# The grouped kernel's default tile (384 experts of ~64 rows, ms for w1/w3 and w2; run 28: 64 x 128 5.12 / 5.26,
# 64 x 64 6.47 / 6.68; run 29: 64 x 128 5.10 / 5.26, 128 x 128 4.51 / 4.63, 128 x 192 4.11 / 4.35): two consumer
# warpgroups and the plain kernel's 192-wide tile pay off even when half of a tile's rows belong to the next group.
GROUPED_BM, GROUPED_BN = 128, 192


@functools.lru_cache(maxsize=None)
def fp4_gemm_grouped_kernel(N: int, K: int, BM: int = GROUPED_BM, BN: int = GROUPED_BN, BK: int = 128,
                            stages: int = 3,
                            async_promote: bool = False, swizzle128: bool | None = None):
    """``fp4_gemm_kernel``'s tile over G groups of rows (the routed experts): A [S, K] holds the groups' rows
    one after another, B [G N, K/2] and its scales the G weights stacked, and ``tiles`` [NT, 3] int32 lists
    every (group g, first row r0, group end r1) tile of BM rows (r0 = group start + i BM): CTA (bx, t) computes
    rows [r0, min(r0 + BM, r1)) x columns [bx BN, bx BN + BN) against B rows g N + bx BN ... . A tile's loads
    may run past its group (into the next group's rows, or TMA's zero fill past S) and past N (into the next
    weight); those rows and columns are not stored. Each output element is computed exactly as
    ``fp4_gemm_kernel`` computes it with the same BM / BN (threads = 2 BM). No block rasterization: TileLang's remaps blockIdx
    after the kernel's first reads of it, which would pair one tile's rows with another tile's weight."""
    swizzle128 = BK == 128 if swizzle128 is None else swizzle128
    S, GN, NT = T.dynamic("S"), T.dynamic("GN"), T.dynamic("NT")
    KB, threads = K // 32, 2 * BM
    if K % BK or BK % 32 or BN % 32 or BM % 64:
        raise ValueError(f"fp4_gemm_grouped: K={K} must be a multiple of BK={BK} (of 32), BN={BN} of 32, "
                         f"BM={BM} of 64")
    tile_loop = _tile_loop_macro(N, K, BM, BN, BK, stages, async_promote, 0)

    @T.prim_func
    def fp4_gemm_grouped(
        A: T.Tensor([S, K], FP8),
        As: T.Tensor([S, KB], F32),
        Bp: T.Tensor([GN, K // 2], U8),
        Bs: T.Tensor([GN, KB], F32),
        tiles: T.Tensor([NT, 3], "int32"),
        C: T.Tensor([S, N], BF16),
    ):
        with T.Kernel(T.ceildiv(N, BN), NT, threads=threads) as (bx, by):
            if swizzle128:
                a_sw128 = T.alloc_shared([BM, BK], FP8)
                b_sw128 = T.alloc_shared([BN, BK], FP8)
                tile_loop(a_sw128, b_sw128, A, As, Bp, Bs, C, bx, tiles[by, 1], tiles[by, 0] * N, tiles[by, 2])
            else:
                a_s = T.alloc_shared([BM, BK], FP8)
                b_s = T.alloc_shared([BN, BK], FP8)
                tile_loop(a_s, b_s, A, As, Bp, Bs, C, bx, tiles[by, 1], tiles[by, 0] * N, tiles[by, 2])

    return compile_kernel(fp4_gemm_grouped, out_idx=[5])


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
    reference.check_fp4_gemm(a, a_s, b, b_s, act_block_size)  # the torch op's shape checks, the same errors
    if act_block_size % 32:
        raise ValueError(f"fp4_gemm (tilelang): act_block_size must be a multiple of 32, got {act_block_size}")
    K = a.shape[-1]
    N = b.shape[0]
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


def _stacked_view(ts) -> torch.Tensor | None:
    """[G, ...] WITHOUT a copy when the G tensors are equally spaced views of one storage (``moe.pack_experts``
    lays the experts of a layer out so), else None."""
    t0 = ts[0]
    if not isinstance(t0, torch.Tensor) or len(ts) < 2:
        return None
    step = ts[1].data_ptr() - t0.data_ptr()
    ptr = t0.untyped_storage().data_ptr()
    for i, t in enumerate(ts):
        if (t.shape != t0.shape or t.stride() != t0.stride() or t.dtype != t0.dtype or t.device != t0.device
                or t.untyped_storage().data_ptr() != ptr or t.data_ptr() - t0.data_ptr() != i * step):
            return None
    if step <= 0 or step % t0.element_size():
        return None
    return torch.as_strided(t0, (len(ts), *t0.shape), (step // t0.element_size(), *t0.stride()))


def _stacked(w, what: str, keep: list[int]) -> tuple[torch.Tensor, list[int]]:
    """(stack [G', ...], index in it of each kept group): an already stacked tensor or a zero-copy view of all
    G weights when they allow it (then every index stands), else a copy of the ``keep`` groups' weights only."""
    if isinstance(w, torch.Tensor):
        return w, keep
    view = _stacked_view(w)
    if view is not None:
        return view, keep
    shapes = {tuple(w[g].shape) for g in keep}
    if len(shapes) > 1:
        raise ValueError(f"fp4_gemm_grouped (tilelang): the {what} differ in shape: {sorted(shapes)}")
    return torch.stack([w[g] for g in keep]), list(range(len(keep)))


def fp4_gemm_grouped(a: torch.Tensor, a_s: torch.Tensor, b, b_s, counts, scale_dtype=quant.E8M0,
                     act_block_size: int = 32, out_dtype=torch.bfloat16, **cfg) -> torch.Tensor:
    """Same contract as ``reference.fp4_gemm_grouped``: one ``fp4_gemm_grouped_kernel`` launch for all groups.
    Weights given as a list are used in place when they are equally spaced views of one buffer
    (``moe.pack_experts``, which ``init_params`` and ``load_params`` apply), else the non-empty groups' weights
    are stacked first (a copy per call: run 28, 3.4-3.8 ms for 384 release experts). cfg goes to the kernel;
    without cfg, groups of ``BF16_MIN_M`` rows on average run one ``fp4_gemm`` each (its bf16 path) instead."""
    from functional_dsv41.kernels.reference import check_groups
    counts = check_groups(a, a_s, b, b_s, counts, "fp4_gemm_grouped (tilelang)")
    K = a.shape[-1]
    keep = [g for g, n in enumerate(counts) if n]
    S = a.shape[0]
    N = b[0].shape[0]
    if S == 0:
        return torch.empty(0, N, dtype=out_dtype, device=a.device)
    if not cfg and S >= BF16_MIN_M * len(keep):
        # large groups (e.g. 16 experts x 1536 rows): each group's bf16 path beats one grouped launch (run 28:
        # 16 experts 31.1 ms grouped at 64 x 128 against 26.4 per expert); the same contract, group by group
        outs, start = [], 0
        for g in keep:
            outs.append(fp4_gemm(a[start:start + counts[g]], a_s[start:start + counts[g]], b[g], b_s[g],
                                 scale_dtype, act_block_size, out_dtype))
            start += counts[g]
        return torch.cat(outs)
    bst, idx = _stacked(b, "weights", keep)
    bss, idx_s = _stacked(b_s, "scales", keep)
    if idx != idx_s:                        # one of the two was copied: copy the other the same way
        bst, idx = torch.stack([b[g] for g in keep]), list(range(len(keep)))
        bss = torch.stack([b_s[g] for g in keep])
    G = bst.shape[0]
    if bst.shape[-1] * 2 != K or K % 32 or act_block_size % 32 or tuple(bss.shape[:2]) != (G, N):
        raise ValueError(f"fp4_gemm_grouped (tilelang): a has K={K}, b {tuple(bst.shape)} (K/2 packed), "
                         f"b_s {tuple(bss.shape)}, act block {act_block_size}")
    BM = cfg.get("BM", GROUPED_BM)
    tiles, start = [], 0
    for g, i in zip(keep, idx):
        tiles += [(i, r, start + counts[g]) for r in range(start, start + counts[g], BM)]
        start += counts[g]
    tiles_t = torch.tensor(tiles, dtype=torch.int32).to(a.device, non_blocking=True)
    sa, bp, sb = operands(a_s, bst.reshape(G * N, K // 2), bss.reshape(G * N, -1), K, act_block_size)
    cfg.setdefault("BK", _pick_bk(K))
    kern = fp4_gemm_grouped_kernel(N, K, **cfg)
    return kern(a.contiguous(), sa, bp, sb, tiles_t).to(out_dtype)
