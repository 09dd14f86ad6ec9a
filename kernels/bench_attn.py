"""The sparse-attention sections of ``python -m functional_dsv41.kernels.bench`` (attnfwd, attndiag, attnpp,
attnnreg, attnbound, attntail, attntrace, attntraceb, attncl, attnbwd) and the release prefill inputs they share.
Conventions: ``bench.py``'s docstring."""
import json
import statistics

import torch

from ._bench_common import bench, clock_under_load, interleaved_rounds, row


# attnfwd's and attnbwd's configuration sweeps. Run 10: fwd_kernel_ws's default (BI=32 pairs, 4 stages, no early QK)
# 365 TFLOP/s, early QK 299 (kept as the one sweep row, a regression check of the knob).
ATTN_FWD_SWEEP = (dict(kernel="ws", BI=32, stages=4, early_qk=True),)
ATTN_BWD_SWEEP = (dict(BI=64, DS=2),)


def _attn_release_inputs(args):
    """Release prefill attention operands: B=1, M queries, 64 heads x 512, 128 window + 512 of 2048
    compressed rows (ratio 2: query i sees (i+1)//2 of them)."""
    B, M, H, D, n_comp = 1, args.m, 64, 512, 2048
    N = M + n_comp
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, M, H, D, device="cuda", generator=g).bfloat16()
    kv = torch.randn(B, N, D, device="cuda", generator=g).bfloat16()
    if args.attn_data == "settled":                 # the window's rows (the first two blocks of each index row)
        kv[:, :M] *= 4                              # hold each row's maximum: later blocks rarely move it
    sink = torch.randn(H, device="cuda", generator=g)
    i = torch.arange(M, device="cuda")[:, None]
    w = i - 127 + torch.arange(128, device="cuda")[None]
    w = torch.where(w >= 0, w, -1)
    vis = ((i + 1) // 2).clamp(max=n_comp)
    r = torch.rand(M, n_comp, device="cuda", generator=g).masked_fill(torch.arange(n_comp, device="cuda")[None] >= vis, -1)
    top = r.topk(512, -1)
    c = torch.where(top.values >= 0, top.indices + M, -1).sort(-1).values
    idx = torch.cat([w, c], -1).int()[None].contiguous()
    T = idx.shape[-1]
    fl = 2 * B * M * H * T * (D + D)
    by_f = q.numel() * 2 * 2 + B * M * T * (D * 2 + 4)              # q, o, gathered kv rows + indices
    by_b = q.numel() * 2 * 4 + B * M * T * (D * 2 + D * 4 + 4)      # q, o, do, dq + kv rows read, dkv rows added
    holes = (idx < 0).float().mean().item()
    print(f"-- sparse attention, release prefill: B={B} M={M} H={H} D={D} T={T} N={N}, {args.attn_data} scores; "
          f"holes {holes:.1%}; FLOPs fwd 2*B*M*H*T*2D = {fl / 1e9:.1f} G, bwd 2.5x. TFLOP/s below count all T slots "
          f"(the kernels compute on the zero-filled holes, as the release's and the published sparse-MLA figures do); "
          f"over the visible slots only they are x{1 - holes:.3f}. GB/s: gathered KV rows once per use (from L2 "
          f"mostly: may exceed the HBM copy ceiling)", flush=True)
    return dict(q=q, kv=kv, sink=sink, idx=idx, scale=D ** -0.5, fl=fl, by_f=by_f, by_b=by_b)


def attention_fwd(results, args):
    """Forward at the release shape: the default path (FWD_DEFAULT), both kernels explicitly, then the
    sweep ``args.attn_fwd_cfgs`` (dicts with ``kernel`` "ws" -> fwd_kernel_ws or "lockstep" -> fwd_kernel,
    the rest its keyword arguments); each variant also prints its distance to the lock-step output
    (cosine diff, max abs) so a broken variant shows next to its time."""
    from functional_dsv41.kernels import reference
    from functional_dsv41.kernels.tilelang import sparse_attn_seesaw_tl as ss
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    a = _attn_release_inputs(args)
    q, kv, sink, idx, scale, fl, by_f = (a[k] for k in ("q", "kv", "sink", "idx", "scale", "fl", "by_f"))
    H, D = q.shape[2], q.shape[3]
    o_ref = sa._fwd(q, kv, sink, idx, scale, impl="lockstep")[0].float()

    def dist(o):
        o = o.float()
        cd = 1 - torch.nn.functional.cosine_similarity(o.flatten(), o_ref.flatten(), dim=0).item()
        return f"vs lock-step: cos diff {cd:.1e}, max abs {(o - o_ref).abs().max().item():.2e}"

    o = sa._fwd(q, kv, sink, idx, scale)[0]
    results.append(row(f"sparse_attn fwd  tilelang (default {sa.FWD_DEFAULT})",
                       bench(lambda: sa._fwd(q, kv, sink, idx, scale)), fl, by_f, dist(o)))
    for impl in ("pp", "sp", "ws", "lockstep", "seesaw"):
        for block in ((64,) if impl in ("seesaw", "sp", "pp") else (64, 128)):    # pp, sp, seesaw: block 64 only
            try:
                o = sa._fwd(q, kv, sink, idx, scale, block, impl=impl)[0]
                results.append(row(f"  _fwd impl={impl} block={block}",
                                   bench(lambda: sa._fwd(q, kv, sink, idx, scale, block, impl=impl)), fl, by_f, dist(o)))
            except Exception as e:
                print(f"  _fwd impl={impl} block={block}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    for cfg in args.attn_fwd_cfgs:                 # kernel-configuration sweep
        cfg = dict(cfg)
        kind = cfg.pop("kernel", "lockstep")
        name = f"  {kind} kernel {json.dumps(cfg, separators=(',', ':'))}"
        try:
            if kind == "ws":
                ip = sa._pad_idx(idx, 2 * cfg.get("BI", 32))
                kf = sa.fwd_kernel_ws(H, D, ip.shape[-1], scale, **cfg)
            else:
                ip = sa._pad_idx(idx, 128)
                kf = sa.fwd_kernel(H, D, ip.shape[-1], scale, **cfg)
            o = kf(q, kv, sink, ip)[0]
            results.append(row(name, bench(lambda: kf(q, kv, sink, ip)), fl, by_f, dist(o)))
        except Exception as e:
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    # fwd_kernel_seesaw variants (BI / stages / hole mask seeded or applied after QK / pair loop unrolled
    # or not); the distance printed is to the lock-step kernel (block 64): BI = 32 moves the max per 32
    # slots, so it is ~1e-7 away by bf16 rounding of P, the others should match to a few outputs
    seesaw_cfgs = [dict(BI=64, stages=2), dict(BI=32, stages=4), dict(BI=64, stages=2, seed=False),
                   dict(BI=64, stages=2, unroll=False), dict(BI=64, stages=2, qk_split=4),
                   dict(BI=32, stages=4, qk_split=4)]
    for cfg in seesaw_cfgs:
        name = f"  seesaw kernel {json.dumps(cfg, separators=(',', ':'))}"
        try:
            ip = sa._pad_idx(idx, 2 * cfg["BI"])
            kf = ss.fwd_kernel_seesaw(H, D, ip.shape[-1], scale, **cfg)
            o = kf(q, kv, sink, ip)[0]
            results.append(row(name, bench(lambda: kf(q, kv, sink, ip)), fl, by_f, dist(o)))
        except Exception as e:
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    results.append(row("sparse_attn fwd  torch reference", bench(lambda: reference.sparse_attn(q, kv, sink, idx, scale), 2, 5),
                       fl, by_f))
    kvg = kv[0, idx[0].clamp_min(0).long()]                            # [M, T, D] gathered once
    mask = (idx[0] >= 0)[:, None, None, :]                             # [M, 1, 1, T]
    qs = q[0][:, None]                                                 # [M, 1, H, D]: heads as the query axis
    F = torch.nn.functional
    results.append(row("peer: SDPA over pre-gathered KV (no sink), fwd",
                       bench(lambda: F.scaled_dot_product_attention(qs, kvg[:, None], kvg[:, None], attn_mask=mask, scale=scale)),
                       fl, by_f, "gather excluded; mask -> efficient/math kernel"))


# attndiag's rows (also compiled ahead by scripts/precompile_kernels.py attn-bench): fwd_kernel_ws's diag knobs,
# fwd_kernel_sp's configurations (each compared with the default's output; options under trial go here), and
# the multiples of 640 random index slots a query
WS_DIAGS = ("", "compute", "nosoftmax")
SP_DIAG_ROWS = (dict(), dict(gather="cols"), dict(diag="compute"), dict(diag="nosoftmax"))
SLOT_MULTS = (1, 2, 4)
PP_DIAG_ROWS = (dict(diag="compute"), dict(diag="nosoftmax"))
# pp options in every round (132: the H200's SMs)
PP_ROUND_OPTS = (dict(ctas=132), dict(ctas=132, late_s0=True), dict(ctas=132, late_s0=True, o_in_p=True),
                 dict(ctas=132, lazy=8.0), dict(ctas=132, late_s0=True, o_in_p=True, lazy=8.0),
                 dict(ctas=132, late_s0=True, o_in_p=True, q_tma=True),
                 dict(ctas=132, late_s0=True, o_in_p=True, s0_first=True),
                 dict(ctas=132, late_s0=True, o_in_p=True, q_prefetch=True),
                 dict(ctas=132, late_s0=True, o_in_p=True, q_prefetch=True, q_tma=True),
                 dict(ctas=132, late_s0=True, o_in_p=True, q_late=True),
                 dict(ctas=132, late_s0=True, o_in_p=True, q_late=True, q_prefetch=True))
# the "attntraceb" section's options beside the default path's
PP_TRACEB_EXTRA = ({}, dict(q_late=True, q_prefetch=True))
# the "attnbound" section's ablations of the default path's persistent pp kernel
PP_BOUND_DIAGS = (dict(diag="gather"), dict(diag="compute"), dict(diag="nolatency"), dict(diag="smemwrite"),
                  dict(diag="smemwrite_quarter"), dict(diag="nosoftmax"), dict(diag="nostore"))
# the "attnnreg" section's register splits (fwd_kernel_pp's ``nreg``: 2 * consumers' + producer's <= 504)
PP_NREG_SPLITS = ((216, 72), (224, 56), (232, 40), (240, 24))


def attention_diag(results, args):
    """Where the forward's time goes (release shape): the ablations of fwd_kernel_ws's and fwd_kernel_sp's
    ``diag`` knobs (the compute alone on stale rows, no softmax), sp's other gather layout, and both kernels
    over more index slots per query (2x, 4x: how much of a query's time is its fixed start and end). GB/s is
    the gathered KV rows (plus Q and O) over the time."""
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    from functional_dsv41.kernels.tilelang import sparse_attn_sp_tl as sp
    a = _attn_release_inputs(args)
    q, kv, sink, idx, scale, fl, by_f = (a[k] for k in ("q", "kv", "sink", "idx", "scale", "fl", "by_f"))
    H, D = q.shape[2], q.shape[3]
    cfg = sa.FWD_WS_CFG[64]
    ip = sa._pad_idx(idx, 2 * cfg["BI"])
    for diag in WS_DIAGS:
        try:
            kf = sa.fwd_kernel_ws(H, D, ip.shape[-1], scale, **cfg, diag=diag)
            results.append(row(f"  ws diag={diag or 'none'}", bench(lambda: kf(q, kv, sink, ip)), fl, by_f))
        except Exception as e:
            print(f"  ws diag={diag}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    # the split-softmax kernel (the default), its gather layouts and its own ablations
    ip64 = sa._pad_idx(idx, sp.FWD_SP_CFG["BI"])
    o_ref = sp.fwd_kernel_sp(H, D, ip64.shape[-1], scale, **sp.FWD_SP_CFG)(q, kv, sink, ip64)
    from functional_dsv41.kernels.tilelang import sparse_attn_pp_tl as pp
    ip128 = sa._pad_idx(idx, 128)

    def sp_kernel(**kw):
        return sp.fwd_kernel_sp(H, D, ip64.shape[-1], scale, **{**sp.FWD_SP_CFG, **kw})

    def pp_kernel(**kw):
        return pp.fwd_kernel_pp(H, D, ip128.shape[-1], scale, **kw)

    def option_row(name, make, kw, ii):
        """One kernel's row; its outputs (unless a diag ablation) compared with sp's default."""
        try:
            kf = make(**kw)
            o, lse = kf(q, kv, sink, ii)
            note = "" if kw.get("diag") else (f"vs sp: o max abs {(o.float() - o_ref[0].float()).abs().max():.2e}, "
                                              f"lse {(lse - o_ref[1]).abs().max():.2e}")
            results.append(row(name, bench(lambda: kf(q, kv, sink, ii)), fl, by_f, note))
        except Exception as e:
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)

    def opts(kw):
        return json.dumps(kw, separators=(',', ':'))

    for kw in SP_DIAG_ROWS:
        option_row(f"  sp {opts(kw)}", sp_kernel, kw, ip64)
    for kw in PP_DIAG_ROWS:                        # pp's options under trial and its ablations
        option_row(f"  pp {opts(kw)}", pp_kernel, kw, ip128)
    # the ping-pong forward against sp, interleaved in this process (rows of one call compare; calls vary by ~4%)
    for rnd in range(3):
        option_row(f"  sp (round {rnd + 1})", sp_kernel, {}, ip64)
        option_row(f"  pp (round {rnd + 1})", pp_kernel, {}, ip128)
        for kw in PP_ROUND_OPTS:
            option_row(f"  pp {opts(kw)} (round {rnd + 1})", pp_kernel, kw, ip128)
    g = torch.Generator(device="cuda").manual_seed(2)
    B, M, N = q.shape[0], q.shape[1], kv.shape[1]
    for mult in SLOT_MULTS:
        T_ = 640 * mult
        ir = torch.randint(0, N, (B, M, T_), device="cuda", generator=g, dtype=torch.int32)
        f_ = 2 * B * M * H * T_ * 2 * D
        b_ = q.numel() * 4 + B * M * T_ * (D * 2 + 4)
        makers = [("ws", lambda: sa.fwd_kernel_ws(H, D, T_, scale, **cfg)),
                  ("sp", lambda: sp.fwd_kernel_sp(H, D, T_, scale, **sp.FWD_SP_CFG))]
        makers += [(f"pp {opts(kw)}" if kw else "pp", lambda kw=kw: pp.fwd_kernel_pp(H, D, T_, scale, **kw))
                   for kw in ({},) + PP_ROUND_OPTS
                   if pp.pp_fits(H, D, T_, **kw)]
        for kind, make in makers:
            try:
                kf = make()
                results.append(row(f"  {kind}, {T_} random slots a query", bench(lambda: kf(q, kv, sink, ir)), f_, b_))
            except Exception as e:
                print(f"  {kind} T={T_}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


def attention_pp(results, args):
    """The default forward (``_fwd``) against the persistent pp kernel with each of PP_ROUND_OPTS, interleaved over
    ``args.rounds`` rounds (``--rounds``, default 3) in one process at the release shape (rows of one call compare;
    rounds of one row vary by up to ~15%, the clock not being locked): the short form of attndiag's rounds, for
    deciding a pp default. Each row notes its distance to the default's output (the options must not change the
    bits); after the rounds, one summary row a variant gives the median time over them, with its range."""
    _pp_rounds(results, args, PP_ROUND_OPTS)


def attention_nreg(results, args):
    """As attention_pp, over the register splits PP_NREG_SPLITS (consumers', producer's setmaxnreg) of the default
    path's persistent pp kernel (its FWD_PP_BOUNDARY options)."""
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    _pp_rounds(results, args, tuple(dict(ctas=132, nreg=n, **sa.FWD_PP_BOUNDARY) for n in PP_NREG_SPLITS))


def attention_bound(results, args):
    """What bounds the default forward (release shape): its persistent pp kernel (FWD_PP_BOUNDARY's options) against
    the same kernel's ablations, interleaved over ``args.rounds`` rounds: ``diag="gather"`` (the KV gathers alone,
    at the kernel's two stages: nothing computed), "compute" (the compute alone, on stale rows after the first
    pair), "nolatency" (every gather issued, each stage signalled ready at once: the gathers' traffic without their
    latency), "smemwrite" (each stage's shared-memory writes, of zeros, with no reads from L2: the smem writes'
    share of that traffic; "smemwrite_quarter": a quarter of those writes, the same barriers), "nosoftmax" (P = S)
    and "nostore" (O staged but never stored: what O's store reads cost at the query boundary). compute against the
    default says what the gathers cost; nolatency says whether that is their latency on the chain (nolatency near
    compute) or their traffic (near the default)."""
    from functional_dsv41.kernels.tilelang import sparse_attn_pp_tl as pp
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    opts = tuple(dict(ctas=132, **sa.FWD_PP_BOUNDARY, **d) for d in ({},) + PP_BOUND_DIAGS)
    a = _attn_release_inputs(args)
    _pp_rounds(results, args, opts[1:], a)
    # the SM clock and board power each variant runs at (a power-capped clock would make traffic cost time)
    ip128 = sa._pad_idx(a["idx"], 128)
    for kw in opts:
        kf = pp.fwd_kernel_pp(a["q"].shape[2], a["q"].shape[3], ip128.shape[-1], a["scale"], **kw)
        print(f"  pp {json.dumps(kw, separators=(',', ':'))}: "
              f"{clock_under_load(lambda: kf(a['q'], a['kv'], a['sink'], ip128), seconds=2.0)}", flush=True)


def attention_tail(results, args):
    """The default forward's last round of queries: the persistent grid gives query n to CTA n % SMs, so M queries
    take ceil(M / SMs) rounds of one query a CTA, and at M = 4096 on 132 SMs four CTAs run a 32nd round alone
    (31.03 rounds of work in the time of 32). Times the default ``_fwd`` at the full rounds below M, at M, and at
    the full rounds at or above M (4092, 4096, 4224 for the release's 4096 on 132 SMs), interleaved over
    ``args.rounds`` rounds on the first queries of one set of release inputs. If a round of queries costs the
    same whatever M, the time at M matches the time at the next multiple of the SM count; if the time follows the
    queries instead, the last round is cheap (its few CTAs run alone on the chip).
    Run 134 (H100, medians of 12): 4092 / 4096 / 4224 queries in 0.651 / 0.659 / 0.671 ms, 21.0 / 21.2 / 21.0 us
    per 132 queries of work: the time follows the queries, and the 32nd round at 4096 (4 queries, +0.008 ms,
    under one query's FLOPs at one SM's peak) overlaps the others' 31st: it costs 1-2%, not a round's 3%."""
    import math
    import types
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    hi = math.ceil(args.m / sms) * sms
    a = _attn_release_inputs(types.SimpleNamespace(**{**vars(args), "m": hi}))
    q, kv, sink, idx, scale = (a[k] for k in ("q", "kv", "sink", "idx", "scale"))
    print(f"  {sms} SMs, a CTA a query a round", flush=True)
    variants = []
    for n in sorted({n for n in (hi - sms, args.m, hi) if n > 0}):
        qn, idn, rounds = q[:, :n].contiguous(), idx[:, :n].contiguous(), math.ceil(n / sms)
        variants.append((f"default _fwd, {n} queries", lambda qn=qn, idn=idn: sa._fwd(qn, kv, sink, idn, scale),
                         a["fl"] * n / hi, a["by_f"] * n / hi,
                         lambda med, n=n, rounds=rounds: f"{rounds} rounds: {med / rounds * 1e3:.2f} us a round, "
                                                         f"{med / (n / sms) * 1e3:.2f} us a {sms} queries"))
    interleaved_rounds(results, args.rounds, variants)


def _pp_rounds(results, args, opts, a=None):
    """attention_pp's rounds: the default forward, then the persistent pp kernel with each dict of ``opts``, on the
    release inputs ``a`` (``_attn_release_inputs``; made here when not given)."""
    from functional_dsv41.kernels.tilelang import sparse_attn_pp_tl as pp
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    a = a if a is not None else _attn_release_inputs(args)
    q, kv, sink, idx, scale, fl, by_f = (a[k] for k in ("q", "kv", "sink", "idx", "scale", "fl", "by_f"))
    H, D = q.shape[2], q.shape[3]
    ip128 = sa._pad_idx(idx, 128)
    o_def, lse_def = sa._fwd(q, kv, sink, idx, scale)
    rounds = args.rounds
    times: dict[str, list[float]] = {}
    for rnd in range(rounds):
        variant = f"default _fwd {sa.FWD_PP_BOUNDARY}"
        r = row(f"  {variant} (round {rnd + 1})", bench(lambda: sa._fwd(q, kv, sink, idx, scale)), fl, by_f)
        results.append(r)
        times.setdefault(variant, []).append(r["ms"])
        for kw in opts:
            variant = f"pp {json.dumps(kw, separators=(',', ':'))}"
            name = f"  {variant} (round {rnd + 1})"
            try:
                kf = pp.fwd_kernel_pp(H, D, ip128.shape[-1], scale, **kw)
                o, lse = kf(q, kv, sink, ip128)
                same = torch.equal(o, o_def) and torch.equal(lse, lse_def)
                r = row(name, bench(lambda: kf(q, kv, sink, ip128)), fl, by_f,
                        "ablation (wrong outputs)" if kw.get("diag") else "same bits as the default" if same else
                        f"DIFFERS from the default: o max abs {(o.float() - o_def.float()).abs().max():.2e}")
                results.append(r)
                times.setdefault(variant, []).append(r["ms"])
            except Exception as e:
                print(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    print(f"  -- median over {rounds} rounds (TFLOP/s range: slowest to fastest round)", flush=True)
    for variant, ms in times.items():
        med = statistics.median(ms)
        results.append(row(f"  {variant} (median of {len(ms)})", med, fl, by_f,
                           f"{fl / max(ms) / 1e9:.1f}-{fl / min(ms) / 1e9:.1f} TFLOP/s"))


def attention_trace(results, args):
    """fwd_kernel_pp's timeline at the release shape (``diag="trace"``: clock64 stamps relative to each CTA's start,
    written into the LSE slots; medians over the CTAs). Per pair i of 64-slot blocks: when consumer 0 had rescaled
    O_L under m1, issued P1 V1[:, L], had S0 (its softmax's start), published P0, had P1, arrived at the wait for
    stage 0's next left half and got through it; when consumer 1 got through the waits for stage 1 (its QK issued),
    had S1, had issued P0 V0[:, R], finished its softmax, and published P1. The kernel's time beside the untraced
    one's says how much the stamps perturb (5-12%). Persistent options (``ctas``): times from the end of the CTA's
    previous query (consumer 0's epilogue), over the queries after each CTA's first."""
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    a = _attn_release_inputs(args)
    q, kv, sink, idx, scale, fl, by_f = (a[k] for k in ("q", "kv", "sink", "idx", "scale", "fl", "by_f"))
    ip = sa._pad_idx(idx, 128)
    for kw in ({},) + PP_ROUND_OPTS:
        _trace_one(results, q, kv, sink, ip, scale, fl, by_f, kw)


def _trace_one(results, q, kv, sink, ip, scale, fl, by_f, kw):
    """attention_trace's rows and timeline for pp with options ``kw``."""
    from functional_dsv41.kernels.tilelang import sparse_attn_pp_tl as pp
    H, D, NP = q.shape[2], q.shape[3], ip.shape[-1] // 128
    plain = pp.fwd_kernel_pp(H, D, ip.shape[-1], scale, **kw)
    kt = pp.fwd_kernel_pp(H, D, ip.shape[-1], scale, diag="trace", **kw)
    name = f"  pp {json.dumps(kw, separators=(',', ':'))}"
    results.append(row(name, bench(lambda: plain(q, kv, sink, ip)), fl, by_f))
    results.append(row(name + " diag=trace", bench(lambda: kt(q, kv, sink, ip)), fl, by_f))
    st = kt(q, kv, sink, ip)[1][0]                     # [M, 64] cycles since the CTA's start
    G = kw.get("ctas", 0)
    if G:                                              # persistent: each query from its CTA's previous query's end
        period = (st[G:, 62] - st[:-G, 62]).median().item()
        st = st[G:] - st[:-G, 62:63]
        since = (f"since the CTA's previous query's C0 epilogue ended (median of {st.shape[0]} queries; "
                 f"a query {period:.0f})")
    else:
        since = f"since a CTA's start (median of {st.shape[0]} CTAs)"
    med = st.median(0).values.tolist()
    cols = ("0:rescl", "0:PV1L", "0:S0", "0:P0out", "0:P1in", "0:at0L", "0:thru0L", "1:thru1R", "1:S1", "1:PV0R",
            "1:smax", "1:P1out")
    print(f"  pp timeline, cycles {since}, pair i; 0: / 1: consumer 0 / 1")
    print("   i " + "".join(f"{c:>9s}" for c in cols))
    for i in range(NP):
        b = 12 * i
        print(f"  {i:2d} " + "".join(f"{med[b + j]:9.0f}" if i < NP - 1 or j not in (5, 6) else f"{'-':>9s}"
                                     for j in range(12)))
    d = st[:, :12 * NP].reshape(-1, NP, 12)
    dm = lambda j, k: (d[:, :, j] - d[:, :, k]).median().item()             # noqa: E731
    per = (d[:, 1:, 2] - d[:, :-1, 2]).median().item() if NP > 1 else float("nan")
    print(f"  medians: a pair {per:.0f}; C0 softmax + P0 out {dm(3, 2):.0f}, P0 out -> P1 in {dm(4, 3):.0f}, "
          f"P1 in -> O_L rescaled {dm(0, 4):.0f} -> P1 V1[:, L] issued {dm(1, 0):.0f}; "
          f"C1 S1 -> P0 V0[:, R] issued {dm(9, 8):.0f}, -> softmax done {dm(10, 9):.0f}, -> P1 out {dm(11, 10):.0f}",
          flush=True)
    e = 12 * (NP - 1)
    print(f"  last P V done C0 / C1 {med[60]:.0f} / {med[61]:.0f}; C0's epilogue: O normalised {med[e + 5]:.0f}, "
          f"in shared memory {med[e + 6]:.0f}; epilogue done {med[62]:.0f} / {med[63]:.0f}; "
          f"CTA total p10/p50/p90 {st[:, 63].quantile(0.1).item():.0f} / {med[63]:.0f} / "
          f"{st[:, 63].quantile(0.9).item():.0f}", flush=True)


def attention_trace_boundary(results, args):
    """The default path's persistent pp kernel (ctas = 132 with FWD_PP_BOUNDARY's options) at a query boundary
    (``diag="traceb"``, the stamps in ``sparse_attn_pp_tl.BOUNDARY_STAMPS``): when each role got through each wait
    between query k's last P V and query k + 1's first pair, in cycles from consumer 0's epilogue end of query k
    (medians over the CTAs' queries after their first two)."""
    from functional_dsv41.kernels.tilelang import sparse_attn_pp_tl as pp
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    a = _attn_release_inputs(args)
    q, kv, sink, idx, scale, fl, by_f = (a[k] for k in ("q", "kv", "sink", "idx", "scale", "fl", "by_f"))
    ip = sa._pad_idx(idx, 128)
    for extra in PP_TRACEB_EXTRA:
        _traceb_one(results, q, kv, sink, ip, scale, fl, by_f, dict(ctas=132, **sa.FWD_PP_BOUNDARY, **extra))


def _traceb_one(results, q, kv, sink, ip, scale, fl, by_f, kw):
    """attention_trace_boundary's row and boundary timeline for pp with options ``kw``."""
    from functional_dsv41.kernels.tilelang import sparse_attn_pp_tl as pp
    H, D, TP = q.shape[2], q.shape[3], ip.shape[-1]
    G = kw["ctas"]
    kt = pp.fwd_kernel_pp(H, D, TP, scale, diag="traceb", **kw)
    name = f"  pp {json.dumps(kw, separators=(',', ':'))} diag=traceb"
    results.append(row(name, bench(lambda: kt(q, kv, sink, ip)), fl, by_f))
    st = kt(q, kv, sink, ip)[1][0].double()            # [M, 64] cycles since the CTA's start
    e = st[:-G, 62:63]                                  # row k's own C0 epilogue end: the boundary k -> k + 1
    end = st[G:-G] - e[G:]                              # row k's end stamps, from its own boundary (<= 0 mostly)
    start = st[2 * G:] - e[G:]                          # row k + 1's start stamps, from the same boundary
    med = lambda x: x.median().item()                   # noqa: E731
    NP = TP // 128
    print(f"  pp query boundary, cycles from consumer 0's epilogue end of query k (median of {end.shape[0]} "
          f"boundaries; a query {med(st[G:, 62] - st[:-G, 62]):.0f})")
    rows = [(med(end[:, 12 * (NP - 1) + 4]), "C0", "last pair: P1 in (k)"),
            (med(end[:, 60]), "C0", "last P V done (k)"), (med(end[:, 61]), "C1", "last P V done (k)"),
            (med(end[:, 12 * (NP - 1) + 5]), "C0", "epilogue: O normalised (k)"),
            (med(end[:, 12 * (NP - 1) + 6]), "C0", "epilogue: O in shared memory (k)"),
            (med(end[:, 63]), "C1", "epilogue done (k)"),
            (med(start[:, 2]), "C0", "pair 0: S0 done (k + 1)"), (med(start[:, 7]), "C1", "pair 0: through stage "
                                                                                            "1 right (k + 1)"),
            (med(start[:, 8]), "C1", "pair 0: S1 done (k + 1)")]
    for j, who, what, frame in pp.BOUNDARY_STAMPS:
        if kw.get("q_late") and j in (10, 11):        # (q_late loads Q elsewhere: these slots are not written)
            continue
        x = end if frame == "end" else start
        rows.append((med(x[:, 12 + j]), who, what + (" (k)" if frame == "end" else " (k + 1)")))
    for t, who, what in sorted(rows):
        print(f"  {t:9.0f}  {who:>4s}  {what}", flush=True)


def attention_bwd(results, args):
    from functional_dsv41.kernels.tilelang import sparse_attn_bwd_tl as sb
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    a = _attn_release_inputs(args)
    q, kv, sink, idx, scale, fl, by_b = (a[k] for k in ("q", "kv", "sink", "idx", "scale", "fl", "by_b"))
    B, M, H, D = q.shape
    T = idx.shape[-1]
    o, lse = sa._fwd(q, kv, sink, idx, scale)
    do = torch.randn_like(o)
    results.append(row(f"sparse_attn bwd  tilelang default ({sa.BWD_IMPL} path: dq + P/dS, dkv, delta, dsink)",
                       bench(lambda: sa._bwd(q, kv, sink, idx, o, lse, do, scale)), 2.5 * fl, by_b))
    delta = sb.delta_kernel(H, D)(o.view(B * M, H, D), do.view(B * M, H, D))
    dkv = torch.zeros(kv.shape, device="cuda", dtype=torch.float32)
    kb = sb.bwd_kernel(H, D, T, scale)
    results.append(row("  the atomic bwd kernel alone (BWD_IMPL='atomic' path, not the default)", bench(lambda: kb(q, kv, do, idx, lse, delta.view(B, M, H), dkv)),
                       2.5 * fl, by_b))
    for cfg in args.attn_bwd_cfgs:
        try:
            kb2 = sb.bwd_kernel(H, D, T, scale, **cfg)
            results.append(row(f"  bwd kernel {json.dumps(cfg, separators=(',', ':'))}",
                               bench(lambda: kb2(q, kv, do, idx, lse, delta.view(B, M, H), dkv)), 2.5 * fl, by_b))
        except Exception as e:
            print(f"  bwd kernel {cfg}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    del dkv
    _attention_bwd_split(results, args, q, kv, sink, idx, o, lse, do, scale, 2.5 * fl, by_b)
    F = torch.nn.functional
    kvg = kv[0, idx[0].clamp_min(0).long()]
    mask = (idx[0] >= 0)[:, None, None, :]
    qg = q[0][:, None].detach().clone().requires_grad_(True)
    kg = kvg[:, None].detach().clone().requires_grad_(True)
    og = F.scaled_dot_product_attention(qg, kg, kg, attn_mask=mask, scale=scale)
    dog = torch.randn_like(og)
    results.append(row("peer: SDPA over pre-gathered KV (no sink), bwd",
                       bench(lambda: torch.autograd.grad(og, (qg, kg), dog, retain_graph=True)), 2.5 * fl, by_b))


def _attention_bwd_split(results, args, q, kv, sink, idx, o, lse, do, scale, fl_b, by_b):
    """Split backward (sparse_attn_bwd_tl): end to end (delta + dq kernel + zeroing + dkv kernel +
    dsink + casts) per configuration, then its two kernels alone for each configuration."""
    from functional_dsv41.kernels.tilelang import sparse_attn_bwd_tl as sb
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    B, M, H, D = q.shape
    T = idx.shape[-1]
    by_pds = 2 * 2 * B * M * H * T * 2                                # P, dS bf16 written and read back
    for cfg in args.attn_bwd_split_cfgs:
        tag = json.dumps(cfg, separators=(',', ':'))
        try:
            k = dict(sb.DEFAULT_CFG, **cfg)
            results.append(row(f"sparse_attn bwd  split {tag}",
                               bench(lambda: sb.bwd_split(q, kv, sink, idx, o, lse, do, scale, cfg)), fl_b, by_b + by_pds))
            parts = {}
            sb.bwd_split(q, kv, sink, idx, o, lse, do, scale, cfg, parts)
            delta = parts["delta"]
            dkv = torch.zeros(kv.shape, device="cuda", dtype=torch.float32)
            kq = sb.dq_kernel(H, D, T, float(scale), BI=k["BI"], stages=k["dq_stages"], threads=k["dq_threads"])
            results.append(row("  of which the dq kernel (writes P, dS)",
                               bench(lambda: kq(q, kv, do, idx, lse, delta)), 0.6 * fl_b, None, "3 of 5 GEMMs"))
            kk = sb.dkv_kernel(H, D, T, BI=k["dkv_BI"], DC=min(k["DC"], D), stages=k["dkv_stages"],
                               threads=k["dkv_threads"], ws=k["dkv_ws"], pad=k["dkv_pad"])
            results.append(row("  of which the dkv kernel (atomics x4)",
                               bench(lambda: kk(q, do, idx, parts["p"], parts["ds"], dkv)), 0.4 * fl_b, None,
                               "2 of 5 GEMMs; accumulates into dkv across reps"))
            del parts, dkv
        except Exception as e:
            print(f"  split bwd {cfg}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        torch.cuda.empty_cache()
    # the same end to end through the autograd dispatch (BWD_IMPL switch)
    try:
        results.append(row("sparse_attn bwd  _bwd(bwd_impl='split') default cfg",
                           bench(lambda: sa._bwd(q, kv, sink, idx, o, lse, do, scale, bwd_impl="split")), fl_b, by_b))
    except Exception as e:
        print(f"  _bwd split: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


CL_DIAGS = ("noxchg", "compute", "compute+noxchg")


def attention_cl(results, args):
    """The 2-CTA D-split forward (``sparse_attn_cl_tl.fwd_kernel_cl``, two queries an SM) against the default
    persistent ping-pong forward, interleaved in one process (rows of one call compare), each with its distance
    to the lock-step output; then both over 2560 random slots a query (a query's start and end amortised)."""
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    from functional_dsv41.kernels.tilelang import sparse_attn_pp_tl as pp
    from functional_dsv41.kernels.tilelang import sparse_attn_cl_tl as cl
    a = _attn_release_inputs(args)
    q, kv, sink, idx, scale, fl, by_f = (a[k] for k in ("q", "kv", "sink", "idx", "scale", "fl", "by_f"))
    H, D = q.shape[2], q.shape[3]
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    ip = sa._pad_idx(idx, 128)
    o_ref, lse_ref = sa._fwd(q, kv, sink, idx, scale, impl="lockstep")

    def one(name, kf, ii, f_=fl, b_=by_f, check=True):
        try:
            o, lse = kf(q, kv, sink, ii)
            note = (f"vs lock-step: o max abs {(o.float() - o_ref.float()).abs().max():.2e}, "
                    f"lse {(lse - lse_ref).abs().max():.2e}") if check else ""
            results.append(row(name, bench(lambda: kf(q, kv, sink, ii)), f_, b_, note))
        except Exception as e:
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)

    for rnd in range(3):
        one(f"  pp ctas={sms} (round {rnd + 1})", pp.fwd_kernel_pp(H, D, ip.shape[-1], scale, ctas=sms), ip)
        one(f"  cl ctas={sms} (round {rnd + 1})", cl.fwd_kernel_cl(H, D, ip.shape[-1], scale, sms), ip)
    for diag in CL_DIAGS:                          # ablations (wrong outputs: timing only)
        one(f"  cl ctas={sms} diag={diag}", cl.fwd_kernel_cl(H, D, ip.shape[-1], scale, sms, diag=diag), ip,
            check=False)
    try:                                           # the trace: rank 0's consumers' stamps (fwd_kernel_cl's diag)
        _, st = cl.fwd_kernel_cl(H, D, ip.shape[-1], scale, sms, diag="trace")(q, kv, sink, ip)
        NI = ip.shape[-1] // 64
        st = st[0, :, :4 * NI + 1].double()
        med = (st - st[:, :1]).median(0).values.tolist()        # from the query's first stamp
        print("  cl trace (rank 0, median over queries, cycles from block 0's stage ready), per block "
              "ready/QK done/exchange done/P V done: " + "; ".join(
                  f"{j}: " + "/".join(f"{med[4 * j + x]:.0f}" for x in range(4)) for j in range(NI))
              + f"; epilogue done {med[4 * NI]:.0f}", flush=True)
    except Exception as e:
        print(f"  cl trace: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(2)
    B, M, N = q.shape[0], q.shape[1], kv.shape[1]
    T_ = 2560
    ir = torch.randint(0, N, (B, M, T_), device="cuda", generator=g, dtype=torch.int32)
    f_ = 2 * B * M * H * T_ * 2 * D
    b_ = q.numel() * 4 + B * M * T_ * (D * 2 + 4)
    one(f"  cl ctas={sms}, {T_} random slots a query", cl.fwd_kernel_cl(H, D, T_, scale, sms), ir, f_, b_, False)
