"""Sparse attention over index lists (SPEC §10.5) in TileLang for Hopper: forward and backward.

Shapes: q [B, M, H, D] bf16, kv [B, N, D] bf16 (one shared head, K = V), attn_sink [H] fp32,
topk_idxs [B, M, T] int32 with -1 holes. One CTA per (query, block of <= 64 heads): the 64 heads are
the GEMM's M dimension, the gathered index block its N (QK) or K (PV) dimension.

Forward, exactly the release's recurrence: running max from -1e30, fp32 sum of the fp32
probabilities, probabilities cast to bf16 before P @ V, sink exp(sink - m) added to the denominator
only. Exponentials are exp2 of log2e-scaled logits (same function, different rounding of the last
bit). It also returns LSE = log2(l) + m in log2 units of the scaled logits, sink included, so
P[h, t] = exp2(c * q_h.kv_t - LSE_h) with c = scale * log2(e).

Forward kernels (``_fwd`` picks, see FWD_DEFAULT):

- ``fwd_kernel_pp`` (the default for 64 heads, block 64, index slots a multiple of 128; ``sparse_attn_pp_tl``):
  FlashMLA's ping-pong of two consumer warpgroups with a gathering producer, the release's numerics; 448-495
  TFLOP/s at the release shape, +3.1% over sp on average in the same process (runs 48-56), and as a persistent
  grid of one CTA per SM (FWD_PP_PERSISTENT, where there are more queries than SMs) 490-528 (runs 70-72); what
  limits it, in that file.
- ``fwd_kernel_cl`` (``impl="cl"``, opt-in; ``sparse_attn_cl_tl``): 2-CTA clusters splitting D, so each consumer
  warpgroup owns its own query and partial scores cross the cluster by ``st.async``; correct, but 371-382 TFLOP/s
  at the release shape against pp's 474-513 in the same processes (runs 77-79): the exchange sits on every block's
  chain. Why, in that file.
- ``fwd_kernel_sp`` (``sparse_attn_sp_tl``; the default before run 48): the softmax and the P V product on
  different warpgroups, 479.6 TFLOP/s at the release shape (run 31); what limits it, in that file.
- ``fwd_kernel_ws``, warp-specialised: a producer warpgroup gathers KV blocks into a ring of shared stages
  and two consumer warpgroups split each pair of blocks' QK and the output's D halves (365 TFLOP/s, run 10;
  the fallback for block 128 and shapes sp does not take). Its two consumers meet in lock-step at every pair
  and each consumer's QK is an m64n32 WGMMA (smem-bound): over T its steady state tends to 489 TFLOP/s
  (run 30). A persistent version (one CTA per SM, the ring running on across queries) measured 330-364,
  no better, and was removed.
- ``fwd_kernel``, one CTA per query whose two warpgroups gather, multiply and normalise in lock-step (any
  H multiple of 16; the fallback for H != 64, 290 / 311 TFLOP/s, block 64 / 128, run 10).

Holes (-1) in the cp.async gathers (sp, ws) are zero-filled without a read: gathering row 0 for each hole
made that row an L2 hot spot (10% of the release prefill's slots): fixing it took sp from 400 to 480.
(A D-split variant, ``fwd_kernel_ws2``, was removed after run 10: its default did not fit the H200's shared
memory and its variants ran 194-315 TFLOP/s.)

Third (``impl="seesaw"``, not the default): ``sparse_attn_seesaw_tl.fwd_kernel_seesaw``, FlashMLA's
"seesaw" schedule (164-278 TFLOP/s, run 17; why, in that file).

Backward (the release ships none): ``sparse_attn_bwd_tl`` (the split dq / dkv kernels, the default, and the
single "atomic" kernel), picked by ``_bwd``.

Registered as torch.library custom ops ``dsv41::sparse_attn_fwd`` / ``dsv41::sparse_attn_bwd`` (opaque to
torch.compile, with fake kernels), tied by an ``autograd.Function`` with ``setup_context`` so that both
``torch.autograd`` and ``torch.func.grad`` differentiate it (torch 2.11's ``register_autograd`` wrapper
is refused by functorch transforms).
"""


import functools

import torch
import tilelang.language as T

from .. import reference
from ._common import LOG2E, Unsupported, check_nreg, compile_kernel, plain as _plain, softmax_macros

BF16, F32, I32 = "bfloat16", "float32", "int32"


def _head_block(H: int) -> int:
    bh = min(H, 64)
    if H % bh or bh % 16:
        raise ValueError(f"sparse_attn (tilelang): heads {H} must be a multiple of 16 (<= 64) or of 64")
    return bh


def _gather_masked(BH: int, BI: int, D: int):
    """The lock-step kernels' step over index block ``it`` (forward, atomic backward, dq kernel): ``valid[t]``
    = slot t is not a hole, ``kv_s`` = the block's BI KV rows (row max(idx, 0): a hole gathers row 0), and the
    score accumulator ``acc`` [BH, BI] starts at 0 for a real slot and -inf for a hole (the QK GEMM adds to it)."""

    @T.macro
    def gather(KV, Idx, bi, mi, it, kv_s, valid, acc):
        for t in T.Parallel(BI):
            valid[t] = Idx[bi, mi, it * BI + t] >= 0
        for t, d in T.Parallel(BI, D):
            kv_s[t, d] = KV[bi, T.max(Idx[bi, mi, it * BI + t], 0), d]
        for h, t in T.Parallel(BH, BI):
            acc[h, t] = T.if_then_else(valid[t], 0, -T.infinity(F32))

    return gather


@functools.lru_cache(maxsize=None)
def fwd_kernel(H: int, D: int, TP: int, scale: float, BI: int = 64, stages: int = 2, threads: int = 256):
    """o, lse = fwd(q, kv, sink, idx); TP (index slots) a multiple of BI."""
    B, M, N = T.dynamic("B"), T.dynamic("M"), T.dynamic("N")
    BH = _head_block(H)
    NI = TP // BI
    c = float(scale) * LOG2E
    gather = _gather_masked(BH, BI, D)
    _, probs = softmax_macros(BH, BI, c)

    @T.prim_func
    def sparse_attn_fwd(
        Q: T.Tensor([B, M, H, D], BF16),
        KV: T.Tensor([B, N, D], BF16),
        Sink: T.Tensor([H], F32),
        Idx: T.Tensor([B, M, TP], I32),
        O: T.Tensor([B, M, H, D], BF16),
        Lse: T.Tensor([B, M, H], F32),
    ):
        with T.Kernel(M, H // BH, B, threads=threads) as (mi, hb, bi):
            q_s = T.alloc_shared([BH, D], BF16)
            kv_s = T.alloc_shared([BI, D], BF16)
            p_s = T.alloc_shared([BH, BI], BF16)
            valid = T.alloc_fragment([BI], "bool")
            acc_s = T.alloc_fragment([BH, BI], F32)
            acc_o = T.alloc_fragment([BH, D], F32)
            m = T.alloc_fragment([BH], F32)
            m_prev = T.alloc_fragment([BH], F32)
            l = T.alloc_fragment([BH], F32)
            l_blk = T.alloc_fragment([BH], F32)
            alpha = T.alloc_fragment([BH], F32)

            h0 = hb * BH
            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(m, -1e30)
            T.copy(Q[bi, mi, h0:h0 + BH, :], q_s)

            for it in T.Pipelined(NI, num_stages=stages):
                gather(KV, Idx, bi, mi, it, kv_s, valid, acc_s)
                T.gemm(q_s, kv_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(m, m_prev)
                T.reduce_max(acc_s, m, dim=1, clear=False)
                probs(acc_s, m_prev, m, alpha, l_blk, l)
                for h, d in T.Parallel(BH, D):
                    acc_o[h, d] *= alpha[h]
                # TileLang 0.1.15 places the cross-warp reductions' workspace on p_s (their live ranges do
                # not overlap) but ends the reduction without a barrier: a warp that reaches this store
                # while another still reads the last partial sums corrupts l (run 19: 7e-3 cosine diff
                # at 16 heads, data-dependent). The barrier orders the reads before the store.
                T.sync_threads()
                T.copy(acc_s, p_s)
                T.gemm(p_s, kv_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            for h in T.Parallel(BH):
                l[h] = l[h] + T.exp2(Sink[h0 + h] * LOG2E - m[h] * c)
            for h, d in T.Parallel(BH, D):
                acc_o[h, d] /= l[h]
            for h in T.Parallel(BH):
                l_blk[h] = T.log2(l[h]) + m[h] * c
            T.copy(acc_o, q_s)
            T.copy(q_s, O[bi, mi, h0:h0 + BH, :])
            T.copy(l_blk, Lse[bi, mi, h0:h0 + BH])

    return compile_kernel(sparse_attn_fwd, out_idx=[4, 5], workspace_alias_ok=True)   # barrier above


def _ws_gather(H: int, BI: int, CPR: int):
    """The warp-specialised forwards' producer steps (thread tp of its 128; 8 threads a row, CPR 16-byte
    chunks each): ``load_q`` copies Q [H, D] into q_s and arrives on bar_q; ``gather_kv`` copies block j's BI
    KV rows into stage s (the caller arrives). A hole (-1) fails the copy's bounds check, so its row is zero-filled
    without a read: gathering row 0 for every hole made that row an L2 hot spot (10% of the release prefill's
    slots; run 31: +9% for the split-softmax forward)."""

    @T.macro
    def load_q(tp, q_s, Q, bi, mi, bar_q):
        for r in T.unroll(H // 16):              # Q: 8 threads a row, 16 rows a pass
            for u in T.unroll(CPR):
                T.ptx_cp_async(
                    T.access_ptr(q_s[r * 16 + tp // 8, u * 64 + (tp % 8) * 8], "w", 8),
                    T.access_ptr(Q[bi, mi, r * 16 + tp // 8, u * 64 + (tp % 8) * 8], "r", 8), 8)
        T.cp_async_barrier_noinc(bar_q)

    @T.macro
    def gather_kv(tp, j, s, kv_s, KV, Idx, bi, mi):
        for r in T.unroll(BI // 16):
            row = r * 16 + tp // 8
            src = Idx[bi, mi, j * BI + row]      # a hole (-1) fails the copy's bounds check: zero-filled, not read
            for u in T.unroll(CPR):
                T.ptx_cp_async(
                    T.access_ptr(kv_s[s, row, u * 64 + (tp % 8) * 8], "w", 8),
                    T.access_ptr(KV[bi, src, u * 64 + (tp % 8) * 8], "r", 8), 8)
    return load_q, gather_kv


def _ws_epilogue(H: int, DH: int, c: float):
    """The warp-specialised forwards' last step, per consumer w (after both consumers' row sums l are in
    sum_s and every WGMMA on q_s is done): add the peer's sum and the sink exp2(sink log2e - c m) to l,
    normalise this consumer's D half of O, store it through q_s (free by then), and (w == 0) the LSE."""

    @T.macro
    def epilogue(w, l, m, ls, acc_o, sum_s, q_s, Sink, O, Lse, bi, mi):
        for h in T.Parallel(H):
            l[h] = l[h] + sum_s[1 - w, h] + T.exp2(Sink[h] * LOG2E - m[h] * c)
        for h, d in T.Parallel(H, DH):
            acc_o[h, d] /= l[h]
        T.copy(acc_o, q_s[:, w * DH:(w + 1) * DH])
        T.copy(q_s[:, w * DH:(w + 1) * DH], O[bi, mi, :, w * DH:(w + 1) * DH])
        if w == 0:
            for h in T.Parallel(H):
                ls[h] = T.log2(l[h]) + m[h] * c
            T.copy(ls, Lse[bi, mi, :])
    return epilogue


@functools.lru_cache(maxsize=None)
def fwd_kernel_ws(H: int, D: int, TP: int, scale: float, BI: int = 32, stages: int = 4, early_qk: bool = True,
                  nreg: tuple = (232, 40), diag: str = ""):
    """o, lse = fwd(q, kv, sink, idx), warp-specialised (384 threads); H == 64, TP a multiple of 2 * BI.

    Roles. Warpgroup 2, the producer (``nreg[1]`` registers), loads Q once and then gathers the KV rows
    of index block j into shared stage j % stages (cp.async, 16 bytes a thread, completion signalled
    on mbarrier ``full``); it refills a stage once both consumers have released it (``empty``).
    Consumer warpgroups 0 and 1 (``nreg[0]`` registers each) take the index blocks in pairs: consumer
    w computes S = Q K^T for block 2i + w (full D, its own [64, BI] fp32 tile) and owns output columns
    [w D/2, (w+1) D/2) (a [64, D/2] fp32 accumulator). Per pair the two exchange their row maxima
    through shared memory, so both hold the same running max over the pair, write their bf16
    probabilities to shared memory and both multiply P_0 V_0 + P_1 V_1 for their half of D: the
    tensor work is balanced (one QK and two half-width PVs per consumer and pair).

    Numerics: the recurrence of ``reference.sparse_attn(block=2 * BI)`` (the running max moves once
    per pair of blocks; P rounded to bf16 against it); each consumer keeps the probability sum of its
    own blocks under the same max and rescales, the two are added (with the sink) at the end.
    LSE as ``fwd_kernel``. Holes (-1) gather row 0 (finite data, probability exactly 0).

    Pipelining: with ``stages >= 4`` the next pair's blocks have their own stages, so the producer
    gathers pair i+1 while pair i computes and (``early_qk``) each consumer issues the next QK right
    behind its two PVs, keeping the tensor cores fed across the loop edge. Shared memory: Q 64 KB +
    stages * BI * D * 2 bytes (<= 227 KB).

    ``diag`` (benchmark ablations only, wrong outputs; run 30): "compute" = the producer gathers the first
    ``stages`` blocks and then only re-signals the stages (compute on stale rows: the tensor and softmax
    time); "nosoftmax" = no row maxima, exchange or exponentials (P = S cast to bf16): the GEMMs, gathers
    and P handoff alone.
    """
    B, M, N = T.dynamic("B"), T.dynamic("M"), T.dynamic("N")
    if diag not in ("", "compute", "nosoftmax"):
        raise ValueError(f"fwd_kernel_ws: diag {diag!r}")
    if H != 64:
        raise ValueError("fwd_kernel_ws: H must be 64 (one warpgroup's WGMMA M)")
    if D % 128 or D > 512:
        raise ValueError("fwd_kernel_ws: D must be a multiple of 128, <= 512")
    if TP % (2 * BI) or stages < 2 or BI % 16:
        raise ValueError("fwd_kernel_ws: TP a multiple of 2*BI, stages >= 2, BI a multiple of 16")
    if (H + stages * BI) * D * 2 + 2 * H * BI * 2 > 227 * 1024 - 2048:
        raise ValueError("fwd_kernel_ws: shared memory over 227 KB")
    check_nreg("fwd_kernel_ws", nreg)
    NI = TP // BI
    NP = NI // 2
    NS = stages
    early = bool(early_qk) and NS >= 4 and NP > 1      # the next pair must live in other stages
    DH = D // 2
    c = float(scale) * LOG2E
    epilogue = _ws_epilogue(H, DH, c)
    _, probs = softmax_macros(H, BI, c)
    CPR = D // 64                       # 16-byte chunks a producer thread copies per row (8 threads a row)
    load_q, gather_kv = _ws_gather(H, BI, CPR)

    @T.macro
    def hole_bias(j, bias, Idx, bi, mi):
        """bias[h, t] = 0 for a valid slot of block j, -inf for a hole (the QK accumulator's seed)."""
        for h, t in T.Parallel(H, BI):
            bias[h, t] = T.if_then_else(Idx[bi, mi, j * BI + t] >= 0, 0, -T.infinity(F32))

    @T.macro
    def issue_qk(j, acc_s, bias, q_s, kv_s, full):
        """S = bias + Q K_j^T into acc_s; asynchronous (T.wait_wgmma)."""
        T.copy(bias, acc_s)
        T.barrier_wait(full[j % NS], (j // NS) % 2)
        T.wgmma_gemm(q_s, kv_s[j % NS, :, :], acc_s, transpose_B=True)

    @T.macro
    def pair(i, w, last, acc_s, bias, acc_o, m, mp, l, ls, a, q_s, kv_s, p_s, mx_s, full, empty, bar_mx,
             bar_p, Idx, bi, mi):
        """Pair i for consumer w (with early_qk, S of block 2i + w is already in flight in acc_s)."""
        j = 2 * i + w                       # my block
        jp = 2 * i + 1 - w                  # the peer's block
        if not early:
            hole_bias(j, bias, Idx, bi, mi)
            issue_qk(j, acc_s, bias, q_s, kv_s, full)
        T.wait_wgmma(0)
        if early and not last:
            hole_bias(j + 2, bias, Idx, bi, mi)     # index loads in flight during the softmax
        if diag != "nosoftmax":
            T.copy(m, mp)
            T.reduce_max(acc_s, m, dim=1, clear=False)
            T.copy(m, mx_s[w, :])
            T.barrier_arrive(bar_mx[w])
            T.barrier_wait(bar_mx[1 - w], i % 2)
            for h in T.Parallel(H):
                m[h] = T.max(m[h], mx_s[1 - w, h])
            probs(acc_s, mp, m, a, ls, l)
            for h, d in T.Parallel(H, DH):
                acc_o[h, d] *= a[h]
        T.copy(acc_s, p_s[w, :, :])
        T.fence_proxy_async()               # P: generic stores, read next by WGMMA (async proxy)
        T.barrier_arrive(bar_p[w])
        T.wgmma_gemm(p_s[w, :, :], kv_s[j % NS, :, w * DH:(w + 1) * DH], acc_o)
        T.barrier_wait(bar_p[1 - w], i % 2)
        T.barrier_wait(full[jp % NS], (jp // NS) % 2)
        T.wgmma_gemm(p_s[1 - w, :, :], kv_s[jp % NS, :, w * DH:(w + 1) * DH], acc_o)
        if early and not last:
            issue_qk(j + 2, acc_s, bias, q_s, kv_s, full)
            T.wait_wgmma(1)                 # both PVs done, the next QK may still run
        else:
            T.wait_wgmma(0)
        T.barrier_arrive(empty[j % NS])
        T.barrier_arrive(empty[jp % NS])

    @T.macro
    def consumer(w, acc_s, bias, acc_o, m, mp, l, ls, a, q_s, kv_s, p_s, mx_s, sum_s, bar_q, full, empty,
                 bar_mx, bar_p, Idx, Sink, O, Lse, bi, mi):
        """Consumer warpgroup w: blocks 2i + w, output columns [w DH, (w + 1) DH)."""
        T.fill(acc_o, 0)
        T.fill(l, 0)
        T.fill(m, -1e30)
        T.barrier_wait(bar_q, 0)
        if early:
            hole_bias(w, bias, Idx, bi, mi)
            issue_qk(w, acc_s, bias, q_s, kv_s, full)
            for i in T.serial(NP - 1):
                pair(i, w, False, acc_s, bias, acc_o, m, mp, l, ls, a, q_s, kv_s, p_s, mx_s, full, empty, bar_mx,
                     bar_p, Idx, bi, mi)
            pair(NP - 1, w, True, acc_s, bias, acc_o, m, mp, l, ls, a, q_s, kv_s, p_s, mx_s, full, empty, bar_mx,
                 bar_p, Idx, bi, mi)
        else:
            for i in T.serial(NP):
                pair(i, w, True, acc_s, bias, acc_o, m, mp, l, ls, a, q_s, kv_s, p_s, mx_s, full, empty, bar_mx,
                     bar_p, Idx, bi, mi)
        # the two probability sums (same max, same rescales) plus the sink; this exchange also
        # tells each consumer that the other is past its last WGMMA on q_s
        T.copy(l, sum_s[w, :])
        T.barrier_arrive(bar_mx[w])
        T.barrier_wait(bar_mx[1 - w], 0 if diag == "nosoftmax" else NP % 2)
        epilogue(w, l, m, ls, acc_o, sum_s, q_s, Sink, O, Lse, bi, mi)

    @T.prim_func
    def sparse_attn_fwd_ws(
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
            mx_s = T.alloc_shared([2, H], F32)
            sum_s = T.alloc_shared([2, H], F32)

            acc_s0 = T.alloc_fragment([H, BI], F32)
            bias0 = T.alloc_fragment([H, BI], F32)
            acc_o0 = T.alloc_fragment([H, DH], F32)
            m0 = T.alloc_fragment([H], F32)
            mp0 = T.alloc_fragment([H], F32)
            l0 = T.alloc_fragment([H], F32)
            ls0 = T.alloc_fragment([H], F32)
            a0 = T.alloc_fragment([H], F32)
            acc_s1 = T.alloc_fragment([H, BI], F32)
            bias1 = T.alloc_fragment([H, BI], F32)
            acc_o1 = T.alloc_fragment([H, DH], F32)
            m1 = T.alloc_fragment([H], F32)
            mp1 = T.alloc_fragment([H], F32)
            l1 = T.alloc_fragment([H], F32)
            ls1 = T.alloc_fragment([H], F32)
            a1 = T.alloc_fragment([H], F32)

            bar_q = T.alloc_barrier(arrive_count=128)
            full = T.alloc_barrier(arrive_count=[128] * NS)
            empty = T.alloc_barrier(arrive_count=[256] * NS)
            bar_mx = T.alloc_barrier(arrive_count=[128, 128])
            bar_p = T.alloc_barrier(arrive_count=[128, 128])

            tx = T.get_thread_binding()
            if tx < 128:
                T.set_max_nreg(nreg[0], 1)
                consumer(0, acc_s0, bias0, acc_o0, m0, mp0, l0, ls0, a0, q_s, kv_s, p_s, mx_s, sum_s, bar_q, full, empty,
                         bar_mx, bar_p, Idx, Sink, O, Lse, bi, mi)
            elif tx < 256:
                T.set_max_nreg(nreg[0], 1)
                consumer(1, acc_s1, bias1, acc_o1, m1, mp1, l1, ls1, a1, q_s, kv_s, p_s, mx_s, sum_s, bar_q, full, empty,
                         bar_mx, bar_p, Idx, Sink, O, Lse, bi, mi)
            else:
                T.set_max_nreg(nreg[1], 0)
                tp = tx - 256
                load_q(tp, q_s, Q, bi, mi, bar_q)
                for j in T.serial(NI):
                    s = j % NS
                    T.barrier_wait(empty[s], ((j // NS) % 2) ^ 1)
                    if diag == "compute":
                        if j < NS:
                            gather_kv(tp, j, s, kv_s, KV, Idx, bi, mi)
                            T.cp_async_barrier_noinc(full[s])
                        else:
                            T.barrier_arrive(full[s])
                    else:
                        gather_kv(tp, j, s, kv_s, KV, Idx, bi, mi)
                        T.cp_async_barrier_noinc(full[s])

    return compile_kernel(sparse_attn_fwd_ws, out_idx=[4, 5])


# ----------------------------------------------------------------------------- launch helpers
def _pad_idx(idx: torch.Tensor, BI: int) -> torch.Tensor:
    T_ = idx.shape[-1]
    TP = -(-T_ // BI) * BI
    idx = idx.to(torch.int32)
    if TP != T_:
        idx = torch.nn.functional.pad(idx, (0, TP - T_), value=-1)
    return idx.contiguous()


# Forward kernel choice (explicit): "ws" = fwd_kernel_ws where ws_fits(H, D), else the lock-step
# fwd_kernel; "lockstep" = always fwd_kernel. The warp-specialised configuration per ``block``
# (the softmax recurrence's block: the running max moves once per 2 * BI slots):
FWD_DEFAULT = "pp"
# fwd_kernel_pp as a persistent grid of one CTA per SM where there are more queries than SMs (runs 68-72: +7-12%
# against one CTA a query in the same calls, the same bits); PP_SMS, the H200's count, when planning on CPU tensors
# (scripts/precompile_kernels.py)
FWD_PP_PERSISTENT = True
PP_SMS = 132
# on that persistent grid, the options of the boundary between two queries of a CTA (sparse_attn_pp_tl): late_s0
# issues the next query's S0 right after the O store is issued, o_in_p stages most of O_L in the P buffers so the
# store waits on less (taken where pp_fits(..., o_in_p=True), late_s0 alone elsewhere). Run 90 (H100, release
# shape): +1-5% over neither, the same bits (run 91: bitwise equal to one CTA a query in the pp tests; run 92: the
# default path's tests - test_sparse_attn_fwd_default_persistent, the model, release layer and training tests -
# passed with them on, +1-4% again). ``{}`` turns them off.
FWD_PP_BOUNDARY_ON = dict(late_s0=True, o_in_p=True)
FWD_PP_BOUNDARY: dict = dict(FWD_PP_BOUNDARY_ON)
# impl="cl": sparse_attn_cl_tl.fwd_kernel_cl (2-CTA clusters splitting D, two queries an SM) on a persistent grid of
# the SM count rounded down to even, with these options
FWD_CL_CFG = {}
# Run 9/10 (release shape): BI=32/4 stages with early_qk 299 TFLOP/s, without 365; BI=64/2 stages 370.
FWD_WS_CFG = {64: dict(BI=32, stages=4, early_qk=False), 128: dict(BI=64, stages=2, early_qk=False)}
# impl="seesaw": fwd_kernel_seesaw (H = 64, same shapes as ws_fits); its running max moves once per BI
# slots, so BI = 64 is the release's blocking exactly (used for block 64 and 128 alike). Run 17: 164 TFLOP/s.
FWD_SEESAW_CFG = dict(BI=64, stages=2)


def ws_fits(H: int, D: int) -> bool:
    """fwd_kernel_ws's shapes: 64 heads (one warpgroup's WGMMA rows), D a multiple of 128 up to 512."""
    return H == 64 and D % 128 == 0 and D <= 512


def _fwd(q, kv, sink, idx, scale, block: int = 64, impl: str | None = None):
    """block 64: the release's blocking, so the bf16 rounding of P matches the reference's; block 128
    (64-head multiples only): same math, P rounded against other running maxima (1-2 ulp apart on
    ~1% of outputs), measured 313 vs 293 TFLOP/s at the release shape (lock-step kernel).

    impl (default FWD_DEFAULT): "cl" runs fwd_kernel_cl (sparse_attn_cl_tl: 2-CTA clusters splitting D) with
    FWD_CL_CFG for block 64 where cl_fits (T padded to 128), on a persistent grid of the SM count rounded down to
    even, else falls back as "pp" does; "pp" runs fwd_kernel_pp (sparse_attn_pp_tl) for block 64 where pp_fits (a
    persistent grid of one CTA per SM when FWD_PP_PERSISTENT, there are more queries than SMs and its two index
    rows fit, with FWD_PP_BOUNDARY's options), else falls back as "sp" does; "sp" runs fwd_kernel_sp with FWD_SP_CFG for block 64 where sp_fits (its
    block BI = 64 is the release's), else falls back as "ws" does; "ws" runs fwd_kernel_ws with FWD_WS_CFG[block] where ws_fits(H, D)
    (its pairs of BI = block/2 slots give the same block recurrence), else fwd_kernel; "seesaw" runs
    fwd_kernel_seesaw with FWD_SEESAW_CFG where ws_fits(H, D) (block BI = 64 whatever ``block`` asks:
    the release's recurrence), else fwd_kernel; "lockstep" always runs fwd_kernel."""
    B, M, H, D = q.shape
    impl = impl or FWD_DEFAULT
    if impl not in ("cl", "pp", "sp", "ws", "lockstep", "seesaw"):
        raise ValueError(f"sparse_attn fwd impl {impl!r}: 'cl', 'pp', 'sp', 'ws', 'seesaw' or 'lockstep'")
    block = 128 if (block == 128 and H % 64 == 0) else 64
    from .sparse_attn_sp_tl import FWD_SP_CFG, fwd_kernel_sp, sp_fits
    from .sparse_attn_pp_tl import fwd_kernel_pp, pp_fits
    from .sparse_attn_cl_tl import cl_fits, fwd_kernel_cl
    BI = FWD_SP_CFG["BI"]
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else PP_SMS
    if impl == "cl" and block == 64 and cl_fits(H, D, -(-idx.shape[-1] // 128) * 128):
        idx = _pad_idx(idx, 128)
        k = fwd_kernel_cl(H, D, idx.shape[-1], float(scale), sms // 2 * 2, **FWD_CL_CFG)
    elif impl in ("pp", "cl") and block == 64 and pp_fits(H, D, -(-idx.shape[-1] // 128) * 128):
        idx = _pad_idx(idx, 128)
        ctas = sms if FWD_PP_PERSISTENT and B * M > sms and pp_fits(H, D, idx.shape[-1], ctas=sms) else 0
        opts = dict(FWD_PP_BOUNDARY) if ctas else {}
        if opts.get("o_in_p") and not pp_fits(H, D, idx.shape[-1], ctas=ctas, **opts):
            opts["o_in_p"] = False
        k = fwd_kernel_pp(H, D, idx.shape[-1], float(scale), ctas=ctas, **opts)
    elif impl in ("sp", "pp", "cl") and block == BI and sp_fits(H, D, -(-idx.shape[-1] // BI) * BI):
        idx = _pad_idx(idx, BI)
        k = fwd_kernel_sp(H, D, idx.shape[-1], float(scale), **FWD_SP_CFG)
    elif impl == "seesaw" and ws_fits(H, D):
        from .sparse_attn_seesaw_tl import fwd_kernel_seesaw
        idx = _pad_idx(idx, 2 * FWD_SEESAW_CFG["BI"])
        k = fwd_kernel_seesaw(H, D, idx.shape[-1], float(scale), **FWD_SEESAW_CFG)
    elif impl in ("ws", "sp", "pp", "cl") and ws_fits(H, D):
        cfg = FWD_WS_CFG[block]
        idx = _pad_idx(idx, 2 * cfg["BI"])
        k = fwd_kernel_ws(H, D, idx.shape[-1], float(scale), **cfg)
    else:
        idx = _pad_idx(idx, 128)
        k = fwd_kernel(H, D, idx.shape[-1], float(scale), BI=block, stages=1 if block == 128 else 2)
    return tuple(k(q.contiguous(), kv.contiguous(), sink.float().contiguous(), idx))


# Backward implementation (sparse_attn_bwd_tl): "atomic" (bwd_kernel, one kernel) or "split" (a dq
# kernel writing P/dS, then a dkv kernel with vector atomics). Module-level so the autograd path and
# the custom op keep their signatures; tests/bench set it or pass bwd_impl.
BWD_IMPL = "split"   # run 10: split 3.66 ms (234.5 TFLOP/s) vs atomic 6.09 ms at the release shape


def _bwd(q, kv, sink, idx, o, lse, do, scale, bwd_impl=None):
    B, M, H, D = q.shape
    idx = _pad_idx(idx, 128)        # as in the forward: same padded slots
    from .sparse_attn_bwd_tl import bwd_kernel, bwd_split, delta_kernel   # it imports this module
    if (bwd_impl or BWD_IMPL) == "split":
        return bwd_split(q, kv, sink, idx, o, lse, do, scale)
    do = do.contiguous()
    delta = delta_kernel(H, D)(o.reshape(B * M, H, D), do.reshape(B * M, H, D)).view(B, M, H)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    dq = bwd_kernel(H, D, idx.shape[-1], float(scale), DS=max(1, D // 128))(q.contiguous(), kv.contiguous(), do, idx, lse, delta, dkv)
    p_sink = torch.exp2(sink.float() * LOG2E - lse)              # [B, M, H]
    dsink = -(p_sink * delta).sum((0, 1))
    return dq, dkv.to(kv.dtype), dsink.to(sink.dtype)


# ----------------------------------------------------------------------------- torch ops + autograd
@torch.library.custom_op("dsv41::sparse_attn_fwd", mutates_args=())
def sparse_attn_fwd(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, topk_idxs: torch.Tensor,
                    softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd(q, kv, attn_sink, topk_idxs, softmax_scale)


@sparse_attn_fwd.register_fake
def _(q, kv, attn_sink, topk_idxs, softmax_scale):
    B, M, H, D = q.shape
    return q.new_empty(q.shape), q.new_empty((B, M, H), dtype=torch.float32)


@torch.library.custom_op("dsv41::sparse_attn_bwd", mutates_args=())
def sparse_attn_bwd(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, topk_idxs: torch.Tensor,
                    o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor,
                    softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd(q, kv, attn_sink, topk_idxs, o, lse, do, softmax_scale)


@sparse_attn_bwd.register_fake
def _(q, kv, attn_sink, topk_idxs, o, lse, do, softmax_scale):
    return q.new_empty(q.shape), kv.new_empty(kv.shape), attn_sink.new_empty(attn_sink.shape)




class _SparseAttn(torch.autograd.Function):
    """fwd/bwd custom ops tied together; the setup_context form is what torch.func transforms need."""

    # forward calls the launcher directly (functorch hands it plain tensors).
    @staticmethod
    def forward(q, kv, attn_sink, topk_idxs, softmax_scale, block):
        return _fwd(q, kv, attn_sink, topk_idxs, softmax_scale, block)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, kv, attn_sink, topk_idxs, softmax_scale, block = inputs
        o, lse = output
        ctx.save_for_backward(q, kv, attn_sink, topk_idxs, o, lse)
        ctx.softmax_scale = softmax_scale
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        q, kv, attn_sink, topk_idxs, o, lse = ctx.saved_tensors
        # Under torch.func.grad the tensors here are functorch wrappers without storage, which DLPack
        # cannot hand to TileLang, and torch 2.11's custom-op autograd wrapper is refused by functorch:
        # launch on the unwrapped tensors with functorch disabled (plain results are accepted back).
        with torch._C._DisableFuncTorch():
            args = [_plain(t) for t in (q, kv, attn_sink, topk_idxs, o, lse, grad_o)]
            dq, dkv, dsink = _bwd(*args, ctx.softmax_scale)
        return dq, dkv, dsink, None, None, None


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, topk_idxs: torch.Tensor,
                softmax_scale: float, block: int = 64) -> torch.Tensor:
    """Same contract as ``reference.sparse_attn``; ``block`` 64 (the release's) or 128 (faster, see _fwd; 64-head
    multiples). Raises ``Unsupported`` (impl="auto" then runs the torch reference) for non-bf16 q/kv, a head count
    that is not a multiple of 16 (the tiles' M), or another block (the kernels' recurrence is 64's or 128's)."""
    reference.check_sparse_attn(q, kv, attn_sink, topk_idxs)    # the torch op's shape checks, the same errors
    H = q.shape[-2]
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16 or H % 16 or (H > 64 and H % 64):
        raise Unsupported(f"sparse_attn (tilelang): bf16 q/kv with heads a multiple of 16 (<= 64) or of 64, "
                          f"got {q.dtype}/{kv.dtype} with {H} heads")
    if isinstance(block, bool) or block not in (64, 128) or (block == 128 and H % 64):
        raise Unsupported(f"sparse_attn (tilelang): block 64, or 128 with a multiple of 64 heads, got block "
                          f"{block!r} with {H} heads")
    return _SparseAttn.apply(q, kv, attn_sink, topk_idxs, float(softmax_scale), int(block))[0]
