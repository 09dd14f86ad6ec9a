"""Sparse attention forward (SPEC §10.5), "ping-pong" schedule: ``fwd_kernel_pp``, H = 64.

Same contract and numerics as the other forwards (``sparse_attn_tl``): the running max moves once per 64-slot
block and P is rounded to bf16 against that block's max, as the release does; only fp32 summation orders differ.

Why another schedule. ``fwd_kernel_sp`` (a softmax warpgroup feeding two PV warpgroups) is bound by one
warpgroup's serial QK -> softmax path (its docstring). Here, as in FlashMLA's Hopper sparse prefill, each of
two consumer warpgroups computes the QK and the softmax of every other block and the P V product of its own D
half for both blocks of a pair, so while one consumer runs its softmax the other's WGMMAs keep the tensor
cores busy. A producer warpgroup with few registers gathers the KV rows. The roles' code: the producer's in
``sparse_attn_pp_producer_tl``, the consumers' in ``sparse_attn_pp_consumer_tl``; this file holds the kernel (its
options and the CTA's shared memory and barriers) and what each option measured.
What makes it work where ``fwd_kernel_seesaw`` (the same idea, 164-278 TFLOP/s) did not:

- every KV stage is tracked in D halves (left: columns [0, D/2), read by consumer 0's P V; right: consumer 1's),
  each with its own ready / free mbarrier, so a half is regathered as soon as its last reader is done and the
  QK of a block is issued in two commit groups, left half first;
- no WGMMA is in flight across the pair loop's back edge, so the loop stays rolled (a rolled loop with an
  in-flight WGMMA makes ptxas serialise every WGMMA, C7514), and every WGMMA operand is offset by a runtime zero
  read from shared memory each iteration (``zs``), so ptxas cannot hoist the loop-invariant WGMMA descriptors out
  of the loop and spill them (56 bytes of spill left, against the seesaw's 2.3 KB);
- the consumers get 232 registers, the producer 40 (setmaxnreg; 2 * 232 + 40 = 504, the pool of 384 threads; ptxas
  reports no spills). The split was 216 / 72 until run 95 and 224 / 56 until run 156, each change a small gain with
  the same bits (``bench --only attnnreg``, H100, interleaved rounds): 224 / 56 over 216 / 72 +1.5%, +1.6%, +2.2%
  and -1.0% in four sets (runs 95-97, where 232 / 40 and 240 / 24 were no faster); 232 / 40 over 224 / 56 +1.5% and
  +0.7% in medians of 16 on two machines, faster in 24 of 32 rounds (runs 155-156); 240 / 24 is 2-3% slower.

Measured (H200 runs 48-56), and every schedule change tried and not kept since, with its run and the commit that
holds its code: BENCHMARKS.md, "fwd_kernel_pp: measured, and tried and not kept".
What the trace (run 60-62, ``diag="trace"``) shows: a pair takes ~6500 cycles against 4096 of tensor work at the
WGMMA peak, and the time is spread over one serial chain that crosses both consumers every pair (S0 -> softmax 0 ->
P0 -> softmax 1 -> P1 -> O_L rescale -> P1 V1[:, L] -> next QK), each link 300-1800 cycles; shortening one link
(e.g. consumer 1's P0 -> P1 from 1570 to 900 cycles) lengthens the next wait by as much.
What bounds it (``bench --only attnbound``, H100, medians at the release shape; runs 102 and 111-112): the kernel
as it is 523 TFLOP/s in run 102, 533-534 since the producer fix below; its compute alone ("compute": no gathers
after the first pair) 630-636; every gather issued but each stage signalled ready as soon as its copies are issued
("nolatency") 538-548; the gathers alone ("gather", nothing computed) take 0.25 ms of the kernel's 0.65. Not the
clock: every variant runs at 1965-1980 MHz, the kernel at ~516 W, the compute alone at ~460 W (runs 105, 111, under
a 700 W cap). Nsight Compute (run 109, ``scripts/ncu_profile.sh`` and ``scripts/ncu_sass_summary.py``) against
"compute": the tensor pipe's active cycles are the same (57% of the kernel's elapsed cycles, 65% of compute's), and
so are the WGMMAs' shared-memory wavefronts; what the consumers add (+14% warp-stall samples) is all in their
mbarrier waits for the stages' ready barriers. So the gathers do not slow the WGMMAs: they arrive late on the chain
(run 74's micro-benchmark had found the copies' shared-memory writes hidden beside WGMMAs). The same profile showed
the producer spending ~100 instructions between each free wait and its first copy: a floor division ``n // M``
(the query's batch row, passed into the gather as an expression, so re-evaluated for every stage half) and the
block's index reads. Computing the batch row once a query and reading a block's indices once, before the wait, took
them off that path: +1.7% and +3.6% (runs 111-112, medians of 16 rounds, the same bits). The softmax costs ~3%
("nosoftmax" 539-552). The FP32 rescales are not the bound (run 99): a warp skipping every rescale whose factors are
all exactly 1 (the same bits), on scores where ~80% of them can be skipped, measured +1%, within the noise.
FlashAttention-4's threshold (``lazy``, not the release's bits) measured 2-5% on the persistent grid (runs 68-73,
94, 99, 111-112: 544-551). Nor is the handoff mechanism: named barriers in place of the consumers' four P mbarriers
gave the same time (run 100, the code in 5c65f1a); nor the QKs' shared-memory reads (Q's first 128 columns in
registers, run 103, the code in 70a2597); nor the wait for a whole stage half before a QK starts (a ready barrier a
column quarter, runs 55 and 110); nor the persistent grid's 32nd round at 4096 queries (4 of 132 CTAs): it costs
1-2%, not a round's 3%, as its CTAs run with the chip to themselves (run 134, ``bench --only attntail``).

Persistent grid (``ctas``, runs 68-72; the default through ``sparse_attn_tl._fwd`` where there are more queries
than SMs): a query's start (~4000 cycles to the first QK) and end (~3200 after the last P V) overlap its
neighbours' pairs instead of idling the SM: +1-9% (485-526 against 450-490 TFLOP/s in the same processes, runs
68-69), the same bits; consumer 0 issuing the next query's first QK before its epilogue added 3-6% in 5 of 6
comparisons (run 70: 490-528). With ``lazy`` (FlashAttention-4's conditional rescale, not the release's bits) on
top: 508-528. What is left at a query's boundary (the persistent traces, stretched by their stamps): the epilogue
(~3000-4000 cycles: the row sums' exchange, the normalisation, O into stage 1 and its TMA store, whose reads take
~2500) on both consumers' path, and consumer 1's wait for stage 1's regather behind it. Not kept: storing O by the
warpgroups' own copies (no gain, run 69) or straight from the accumulators so that stage 1 frees at the last P V
(433-448 against 490-508: the 4-byte stores cost consumer 0 ~9000 cycles a query, run 71).

What the gathers cost, then. "nolatency" runs at the default's speed on both GPUs (H100 run 140: 541 against 538;
H200 run 143: 527.1 against 526.9), so the rows' flight from L2 is not what the chain waits for. "smemwrite" (the
same producer path and shared-memory writes, of zeros, with no reads from L2) runs at 558 against the default's 540
and compute's 632, and "smemwrite_quarter" (a quarter of those writes behind the same barriers) at 650 (H100 run
145, medians of 8): the L2 reads cost ~3%, the stages' shared-memory writes the rest. Getting 128 KB a pair into
shared memory while the WGMMAs read theirs (~416 KB a pair) is what the consumers wait for. It is the bytes, not
the producer's instructions: the producer issuing each row half's four copies as one block of inline PTX (108
instructions a pair on its paths from a stage half's free wait to its ready arrival, against TileLang's 278 in the
SASS; the same bits) ran 1.4% slower, and not writing a hole's slot after a CTA's first pair (10% fewer writes,
the same bits on finite KV) gained 0.9% on top of that block, so nothing over the default (H100 run 150, medians
of 16 interleaved rounds; as a branch around each row's copies it had lost 1.5-1.9%, runs 147 and 149). Neither was
kept (``row_copies`` and ``skip_holes``, the code in 6e49dbc). With 64 heads a gathered row carries half the
flops it does in FlashMLA's 128-head sparse prefill, and each slot's row is written into shared memory once.
Not by moving the gathers to TMA: row-panel TMA loads (128 bytes each) run at half the speed (run 106, the code in
baba25d), and Hopper has no row-gather TMA. Nor is the cp.async path dearer per byte than TMA's: every block loaded
as four 64 x 64 TMA tiles a stage half from its first row (``diag="tma_all"``, wrong outputs, the same bytes)
ran at the default's speed, 528.7 against 531.2; and loading by TMA only the blocks that are runs of consecutive
rows or all holes (``tma_runs``, the same bits; 38% of the bench's blocks) lost 3.6%, 7% on shuffled rows, to the
per-block vote over the producer warpgroup that picks the path (H100 run 159, medians of 16; the code in 6d597d4).
Cutting the WGMMAs' shared-memory reads does not help (run 103), so merging a pair's two QKs into one m64n128 (Q
read once a pair) has no case either. Independent chains per SM, as FlashAttention-3 runs two query tiles, are ruled
out by the output's size (64 heads x 512 fp32 is 256 registers a
thread for one warpgroup). The 2-CTA cluster that splits D (``sparse_attn_cl_tl``, runs 77-79) is correct, but its
per-block exchange of partial scores puts ~1300-1500 cycles of latency on each chain. Nor is the query boundary's
Q load: four options that move it (``q_tma``, ``s0_first``, ``q_prefetch``, ``q_late``) gave nothing (runs 139-142).
"""
import functools
import inspect

import tilelang.language as T

from ._common import check_nreg, compile_kernel
from .sparse_attn_pp_consumer_tl import consumer_macro
from .sparse_attn_pp_producer_tl import producer_macro
from .sparse_attn_tl import BF16, F32, I32

# diag="traceb": the query-boundary stamps, slot 12 + j of a query's row: (j, who, what, frame). "end": at the end of
# the row's own query (the producer's: its load of the next Q); "start": at the start of the row's query
BOUNDARY_STAMPS = (
    (0, "C0", "epilogue: stage 1's O piece read (tma_store_wait)", "end"),
    (1, "C0", "epilogue: O's other pieces' stores issued", "end"),
    (2, "C0", "next S0: next Q landed (bar_q)", "end"),
    (3, "C0", "next S0: stage 0 left landed (ready)", "end"),
    (4, "C0", "next S0: stage 0 right landed (ready)", "end"),
    (5, "C1", "epilogue: O_R in stage 1, store to issue", "end"),
    (6, "C1", "epilogue: O_R read from stage 1 (tma_store_wait)", "end"),
    (7, "C1", "Q landed (bar_q)", "start"),
    (8, "C1", "pair 0: stage 1 left landed (ready)", "start"),
    (9, "C0", "pair 0: previous O's P-piece stores read", "start"),
    (10, "prod", "next Q: both consumers past the last QK (q_free)", "end"),
    (11, "prod", "next Q's load issued", "end"),
    (12, "prod", "the query's index row landed (bar_i)", "start"),
    (13, "prod", "pair 0: stage 0 left free, gather starts", "start"),
    (14, "prod", "pair 0: stage 0 right free, gather starts", "start"),
    (15, "prod", "pair 0: stage 1 left free, gather starts", "start"),
    (16, "prod", "pair 0: stage 1 right free, gather starts", "start"),
    (17, "prod", "pair 0: all its gathers issued", "start"),
)


def _pp_smem(H: int, D: int, TP: int, BI: int, rows: int = 1, o_in_p: bool = False) -> int:
    """fwd_kernel_pp's shared memory in bytes: Q, two KV stages, P of both blocks of a pair, the index row(s)
    (o_in_p: and a third 64 x 64 bf16 piece of O where D = 512)."""
    return ((H + 2 * BI) * D * 2 + 2 * H * BI * 2 + rows * TP * 4 + 4 * H * 4
            + (H * 64 * 2 if o_in_p and D // 128 > 3 else 0))


@functools.lru_cache(maxsize=None)
def fwd_kernel_pp(H: int, D: int, TP: int, scale: float, BI: int = 64, nreg: tuple = (232, 40), diag: str = "",
                  ctas: int = 0, lazy: float = 0.0, late_s0: bool = False, o_in_p: bool = False,
                  q_tma: bool = False, s0_first: bool = False, q_prefetch: bool = False, q_late: bool = False):
    """o, lse = fwd(q, kv, sink, idx), ping-pong schedule (384 threads); H == 64, TP a multiple of 2 * BI.

    Roles. Warpgroup 2, the producer: copies the query's index row and Q into shared memory (``bar_q``), then
    for each pair i gathers blocks 2i (stage 0) and 2i + 1 (stage 1) in D halves, in the order the halves are
    freed: (0, L), (0, R), (1, L), (1, R); ``ready[2 s + h]`` / ``free[2 s + h]``. Holes (-1) fail the copy's
    bounds check and are zero-filled without a read. Consumer 0 owns output columns L = [0, D/2), consumer 1
    R = [D/2, D). Pair i, with m the running max after block 2i - 1 (S0 of block 2i is already in consumer 0's
    accumulator):

      C0: m0 = max(m, rowmax S0); P0 = bf16(exp2(c S0 - c m0)); publish P0, m0 (``bar_p0``);
          O_L = O_L exp2(c (m - m0)) + P0 V0[:, L]; wait P1, m1 (``bar_p1``); O_L = O_L exp2(c (m0 - m1)) +
          P1 V1[:, L]; issue the QK of block 2i + 2 (left half, then - once P1 V1[:, L] is done - right half).
      C1: issue S1 = Q K1^T; wait P0, m0; O_R = O_R exp2(c (m - m0)) + P0 V0[:, R] (in flight during its
          softmax); m1 = max(m0, rowmax S1); P1 = bf16(exp2(c S1 - c m1)); publish P1, m1;
          O_R = O_R exp2(c (m0 - m1)) + P1 V1[:, R].

    Both consumers keep the fp32 probability sum of their own blocks, rescaled with their output half; at the
    end the two sums (under the same final max) and the sink exp2(sink log2e - c m) form the denominator, and
    LSE = log2(l) + c m as the other forwards. P0 / P1 are rewritten only after the other consumer's P V that
    reads them completed (``p_free``). Shared memory: Q + 2 * BI * D * 2 + 2 * 64 * BI * 2 + TP * 4 bytes.

    ``ctas`` (0: one CTA a query): a persistent grid of that many CTAs (the SM count; one CTA fits an SM), CTA c
    taking queries c, c + ctas, ...; every per-pair barrier's phase runs on over its queries (gp = k NP + i). The
    producer loads the next query's index row (a second buffer) as soon as it has issued the current query's gathers,
    its Q once both consumers are past their last QK (``q_free``), and gathers its first blocks as the stages free
    up; O is staged in stage 1 (each consumer's half is free once its own last P V is done), whose halves the
    epilogue frees once the TMA store has read them; consumer 0 issues the next query's first QK before its
    epilogue. So a query's start and end overlap its neighbours' pairs instead of costing each CTA ~25% of its time
    (run 65: ~4000 cycles before the first QK, ~3200 after the last P V, of ~41000). Same arithmetic, same bits.

    ``lazy`` (0: the release's numerics): tau > 0 keeps a warp's running maxima until one of its 16 rows would move by
    more than tau (log2 units), and skips the O rescale of a warp whose factors are all exactly 1, as FlashAttention-4
    does: P <= 2^tau is rounded to bf16 under the stale max, the sums and O under the same one, so the result is the
    same softmax to rounding (bits differ from the release's, within DESIGN's tolerances: against an fp64 softmax its
    mean error is 1.00-1.07x the release numerics', run 69), with most of the ~256 FMULs a thread spends on O
    rescales per pair gone.

    ``late_s0`` (persistent only): consumer 0 issues the next query's first QK after its epilogue has issued the O
    store, not before the epilogue, and waits for the store's reads only after that QK is issued: the QK's waits
    (the next Q, stage 0's gathers) then pass under the store's reads instead of delaying the epilogue, which is on
    the path to stage 1's next gather and consumer 1's next S1. ``o_in_p`` (with ``late_s0``): only O_L's last 64
    columns go through stage 1 (stored first, then freed once read, while the others are written); the others
    through P0, P1 and a 64 x 64 buffer (D = 512), free then until consumer 0's next P0 (it waits for their reads
    first) and consumer 1's next P1 (``p_free1`` of the query's last pair arrives after those reads). Stage 1's
    left half is then free after one 8 KB read instead of 32 KB. Both: the same arithmetic, the same bits (run 91).
    Measured (run 90, H100, release shape, three rounds): the default 490-505 TFLOP/s, late_s0 500-523, late_s0 +
    o_in_p 504-526; consumer 1's first S1 of a query comes ~1000 cycles earlier, and the serial chain of the pairs
    after takes most of it back. On the default path (sparse_attn_tl.FWD_PP_BOUNDARY) since run 92 passed its
    tests with them (H100: +1-4% on average over three rounds, the same bits).

    ``q_tma`` (persistent only): the producer loads each query's Q [64, D] (64 KB, from HBM) with one TMA load, its
    bytes expected on ``bar_q``, instead of 4096 16-byte cp.asyncs spread over its threads. Why: the next query's first
    gathers are issued right behind that Q load, so with cp.async they queue behind its reads, and each thread's
    cp.async arrival on a stage's ready barrier also waits for all its earlier copies, Q's included; the traces put
    the next query's first QK ~3000 cycles after consumer 0's O is in shared memory. The same bits by construction
    (the same Q lands in the same layout). No gain (run 139: 521.2 TFLOP/s against 528.5, the next QK where it was).

    ``s0_first`` (with ``o_in_p``): consumer 0 issues all four of O_L's stores, then the next query's first QK, and
    only then waits for stage 1's piece to be read and frees stage 1's left half: the QK no longer waits behind that
    read (the earlier traces put O's store reads at ~2500 cycles for 32 KB), at the cost of stage 1's left half
    being freed after the QK's waits. The same arithmetic, the same bits. No gain (run 140: 519.7 against 529.2; that
    read takes ~110 cycles, and the QK waits for stage 0's gathers instead).

    ``q_prefetch`` (persistent only): at the start of each query's gathers one producer thread prefetches the next
    query's Q (64 KB) and index row into L2 (``cp.async.bulk.prefetch.L2``), so that their loads a query later come
    from L2, not HBM. Why: the boundary trace (``diag="traceb"``, run 140) has Q's 64 KB from HBM taking ~5000
    cycles to land, and each producer thread's cp.async arrival on stage 0's ready barrier waits for its share of
    Q, so the next query's first QK waited for Q. The same bits by construction. No gain (run 141: 524.7 against
    535.1; stage 0 still lands ~5000 cycles after its free, so Q's HBM latency is not what holds it back).

    ``q_late`` (persistent only): the producer loads each query's Q (after the CTA's first) right behind the gathers
    of its first block (stage 0), not right after the previous query's last gathers: stage 0's ready arrivals then
    no longer cover Q's copies, and its gathers no longer queue behind them (runs 140-141: they land ~4700 cycles
    after their free at a query boundary, ~1600 within a query). Q lands later; with ``q_prefetch`` it comes from
    L2. The same bits by construction. No gain (run 142, H200: 518.8 alone, 518.9 with ``q_prefetch``, against
    519.1; stage 0 still lands ~4200 cycles after its free, so queueing behind Q is not what holds it back).
    These four stay opt-in and off; their runs are in BENCHMARKS.md (runs 139-142).

    ``diag`` (benchmark ablations only, wrong outputs): "compute" = the producer gathers the first pair only and then
    re-signals the stages (stale rows: the compute alone); "gather" = the consumers compute nothing, they wait for
    each stage half and free it at once (the gathers alone, at this kernel's two stages; no O or LSE written);
    "nolatency" = every gather is issued as usual, but its stage half is signalled ready at once, not when its rows
    have landed (the gathers' traffic without their latency on the chain);
    "smemwrite" = each stage half gets the same 16-byte shared-memory writes from the same producer threads, but of
    zeros by generic stores, read from nowhere, and is signalled ready at once (O = 0 exactly: the smem writes'
    share of what the gathers cost, without their reads from L2); "smemwrite_quarter" = the same with a quarter of
    the bytes (each thread's first 16-byte piece of each row it covers; the rest keeps stale rows), the same barriers
    (whether the bytes or the producer's path per stage half cost);
    "nosoftmax" = no row maxima or exponentials (P = S);
    "nostore" (late_s0 path) = O is normalised and staged as usual but never stored (O not written: the cost of O's
    store reads on the query boundary's chain; run 140 measured it 22% slower than the kernel, at 594 W against
    508, not understood);
    "trace" = the normal kernel, but thread 0 of each consumer writes clock64() stamps (cycles since the CTA's start)
    into the LSE row instead of the LSE, 12 a pair (TP <= 640) and 4 at the end (persistent: into each query's row,
    still from the CTA's start); ``kernels.bench --only attntrace`` prints their medians as a timeline;
    "traceb" (late_s0 + o_in_p, TP 512-640) = "trace" with pairs 1-2's slots holding the query boundary's stamps
    instead, the producer's included (``BOUNDARY_STAMPS``; ``kernels.bench --only attntraceb``).
    """
    B, M, N = T.dynamic("B"), T.dynamic("M"), T.dynamic("N")
    if H != 64:
        raise ValueError("fwd_kernel_pp: H must be 64 (one warpgroup's WGMMA M)")
    if D % 128 or D > 512:
        raise ValueError("fwd_kernel_pp: D must be a multiple of 128, <= 512")
    if TP % (2 * BI) or BI % 16 or BI > 64:
        raise ValueError("fwd_kernel_pp: TP a multiple of 2*BI, BI a multiple of 16 up to 64")
    if _pp_smem(H, D, TP, BI, 2 if ctas else 1, o_in_p) > 227 * 1024 - 2048:
        raise ValueError("fwd_kernel_pp: shared memory over 227 KB")
    check_nreg("fwd_kernel_pp", nreg)
    if diag not in ("", "compute", "nosoftmax", "trace", "traceb", "gather", "nolatency", "nostore", "smemwrite",
                    "smemwrite_quarter"):
        raise ValueError(f"fwd_kernel_pp: diag {diag!r}")
    if not isinstance(ctas, int) or ctas < 0:
        raise ValueError(f"fwd_kernel_pp: ctas must be 0 (a CTA a query) or the persistent grid's size, got {ctas!r}")
    for name, on in (("late_s0", late_s0), ("q_tma", q_tma), ("q_late", q_late), ("q_prefetch", q_prefetch)):
        if on and not ctas:
            raise ValueError(f"fwd_kernel_pp: {name} needs the persistent grid (ctas > 0)")
    if s0_first and not o_in_p:
        raise ValueError("fwd_kernel_pp: s0_first needs o_in_p")
    if diag == "nostore" and not late_s0:
        raise ValueError("fwd_kernel_pp: diag='nostore' needs late_s0 (its epilogue's stores are TMA copies)")
    if o_in_p and not (late_s0 and BI == 64):
        raise ValueError("fwd_kernel_pp: o_in_p needs late_s0 (and BI = 64: a P buffer holds 64 x 64 of O)")
    if not 0 <= lazy <= 16:
        raise ValueError(f"fwd_kernel_pp: lazy must be in [0, 16] (log2 units; P <= 2^lazy in bf16), got {lazy!r}")
    P = ctas > 0
    OP = bool(o_in_p)
    NB = 2 if P else 1                  # index rows in shared memory (persistent: the next query's beside)
    TR = diag in ("trace", "traceb")
    TB = diag == "traceb"
    NP = TP // BI // 2
    if TR and NP > 5:
        raise ValueError("fwd_kernel_pp: diag='trace' keeps 12 stamps a pair in the 64 LSE slots: TP <= 640")
    if TB and not (OP and NP >= 4):
        raise ValueError("fwd_kernel_pp: diag='traceb' stamps the o_in_p boundary (late_s0, o_in_p) in pairs 1-2's "
                         "slots, the last pair's kept: it needs o_in_p and TP >= 8 BI")
    DH = D // 2

    @T.macro
    def clock_to(slot, t0s, Lse, bi, mi):
        """Thread 0 of the calling warpgroup writes clock64() - the CTA's start into Lse[bi, mi, slot] (cycles, exact
        in fp32 below 2^24)."""
        if T.get_thread_binding() % 128 == 0:
            Lse[bi, mi, slot] = T.cast(T.call_extern("int64", "clock64") - t0s[0], F32)

    @T.macro
    def stamp(slot, t0s, Lse, bi, mi):
        """diag="trace": clock_to(slot). "traceb": not in pairs 1-2's slots [12, 36), which hold bstamp's."""
        if TB:
            if slot < 12 or slot >= 36:
                clock_to(slot, t0s, Lse, bi, mi)
        elif TR:
            clock_to(slot, t0s, Lse, bi, mi)

    @T.macro
    def bstamp(j, t0s, Lse, bi, mi):
        """diag="traceb": a query-boundary stamp j (< 24) into slot 12 + j of query (bi, mi)'s row (BOUNDARY_STAMPS
        names them)."""
        if TB:
            clock_to(12 + j, t0s, Lse, bi, mi)

    # warpgroups 0 and 1: the QKs, softmaxes and P Vs, and the epilogue (``sparse_attn_pp_consumer_tl``)
    consumer = consumer_macro(H, D, TP, BI, M, ctas, nreg[0], diag, scale=scale, lazy=lazy, late_s0=late_s0,
                              o_in_p=o_in_p, s0_first=s0_first, stamp=stamp, bstamp=bstamp)

    # warpgroup 2: the index rows, Q and the KV gathers (the one role that reads Q, KV and Idx)
    producer = producer_macro(H, D, TP, BI, M, ctas, nreg[1], diag, q_tma=q_tma, q_late=q_late, q_prefetch=q_prefetch,
                              bstamp=bstamp)

    @T.macro
    def cta_body(cta, bi, mi, Q, KV, Sink, Idx, O, Lse):
        """One CTA: shared memory, barriers, the three roles. ``cta`` (persistent) or (bi, mi): its query."""
        q_s = T.alloc_shared([1, H, D], BF16)      # [1, ...]: indexed by the runtime zero z (consumers)
        zs = T.alloc_shared([1], I32)
        t0s = T.alloc_shared([1], "int64")          # diag="trace": the CTA's start (clock64)
        kv_s = T.alloc_shared([2, BI, D], BF16)
        p_s = T.alloc_shared([2, H, BI], BF16)
        idx_s = T.alloc_shared([NB, TP], I32)
        mx_s = T.alloc_shared([2, H], F32)
        sum_s = T.alloc_shared([2, H], F32)
        o_s = T.alloc_shared([H, 64], BF16) if OP and DH // 64 > 3 else None   # o_in_p: O_L's third piece

        bar_q = T.alloc_barrier(arrive_count=128)
        bar_i = T.alloc_barrier(arrive_count=128)   # persistent: an index row landed
        q_free = T.alloc_barrier(arrive_count=256)  # persistent: both consumers past their last QK
        ready = T.alloc_barrier(arrive_count=[128] * 4)
        free = T.alloc_barrier(arrive_count=[128] * 4)
        bar_p0 = T.alloc_barrier(arrive_count=128)
        bar_p1 = T.alloc_barrier(arrive_count=128)
        p_free0 = T.alloc_barrier(arrive_count=128)
        p_free1 = T.alloc_barrier(arrive_count=128)
        bar_end = T.alloc_barrier(arrive_count=256)

        NQ = (B * M - cta + ctas - 1) // ctas if P else 1  # this CTA's queries: cta, cta + ctas, ...
        tx = T.get_thread_binding()
        if tx == 0:
            zs[0] = 0
            if TR:
                t0s[0] = T.call_extern("int64", "clock64")
        T.sync_threads()
        if tx < 128:
            consumer(0, cta, NQ, zs, q_s, kv_s, idx_s, p_s, mx_s, sum_s, o_s, bar_q, q_free, ready, free, bar_p0,
                     bar_p1, p_free0, p_free1, bar_end, t0s, Sink, O, Lse, bi, mi)
        elif tx < 256:
            consumer(1, cta, NQ, zs, q_s, kv_s, idx_s, p_s, mx_s, sum_s, o_s, bar_q, q_free, ready, free, bar_p0,
                     bar_p1, p_free0, p_free1, bar_end, t0s, Sink, O, Lse, bi, mi)
        else:
            producer(cta, NQ, zs, q_s, kv_s, idx_s, bar_q, bar_i, q_free, ready, free, Q, KV, Idx, bi, mi, t0s, Lse)

    @T.prim_func
    def sparse_attn_fwd_pp(
        Q: T.Tensor([B, M, H, D], BF16),
        KV: T.Tensor([B, N, D], BF16),
        Sink: T.Tensor([H], F32),
        Idx: T.Tensor([B, M, TP], I32),
        O: T.Tensor([B, M, H, D], BF16),
        Lse: T.Tensor([B, M, H], F32),
    ):
        if P:
            with T.Kernel(ctas, threads=384) as cta:
                cta_body(cta, cta // M, cta % M, Q, KV, Sink, Idx, O, Lse)
        else:
            with T.Kernel(M, B, threads=384) as (mi, bi):
                cta_body(0, bi, mi, Q, KV, Sink, Idx, O, Lse)

    return compile_kernel(sparse_attn_fwd_pp, out_idx=[4, 5])


def pp_fits(H: int, D: int, TP: int, BI: int = 64, ctas: int = 0, o_in_p: bool = False, **kernel_opts) -> bool:
    """fwd_kernel_pp's shapes: 64 heads, D a multiple of 128 up to 512, TP a multiple of 2 * BI, and Q, two
    stages, P and the index row (two when persistent, ``ctas`` > 0; ``o_in_p``'s piece of O) within the shared
    memory. ``kernel_opts``: fwd_kernel_pp's other keywords, which take no shared memory, so that a caller can pass
    the option dict it builds the kernel with (``pp_fits(H, D, TP, **kw)``); any other name is refused."""
    unknown = set(kernel_opts) - _PP_NO_SMEM_OPTS
    if unknown:
        raise TypeError(f"pp_fits: {sorted(unknown)} are not fwd_kernel_pp options")
    return (H == 64 and D % 128 == 0 and D <= 512 and TP % (2 * BI) == 0
            and _pp_smem(H, D, TP, BI, 2 if ctas else 1, o_in_p) <= 227 * 1024 - 2048)


# fwd_kernel_pp's options (its keywords with defaults) that pp_fits does not take itself, none of which takes shared
# memory: derived from the signature, so that a new kernel option needs no second list kept in step here
_PP_NO_SMEM_OPTS = ({n for n, p in inspect.signature(fwd_kernel_pp.__wrapped__).parameters.items()
                     if p.default is not inspect.Parameter.empty} - set(inspect.signature(pp_fits).parameters))
