"""The block-scaled GEMM sections of ``python -m functional_dsv41.kernels.bench`` (gemm, gemm128, gemmdiag,
gemmtail, gemmwrap, gemmsmall, fp4gemm) and the configuration lists they sweep. Conventions: ``bench.py``'s docstring."""
import json

import torch

from ._bench_common import bench, clock_under_load, graph_ms, interleaved_rounds, row


# fp8 warp-specialised kernel without turn-taking (fp8_gemm_tl.fp8_gemm_ws_kernel), swept by "gemm" after
# args.gemm_cfgs: 3 consumers x BN=128 (stages 3 / 4 / 5; 4-5 store C from registers), 2 consumers with two
# temporaries (BK 128 / 256), 2 consumers at BN=192 (the ping-pong without turns), 3 consumers at BN=96 with two
# temporaries, 3 consumers at BK=256 (2 stages), the persistent variants (132 CTAs = the H200's SMs), and 2-CTA
# clusters multicasting A (run 17: 585 at 5120x5120, the only shape measured then).
FP8_WS_CFGS = [dict(kernel="ws"), dict(kernel="ws", store="direct"), dict(kernel="ws", stages=4),
               dict(kernel="ws", stages=5), dict(kernel="ws", stages=4, persistent=132),
               dict(kernel="ws", consumers=2, double_tmp=True, nreg=(240, 24), stages=4),
               dict(kernel="ws", consumers=2, double_tmp=True, nreg=(240, 24), BK=256),
               dict(kernel="ws", consumers=2, double_tmp=True, nreg=(240, 24), stages=4, persistent=132),
               dict(kernel="ws", consumers=2, BN=192, nreg=(240, 24)),
               dict(kernel="ws", BN=96, double_tmp=True, stages=4), dict(kernel="ws", BK=256, stages=2),
               dict(kernel="ws", cluster=2), dict(kernel="ws", cluster=2, stages=4),
               dict(kernel="ws", consumers=2, BN=128, nreg=(240, 24), cluster=2, stages=4)]


def gemms(results, args):
    """fp8 GEMM sweep over args.gemm_cfgs (default first) and FP8_WS_CFGS + the e2e call and the peers."""
    from functional_dsv41 import quant as Q
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    for (M, N, K) in [(4096, 5120, 5120), (4096, 2304, 5120), (4096, 5120, 2304)]:
        print(f"-- fp8 GEMM (32-wide e8m0 blocks) M={M} N={N} K={K}: {2 * M * N * K / 1e9:.1f} GFLOP", flush=True)
        x = torch.randn(M, K, device="cuda").bfloat16()
        a, a_s = Q.act_quant(x, 32, "ue8m0", Q.E8M0)
        b, b_s = Q.quant_fp8_block(torch.randn(N, K, device="cuda") * 0.02)
        fl, by = 2 * M * N * K, M * K + N * K + M * N * 2 + M * K // 32
        sa, sb = fg._scales(a_s), fg._col_scales(b_s, N)
        for cfg in [*args.gemm_cfgs, *FP8_WS_CFGS]:
            name = f"fp8_gemm tilelang {json.dumps(cfg, separators=(',', ':'))}"
            if not cfg:                            # the default: say which kernel it is
                name = f"fp8_gemm tilelang default {json.dumps(fg.default_config(M, N, K), separators=(',', ':'))}"
            try:                                   # a failing variant prints its error, the sweep goes on
                kc = dict(cfg) or fg.default_config(M, N, K)  # {}: what fp8_gemm runs with no options
                build = fg.kernel_factory(kc.pop("kernel", "pingpong"))
                k = build(N, K, **kc)
                results.append(row(name, bench(lambda: k(a, sa, b, sb)), fl, by))
            except Exception as e:
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        results.append(row("fp8_gemm end-to-end (scale conversion incl.)",
                           bench(lambda: fg.fp8_gemm(a, a_s, b, b_s)), fl, by))
        sa_r = torch.rand(M, 1, device="cuda") + 0.5
        sb_r = torch.rand(1, N, device="cuda") + 0.5
        bt = b.t()
        results.append(row("ceiling: torch._scaled_mm rowwise scales (no 32-wide K blocks, no promotion)",
                           bench(lambda: torch._scaled_mm(a, bt, sa_r, sb_r, out_dtype=torch.bfloat16)), fl, by))
        xb, wb = x, torch.randn(N, K, device="cuda").bfloat16()
        results.append(row("peer: bf16 matmul (torch)", bench(lambda: xb @ wb.t()), fl))


# The halves kernel promoting once per 128 columns (``group=128``) on operands re-expressed at one scale per group
# (quant.align_fp8_groups): a quarter of SPEC §10.3's FFMAs, the lever run 47's additive model left (stop 48's
# estimate: ~840 TFLOP/s on an H100). stages=4 does not fit beside BN=192's C tile. one_tmp: BN=256 tiles (4.85
# waves at 4096 x 5120), also with SPEC §10.3's promotion per 32 (the last two).
GEMM128_CFGS = [dict(kernel="halves", group=128), dict(kernel="halves", group=128, stages=2),
                dict(kernel="halves", group=128, chain=2), dict(kernel="halves", group=128, stage_scales=False),
                dict(kernel="halves", group=128, BN=128, stages=4),
                dict(kernel="halves", group=128, consumers=3, BN=128),
                dict(kernel="halves", group=128, one_tmp=True, BN=256), dict(kernel="halves", group=128, one_tmp=True,
                                                                            BN=256, stages=2),
                dict(kernel="halves", group=128, one_tmp=True, BN=192),
                dict(kernel="halves", one_tmp=True, BN=256), dict(kernel="halves", one_tmp=True, BN=256, stages=2)]


def gemm_group128(results, args):
    """fp8 GEMM with one promotion per 128 columns against the default (promotion per 32, SPEC §10.3), interleaved
    over args.rounds rounds at the three release shapes; the cosine diff of each against SPEC §10.3 on the
    release's operands, and what aligning the activations costs as a separate torch pass (a quantiser writing
    aligned operands directly would cost what act_quant costs)."""
    from functional_dsv41 import quant as Q
    from functional_dsv41.kernels import reference
    from functional_dsv41.kernels.tilelang import act_quant_tl, fp8_gemm_tl as fg
    for (M, N, K) in [(4096, 5120, 5120), (4096, 2304, 5120), (4096, 5120, 2304)]:
        print(f"-- fp8 GEMM, one promotion per 128 columns, M={M} N={N} K={K}", flush=True)
        a, a_s = Q.act_quant(torch.randn(M, K, device="cuda").bfloat16(), 32, "ue8m0", Q.E8M0)
        b, b_s = Q.quant_fp8_block(torch.randn(N, K, device="cuda") * 0.02)
        a2, a2_s = Q.align_fp8_groups(a, a_s, 128)
        b2, b2_s = Q.align_fp8_groups(b, b_s, 128)
        fl, by = 2 * M * N * K, M * K + N * K + M * N * 2 + M * K // 32
        sa, sb = fg._scales(a_s), fg._col_scales(b_s, N)
        sa2, sb2 = fg._scales(Q.expand_group_scales(a2_s)), fg._col_scales(Q.expand_group_scales(b2_s), N)
        ref = reference.fp8_gemm(a, a_s, b, b_s)
        variants = []
        for cfg in [fg.default_config(M, N, K), *GEMM128_CFGS]:
            kc = dict(cfg)
            k = fg.kernel_factory(kc.pop("kernel"))(N, K, **kc)
            ops = (a2, sa2, b2, sb2) if cfg.get("group", 32) != 32 else (a, sa, b, sb)
            out, r = k(*ops).float(), ref.float()
            cd = float(1 - 2 * (out * r).sum() / (out.square().sum() + r.square().sum()))
            name = json.dumps(cfg, separators=(",", ":"))
            name += " (fp8_gemm's group=128 pick)" if cfg == fg.group_config(M, N) else ""
            variants.append((name, lambda k=k, ops=ops: k(*ops), fl, by, lambda ms, cd=cd: f"cosine diff {cd:.1e}"))
        bt, sa_r, sb_r = b.t(), torch.rand(M, 1, device="cuda") + 0.5, torch.rand(1, N, device="cuda") + 0.5
        variants.append(("torch._scaled_mm rowwise", lambda: torch._scaled_mm(a, bt, sa_r, sb_r,
                                                                              out_dtype=torch.bfloat16), fl, by, None))
        interleaved_rounds(results, args.rounds, variants)
        xb = torch.randn(M, K, device="cuda").bfloat16()
        results.append(row("act_quant (TileLang)", bench(lambda: act_quant_tl.act_quant(xb)), None, 3 * M * K))
        results.append(row("act_quant_grouped 128 (TileLang, aligned)", bench(lambda: act_quant_tl.act_quant_grouped(
            xb, 128)), None, 3 * M * K))
        results.append(row("align_fp8_groups(a) (torch, separate pass)", bench(lambda: Q.align_fp8_groups(a, a_s)),
                           None, 2 * M * K + M * K // 16))
        results.append(row("fp8_gemm(group=128) (scale expansion incl.)",
                           bench(lambda: fg.fp8_gemm(a2, a2_s, b2, b2_s, group=128)), fl, by))
        results.append(row("fp8_gemm default (scale conversion incl.)", bench(lambda: fg.fp8_gemm(a, a_s, b, b_s)),
                           fl, by))
        results.append(row("a linear: act_quant + fp8_gemm default", bench(
            lambda: fg.fp8_gemm(*act_quant_tl.act_quant(xb), b, b_s)), fl, by))
        results.append(row("a linear: act_quant_grouped + fp8_gemm(group=128)", bench(
            lambda: fg.fp8_gemm(*act_quant_tl.act_quant_grouped(xb), b2, b2_s, group=128)), fl, by))


def gemm_diag(results, args):
    """Where the fp8 GEMM's time goes (4096x5120x5120; WRONG numerics, timing only): the ws kernel as is, with
    the per-slice wait but no promotion, and with neither (a plain fp8 GEMM in the same structure); then 2-CTA
    clusters sharing the A tile by TMA multicast (``cluster=2``, correct numerics unless diag), with the plain
    GEMM's ceiling under multicast (diag="no_wait")."""
    from functional_dsv41 import quant as Q
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    from functional_dsv41.kernels.tilelang import fp8_gemm_ws_tl as fw
    M, N, K = 4096, 5120, 5120
    print(f"-- fp8 GEMM diagnostics M={M} N={N} K={K} (diag rows ignore the scales: timing only)", flush=True)
    a, a_s = Q.act_quant(torch.randn(M, K, device="cuda").bfloat16(), 32, "ue8m0", Q.E8M0)
    b, b_s = Q.quant_fp8_block(torch.randn(N, K, device="cuda") * 0.02)
    sa, sb = fg._scales(a_s), fg._col_scales(b_s, N)
    c2 = dict(consumers=2, BN=128, nreg=(240, 24), cluster=2)
    variants = [(base, diag) for base in (dict(), dict(consumers=2, BN=192, nreg=(240, 24), stages=2))
                for diag in ("", "no_promote", "no_wait")]
    variants += [(dict(cluster=2), ""), (dict(cluster=2, stages=4), ""), (dict(cluster=2), "no_wait"),
                 (c2, ""), (dict(c2, stages=4), ""), (c2, "no_wait")]
    for base, diag in variants:
        name = f"fp8_gemm ws {json.dumps(dict(base, diag=diag), separators=(',', ':'))}"
        try:
            k = fw.fp8_gemm_ws_kernel(N, K, **base, diag=diag)
            results.append(row(name, bench(lambda: k(a, sa, b, sb)), 2 * M * N * K))
        except Exception as e:
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


GEMM_TAIL_ALTS = [dict(kernel="halves", BN=128)]    # gemmtail's other tilings of 4096 x 5120 x 5120


def gemm_tail(results, args):
    """The default fp8 GEMM's last wave (N = K = 5120): the halves kernel runs one 128 x 192 tile a CTA and one CTA
    an SM, so 4096 rows make 32 x 27 = 864 CTAs, 6.55 waves of 132 SMs, and the 7th wave runs 72 CTAs on 132 SMs.
    Times the kernel at 3712 rows (783 CTAs, 5.93 waves), 4096 and 4352 (918 CTAs, 6.95 waves), interleaved over
    ``args.rounds`` rounds: if a wave costs the same however full it is, 4096 rows take the time of 4352, and the
    time a wave says what filling the last one (stream-K) could gain. Beside them, in the same rounds, the halves
    kernel at BN = 128 (GEMM_TAIL_ALTS) at 4096 rows: 1280 CTAs, 9.70 waves in 10, narrower tiles for a fuller
    last wave."""
    import math
    from functional_dsv41 import quant as Q
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    N = K = 5120
    rows = (3712, 4096, 4352)
    default = fg.default_config(max(rows), N, K)
    print(f"-- fp8 GEMM last wave: N={N} K={K}, default {json.dumps(default, separators=(',', ':'))}, {sms} SMs",
          flush=True)
    a, a_s = Q.act_quant(torch.randn(max(rows), K, device="cuda").bfloat16(), 32, "ue8m0", Q.E8M0)
    b, b_s = Q.quant_fp8_block(torch.randn(N, K, device="cuda") * 0.02)
    sa, sb = fg._scales(a_s), fg._col_scales(b_s, N)
    variants = []
    for cfg, m_rows, label in [(default, rows, ""), *((alt, (4096,), " " + json.dumps(alt, separators=(",", ":")))
                                                      for alt in GEMM_TAIL_ALTS)]:
        kc = dict(cfg)
        kf = fg.kernel_factory(kc.pop("kernel"))(N, K, **kc)
        BM, BN = 64 * kc.get("consumers", 2), kc.get("BN", 192)    # the halves kernel's defaults where unset
        for m in m_rows:
            ctas = math.ceil(m / BM) * math.ceil(N / BN)
            waves = math.ceil(ctas / sms)
            variants.append((f"M={m}{label}", lambda kf=kf, am=a[:m], sam=sa[:m].contiguous(): kf(am, sam, b, sb),
                             2 * m * N * K, None,
                             lambda med, ctas=ctas, waves=waves: f"{ctas} CTAs = {ctas / sms:.2f} waves in {waves}, "
                                                                 f"{med / waves * 1e3:.1f} us a wave"))
    interleaved_rounds(results, args.rounds, variants)


def gemm_wrapper(results, args):
    """What the fp8 GEMM's Python wrapper adds to the kernel, at the release's 5120-deep shapes from prefill (4096
    rows) down to decode (16 and 1 rows): the kernel alone, the two fp32 scale operands (A's e8m0 scales, B's
    32x32 block scales expanded per column) built the old way (torch ops) and the current way (one
    ``_gemm.e8m0_expand_kernel`` launch each), ``fp8_gemm`` end to end, and a whole ``linear`` (act_quant +
    fp8_gemm, the model's call) eager and in a CUDA graph: how much of a small call is the host's
    (benchmarks/host_overhead.py measures our Python's part of it without a GPU)."""
    from functional_dsv41 import quant as Q
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    from functional_dsv41.linear import linear
    for M, N, K in [(4096, 5120, 5120), (16, 5120, 5120), (1, 2304, 5120)]:
        print(f"-- fp8 GEMM wrapper M={M} N={N} K={K}", flush=True)
        a, a_s = Q.act_quant(torch.randn(M, K, device="cuda").bfloat16(), 32, "ue8m0", Q.E8M0)
        b, b_s = Q.quant_fp8_block(torch.randn(N, K, device="cuda") * 0.02)
        sa, sb = fg._scales(a_s), fg._col_scales(b_s, N)
        k = fg.fp8_gemm_pingpong_kernel(N, K)
        fl = 2 * M * N * K
        results.append(row(f"M={M}: kernel only", bench(lambda: k(a, sa, b, sb)), fl))
        results.append(row(f"M={M}: A scales, torch ops (before run 22)",
                           bench(lambda: Q.e8m0_to_float(a_s).contiguous())))
        results.append(row(f"M={M}: B scales, torch ops (before run 22)",
                           bench(lambda: Q.e8m0_to_float(b_s).repeat_interleave(32, 0)[:N].contiguous())))
        results.append(row(f"M={M}: A scales, e8m0_expand_kernel", bench(lambda: fg._scales(a_s))))
        results.append(row(f"M={M}: B scales, e8m0_expand_kernel", bench(lambda: fg._col_scales(b_s, N))))
        results.append(row(f"M={M}: fp8_gemm end to end", bench(lambda: fg.fp8_gemm(a, a_s, b, b_s)), fl))
        x, p = torch.randn(M, K, device="cuda").bfloat16(), {"weight": b, "scale": b_s}
        results.append(row(f"M={M}: linear (act_quant + fp8_gemm), eager", bench(lambda: linear(x, p)), fl))
        results.append(row(f"M={M}: linear, in a CUDA graph", graph_ms(lambda: linear(x, p)), fl))


# Small-M (decode) fp8 GEMM candidates: 64-row tiles (one consumer warpgroup) and narrow N tiles, so that a
# 5120-wide output spreads over more of the 132 SMs than the ping-pong's 27 CTAs (N / 192). The first two are
# fp8_gemm_tl.SMALL_CFGS (the defaults where their grid fits one wave, since run 27).
GEMM_SMALL_CFGS = [dict(kernel="loop", BM=64, BN=64, threads=128, stages=4),
                   dict(kernel="loop", BM=64, BN=128, threads=128, stages=4),
                   dict(kernel="loop", BM=64, BN=32, threads=128, stages=6)]
FP4_SMALL_CFGS = [dict(), dict(BM=64, BN=64, threads=128, stages=4)]


def gemm_small(results, args):
    """Block-scaled GEMMs at small and middle M, where the kernel choice depends on M (``default_config``).
    fp8 (M = 1 ... 512, K = 5120): the ping-pong against GEMM_SMALL_CFGS; up to M = 64 bound by reading B
    (N x K fp8 bytes), so GB/s counts B's bytes; the note gives the cosine difference from the ping-pong's
    output. fp4 (M = 64 ... 1024): the block-scaled loop (FP4_SMALL_CFGS) against the bf16 path. The
    "end to end" rows are the wrappers with no options (what the model runs), host work included."""
    from functional_dsv41 import quant as Q
    from functional_dsv41.kernels.tilelang import fp4_gemm_tl as f4
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    for N in (5120, 2304):
        K = 5120
        b, b_s = Q.quant_fp8_block(torch.randn(N, K, device="cuda") * 0.02)
        sb = fg._col_scales(b_s, N)
        wb = torch.randn(N, K, device="cuda").bfloat16()
        for M in (1, 16, 64, 128, 256, 512):
            print(f"-- fp8 GEMM, small M={M} N={N} K={K}", flush=True)
            a, a_s = Q.act_quant(torch.randn(M, K, device="cuda").bfloat16(), 32, "ue8m0", Q.E8M0)
            sa = fg._scales(a_s)
            fl, by = 2 * M * N * K, N * K
            k0 = fg.fp8_gemm_pingpong_kernel(N, K)
            ref = k0(a, sa, b, sb).float()
            results.append(row(f"M={M} ping-pong BN=192", bench(lambda: k0(a, sa, b, sb)), fl, by))
            for cfg in GEMM_SMALL_CFGS:
                kc = dict(cfg)
                kc.pop("kernel")
                name = f"M={M} loop {json.dumps(kc, separators=(',', ':'))}"
                try:
                    k = fg.fp8_gemm_kernel(N, K, **kc)
                    out = k(a, sa, b, sb).float()
                    cd = float(1 - torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0))
                    results.append(row(name, bench(lambda: k(a, sa, b, sb)), fl, by, note=f"cos diff {cd:.1e}"))
                except Exception as e:
                    print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            results.append(row(f"M={M} fp8_gemm end to end ({json.dumps(fg.default_config(M, N, K))})",
                               bench(lambda: fg.fp8_gemm(a, a_s, b, b_s)), fl, by))
            xb = torch.randn(M, K, device="cuda").bfloat16()
            results.append(row(f"M={M} peer: bf16 matmul (torch, 2x the bytes)", bench(lambda: xb @ wb.t()), fl, 2 * by))
    for (N, K) in [(2304, 5120), (5120, 2304)]:
        b, b_s = Q.quant_fp4(torch.randn(N, K, device="cuda") * 0.02)
        for M in (64, 256, 512, 768, 1024):
            print(f"-- fp4 GEMM, small M={M} N={N} K={K}", flush=True)
            a, a_s = Q.act_quant(torch.randn(M, K, device="cuda").bfloat16(), 32, "ue8m0", Q.E8M0)
            sa, bp, sb = f4.operands(a_s, b, b_s, K)
            fl = 2 * M * N * K
            ref = f4.fp4_gemm(a, a_s, b, b_s, kernel="loop").float()
            for cfg in FP4_SMALL_CFGS:
                name = f"M={M} fp4 loop {json.dumps(cfg, separators=(',', ':'))}"
                try:
                    k = f4.fp4_gemm_kernel(N, K, **cfg)
                    out = k(a, sa, bp, sb).float()
                    cd = float(1 - torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0))
                    results.append(row(name, bench(lambda: k(a, sa, bp, sb)), fl, note=f"cos diff {cd:.1e}"))
                except Exception as e:
                    print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            results.append(row(f"M={M} fp4 bf16 path end to end", bench(lambda: f4.fp4_gemm(a, a_s, b, b_s, kernel="bf16")), fl))
            results.append(row(f"M={M} fp4 loop end to end", bench(lambda: f4.fp4_gemm(a, a_s, b, b_s, kernel="loop")), fl))
            results.append(row(f"M={M} fp4_gemm end to end ({f4.default_config(M)['kernel']})",
                               bench(lambda: f4.fp4_gemm(a, a_s, b, b_s)), fl))


# Each row: TileLang's own shared layout for the A/B tiles (four 32-byte-swizzled [rows, 32] panels, four
# 32-byte-row TMA boxes per tile) against ``swizzle128=True`` (one 128-byte-swizzled tile, one TMA box). The diag row is
# the plain fp8 GEMM (no scales, no per-slice wait) in the ws structure: the structure's own ceiling.
GEMM_WIDE_CFGS = [dict(kernel="pingpong"), dict(kernel="pingpong", early_sp=True), dict(kernel="pingpong", BN=128),
                  dict(kernel="pingpong", stages=3),
                  dict(kernel="ws"), dict(kernel="ws", stages=4), dict(kernel="ws", cluster=2),
                  dict(kernel="ws", consumers=2, BN=192, nreg=(240, 24)),
                  dict(kernel="ws", consumers=2, double_tmp=True, nreg=(240, 24), stages=4),
                  dict(kernel="ws", consumers=2, BN=192, nreg=(240, 24), stages=2, diag="no_wait"),
                  dict(kernel="ws", diag="no_wait"), dict(kernel="loop"), dict(kernel="loop", BN=128, async_promote=True)]
FP4_WIDE_SW_CFGS = [dict(), dict(BN=128, async_promote=True), dict(stages=4)]


def gemm_wide(results, args):
    """The fp8 GEMM's shared-memory layout: every GEMM_WIDE_CFGS entry with and without ``swizzle128`` at the three
    release shapes. The note says whether the swizzle128 kernel's output is bitwise equal to the narrow one's (it must
    be: the same WGMMAs in the same order, only the bytes' placement in shared memory differs)."""
    from functional_dsv41 import quant as Q
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    from functional_dsv41.kernels.tilelang._gemm import dequant_bf16
    for (M, N, K) in [(4096, 5120, 5120), (4096, 2304, 5120), (4096, 5120, 2304)]:
        print(f"-- fp8 GEMM shared layout M={M} N={N} K={K}", flush=True)
        a, a_s = Q.act_quant(torch.randn(M, K, device="cuda").bfloat16(), 32, "ue8m0", Q.E8M0)
        b, b_s = Q.quant_fp8_block(torch.randn(N, K, device="cuda") * 0.02)
        sa, sb = fg._scales(a_s), fg._col_scales(b_s, N)
        fl, by = 2 * M * N * K, M * K + N * K + M * N * 2 + M * K // 32
        for cfg in GEMM_WIDE_CFGS:
            kc = dict(cfg)
            build = fg.kernel_factory(kc.pop("kernel"))
            outs = []
            for sw in (False, True):
                name = f"{json.dumps(dict(cfg, swizzle128=sw), separators=(',', ':'))}"
                try:
                    k = build(N, K, **kc, swizzle128=sw)
                    outs.append(k(a, sa, b, sb))
                    note = "" if not sw or len(outs) < 2 else \
                        ("bitwise equal to narrow" if torch.equal(outs[0], outs[1]) else "DIFFERS from narrow")
                    results.append(row(name, bench(lambda: k(a, sa, b, sb)), fl, by, note=note))
                except Exception as e:
                    print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        _bf16_path_rows(results, "fp8", lambda: fg.fp8_gemm(a, a_s, b, b_s, kernel="bf16"),
                        lambda: dequant_bf16(a, a_s, "e4m3"), lambda: dequant_bf16(b, b_s, "e4m3", row_rep=32),
                        fg.fp8_gemm(a, a_s, b, b_s, kernel="pingpong"), M, N, K)
    from functional_dsv41.kernels.tilelang import fp4_gemm_tl as f4
    for (M, N, K) in [(4096, 2304, 5120), (4096, 5120, 2304), (256, 2304, 5120), (1024, 2304, 5120)]:
        print(f"-- fp4 GEMM shared layout M={M} N={N} K={K}", flush=True)
        a, a_s = Q.act_quant(torch.randn(M, K, device="cuda").bfloat16(), 32, "ue8m0", Q.E8M0)
        b, b_s = Q.quant_fp4(torch.randn(N, K, device="cuda") * 0.02)
        sa, bp, sb = f4.operands(a_s, b, b_s, K)
        fl = 2 * M * N * K
        for cfg in (FP4_WIDE_SW_CFGS if M == 4096 else [dict()]):
            outs = []
            for sw in (False, True):
                name = f"fp4 {json.dumps(dict(cfg, swizzle128=sw), separators=(',', ':'))}"
                try:
                    k = f4.fp4_gemm_kernel(N, K, **cfg, swizzle128=sw)
                    outs.append(k(a, sa, bp, sb))
                    note = "" if not sw or len(outs) < 2 else \
                        ("bitwise equal to narrow" if torch.equal(outs[0], outs[1]) else "DIFFERS from narrow")
                    results.append(row(name, bench(lambda: k(a, sa, bp, sb)), fl, note=note))
                except Exception as e:
                    print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        _bf16_path_rows(results, "fp4", lambda: f4.fp4_gemm(a, a_s, b, b_s, kernel="bf16"),
                        lambda: dequant_bf16(a, a_s, "e4m3"), lambda: dequant_bf16(b, b_s, "e2m1"),
                        f4.fp4_gemm(a, a_s, b, b_s, kernel="loop"), M, N, K)


def _bf16_path_rows(results, what, e2e, deq_a, deq_b, ref, M, N, K):
    """The bf16 path of a block-scaled GEMM: both operands dequantised exactly to bf16 (one pass each), then
    torch's bf16 matmul; its parts timed alone, and its cosine difference from the block-scaled kernel."""
    fl = 2 * M * N * K
    try:
        out = e2e().float()
        cd = float(1 - torch.nn.functional.cosine_similarity(out.flatten(), ref.float().flatten(), dim=0))
        results.append(row(f"{what} bf16 path end to end", bench(e2e), fl, note=f"cos diff {cd:.1e}"))
        xa, xb = deq_a(), deq_b()
        nb_b = N * K * (3 if what == "fp8" else 2.5)
        results.append(row(f"{what} bf16 path: dequant A", bench(deq_a), None, M * K * 3))
        results.append(row(f"{what} bf16 path: dequant B", bench(deq_b), None, nb_b))
        results.append(row(f"{what} bf16 path: matmul alone", bench(lambda: xa @ xb.t()), fl))
    except Exception as e:
        print(f"{what} bf16 path: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


# Block-scaled GEMM knobs swept by "gemm" and "fp4gemm" (the "gemm" sweep starts with fp8_gemm's default, since run
# 44 the halves kernel). fp8 ping-pong, BN=192, 2 stages: run 11 569 / 584 / 522 TFLOP/s; "loop" = the pipelined
# main loop shared with fp4 (BN=192 sync: 549 / 541 / 508). fp4 default: the loop at BN=192 (294 / 279).
GEMM_CFGS = [dict(kernel="pingpong"), dict(kernel="pingpong", handoff="issue"), dict(kernel="halves", stages=2),
             dict(kernel="halves", chain=2), dict(kernel="halves", chain=2, stages=2),
             dict(kernel="halves", stage_scales=False),
             dict(kernel="pingpong", BN=128), dict(kernel="pingpong", stages=3), dict(kernel="loop"),
             dict(kernel="loop", BN=128), dict(kernel="loop", stages=3), dict(kernel="loop", BN=128, BM=192, threads=384)]
FP4_GEMM_CFGS = [dict(BN=128), dict(BN=128, async_promote=True), dict(BN=128, BM=192, threads=384),
                 dict(stages=4)]


def fp4_gemms(results, args):
    """fp8 activations x fp4 (e2m1, e8m0/32) expert weights at the release expert shapes (w1/w3, w2)."""
    from functional_dsv41 import quant as Q
    from functional_dsv41.kernels.tilelang import fp4_gemm_tl as f4
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    for (M, N, K) in [(args.m, 2304, 5120), (args.m, 5120, 2304)]:
        print(f"-- fp4 GEMM (fp8 x e2m1, 32-wide e8m0 blocks) M={M} N={N} K={K}: {2 * M * N * K / 1e9:.1f} GFLOP",
              flush=True)
        x = torch.randn(M, K, device="cuda").bfloat16()
        a, a_s = Q.act_quant(x, 32, "ue8m0", Q.E8M0)
        w = torch.randn(N, K, device="cuda") * 0.02
        b, b_s = Q.quant_fp4(w)
        fl, by = 2 * M * N * K, M * K + N * K // 2 + M * N * 2 + M * K // 32 + N * K // 32
        sa, bp, sb = f4.operands(a_s, b, b_s, K)
        for cfg in args.fp4_gemm_cfgs:
            name = f"fp4_gemm tilelang {json.dumps(cfg, separators=(',', ':'))}"
            try:                                   # a failing variant prints its error, the sweep goes on
                k = f4.fp4_gemm_kernel(N, K, **cfg)
                results.append(row(name, bench(lambda: k(a, sa, bp, sb)), fl, by))
            except Exception as e:
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        results.append(row(f"fp4_gemm end to end ({f4.default_config(M)['kernel']}, scale conversion incl.)",
                           bench(lambda: f4.fp4_gemm(a, a_s, b, b_s)), fl, by))
        b8, b8_s = Q.quant_fp8_block(w)
        results.append(row("peer: fp8_gemm tilelang, fp8 weights (e2e)",
                           bench(lambda: fg.fp8_gemm(a, a_s, b8, b8_s)), fl))
        sa_r = torch.rand(M, 1, device="cuda") + 0.5
        sb_r = torch.rand(1, N, device="cuda") + 0.5
        bt = b8.t()
        results.append(row("ceiling: torch._scaled_mm fp8 rowwise scales (no K blocks)",
                           bench(lambda: torch._scaled_mm(a, bt, sa_r, sb_r, out_dtype=torch.bfloat16)), fl))
        wb = w.bfloat16()
        results.append(row("peer: bf16 matmul (torch)", bench(lambda: x @ wb.t()), fl))


# Grouped fp4 GEMM tiles swept by "grouped" (BM x BN; the default, fp4_gemm_tl.GROUPED_BM x GROUPED_BN, first).
FP4_GROUPED_CFGS = [dict(), dict(BM=64), dict(BN=128), dict(stages=4)]


def fp4_grouped(results, args):
    """The routed experts of one release MoE layer at 4096 tokens: 384 experts, 6 per token (24576 expert rows,
    ~64 per expert, drawn uniformly at random), w1/w3 (2304 x 5120) and w2 (5120 x 2304). Rows: the grouped
    kernel alone per tile (weights already stacked), the stacking copy of the 384 weights and scales, the
    grouped wrapper end to end (stacking included, as the MoE calls it), and the per-expert loop (384
    ``fp4_gemm`` calls, what the MoE ran before)."""
    from functional_dsv41 import quant as Q
    from functional_dsv41.kernels.tilelang import fp4_gemm_tl as f4
    G, T_, KS = 384, args.m, 6
    e = torch.stack([torch.randperm(G, device="cuda")[:KS] for _ in range(T_)]).flatten()
    counts = torch.bincount(e, minlength=G).tolist()
    S = sum(counts)
    for (N, K) in [(2304, 5120), (5120, 2304)]:
        print(f"-- fp4 grouped GEMM: {G} experts, {S} rows (min {min(counts)}, max {max(counts)} per expert), "
              f"N={N} K={K}", flush=True)
        a, a_s = Q.act_quant(torch.randn(S, K, device="cuda").bfloat16(), 32, "ue8m0", Q.E8M0)
        ws = [Q.quant_fp4(torch.randn(N, K, device="cuda") * 0.02) for _ in range(G)]
        b, b_s = [w for w, _ in ws], [s for _, s in ws]
        fl = 2 * S * N * K
        bst, bss = torch.stack(b), torch.stack(b_s)
        by_w = G * N * K // 2 + G * N * K // 32
        results.append(row("stack the 384 weights + scales (torch.stack)",
                           bench(lambda: (torch.stack(b), torch.stack(b_s))), None, 2 * by_w))
        ref = f4.fp4_gemm_grouped(a, a_s, bst, bss, counts).float()
        for cfg in FP4_GROUPED_CFGS:
            name = f"grouped kernel {json.dumps(cfg, separators=(',', ':'))}, weights stacked"
            try:
                out = f4.fp4_gemm_grouped(a, a_s, bst, bss, counts, **cfg).float()
                cd = float(1 - torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0))
                results.append(row(name, bench(lambda: f4.fp4_gemm_grouped(a, a_s, bst, bss, counts, **cfg)), fl,
                                   note=f"cos diff {cd:.1e}"))
            except Exception as ex:
                print(f"{name}: FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
        results.append(row("grouped end to end (list of weights: stacking included)",
                           bench(lambda: f4.fp4_gemm_grouped(a, a_s, b, b_s, counts)), fl))

        def loop():
            start = 0
            for g, n in enumerate(counts):
                if n:
                    f4.fp4_gemm(a[start:start + n], a_s[start:start + n], b[g], b_s[g])
                start += n
        results.append(row("per-expert loop (384 fp4_gemm calls)", bench(loop), fl))


# gemmprobe: the promoted kernels beside their structures without the promotion, each with the SM clock and board
# power under sustained load (is the promoted GEMM clock- or power-throttled, and which structure hides the
# promotion best?). diag rows ignore the scales (timing only).
GEMM_PROBE_CFGS = [dict(kernel="pingpong"), dict(kernel="pingpong", handoff="issue"),
                   dict(kernel="ws"), dict(kernel="ws", diag="no_promote"), dict(kernel="ws", diag="no_wait"),
                   dict(kernel="ws", consumers=2, BN=192, nreg=(240, 24), stages=2),
                   dict(kernel="ws", consumers=2, BN=192, nreg=(240, 24), stages=3),
                   dict(kernel="ws", consumers=2, BN=192, nreg=(240, 24), stages=2, diag="no_promote"),
                   dict(kernel="ws", consumers=2, BN=192, nreg=(240, 24), stages=2, diag="no_wait"),
                   dict(kernel="ws", consumers=2, double_tmp=True, nreg=(240, 24), stages=4),
                   dict(kernel="halves"), dict(kernel="halves", stages=2), dict(kernel="halves", stages=4, BN=128),
                   dict(kernel="halves", stage_scales=False), dict(kernel="halves", stages=2, stage_scales=False),
                   dict(kernel="halves", stages=4, BN=128, stage_scales=False),
                   dict(kernel="halves", consumers=3, BN=128), dict(kernel="halves", consumers=3, BN=128, stages=2),
                   dict(kernel="halves", consumers=3, BN=128, stage_scales=False),
                   dict(kernel="halves", chain=2), dict(kernel="halves", chain=2, stages=2)]


def gemm_probe(results, args):
    """Every GEMM_PROBE_CFGS entry at 4096x5120x5120: time, TFLOP/s, and the SM clock / board power under load;
    then torch._scaled_mm (rowwise) the same way, the peer's clock for comparison."""
    from functional_dsv41 import quant as Q
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    M, N, K = 4096, 5120, 5120
    print(f"-- fp8 GEMM probe M={M} N={N} K={K} (diag rows ignore the scales: timing only)", flush=True)
    a, a_s = Q.act_quant(torch.randn(M, K, device="cuda").bfloat16(), 32, "ue8m0", Q.E8M0)
    b, b_s = Q.quant_fp8_block(torch.randn(N, K, device="cuda") * 0.02)
    sa, sb = fg._scales(a_s), fg._col_scales(b_s, N)
    fl = 2 * M * N * K
    for cfg in GEMM_PROBE_CFGS:
        name = f"probe {json.dumps(cfg, separators=(',', ':'))}"
        try:
            kc = dict(cfg)
            build = fg.kernel_factory(kc.pop("kernel"))
            k = build(N, K, **kc)
            fn = lambda: k(a, sa, b, sb)                # noqa: E731
            ms = bench(fn)
            results.append(row(name, ms, fl, note=clock_under_load(fn)))
        except Exception as e:
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    bt = b.t()
    sa_r, sb_r = torch.rand(M, 1, device="cuda") + 0.5, torch.rand(1, N, device="cuda") + 0.5
    fn = lambda: torch._scaled_mm(a, bt, sa_r, sb_r, out_dtype=torch.bfloat16)  # noqa: E731
    results.append(row("probe ceiling torch._scaled_mm rowwise (no K blocks)", bench(fn), fl, note=clock_under_load(fn)))
