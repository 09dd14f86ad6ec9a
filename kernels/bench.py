"""Benchmark the TileLang kernels at the release shapes: ``python -m functional_dsv41.kernels.bench``.

Prints, in one run: the machine's measured ceilings (bf16 matmul, device-to-device copy), then TFLOP/s
and GB/s of each kernel and of the peers present in the image (torch._scaled_mm, SDPA over gathered
KV, the torch reference). Times are medians of CUDA-event timings (triton.testing.do_bench).

FLOP conventions (stated in the output): sparse attention forward 2*B*M*H*T*(D + D) (QK and PV over
the T gathered slots, holes included); backward 2.5x that (dP, dq, dk, dv plus the recomputed QK);
GEMM 2*M*N*K. GB/s counts the fewest bytes the op must move (inputs read once, outputs written once), except
for attention: gathered KV rows once per use, most of them served by L2, so it can exceed the HBM copy ceiling.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from functional_dsv41.config import write_atomic

from ._bench_common import bench, graph_ms, positive_int, row
from .bench_attn import (ATTN_BWD_SWEEP, ATTN_FWD_SWEEP, attention_bound, attention_bwd, attention_cl,
                         attention_diag, attention_fwd, attention_nreg, attention_pp, attention_tail, attention_trace,
                         attention_trace_boundary)
from .bench_gemm import (FP4_GEMM_CFGS, GEMM_CFGS, fp4_gemms, fp4_grouped, gemm_diag, gemm_group128, gemm_probe,
                         gemm_small, gemm_tail, gemm_wide, gemm_wrapper, gemms)


def ceilings(results):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    results.append(row("ceiling: bf16 matmul 8192^3 (torch)", bench(lambda: a @ b), 2 * n ** 3))
    x = torch.empty(2 * 1024 ** 3 // 4, device="cuda", dtype=torch.float32).normal_()
    y = torch.empty_like(x)
    results.append(row("ceiling: device copy 2 GiB (read+write)", bench(lambda: y.copy_(x)), None, 2 * x.numel() * 4))
    del a, b, x, y


def quantizers(results, args):
    from functional_dsv41 import quant as Q
    from functional_dsv41.kernels.tilelang import act_quant_tl as aq
    x = torch.randn(args.m, 5120, device="cuda").bfloat16()
    by = x.numel() * 3 + x.numel() // 32
    print(f"-- act_quant [{args.m}, 5120] bf16 -> e4m3 + e8m0/32", flush=True)
    results.append(row("act_quant tilelang", bench(lambda: aq.act_quant(x)), None, by))
    results.append(row("act_quant torch reference", bench(lambda: Q.act_quant(x)), None, by))


def fp4_hc(results, args):
    """fp4_act_quant at the indexer ([M, 512], e8m0/32) and compressed-KV ([32M, 128], e4m3/16) shapes
    (the hc_split_sinkhorn rows moved to the "hc" section)."""
    from functional_dsv41 import quant as Q
    from functional_dsv41.kernels.tilelang import fp4_quant_tl as fq
    for (r, n, bs, sd) in ((args.m, 512, 32, Q.E8M0), (args.m * 32, 128, 16, Q.FP8)):
        x = torch.randn(r, n, device="cuda").bfloat16()
        by = x.numel() * 2 + x.numel() // 2 + x.numel() // bs
        print(f"-- fp4_act_quant [{r}, {n}] bf16 -> e2m1 + {sd}/{bs}", flush=True)
        results.append(row(f"fp4_act_quant [{r},{n}] /{bs} tilelang", bench(lambda: fq.fp4_act_quant(x, bs, sd)), None, by))
        results.append(row(f"fp4_act_quant [{r},{n}] /{bs} torch reference", bench(lambda: Q.fp4_act_quant(x, bs, sd)), None, by))


def hc_sinkhorn(results, args):
    """hc_split_sinkhorn [M, 24] (hc 4, 20 iterations): forward variants (tokens per CTA; IEEE division,
    IEEE reciprocal + multiply, MUFU reciprocal + multiply), the backward alone (TileLang kernel, CTA sizes; torch recompute; reference
    autograd) and forward+backward through autograd. "eager" rows time the Python call (host overhead
    included, what training sees without graphs); "graph" rows the GPU alone (20 calls in a CUDA graph).
    GB/s: fwd mixes read + 24 outputs written; bwd mixes + 24 output grads read, d mixes written."""
    from functional_dsv41.kernels import reference
    from functional_dsv41.kernels.tilelang import hc_sinkhorn_tl as hs
    M = args.m
    g = torch.Generator(device="cuda").manual_seed(0)
    m = torch.randn(M, 24, device="cuda", generator=g) * 2
    sc, bb = torch.tensor([0.5, 0.7, 1.3], device="cuda"), torch.randn(24, device="cuda", generator=g)
    gp, gq, gc = (torch.randn(M, *s, device="cuda", generator=g) for s in ((4,), (4,), (4, 4)))
    by_f, by_b = M * 24 * 4 * 2, M * 24 * 4 * 3
    print(f"-- hc_split_sinkhorn [{M}, 24], hc 4, 20 iterations", flush=True)

    def both(name, fn, nbytes, graph=True):
        try:
            results.append(row(name + " eager", bench(fn), None, nbytes))
            if graph:
                results.append(row(name + " graph", graph_ms(fn), None, nbytes))
        except Exception as e:
            print(f"!! {name}: {type(e).__name__}: {e}", flush=True)

    # forward
    both("hc fwd API tilelang (default cfg)", lambda: hs.hc_split_sinkhorn(m, sc, bb), by_f)
    for threads in (128, 64, 32):
        for div in ("ieee", "rcp", "approx"):
            try:
                k = hs.hc_split_sinkhorn_kernel(4, 20, 1e-6, threads, div)
            except Exception as e:
                print(f"!! hc fwd kernel threads={threads} div={div}: {type(e).__name__}: {e}", flush=True)
                continue
            both(f"  fwd kernel threads={threads} div={div}", lambda: k(m, sc, bb), by_f)
    both("hc fwd torch reference", lambda: reference.hc_split_sinkhorn(m, sc, bb), by_f)

    # backward alone
    for threads in (128, 64, 32):
        for div in ("rcp", "approx"):
            both(f"hc bwd tilelang threads={threads} div={div}",
                 lambda: hs._bwd_tl_run(m, sc, bb, gp, gq, gc, 4, 20, 1e-6, threads, div), by_b)
    both("hc bwd torch recompute (_bwd)", lambda: hs._bwd(m, sc, bb, gp, gq, gc, 4, 20, 1e-6), by_b)
    mr, scr, br = (t.clone().requires_grad_() for t in (m, sc, bb))
    outs = reference.hc_split_sinkhorn(mr, scr, br)
    both("hc bwd torch reference autograd",
         lambda: torch.autograd.grad(outs, (mr, scr, br), (gp, gq, gc), retain_graph=True), by_b, graph=False)

    # forward + backward through autograd
    mg, scg, bg = (t.clone().requires_grad_() for t in (m, sc, bb))

    def fb(fn):
        pre, post, comb = fn(mg, scg, bg)
        torch.autograd.grad((pre, post, comb), (mg, scg, bg), (gp, gq, gc))
    for bwd in ("tilelang", "torch"):
        both(f"hc fwd+bwd tilelang fwd / {bwd} bwd", lambda: fb(lambda *a: hs.hc_split_sinkhorn(*a, bwd=bwd)),
             by_f + by_b, graph=False)
    both("hc fwd+bwd torch reference autograd", lambda: fb(reference.hc_split_sinkhorn), by_f + by_b, graph=False)


def indexer(results, args):
    """Lightning indexer: scoring (+ mask) TFLOP/s counting VISIBLE (query, entry) pairs only,
    2*pairs*Hi*Di; GB/s = q, k, w read + the [s, n] bf16 scores written. Top-k vs torch.topk (peer,
    no tie rule) and the reference's exact int64-key top-k. Backward = dq, dk, dw (3x the forward's
    visible FLOPs: recomputed q.k, dS k, dS^T q). Shapes: release prefill (s queries x n = s/4 entries,
    ratio 4, causal) and long-context rows (few queries x 16K..64K entries, all visible)."""
    from functional_dsv41.kernels import reference_indexer as ref
    from functional_dsv41.kernels.tilelang import index_topk_tl as itk, indexer_tl as it
    H, D = 32, 128
    # scoring variants (the default is SCORE_CFG = BQ 4, BN 128, stages 2, chunks by _chunks); stages 0 =
    # round 1's unpipelined loads; chunks: 1 = round 1's one CTA per query block, 2x = twice the default
    cfgs = getattr(args, "indexer_cfgs", [dict(BQ=4, BN=128, stages=0), dict(BQ=4, BN=64, stages=2),
                                          dict(BQ=2, BN=128, stages=2), dict(BQ=8, BN=64, stages=2),
                                          dict(BQ=4, BN=128, stages=3), dict(hsum="gemm"),
                                          dict(hsum="gemm", BQ=8, BN=64)])
    topk_threads = getattr(args, "indexer_topk_threads", [256, 512, 1024])
    bwd_cfgs = [dict(stages=0), dict(chunks=1), dict(stages=0, chunks=1), dict(BNk=64)]
    shapes = [(args.m, args.m // 4, 4), (64, 16384, 0), (16, 65536, 0)]
    for (s, n, ratio) in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, s, H, D, device="cuda", generator=g).bfloat16()
        k = torch.randn(1, n, D, device="cuda", generator=g).bfloat16()
        w = (torch.randn(1, s, H, device="cuda", generator=g) / 64).bfloat16()
        t = torch.arange(s, device="cuda")
        hi = (((t + 1) // ratio).clamp(max=n) if ratio else torch.full_like(t, n))[None].contiguous()
        lo = torch.zeros_like(hi)
        pairs = int((hi - lo).sum())
        fl, by = 2 * pairs * H * D, q.numel() * 2 + k.numel() * 2 + w.numel() * 2 + s * n * 2
        print(f"-- indexer scoring s={s} n={n} Hi={H} Di={D} {'causal ratio ' + str(ratio) if ratio else 'all visible'}: "
              f"{pairs / (s * n):.0%} of pairs visible, {fl / 1e9:.1f} GFLOP (visible pairs only)", flush=True)
        results.append(row(f"index_scores tilelang s={s} n={n}", bench(lambda: it.index_scores(q, k, w, lo, hi)), fl, by))
        for cfg in cfgs:
            try:
                results.append(row(f"  score kernel {json.dumps(cfg, separators=(',', ':'))}",
                                   bench(lambda: it._score_fwd(q, k, w, lo, hi, cfg=cfg)), fl, by))
            except Exception as e:
                print(f"  score kernel {cfg}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        c0 = it._chunks(s // 4, n // 128, torch.cuda.get_device_properties(0).multi_processor_count)
        for ch in sorted({1, 2 * c0, max(1, c0 // 2)} - {c0}):
            try:
                results.append(row(f"  score kernel default cfg, chunks={ch} (default {c0})",
                                   bench(lambda: it._score_fwd(q, k, w, lo, hi, cfg=dict(chunks=ch))), fl, by))
            except Exception as e:
                print(f"  score kernel chunks={ch}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        cand = torch.rand(1, s, n, device="cuda", generator=g) < 0.5
        try:
            results.append(row("  with a candidate mask (level 2)", bench(lambda: it.index_scores(q, k, w, lo, hi, cand)),
                               fl, by + s * n))
        except Exception as e:
            print(f"  with candidates: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        results.append(row("index_scores torch reference", bench(lambda: ref.index_scores(q, k, w, lo, hi), 2, 10), fl, by))
        I = ref.index_scores(q, k, w, lo, hi)
        kt = 512
        by_t = s * n * 2 + s * kt * 8
        results.append(row(f"index_topk tilelang k={kt} threads=auto ({itk._topk_threads(s, n, 132)})",
                           bench(lambda: itk.index_topk(I, kt)), None, by_t))
        for th in topk_threads:
            for agg in (False, True):
                try:
                    results.append(row(f"index_topk tilelang k={kt} threads={th}{' agg' if agg else ''}",
                                       bench(lambda: itk.index_topk(I, kt, threads=th, agg=agg)), None, by_t))
                except Exception as e:
                    print(f"  topk threads={th} agg={agg}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        results.append(row("index_topk torch reference (exact ties)", bench(lambda: ref.index_topk(I, kt), 2, 10), None, by_t))
        results.append(row("peer: torch.topk (no tie rule, unsorted ids)",
                           bench(lambda: torch.topk(I, min(kt, n), dim=-1, sorted=False)), None, by_t))
        if n >= 16384:
            blocks = (torch.arange(n, device="cuda") // 8)[None].contiguous()
            results.append(row("index_candidates tilelang path (amax + top-k kernel, 2048 of n/8 blocks)",
                               bench(lambda: itk.index_candidates(I, lo, hi, 8, n // 8, 2048), 2, 10), None, s * n * 3))
            for th in topk_threads:
                try:
                    results.append(row(f"  candidates top-k threads={th} (auto {itk._topk_threads(s, n // 8, 132)})",
                                       bench(lambda: itk.index_candidates(I, lo, hi, 8, n // 8, 2048, threads=th), 2, 10),
                                       None, s * n * 3))
                except Exception as e:
                    print(f"  candidates threads={th}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            results.append(row("index_candidates torch reference",
                               bench(lambda: ref.index_candidates(I, lo, hi, blocks, n // 8, 2048), 2, 10), None, s * n * 3))
        qg, kg, wg = (x.clone().requires_grad_(True) for x in (q, k, w))
        out = it.index_scores(qg, kg, wg, lo, hi)
        dI = torch.randn_like(out).masked_fill(torch.isneginf(out), 0)
        results.append(row("index_scores bwd (dq, dk, dw) tilelang path",
                           bench(lambda: torch.autograd.grad(out, (qg, kg, wg), dI, retain_graph=True), 2, 10), 3 * fl))
        for part in ("q", "k"):
            results.append(row(f"  bwd {'dq/dw' if part == 'q' else 'dk'} kernel alone (default cfg, incl. zero-fill)",
                               bench(lambda: it._score_bwd(q, k, w, lo, hi, None, dI, only=part), 2, 10), 2 * fl))
        for bc in bwd_cfgs:
            try:
                results.append(row(f"  bwd kernels {json.dumps(bc, separators=(',', ':'))}",
                                   bench(lambda: it._score_bwd(q, k, w, lo, hi, None, dI, cfg=bc), 2, 10), 3 * fl))
            except Exception as e:
                print(f"  bwd cfg {bc}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        results.append(row("  bwd in plain torch ops (recomputed [s,Hi,n] scores)",
                           bench(lambda: it._score_bwd_torch(q, k, w, lo, hi, None, dI), 2, 10), 3 * fl))
        outr = ref.index_scores(qg, kg, wg, lo, hi)
        results.append(row("index_scores bwd torch reference (autograd)",
                           bench(lambda: torch.autograd.grad(outr, (qg, kg, wg), dI, retain_graph=True), 2, 10), 3 * fl))
        del q, k, w, I, out, outr, qg, kg, wg, dI, cand
        torch.cuda.empty_cache()
    # top-k alone on more (rows, n): where the thread-count rule (_topk_threads) is not measured yet
    for (r, n) in ((4096, 4096), (4096, 16384), (512, 16384), (132, 4096)):
        g = torch.Generator(device="cuda").manual_seed(1)
        X = torch.randn(r, n, device="cuda", generator=g).bfloat16()
        by_t = r * n * 2 + r * 512 * 8
        print(f"-- indexer top-k k=512 rows={r} n={n} (auto threads {itk._topk_threads(r, n, 132)})", flush=True)
        for th in topk_threads:
            for agg in (False, True):
                try:
                    results.append(row(f"index_topk tilelang rows={r} n={n} threads={th}{' agg' if agg else ''}",
                                       bench(lambda: itk.index_topk(X, 512, threads=th, agg=agg)), None, by_t))
                except Exception as e:
                    print(f"  topk threads={th} agg={agg}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        results.append(row("peer: torch.topk (no tie rule, unsorted ids)",
                           bench(lambda: torch.topk(X, 512, dim=-1, sorted=False)), None, by_t))
        del X


def hc_apply(results, args):
    """hc_pre / hc_post at the release shape ([M] tokens, hc 4, dim 5120, bf16): the fused kernels against the torch
    reference (whose hc_post builds an [M, 4, 4, 5120] fp32 temporary): forwards, backwards, and both forward +
    backward with the kernel and the torch backwards. GB/s count the bytes that must move: hc_pre reads h (bf16) and
    writes x; hc_post reads y and res and writes out; their backwards read the inputs and the gradient and write
    the bf16 gradients."""
    from functional_dsv41.kernels.tilelang import hc_apply_tl as ha
    enabled, ha.ENABLED = ha.ENABLED, True   # (opt-in in the model until measured: this measures it)
    try:
        _hc_apply_rows(results, args, ha)
    finally:
        ha.ENABLED = enabled


def _hc_apply_rows(results, args, ha):
    from functional_dsv41.kernels import reference
    M, hc, dim = args.m, 4, 5120
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(M, hc, dim, device="cuda", generator=g).bfloat16()
    y = torch.randn(M, dim, device="cuda", generator=g).bfloat16()
    pre = torch.rand(M, hc, device="cuda", generator=g)
    post = 2 * torch.rand(M, hc, device="cuda", generator=g)
    comb = torch.softmax(torch.randn(M, hc, hc, device="cuda", generator=g), -1)
    by_pre, by_post = M * dim * 2 * (hc + 1), M * dim * 2 * (2 * hc + 1)
    print(f"-- hc_pre / hc_post [{M}, {hc}, {dim}] bf16", flush=True)
    results.append(row("hc_pre tilelang", bench(lambda: ha.hc_pre(h, pre)), None, by_pre))
    for st in (True, False):
        k, x = ha.hc_pre_kernel(hc, dim, st), torch.empty_like(y)
        results.append(row(f"  hc_pre kernel staged={st}", bench(lambda: k(h, pre, x)), None, by_pre))
    results.append(row("hc_pre torch reference", bench(lambda: reference.hc_pre(h, pre)), None, by_pre))
    results.append(row("hc_post tilelang", bench(lambda: ha.hc_post(y, h, post, comb)), None, by_post))
    for st in (True, False):
        k, o = ha.hc_post_kernel(hc, dim, st), torch.empty_like(h)
        results.append(row(f"  hc_post kernel staged={st}", bench(lambda: k(y, h, post, comb, o)), None, by_post))
    results.append(row("hc_post torch reference", bench(lambda: reference.hc_post(y, h, post, comb)), None, by_post))
    dx, dout = torch.randn_like(y), torch.randn_like(h)
    # backward bytes: hc_pre reads h, dx and writes dh; hc_post reads y, res, dout and writes dy, dres
    bb_pre, bb_post = M * dim * 2 * (2 * hc + 1), M * dim * 2 * (4 * hc + 2)
    k = ha.hc_pre_bwd_kernel(hc, dim)
    dh, dp = torch.empty_like(h), torch.empty_like(pre)
    results.append(row("hc_pre bwd kernel", bench(lambda: k(h, pre, dx, dh, dp)), None, bb_pre))
    results.append(row("hc_pre bwd torch (reference.hc_pre_bwd)", bench(lambda: reference.hc_pre_bwd(h, pre, dx)),
                       None, bb_pre))
    k = ha.hc_post_bwd_kernel(hc, dim)
    dy, dr, dq, dc = torch.empty_like(y), torch.empty_like(h), torch.empty_like(post), torch.empty_like(comb)
    results.append(row("hc_post bwd kernel", bench(lambda: k(y, h, post, comb, dout, dy, dr, dq, dc.view(M, -1))),
                       None, bb_post))
    results.append(row("hc_post bwd torch (reference.hc_post_bwd)",
                       bench(lambda: reference.hc_post_bwd(y, h, post, comb, dout)), None, bb_post))
    hg, yg, pg, qg, cg = (t.clone().requires_grad_() for t in (h, y, pre, post, comb))

    def fb(fpre, fpost):
        a = fpre(hg, pg)
        b = fpost(yg, hg, qg, cg)
        torch.autograd.grad((a, b), (hg, yg, pg, qg, cg), (dx, dout))
    fused_bwd = ha.FUSED_BWD
    try:
        for fused in (True, False):
            ha.FUSED_BWD = fused
            results.append(row(f"hc_pre + hc_post fwd+bwd tilelang ({'kernel' if fused else 'torch'} bwd)",
                               bench(lambda: fb(ha.hc_pre, ha.hc_post)), None, None))
    finally:
        ha.FUSED_BWD = fused_bwd
    results.append(row("hc_pre + hc_post fwd+bwd torch reference autograd",
                       bench(lambda: fb(reference.hc_pre, reference.hc_post)), None, None))


# name -> section(results, args); each kernel family owns one entry (--only picks some)
SECTIONS = {
    "ceilings": lambda results, args: ceilings(results),
    "attnfwd": attention_fwd,
    "attndiag": attention_diag,
    "attnpp": attention_pp,
    "attnnreg": attention_nreg,
    "attnbound": attention_bound,
    "attntail": attention_tail,
    "attntrace": attention_trace,
    "attntraceb": attention_trace_boundary,
    "attncl": attention_cl,
    "attnbwd": attention_bwd,
    "gemm": gemms,
    "gemm128": gemm_group128,
    "gemmdiag": gemm_diag,
    "gemmtail": gemm_tail,
    "gemmprobe": gemm_probe,
    "gemmwrap": gemm_wrapper,
    "gemmsmall": gemm_small,
    "gemmwide": gemm_wide,
    "fp4gemm": fp4_gemms,
    "grouped": fp4_grouped,
    "quant": quantizers,
    "fp4hc": fp4_hc,
    "hc": hc_sinkhorn,
    "hcapply": hc_apply,
    "indexer": indexer,
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--m", type=positive_int, default=4096, help="queries / GEMM rows (release prefill 4096)")
    p.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections: " + ",".join(SECTIONS))
    p.add_argument("--json", default=None,
                   help="write the rows here (rewritten after each section, so a run cut short keeps the rows so far)")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="attnpp, attnnreg, attnbound: interleaved rounds of their rows, summarised by "
                        "median, min and max (default 3)")
    p.add_argument("--attn-data", choices=("random", "settled"), default="random",
                   help="the attention sections' KV rows: random normal (default), or 'settled': the window's rows x4, "
                        "so each query's running maxima are set in its first two blocks and rarely move after")
    args = p.parse_args(argv)
    parts = args.only.split(",")
    unknown = [s for s in parts if s not in SECTIONS]
    if unknown:
        p.error(f"argument --only: unknown section(s) {unknown}; known: {list(SECTIONS)}")
    json_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else None
    if json_dir and not os.path.isdir(json_dir):
        p.error(f"argument --json: no folder {json_dir} to write {args.json} in")
    if not torch.cuda.is_available():
        raise SystemExit("functional_dsv41.kernels.bench measures the GPU kernels and needs a CUDA device; "
                         "recorded H200 figures are in BENCHMARKS.md, CPU benchmarks in benchmarks/")
    args.attn_fwd_cfgs = list(ATTN_FWD_SWEEP)
    args.attn_bwd_cfgs = list(ATTN_BWD_SWEEP)
    # runs 9-10 measured the split knobs (dkv_ws, DC=256, dkv_threads, stages, dkv_BI=128, the window fast
    # path): all slower than the default; it alone is timed (end to end and per kernel)
    args.attn_bwd_split_cfgs = [{}]
    args.gemm_cfgs = [{}, *GEMM_CFGS]                   # {} = default_config(M, N, K) first (halves at 4096 rows; fp8_gemm_tl)
    args.fp4_gemm_cfgs = [{}, *FP4_GEMM_CFGS]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    try:
        import tilelang
        print(f"tilelang {tilelang.__version__}")
    except Exception as e:  # pragma: no cover
        print(f"tilelang unavailable: {e}")
    print(f"{'kernel':<48s} {'ms':>9s} {'TFLOP/s':>9s} {'GB/s':>9s}")
    results, failed = [], []
    for part in parts:
        t0 = time.monotonic()
        try:
            SECTIONS[part](results, args)
        except Exception as e:
            import traceback
            traceback.print_exc()
            print(f"!! {part} failed: {type(e).__name__}: {e}", flush=True)
            failed.append(part)
        torch.cuda.empty_cache()
        print(f"== section {part}: {time.monotonic() - t0:.0f} s", flush=True)
        if args.json:                   # after every section: a run stopped by a time limit keeps the rows so far
            write_atomic(args.json, json.dumps(results, indent=1))
    if failed:
        raise SystemExit(f"kernels.bench: {len(failed)} section(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
