"""GPU benchmark: release-size backbone blocks, torch reference against impl="auto" (TileLang kernels).

Three blocks at the release's dimensions (dim 5120, 64 heads x 512, q_lora 1280, 8 x 1024 grouped output,
indexer 32 x 128 top-512, window 128, MoE 2304-wide fp4 experts top-6 + shared expert, fp8 dense weights,
4 hyper-connection streams): block 0 window-only, block 1 ratio 2 (Full: compressor + indexer), block 2
ratio 1 (Full). Only the routed-expert count is cut (16 of 384, ``--experts``): the expert GEMMs keep their
release shapes, there are fewer of them, and the random weights fit one GPU and draw in seconds. Prints, per
impl, ms per forward of the three blocks, tokens/s and peak memory; and the per-kernel-op time split.

    python benchmarks/release_layers.py [--seq 4096] [--experts 16] [--impls torch,auto,auto-hctorch] [--repeat 3]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import functional_dsv41 as fd  # noqa: E402
from functional_dsv41.kernels._bench_common import positive_int  # noqa: E402


def release_layers_cfg(n_experts: int = 16, max_seq_len: int = 8192) -> fd.Config:
    """Config.flash with three backbone blocks (window, ratio-2 Full, ratio-1 Full), no Engram, vision or
    DSpark, a 1024-token vocabulary and ``n_experts`` routed experts; every other dimension the release's."""
    return fd.Config.flash(n_layers=3, n_mtp_layers=0, vocab_size=1024, compress_ratios=(0, 2, 1),
                           kv_source_layers=(1, 2), index_source_layers=(1, 2), candidate_source_layer=2,
                           engram_layer_ids=(), engram_num_embeddings=(), vision_n_layers=0, image_token_id=1000,
                           dspark_noise_token_id=1001, dspark_target_layer_ids=(), n_routed_experts=n_experts,
                           max_seq_len=max_seq_len)


def op_split(params, ids, cfg, impl) -> dict[str, float]:
    """Milliseconds per kernel op in one forward (CUDA events around each public kernel call)."""
    from functional_dsv41 import kernels
    times: dict[str, list] = {}
    real = {n: getattr(kernels, n) for n in kernels.OPS}

    def timed(name):
        def f(*a, **k):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = real[name](*a, **k)
            e.record()
            times.setdefault(name, []).append((s, e))
            return out
        return f
    try:
        for n in kernels.OPS:
            setattr(kernels, n, timed(n))
        with torch.no_grad():
            fd.forward(params, {"input_ids": ids}, cfg=cfg, impl=impl, validate=False)
        torch.cuda.synchronize()
    finally:
        for n in kernels.OPS:
            setattr(kernels, n, real[n])
    return {n: sum(s.elapsed_time(e) for s, e in v) for n, v in times.items()}


IMPLS = ("torch", "auto", "auto-hctorch")    # auto-hctorch: impl="auto" with the fused hc_pre / hc_post turned off


@contextlib.contextmanager
def _impl(impl):
    """The model's ``impl`` for one of IMPLS, with the fused hc ops off inside for "auto-hctorch"."""
    if impl != "auto-hctorch":
        yield impl
        return
    from functional_dsv41.kernels.tilelang import hc_apply_tl as ha
    enabled, ha.ENABLED = ha.ENABLED, False             # the wrappers read it at each call
    try:
        yield "auto"
    finally:
        ha.ENABLED = enabled


def _forward(params, ids, cfg, impl):
    """One forward of the three blocks under ``impl`` (one of IMPLS), synchronised."""
    with _impl(impl) as model_impl, torch.no_grad():
        fd.forward(params, {"input_ids": ids}, cfg=cfg, impl=model_impl, validate=False)
    torch.cuda.synchronize()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=positive_int, default=4096)
    ap.add_argument("--experts", type=positive_int, default=16)
    ap.add_argument("--impls", default="torch,auto",
                    help=f"comma-separated, of {', '.join(IMPLS)} (auto-hctorch: auto with the fused hyper-connection "
                         f"applications off, as DSV41_HC_APPLY=torch)")
    ap.add_argument("--repeat", type=positive_int, default=3,
                    help="timed forwards per impl, interleaved across the impls (round r times each impl once)")
    args = ap.parse_args(argv)
    impls = args.impls.split(",")
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        ap.error(f"--impls: unknown {', '.join(map(repr, bad))}; choose from {', '.join(IMPLS)}")
    if not torch.cuda.is_available():
        raise SystemExit("release_layers.py needs a CUDA GPU")
    cfg = release_layers_cfg(args.experts, max(8192, args.seq))
    t0 = time.perf_counter()
    params = fd.init_params(cfg, seed=0, device="cuda", draw_on_device=True)
    torch.cuda.synchronize()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; release-size blocks (window, ratio 2, "
          f"ratio 1), {args.experts} routed experts, seq {args.seq}, batch 1; params drawn in "
          f"{time.perf_counter() - t0:.1f} s; {args.repeat} timed forwards per impl, interleaved")
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq), device="cuda", generator=g)
    peak = {}
    for impl in impls:                                  # compile / warm up; the peak of one forward
        _forward(params, ids, cfg, impl)
        torch.cuda.reset_peak_memory_stats()
        _forward(params, ids, cfg, impl)
        peak[impl] = torch.cuda.max_memory_allocated() / 2**30
    ms = {impl: [] for impl in impls}
    for _ in range(args.repeat):
        for impl in impls:
            t = time.perf_counter()
            _forward(params, ids, cfg, impl)
            ms[impl].append((time.perf_counter() - t) * 1e3)
    for impl in impls:
        best, med = min(ms[impl]), statistics.median(ms[impl])
        print(f"impl={impl:12s}: {best:8.1f} ms per forward of 3 blocks, best of {args.repeat} (median {med:.1f}; "
              f"{best / 3:7.1f} ms/block), {args.seq / best * 1e3:9.0f} tokens/s, peak {peak[impl]:.1f} GiB")
        with _impl(impl) as model_impl:
            split = op_split(params, ids, cfg, model_impl)
        print("   ops (ms): " + ", ".join(f"{n} {v:.1f}" for n, v in sorted(split.items(), key=lambda x: -x[1])))


if __name__ == "__main__":
    main()
