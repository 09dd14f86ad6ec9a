"""The producer warpgroup of the ping-pong sparse-attention forward (``sparse_attn_pp_tl.fwd_kernel_pp``, SPEC
§10.5): warpgroup 2, which alone reads Q, KV and the index rows from global memory. For each query it copies the
index row and Q into shared memory, then gathers the KV rows of its blocks into the two stages in D halves, in the
order the consumers free them; on the persistent grid it also loads the next query's index row and Q. The consumers
(the QK, softmax and P V of each pair) are in ``sparse_attn_pp_consumer_tl``, the barriers both sides share in
``sparse_attn_pp_tl``, whose docstrings say what each option and ablation here was for and what it measured."""
import tilelang.language as T

from .sparse_attn_tl import I32

# q_prefetch: a bulk prefetch of contiguous global bytes into L2 (one instruction, no completion to wait for)
_PREFETCH_SRC = r"""
__device__ __forceinline__ void dsv41_prefetch_l2(const void* base, long long offset, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
               : : "l"(static_cast<const char*>(base) + offset), "r"(bytes) : "memory");
}
"""

# diag="smemwrite": a 16-byte generic store of zeros into shared memory (what a cp.async of 16 bytes writes, without
# the read from global memory)
_ZERO16_SRC = r"""
__device__ __forceinline__ void dsv41_st_shared_zero16(void* p) {
  *reinterpret_cast<uint4*>(p) = make_uint4(0u, 0u, 0u, 0u);
}
"""


def producer_macro(H: int, D: int, TP: int, BI: int, M, ctas: int, nreg: int, diag: str, *, q_tma: bool,
                   q_late: bool, q_prefetch: bool, bstamp):
    """fwd_kernel_pp's producer warpgroup (warpgroup 2, ``nreg`` registers a thread), as the TileLang macro
    ``producer(cta, NQ, zs, q_s, kv_s, idx_s, bar_q, bar_i, q_free, ready, free, Q, KV, Idx, bi, mi, t0s, Lse)``:
    copies each query's index row and Q [H, D] into shared memory, then gathers its KV blocks (BI rows of D
    columns, stage s = block parity) in D halves, in the order the consumers free them. ``M`` is the kernel's
    dynamic query count (a query n of the persistent grid is (n // M, n % M)); ``ctas``, ``diag``, ``q_tma``,
    ``q_late`` and ``q_prefetch`` are fwd_kernel_pp's options; ``bstamp`` its query-boundary stamp macro
    (diag="traceb"). Only the producer copies from global memory into Q, the stages and the index rows."""
    P = ctas > 0
    NB = 2 if P else 1                  # index rows in shared memory (persistent: the next query's beside)
    NP = TP // BI // 2
    DH = D // 2
    CPH = DH // 64                      # 16-byte chunks a producer thread copies per row half (8 threads a row)
    QT, QL, QP = bool(q_tma), bool(q_late), bool(q_prefetch)
    TB = diag == "traceb"
    SW = diag in ("smemwrite", "smemwrite_quarter")
    L, R = 0, 1

    @T.macro
    def load_src(tp, j, idx_s, ib, src):
        """The indices of the BI // 16 rows of block j (index row ib) that thread tp gathers, into src: read once a
        block, for both its halves (TileLang puts a producer-warpgroup barrier before and after these shared reads,
        against the cp.async writes around them)."""
        for r in T.unroll(BI // 16):
            src[r] = idx_s[ib, j * BI + r * 16 + tp // 8]

    @T.macro
    def gather_half(tp, s, h, kv_s, src, KV, bi):
        """The block's BI rows (their indices in src), columns of half h, into stage s (thread tp of 128: 8 threads a
        row, 16 rows a pass). A hole (-1) fails the copy's bounds check: zero-filled, not read. diag="smemwrite": the
        same 16-byte pieces at the same addresses, from the same threads, written as zeros by generic stores, nothing
        read from KV; "smemwrite_quarter": only the first of each thread's CPH pieces a row (a quarter of the bytes at
        D = 512, the rest of the stage left as it was)."""
        for r in T.unroll(BI // 16):
            row = r * 16 + tp // 8
            for u in T.unroll(1 if diag == "smemwrite_quarter" else CPH):
                col = h * DH + u * 64 + (tp % 8) * 8
                if SW:
                    # (declared a read: as a write, TileLang's sync planner put a producer-warpgroup barrier before
                    # every row's stores, which the gathers do not have (run 144); query_gathers places the gathers'
                    # own two barriers a stage by hand instead)
                    T.call_extern("handle", "dsv41_st_shared_zero16", T.access_ptr(kv_s[s, row, col], "r", 8))
                else:
                    T.ptx_cp_async(T.access_ptr(kv_s[s, row, col], "w", 8),
                                   T.access_ptr(KV[bi, src[r], col], "r", 8), 8)

    @T.macro
    def load_row(tp, bi, mi, ib, idx_s, Idx):
        """Query (bi, mi)'s index row into idx_s[ib] (16 bytes a copy)."""
        for r in T.serial((TP // 4 + 127) // 128):
            if r * 128 + tp < TP // 4:
                T.ptx_cp_async(T.access_ptr(idx_s[ib, (r * 128 + tp) * 4], "w", 4),
                               T.access_ptr(Idx[bi, mi, (r * 128 + tp) * 4], "r", 4), 4)

    @T.macro
    def load_q(tp, bi, mi, q_s, Q, bar_q):
        """Query (bi, mi)'s Q [H, D] into q_s, then the producer's arrival on ``bar_q``: 16-byte cp.asyncs (8 threads a
        row, 16 rows a pass), or (``q_tma``) one TMA load issued by one producer thread, its bytes expected on bar_q,
        so that the next gathers' cp.asyncs neither queue behind Q's 4096 reads from HBM nor wait for them in their
        own completion arrivals (a thread's cp.async arrival covers all its earlier copies). Either way each producer
        thread's arrival is its cp.async arrival, so bar_q also says the query's index row (copied before) has landed:
        the consumers seed their QKs from it after waiting on bar_q."""
        if QT:
            T.tma_copy(Q[bi, mi, :, :], q_s[0, :, :], barrier=bar_q, leader_scope_threads=128)
        else:
            for r in T.unroll(H // 16):
                for u in T.unroll(D // 64):
                    T.ptx_cp_async(T.access_ptr(q_s[0, r * 16 + tp // 8, u * 64 + (tp % 8) * 8], "w", 8),
                                   T.access_ptr(Q[bi, mi, r * 16 + tp // 8, u * 64 + (tp % 8) * 8], "r", 8), 8)
        T.cp_async_barrier_noinc(bar_q)

    @T.macro
    def query_gathers(tp, k, ib, src, kv_s, idx_s, ready, free, KV, bi, t0s, Lse, mi, q_s, Q, bar_q, q_free):
        for i in T.serial(NP):
            gp = k * NP + i
            for s, h in ((0, L), (0, R), (1, L), (1, R)):
                # smemwrite: the gathers' two producer barriers a stage, placed by hand: one before the index reads,
                # one after the free wait (where TileLang puts it before its own copies)
                if h == L:                              # (before the wait: not on the path from free to the copies)
                    if SW:
                        T.sync_threads(5, 128)
                    load_src(tp, 2 * i + s, idx_s, ib, src)
                T.barrier_wait(free[2 * s + h], (gp % 2) ^ 1)
                if TB:
                    if i == 0:
                        bstamp(13 + 2 * s + h, t0s, Lse, bi, mi)
                if SW and h == L:
                    T.sync_threads(5, 128)
                if diag == "compute":
                    if gp > 0:
                        T.barrier_arrive(ready[2 * s + h])
                    else:
                        gather_half(tp, s, h, kv_s, src, KV, bi)
                        T.cp_async_barrier_noinc(ready[2 * s + h])
                elif SW:                                # the stage's bytes written, none read from KV
                    gather_half(tp, s, h, kv_s, src, KV, bi)
                    T.fence_proxy_async()               # generic stores, read next by WGMMA (async proxy)
                    T.barrier_arrive(ready[2 * s + h])
                else:
                    gather_half(tp, s, h, kv_s, src, KV, bi)
                    if diag == "nolatency":             # ready at once, before the rows land
                        T.barrier_arrive(ready[2 * s + h])
                    else:
                        T.cp_async_barrier_noinc(ready[2 * s + h])
                if QL and s == 0 and h == R:            # q_late: the query's Q behind its first block's gathers
                    if i == 0:
                        if k > 0:
                            T.barrier_wait(q_free, (k - 1) % 2)
                            load_q(tp, bi, mi, q_s, Q, bar_q)
            if TB:
                if i == 0:
                    bstamp(17, t0s, Lse, bi, mi)

    @T.macro
    def producer(cta, NQ, zs, q_s, kv_s, idx_s, bar_q, bar_i, q_free, ready, free, Q, KV, Idx, bi, mi, t0s, Lse):
        """Warpgroup 2: each query's index row and Q, then its pairs' KV gathers in the order the stage halves are
        freed. Persistent: the next query's index row (the other buffer) right after the current query's gathers,
        its Q once both consumers are past their last QK (``q_free``); its first gathers then wait only for the
        stages."""
        T.set_max_nreg(nreg, 0)
        tp = T.get_thread_binding() - 256
        if QP:
            T.import_source(_PREFETCH_SRC)
        if SW:
            T.import_source(_ZERO16_SRC)
        src = T.alloc_local([BI // 16], I32)
        bq = T.alloc_local([1], I32)                    # persistent: the query's batch row, computed once a query
        mq = T.alloc_local([1], I32) if TB or QL else None  # traceb, q_late: the query's row
        if P:
            if NQ > 0:                                   # (the grid may outnumber the queries)
                load_row(tp, cta // M, cta % M, 0, idx_s, Idx)
                T.cp_async_barrier_noinc(bar_i)
                load_q(tp, cta // M, cta % M, q_s, Q, bar_q)
            for k in T.serial(NQ):
                n = cta + k * ctas
                # n // M is a floor division by a runtime M (a 64-bit and a 32-bit one in the generated code);
                # passed as an expression, every gather re-evaluated it after its stage half's free wait, on the
                # path to the copies (run 109's SASS)
                T.barrier_wait(bar_i, k % 2)             # this query's whole index row is in idx_s[k % 2]
                bq[0] = n // M
                if TB or QL:
                    mq[0] = n % M
                if TB:
                    bstamp(12, t0s, Lse, bq[0], mq[0])
                if QP:                                  # the next query's Q and index row into L2, a query ahead
                    if k < NQ - 1:
                        if tp == 0:                     # (query n + ctas: row n + ctas of the [B M] queries)
                            T.call_extern("handle", "dsv41_prefetch_l2", Q.data,
                                          T.cast(n + ctas, "int64") * (H * D * 2), H * D * 2)
                            T.call_extern("handle", "dsv41_prefetch_l2", Idx.data,
                                          T.cast(n + ctas, "int64") * (TP * 4), TP * 4)
                query_gathers(tp, k, k % NB, src, kv_s, idx_s, ready, free, KV, bq[0], t0s, Lse,
                              mq[0] if TB or QL else 0, q_s, Q, bar_q, q_free)
                if k < NQ - 1:
                    load_row(tp, (n + ctas) // M, (n + ctas) % M, (k + 1) % NB, idx_s, Idx)
                    T.cp_async_barrier_noinc(bar_i)
                    if not QL:
                        T.barrier_wait(q_free, k % 2)
                        if TB:
                            bstamp(10, t0s, Lse, bq[0], mq[0])
                        load_q(tp, (n + ctas) // M, (n + ctas) % M, q_s, Q, bar_q)
                        if TB:
                            bstamp(11, t0s, Lse, bq[0], mq[0])
        else:
            load_row(tp, bi, mi, 0, idx_s, Idx)
            load_q(tp, bi, mi, q_s, Q, bar_q)             # (cp.async: bar_q covers the index row too)
            T.barrier_wait(bar_q, 0)                     # the whole index row is in idx_s
            query_gathers(tp, 0, 0, src, kv_s, idx_s, ready, free, KV, bi, t0s, Lse, mi, q_s, Q, bar_q, q_free)
        if diag == "nolatency":                          # no copy may land after the CTA has exited
            T.ptx_commit_group()
            T.ptx_wait_group(0)

    return producer
