"""Sparse attention forward (SPEC §10.5) in TileLang for Hopper: ``fwd_kernel_sp``, the default for 64 heads.

Shapes, numerics, holes and the other forward kernels: ``sparse_attn_tl`` (whose ``_fwd`` picks this kernel with
``FWD_SP_CFG`` where ``sp_fits``). It puts the softmax and the P V product on different
warpgroups. A softmax warpgroup computes S = Q K^T for a whole 64-slot block (m64n64 over the full D) and
the softmax, and hands bf16 P to two PV warpgroups (one D half each) through a double buffer, so it works
on block j + 1 while they multiply block j; the PV warpgroups refill the two-stage KV ring themselves.
**479.6 TFLOP/s** at the release shape (H200 run 31; 468-479 in runs 32-34). What limits it: not shared-memory
bandwidth (run 32: Q held in registers, 56 KB a block less traffic, a third stage: no faster; Nsight Compute:
tensor pipe 50%, shared memory 53%, no eligible warp 68% of cycles) and hardly the gathers (no gathers: 492-495);
it is the softmax warpgroup's serial path: it waits for its QK (sharing the tensor core with the previous
block's PV), then softmaxes with the tensor core idle (no softmax: 511-532). Over T the time is 0.085 ms + 1.01
us a slot: 12% is per-query start and end, the steady state 529 TFLOP/s. Moving work off that path (the next
hole mask during the QK, the row sum after P's hand-over: 453-459) or an L2 prefetch of the next wave's Q
(473-480) did not help (runs 33-34). Next step: QK j+1 issued before softmax j, which needs two S accumulators and
a third KV stage, so Q out of shared memory; with two PV warpgroups of 160 registers the softmax warpgroup's
184 cannot also hold Q (128), so that needs another split of the work: e.g. two CTAs of a cluster each taking
half of D (half of Q and of each KV row, partial scores exchanged through distributed shared memory).
Not the per-query start and end either: a persistent version (one CTA per SM taking queries in turn, the next
query's index row, Q and first blocks loaded during the current one; commit ba4d2c0) timed the same on 132 CTAs
as on one query a CTA, 3-5% slower than this kernel (runs 36-39).
"""
import functools

import tilelang.language as T

from ._common import LOG2E, compile_kernel, softmax_macros
from .sparse_attn_tl import BF16, F32, I32, _ws_gather


def _sp_smem(H: int, D: int, TP: int, BI: int, NS: int) -> int:
    """fwd_kernel_sp's shared memory in bytes: Q, NS KV stages, the double-buffered P, the index row."""
    return (H + NS * BI) * D * 2 + 2 * H * BI * 2 + TP * 4


@functools.lru_cache(maxsize=None)
def fwd_kernel_sp(H: int, D: int, TP: int, scale: float, BI: int = 64, stages: int = 2, pv_split: int = 1,
                  gather: str = "rows", diag: str = ""):
    """o, lse = fwd(q, kv, sink, idx) with the softmax and the P V product on different warpgroups (384
    threads); H == 64, TP a multiple of BI.

    Roles. Warpgroup 2, the softmax warpgroup: loads Q and the query's index row into shared memory, then
    for each block j: S = Q K_j^T over the full D (one m64nBI WGMMA, seeded with -inf at holes), the
    running max, alpha = exp2(c (m_old - m_new)), the fp32 probabilities and their row sum; it hands the
    bf16 P and alpha to the PV warpgroups through a double buffer (mbarriers ``p_full`` / ``p_empty``), so
    it computes block j + 1's QK and softmax while they multiply block j. Warpgroups 0 and 1 each own half
    of D: acc_o = alpha acc_o + P V_j[:, half]; then each refills the stage with block j + stages (cp.async;
    ``full`` tells the softmax warpgroup), so the KV ring needs no producer warps. ``gather`` "rows" (run 31:
    479.6 TFLOP/s): half of the rows each, after both are done with the stage (mbarrier ``empty``); "cols"
    (468.0): each copies the D half it reads itself, so it need not wait for the other. At the end the
    softmax warpgroup adds the sink to the sum and passes it on (``bar_fin``); the PV warpgroups normalise
    and store O through Q's buffer (free by then), the softmax warpgroup stores the LSE.

    Why no producer warpgroup: with a fourth warpgroup ptxas caps every thread at 128 registers
    (65536 / 512), below a PV warpgroup's 128 fp32 accumulators plus addresses (it spills 2.2 KB, and
    one m64n256 WGMMA needs 154); 384 threads leave 168.

    ``diag`` (benchmark ablations only, wrong outputs): "compute" = no gathers after the first ``stages``
    blocks (stale rows); "nosoftmax" = P = S (no max, exponentials or sums).

    Numerics: the recurrence of ``fwd_kernel`` with block BI (the release's for BI = 64: the running max
    moves once per block, P rounded to bf16 against it, the sum over the fp32 probabilities); not bitwise
    the lock-step kernel's (fp32 summation order: max abs 2e-3 on the release inputs, as ``fwd_kernel_ws``).
    Shared memory: Q 64 KB + stages * BI * D * 2 + 2 * H * BI * 2 + TP * 4 bytes.
    """
    B, M, N = T.dynamic("B"), T.dynamic("M"), T.dynamic("N")
    if H != 64 or D % 128 or D > 512:
        raise ValueError("fwd_kernel_sp: H must be 64, D a multiple of 128 up to 512")
    NS = stages
    if TP % BI or BI % 32 or NS < 2 or TP < NS * BI:
        raise ValueError("fwd_kernel_sp: TP a multiple of BI (at least stages * BI), BI a multiple of 32, stages >= 2")
    if _sp_smem(H, D, TP, BI, NS) > 227 * 1024 - 2048:
        raise ValueError("fwd_kernel_sp: shared memory over 227 KB")
    DH = D // 2
    if diag not in ("", "compute", "nosoftmax"):
        raise ValueError(f"fwd_kernel_sp: diag {diag!r}")
    if gather not in ("cols", "rows"):
        raise ValueError(f"fwd_kernel_sp: gather {gather!r}")
    if pv_split not in (1, 2) or (DH // pv_split) % 8:
        raise ValueError("fwd_kernel_sp: pv_split 1 or 2, D / 2 / pv_split a multiple of 8")
    NI = TP // BI
    PN = DH // pv_split
    c = float(scale) * LOG2E
    _, probs = softmax_macros(H, BI, c)
    CPR = D // 64                       # 16-byte chunks a thread copies per row (8 threads a row)
    HB = BI // 2                        # rows of a block each PV warpgroup gathers
    load_q = _ws_gather(H, BI, CPR)[0]

    @T.macro
    def gather_half(t, w, j, kv_s, KV, src_of, bi):
        """PV warpgroup w's half of block j into stage j % NS (thread t of 128, 8 threads a row): the columns
        [w D/2, (w+1) D/2) of all BI rows ("cols") or all columns of rows w HB + [0, HB) ("rows")."""
        if gather == "cols":
            for r in T.unroll(BI // 16):
                row = r * 16 + t // 8
                src = src_of(j * BI + row)      # a hole (-1): zero-filled by the bounds check, not read
                for u in T.unroll(CPR // 2):
                    col = w * DH + u * 64 + (t % 8) * 8
                    T.ptx_cp_async(T.access_ptr(kv_s[j % NS, row, col], "w", 8),
                                   T.access_ptr(KV[bi, src, col], "r", 8), 8)
        else:
            for r in T.unroll(HB // 16):
                row = w * HB + r * 16 + t // 8
                src = src_of(j * BI + row)      # a hole (-1): zero-filled by the bounds check, not read
                for u in T.unroll(CPR):
                    T.ptx_cp_async(T.access_ptr(kv_s[j % NS, row, u * 64 + (t % 8) * 8], "w", 8),
                                   T.access_ptr(KV[bi, src, u * 64 + (t % 8) * 8], "r", 8), 8)

    @T.macro
    def softmax_wg(t, acc_s, m, mp, l, ls, a, q_s, idx_s, kv_s, p_s, al_s, l_s, full, p_full, p_empty, bar_q,
                   bar_fin, Q, Idx, Sink, Lse, bi, mi):
        for r in T.serial((TP // 4 + 127) // 128):   # the index row, 4 slots a copy
            if r * 128 + t < TP // 4:
                T.ptx_cp_async(T.access_ptr(idx_s[(r * 128 + t) * 4], "w", 4),
                               T.access_ptr(Idx[bi, mi, (r * 128 + t) * 4], "r", 4), 4)
        load_q(t, q_s, Q, bi, mi, bar_q)        # its arrive on bar_q also covers the index row's copies
        T.fill(l, 0)
        T.fill(m, -1e30)
        if diag == "nosoftmax":
            T.fill(a, 1)
        T.barrier_wait(bar_q, 0)
        for j in T.serial(NI):
            for h, tt in T.Parallel(H, BI):
                acc_s[h, tt] = T.if_then_else(idx_s[j * BI + tt] >= 0, 0, -T.infinity(F32))
            T.barrier_wait(full[j % NS], (j // NS) % 2)
            T.wgmma_gemm(q_s, kv_s[j % NS, :, :], acc_s, transpose_B=True)
            T.wait_wgmma(0)
            if diag != "nosoftmax":
                T.copy(m, mp)
                T.reduce_max(acc_s, m, dim=1, clear=False)
                probs(acc_s, mp, m, a, ls, l)
            T.barrier_wait(p_empty[j % 2], ((j // 2) % 2) ^ 1)
            T.copy(acc_s, p_s[j % 2, :, :])
            T.copy(a, al_s[j % 2, :])
            T.fence_proxy_async()               # P: generic stores, read next by WGMMA (async proxy)
            T.barrier_arrive(p_full[j % 2])
        for h in T.Parallel(H):
            l[h] = l[h] + T.exp2(Sink[h] * LOG2E - m[h] * c)
        T.copy(l, l_s)
        T.barrier_arrive(bar_fin)               # also: this warpgroup's last QK is done, q_s is free
        for h in T.Parallel(H):
            ls[h] = T.log2(l[h]) + m[h] * c
        T.copy(ls, Lse[bi, mi, :])

    @T.macro
    def pv_step(w, k, acc, a, kv_s, p_s, j):
        for h, d in T.Parallel(H, PN):
            acc[h, d] *= a[h]
        T.wgmma_gemm(p_s[j % 2, :, :], kv_s[j % NS, :, w * DH + k * PN:w * DH + (k + 1) * PN], acc)

    @T.macro
    def pv_out(w, k, acc, a, q_s):
        for h, d in T.Parallel(H, PN):
            acc[h, d] /= a[h]
        T.copy(acc, q_s[:, w * DH + k * PN:w * DH + (k + 1) * PN])

    @T.macro
    def pv_wg(w, t, acc0, acc1, a, q_s, idx_s, kv_s, p_s, al_s, l_s, full, empty, p_full, p_empty, bar_q, bar_fin,
              KV, Idx, O, bi, mi):
        """acc0 (, acc1 when pv_split == 2): this warpgroup's [H, PN] fp32 accumulators, columns w DH + k PN + [0, PN)."""
        for j in T.unroll(NS):                  # the first NS blocks, indices from global memory
            gather_half(t, w, j, kv_s, KV, lambda i: Idx[bi, mi, i], bi)
            T.cp_async_barrier_noinc(full[j])
        T.fill(acc0, 0)
        if pv_split == 2:
            T.fill(acc1, 0)
        T.barrier_wait(bar_q, 0)                # the index row is in idx_s
        for j in T.serial(NI):
            T.barrier_wait(p_full[j % 2], (j // 2) % 2)
            for h in T.Parallel(H):
                a[h] = al_s[j % 2, h]
            pv_step(w, 0, acc0, a, kv_s, p_s, j)
            if pv_split == 2:
                pv_step(w, 1, acc1, a, kv_s, p_s, j)
            T.wait_wgmma(0)
            T.barrier_arrive(p_empty[j % 2])
            if j + NS < NI:                     # refill stage j % NS (QK j is done: P j came after it)
                if gather == "rows":            # the rows the other PV warpgroup may still be reading
                    T.barrier_arrive(empty[j % NS])
                    T.barrier_wait(empty[j % NS], (j // NS) % 2)
                if diag == "compute":
                    T.barrier_arrive(full[j % NS])
                else:
                    gather_half(t, w, j + NS, kv_s, KV, lambda i: idx_s[i], bi)
                    T.cp_async_barrier_noinc(full[j % NS])
        T.barrier_wait(bar_fin, 0)
        for h in T.Parallel(H):
            a[h] = l_s[h]
        pv_out(w, 0, acc0, a, q_s)
        if pv_split == 2:
            pv_out(w, 1, acc1, a, q_s)
        T.copy(q_s[:, w * DH:(w + 1) * DH], O[bi, mi, :, w * DH:(w + 1) * DH])

    @T.prim_func
    def sparse_attn_fwd_sp(
        Q: T.Tensor([B, M, H, D], BF16),
        KV: T.Tensor([B, N, D], BF16),
        Sink: T.Tensor([H], F32),
        Idx: T.Tensor([B, M, TP], I32),
        O: T.Tensor([B, M, H, D], BF16),
        Lse: T.Tensor([B, M, H], F32),
    ):
        with T.Kernel(M, B, threads=384) as (mi, bi):
            q_s = T.alloc_shared([H, D], BF16)
            kv_s = T.alloc_shared([NS, BI, D], BF16)
            p_s = T.alloc_shared([2, H, BI], BF16)
            idx_s = T.alloc_shared([TP], I32)
            al_s = T.alloc_shared([2, H], F32)
            l_s = T.alloc_shared([H], F32)

            acc00 = T.alloc_fragment([H, PN], F32)
            acc01 = T.alloc_fragment([H, PN], F32)
            a0 = T.alloc_fragment([H], F32)
            acc10 = T.alloc_fragment([H, PN], F32)
            acc11 = T.alloc_fragment([H, PN], F32)
            a1 = T.alloc_fragment([H], F32)
            acc_s = T.alloc_fragment([H, BI], F32)
            m = T.alloc_fragment([H], F32)
            mp = T.alloc_fragment([H], F32)
            l = T.alloc_fragment([H], F32)
            ls = T.alloc_fragment([H], F32)
            a2 = T.alloc_fragment([H], F32)

            bar_q = T.alloc_barrier(arrive_count=128)
            full = T.alloc_barrier(arrive_count=[256] * NS)
            empty = T.alloc_barrier(arrive_count=[256] * NS)
            p_full = T.alloc_barrier(arrive_count=[128, 128])
            p_empty = T.alloc_barrier(arrive_count=[256, 256])
            bar_fin = T.alloc_barrier(arrive_count=128)

            tx = T.get_thread_binding()
            if tx < 128:
                pv_wg(0, tx, acc00, acc01, a0, q_s, idx_s, kv_s, p_s, al_s, l_s, full, empty, p_full, p_empty, bar_q,
                      bar_fin, KV, Idx, O, bi, mi)
            elif tx < 256:
                pv_wg(1, tx - 128, acc10, acc11, a1, q_s, idx_s, kv_s, p_s, al_s, l_s, full, empty, p_full, p_empty,
                      bar_q, bar_fin, KV, Idx, O, bi, mi)
            else:
                softmax_wg(tx - 256, acc_s, m, mp, l, ls, a2, q_s, idx_s, kv_s, p_s, al_s, l_s, full, p_full, p_empty,
                           bar_q, bar_fin, Q, Idx, Sink, Lse, bi, mi)

    return compile_kernel(sparse_attn_fwd_sp, out_idx=[4, 5])


# impl="sp": fwd_kernel_sp (softmax and PV on different warpgroups) with this configuration where sp_fits.
# Run 31 (release shape, holes zero-filled): gather "rows" 479.6 TFLOP/s, "cols" 468.0; BI = 32 with 3-4 stages
# and pv_split 2 were slower or equal in run 30/31 (326-333 and 399 vs 396, before the hole fix).
FWD_SP_CFG = dict(BI=64, stages=2, pv_split=1, gather="rows")


def sp_fits(H: int, D: int, TP: int) -> bool:
    """fwd_kernel_sp's shapes: 64 heads, D a multiple of 128 up to 512, and (Q, two stages, P, the index
    row of TP slots) within the shared memory."""
    BI, NS = FWD_SP_CFG["BI"], FWD_SP_CFG["stages"]
    return (H == 64 and D % 128 == 0 and D <= 512 and TP >= NS * BI
            and _sp_smem(H, D, TP, BI, NS) <= 227 * 1024 - 2048)
