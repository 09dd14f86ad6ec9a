"""The two consumer warpgroups of the ping-pong sparse-attention forward (``sparse_attn_pp_tl.fwd_kernel_pp``, SPEC
§10.5): warpgroups 0 and 1, which own output columns [0, D/2) and [D/2, D). Each computes the QK and the softmax of
every other block (consumer 0 the pair's first, consumer 1 its second) and the P V product of its own D half for
both blocks of a pair, handing P and the running max to its peer through shared memory; at the end of a query they
exchange their row sums and each normalises and stores its half of O (consumer 0 the LSE too). The producer
(``sparse_attn_pp_producer_tl``) gathers the stages they read; ``sparse_attn_pp_tl`` holds the kernel, its options'
docstrings (what each was for and what it measured) and the barriers both sides share."""
import tilelang.language as T

from ._common import LOG2E, softmax_macros
from .sparse_attn_tl import F32, I32


def consumer_macro(H: int, D: int, TP: int, BI: int, M, ctas: int, nreg: int, diag: str, *, scale: float,
                   lazy: float, late_s0: bool, o_in_p: bool, s0_first: bool, stamp, bstamp):
    """fwd_kernel_pp's consumer warpgroups (``nreg`` registers a thread), as the TileLang macro
    ``consumer(w, cta, NQ, zs, q_s, kv_s, idx_s, p_s, mx_s, sum_s, o_s, bar_q, q_free, ready, free, bar_p0, bar_p1,
    p_free0, p_free1, bar_end, t0s, Sink, O, Lse, bi, mi)`` for warpgroup w: its pairs of each of its queries (one,
    or the persistent CTA's cta, cta + ctas, ...), the row sums' exchange and its epilogue. ``M`` is the kernel's
    dynamic query count; ``ctas``, ``diag``, ``scale``, ``lazy``, ``late_s0``, ``o_in_p`` and ``s0_first`` are
    fwd_kernel_pp's options (validated there); ``stamp`` / ``bstamp`` its trace macros (diag="trace" / "traceb")."""
    P = ctas > 0
    LS = bool(late_s0)
    OP = bool(o_in_p)
    SF = bool(s0_first)
    NB = 2 if P else 1                  # index rows in shared memory (persistent: the next query's beside)
    LZ = lazy > 0
    SM = diag != "nosoftmax"
    TR = diag in ("trace", "traceb")
    TB = diag == "traceb"
    NS = diag == "nostore"
    NP = TP // BI // 2
    DH = D // 2
    OPJ = tuple(range(DH // 64 - 1))    # o_in_p: O_L's pieces of 64 columns outside stage 1 (P0, P1, o_s)
    c = float(scale) * LOG2E
    factor, probs = softmax_macros(H, BI, c, lazy=LZ)   # lazy: a is exactly 1.0 where the max did not move
    L, R = 0, 1

    @T.macro
    def epilogue(w, l, m, ls, acc_o, sum_s, q_s, kv_s, p_s, o_s, free, Sink, O, Lse, bi, mi, t0s):
        """Consumer w, after both row sums are in sum_s and every WGMMA on q_s is done: l += the peer's sum + the
        sink exp2(sink log2e - c m); O[:, half w] = acc_o / l through shared memory and one TMA store; w == 0 stores
        LSE = log2(l) + c m. O goes through q_s (one CTA a query) or, persistent (q_s may hold the next query's Q
        already), through stage 1's half w - its last readers were this consumer's own P1 V1[:, half w] and
        consumer 1's QK of the last pair - which is freed for the next query's gather once the store has read it."""
        for h in T.Parallel(H):
            l[h] = l[h] + sum_s[1 - w, h] + T.exp2(Sink[h] * LOG2E - m[h] * c)
        for h, d in T.Parallel(H, DH):
            acc_o[h, d] /= l[h]
        if w == 0:                                      # trace: the last pair's free consumer-0 slots
            stamp(12 * (NP - 1) + 5, t0s, Lse, bi, mi)
        if OP and w == 0:
            # o_in_p: only O_L's last 64 columns go through stage 1 (stored first, its own bulk group), the others
            # through P0, P1 (free until this consumer's next P0 and consumer 1's next P1) and o_s
            T.copy(acc_o[:, DH - 64:DH], kv_s[1, :, DH - 64:DH])
            if not NS:
                T.tma_copy(kv_s[1, :, DH - 64:DH], O[bi, mi, :, DH - 64:DH])
            for j in OPJ:
                T.copy(acc_o[:, j * 64:(j + 1) * 64], p_s[j, :, :] if j < 2 else o_s)
            stamp(12 * (NP - 1) + 6, t0s, Lse, bi, mi)
            if not SF:
                T.tma_store_wait(0)                     # the stage's piece is read (under the writes above):
                bstamp(0, t0s, Lse, bi, mi)
                T.barrier_arrive(free[2 + w])           # stage 1's left half is free for the next query
            if not NS:
                for j in OPJ:
                    T.tma_copy(p_s[j, :, :] if j < 2 else o_s, O[bi, mi, :, j * 64:(j + 1) * 64])
            bstamp(1, t0s, Lse, bi, mi)
        elif LS:                                        # the store's reads are waited for in release_o
            T.copy(acc_o, kv_s[1, :, w * DH:(w + 1) * DH])
            if w == 0:
                stamp(12 * (NP - 1) + 6, t0s, Lse, bi, mi)
            bstamp(5, t0s, Lse, bi, mi)
            if not NS:
                T.tma_copy(kv_s[1, :, w * DH:(w + 1) * DH], O[bi, mi, :, w * DH:(w + 1) * DH])
        else:
            # staged in q_s[0] (one CTA a query) or kv_s[1] (persistent); not bound to a name, which TileLang would
            # give the buffer in the generated code
            T.copy(acc_o, (kv_s if P else q_s)[int(P), :, w * DH:(w + 1) * DH])
            if w == 0:
                stamp(12 * (NP - 1) + 6, t0s, Lse, bi, mi)
            T.copy((kv_s if P else q_s)[int(P), :, w * DH:(w + 1) * DH], O[bi, mi, :, w * DH:(w + 1) * DH])  # TMA
            if P:
                T.sync_threads(3 + w, 128)              # the store's reads are done (its issuing thread waited)
                T.barrier_arrive(free[2 + w])
        if w == 0 and not TR:
            for h in T.Parallel(H):
                ls[h] = T.log2(l[h]) + m[h] * c
            T.copy(ls, Lse[bi, mi, :])

    @T.macro
    def release_o(w, free, t0s, Lse, bi, mi):
        """late_s0: stage 1's half w is free once the O store issued by the epilogue has read it. Only the issuing
        thread has a bulk group to wait for; each thread arrives after its own wait, so the phase completes after
        the issuer's."""
        if not (OP and w == 0):                         # (o_in_p: the epilogue freed it already)
            T.tma_store_wait(0)
            bstamp(6, t0s, Lse, bi, mi)
            T.barrier_arrive(free[2 + w])
        elif SF:                                        # s0_first: the oldest of its bulk groups, the stage's piece
            T.tma_store_wait(len(OPJ))
            bstamp(0, t0s, Lse, bi, mi)
            T.barrier_arrive(free[2 + w])

    @T.macro
    def seed(j, acc_s, idx_s, ib):
        """The QK accumulator's seed for block j: 0 at a slot, -inf at a hole."""
        for h, t in T.Parallel(H, BI):
            acc_s[h, t] = T.if_then_else(idx_s[ib, j * BI + t] >= 0, 0, -T.infinity(F32))

    @T.macro
    def qk_half(z, h, s, acc_s, q_s, kv_s):
        T.wgmma_gemm(q_s[z, :, h * DH:(h + 1) * DH], kv_s[z + s, :, h * DH:(h + 1) * DH], acc_s, transpose_B=True)

    @T.macro
    def pv(z, b, h, acc_o, p_s, kv_s):
        """acc_o += P_b V_b[:, half h] (P of block b of the pair, stage b)."""
        T.wgmma_gemm(p_s[z + b, :, :], kv_s[z + b, :, h * DH:(h + 1) * DH], acc_o)

    @T.macro
    def scale_o(acc_o, a, vote):
        """O half *= a per row. lazy: skipped when no row of the warp has a != 1 (a warp-uniform branch: the factors
        are then all exactly 1, so skipping changes no bit)."""
        if LZ:
            vote[0] = 0
            for h in T.Parallel(H):
                vote[0] = vote[0] | T.if_then_else(a[h] != 1.0, 1, 0)
            if T.any_sync(vote[0]) != 0:
                for h, d in T.Parallel(H, DH):
                    acc_o[h, d] *= a[h]
        else:
            for h, d in T.Parallel(H, DH):
                acc_o[h, d] *= a[h]

    @T.macro
    def softmax(acc_s, m_old, m, a, ls, l, vote):
        """A consumer's softmax of its block: m = max(m_old, rowmax S), a = exp2(c (m_old - m)), S <- exp2(c S - c m)
        (fp32, P before its bf16 rounding), l = l a + rowsum (l was under m_old). lazy (tau = ``lazy``): a warp keeps
        m = m_old for all its rows unless one of them would move by more than tau in log2 units (P <= 2^tau)."""
        T.copy(m_old, m)
        if SM:
            T.reduce_max(acc_s, m, dim=1, clear=False)
        if LZ:
            vote[0] = 0
            for h in T.Parallel(H):
                vote[0] = vote[0] | T.if_then_else((m[h] - m_old[h]) * c > lazy, 1, 0)
            if T.any_sync(vote[0]) == 0:
                T.copy(m_old, m)
        if SM:
            probs(acc_s, m_old, m, a, ls, l)
        else:
            factor(a, m_old, m)
            T.fill(ls, 1)
            for h in T.Parallel(H):
                l[h] = l[h] * a[h] + ls[h]

    @T.macro
    def rescale(acc_o, l, a, m_from, m_to, vote):
        factor(a, m_from, m_to)
        for h in T.Parallel(H):
            l[h] = l[h] * a[h]
        scale_o(acc_o, a, vote)

    @T.macro
    def issue_s0(k, z, zs, acc_s, q_s, kv_s, idx_s, bar_q, ready, t0s, Lse, bi, mi):
        """Consumer 0: the QK of the CTA's k-th query's first block (S0 of its first pair), issued, not waited for."""
        T.barrier_wait(bar_q, k % 2)
        bstamp(2, t0s, Lse, bi, mi)
        z = zs[0]
        seed(0, acc_s, idx_s, k % NB)
        T.barrier_wait(ready[0 + L], (k * NP) % 2)
        bstamp(3, t0s, Lse, bi, mi)
        qk_half(z, L, 0, acc_s, q_s, kv_s)
        T.barrier_wait(ready[0 + R], (k * NP) % 2)
        bstamp(4, t0s, Lse, bi, mi)
        qk_half(z, R, 0, acc_s, q_s, kv_s)

    @T.macro
    def consumer0(k, z, zs, acc_s, acc_o, m, m0, a, ls, l, vote, q_s, kv_s, idx_s, p_s, mx_s, bar_q, q_free, ready,
                  free, bar_p0, bar_p1, p_free0, p_free1, t0s, Lse, bi, mi):
        """Consumer 0's pairs of the CTA's k-th query (every per-pair barrier's phase runs on: gp = k NP + i)."""
        ib = k % NB
        if not P:                                       # persistent: issued before the previous query's epilogue
            issue_s0(k, z, zs, acc_s, q_s, kv_s, idx_s, bar_q, ready, t0s, Lse, bi, mi)
        T.wait_wgmma(0)
        if P and NP == 1:
            T.barrier_arrive(q_free)                    # my last QK of this query is done
        for i in T.serial(NP):
            gp = k * NP + i
            z = zs[0]                                   # 0, unknown to ptxas: no WGMMA descriptor is hoisted
            stamp(12 * i + 2, t0s, Lse, bi, mi)
            softmax(acc_s, m, m0, a, ls, l, vote)       # m0 = max(m, rowmax S0), a = exp2(c (m - m0))
            scale_o(acc_o, a, vote)                     # O_L under m0
            T.barrier_wait(p_free0, (gp % 2) ^ 1)      # consumer 1 is done with P0 of the pair before
            if OP:                                      # the previous query's O pieces in P0, P1 are read
                if i == 0:
                    if k > 0:                           # (only the store's issuer waits: the others wait for it)
                        T.tma_store_wait(0)
                        T.sync_threads(3, 128)
                        bstamp(9, t0s, Lse, bi, mi)
                        T.barrier_arrive(p_free1)       # (the previous query's last pair's, held back)
            T.copy(acc_s, p_s[0, :, :])
            T.copy(m0, mx_s[0, :])
            T.fence_proxy_async()                       # P0: generic stores, read next by WGMMA (async proxy)
            T.barrier_arrive(bar_p0)
            stamp(12 * i + 3, t0s, Lse, bi, mi)
            pv(z, 0, L, acc_o, p_s, kv_s)
            T.barrier_wait(bar_p1, gp % 2)             # P1, m1 of pair i
            stamp(12 * i + 4, t0s, Lse, bi, mi)
            for h in T.Parallel(H):
                m[h] = mx_s[1, h]
            T.wait_wgmma(0)                             # P0 V0[:, L] done: stage 0's left half is free
            T.barrier_arrive(free[0 + L])
            rescale(acc_o, l, a, m0, m, vote)           # O_L, l under m1
            stamp(12 * i + 0, t0s, Lse, bi, mi)
            T.barrier_wait(ready[2 + L], gp % 2)
            pv(z, 1, L, acc_o, p_s, kv_s)
            stamp(12 * i + 1, t0s, Lse, bi, mi)
            if i < NP - 1:                              # S0 of pair i + 1 (block 2i + 2, stage 0 refilled)
                seed(2 * i + 2, acc_s, idx_s, ib)
                stamp(12 * i + 5, t0s, Lse, bi, mi)
                T.barrier_wait(ready[0 + L], (gp + 1) % 2)
                stamp(12 * i + 6, t0s, Lse, bi, mi)
                qk_half(z, L, 0, acc_s, q_s, kv_s)
                T.wait_wgmma(1)                         # P1 V1[:, L] done
                T.barrier_arrive(free[2 + L])
                T.barrier_arrive(p_free1)
                T.barrier_wait(ready[0 + R], (gp + 1) % 2)
                qk_half(z, R, 0, acc_s, q_s, kv_s)
                T.wait_wgmma(0)
                if P:
                    if i == NP - 2:
                        T.barrier_arrive(q_free)        # my last QK of this query is done
            else:
                T.wait_wgmma(0)
                if not P:                               # persistent: the epilogue frees it (O is staged there)
                    T.barrier_arrive(free[2 + L])
                if not OP:                              # o_in_p: once O's pieces in P0, P1 are read
                    T.barrier_arrive(p_free1)

    @T.macro
    def consumer1(k, z, zs, acc_s, acc_o, m, m0, a, ls, l, vote, q_s, kv_s, idx_s, p_s, mx_s, bar_q, q_free, ready,
                  free, bar_p0, bar_p1, p_free0, p_free1, t0s, Lse, bi, mi):
        """Consumer 1's pairs of the CTA's k-th query."""
        ib = k % NB
        T.barrier_wait(bar_q, k % 2)
        bstamp(7, t0s, Lse, bi, mi)
        for i in T.serial(NP):
            gp = k * NP + i
            z = zs[0]                                   # 0, unknown to ptxas: no WGMMA descriptor is hoisted
            seed(2 * i + 1, acc_s, idx_s, ib)
            T.barrier_wait(ready[2 + L], gp % 2)
            if TB:
                if i == 0:
                    bstamp(8, t0s, Lse, bi, mi)
            qk_half(z, L, 1, acc_s, q_s, kv_s)
            T.barrier_wait(ready[2 + R], gp % 2)
            stamp(12 * i + 7, t0s, Lse, bi, mi)
            qk_half(z, R, 1, acc_s, q_s, kv_s)
            T.barrier_wait(bar_p0, gp % 2)             # P0, m0 of pair i
            for h in T.Parallel(H):
                m0[h] = mx_s[0, h]
            T.wait_wgmma(0)                             # S1 done (O_R must not be touched while it runs)
            if P:
                if i == NP - 1:
                    T.barrier_arrive(q_free)            # my last QK of this query is done
            stamp(12 * i + 8, t0s, Lse, bi, mi)
            rescale(acc_o, l, a, m, m0, vote)           # O_R, l under m0
            T.barrier_wait(ready[0 + R], gp % 2)
            pv(z, 0, R, acc_o, p_s, kv_s)               # runs under the softmax
            stamp(12 * i + 9, t0s, Lse, bi, mi)
            softmax(acc_s, m0, m, a, ls, l, vote)       # m = m1 = max(m0, rowmax S1), a = exp2(c (m0 - m1))
            stamp(12 * i + 10, t0s, Lse, bi, mi)
            T.barrier_wait(p_free1, (gp % 2) ^ 1)      # consumer 0 is done with P1 of the pair before
            T.copy(acc_s, p_s[1, :, :])
            T.copy(m, mx_s[1, :])
            T.fence_proxy_async()
            T.barrier_arrive(bar_p1)
            stamp(12 * i + 11, t0s, Lse, bi, mi)
            T.wait_wgmma(0)                             # P0 V0[:, R] done: stage 0's right half, P0 free
            T.barrier_arrive(free[0 + R])
            T.barrier_arrive(p_free0)
            scale_o(acc_o, a, vote)                     # O_R under m1
            pv(z, 1, R, acc_o, p_s, kv_s)
            T.wait_wgmma(0)
            if P:
                if i < NP - 1:                          # the last pair's: the epilogue frees it (O is staged there)
                    T.barrier_arrive(free[2 + R])
            else:
                T.barrier_arrive(free[2 + R])

    @T.macro
    def one_query(w, k, NQ, z, zs, acc_s, acc_o, m, m0, a, ls, l, vote, q_s, kv_s, idx_s, p_s, mx_s, sum_s, o_s, bar_q,
                  q_free, ready, free, bar_p0, bar_p1, p_free0, p_free1, bar_end, t0s, Sink, O, Lse, bi, mi):
        """Consumer w's k-th query of the CTA: its pairs, the row sums' exchange, its epilogue. Persistent: consumer
        0 issues the next query's first QK (Q and stage 0 are already there) before the exchange and the epilogue,
        so the tensor core runs it under their FP32 work (run 70: +3-6%); it is waited for before the loop's back
        edge (no WGMMA in flight across it)."""
        T.fill(acc_o, 0)
        T.fill(l, 0)
        T.fill(m, -1e30)
        pairs = consumer0 if w == 0 else consumer1
        pairs(k, z, zs, acc_s, acc_o, m, m0, a, ls, l, vote, q_s, kv_s, idx_s, p_s, mx_s, bar_q, q_free, ready, free,
              bar_p0, bar_p1, p_free0, p_free1, t0s, Lse, bi, mi)
        if P and w == 0 and not LS:
            if k < NQ - 1:
                issue_s0(k + 1, z, zs, acc_s, q_s, kv_s, idx_s, bar_q, ready, t0s, Lse, bi, mi)
        # both sums are under the final max (m1 of the last pair); the exchange also says both consumers are past
        # their last WGMMA on q_s, which the epilogue reuses for O (one CTA a query)
        T.copy(l, sum_s[w, :])
        stamp(60 + w, t0s, Lse, bi, mi)                  # trace: the consumer's last P V done
        T.barrier_arrive(bar_end)
        T.barrier_wait(bar_end, k % 2)
        epilogue(w, l, m, ls, acc_o, sum_s, q_s, kv_s, p_s, o_s, free, Sink, O, Lse, bi, mi, t0s)
        if LS:                                          # the next S0 waits (Q, stage 0) under the O store's reads
            if w == 0:
                if k < NQ - 1:
                    issue_s0(k + 1, z, zs, acc_s, q_s, kv_s, idx_s, bar_q, ready, t0s, Lse, bi, mi)
            release_o(w, free, t0s, Lse, bi, mi)
        stamp(62 + w, t0s, Lse, bi, mi)                  # trace: the consumer's epilogue done
        if P and w == 0:
            T.wait_wgmma(0)                             # no WGMMA in flight across the query loop's back edge

    @T.macro
    def gathers_only(w, NQ, q_free, ready, free):
        """diag="gather": consumer w waits for its stage's halves (w = 0: stage 0, w = 1: stage 1) of every pair and
        frees them at once; persistent: says it is past the query's last QK (the producer's next Q waits for it)."""
        for k in T.serial(NQ):
            for i in T.serial(NP):
                gp = k * NP + i
                T.barrier_wait(ready[2 * w + L], gp % 2)
                T.barrier_wait(ready[2 * w + R], gp % 2)
                T.barrier_arrive(free[2 * w + L])
                T.barrier_arrive(free[2 * w + R])
            if P:
                T.barrier_arrive(q_free)

    @T.macro
    def consumer(w, cta, NQ, zs, q_s, kv_s, idx_s, p_s, mx_s, sum_s, o_s, bar_q, q_free, ready, free, bar_p0, bar_p1,
                 p_free0, p_free1, bar_end, t0s, Sink, O, Lse, bi, mi):
        """Consumer warpgroup w: its registers and its queries (one, or the persistent CTA's cta, cta + ctas, ...)."""
        if diag == "gather":
            gathers_only(w, NQ, q_free, ready, free)
        else:
            acc_s = T.alloc_fragment([H, BI], F32)
            acc_o = T.alloc_fragment([H, DH], F32)
            m = T.alloc_fragment([H], F32)
            m0 = T.alloc_fragment([H], F32)
            a = T.alloc_fragment([H], F32)
            ls = T.alloc_fragment([H], F32)
            l = T.alloc_fragment([H], F32)
            vote = T.alloc_local([1], I32)
            bm = T.alloc_local([2], I32)                # persistent: the query's (batch, row), once a query
            z = T.alloc_var(I32)
            T.set_max_nreg(nreg, 1)
            if P:
                if w == 0:
                    if NQ > 0:
                        issue_s0(0, z, zs, acc_s, q_s, kv_s, idx_s, bar_q, ready, t0s, Lse, bi, mi)
                for k in T.serial(NQ):
                    n = cta + k * ctas
                    bm[0] = n // M                      # (as the producer's bq: not re-evaluated at each use)
                    bm[1] = n % M
                    one_query(w, k, NQ, z, zs, acc_s, acc_o, m, m0, a, ls, l, vote, q_s, kv_s, idx_s, p_s, mx_s,
                              sum_s, o_s, bar_q, q_free, ready, free, bar_p0, bar_p1, p_free0, p_free1, bar_end, t0s,
                              Sink, O, Lse, bm[0], bm[1])
            else:
                one_query(w, 0, 1, z, zs, acc_s, acc_o, m, m0, a, ls, l, vote, q_s, kv_s, idx_s, p_s, mx_s, sum_s, o_s,
                          bar_q, q_free, ready, free, bar_p0, bar_p1, p_free0, p_free1, bar_end, t0s, Sink, O, Lse,
                          bi, mi)

    return consumer
