"""One launch of a kernel at the release shape inside a CUDA profiler range, for Nsight Compute
(``scripts/ncu_profile.sh`` runs it under ``ncu --profile-from-start off``, so only that launch is profiled). The
kernel is compiled and run a few times before the range, so the profiled launch is neither a compile nor a cold
start.

    python3 -m functional_dsv41.kernels.ncu_one attn [--diag compute] [--kw '{"lazy": 8.0}']   # the default
                                                    # forward's persistent pp kernel (with more options)
    python3 -m functional_dsv41.kernels.ncu_one gemm [--mnk 4096,5120,5120] [--kw '{"kernel": "ws"}']   # fp8_gemm's
                                                    # default kernel (or the configuration given)
"""
import argparse
import json

import torch

from ._bench_common import positive_int


def _json_dict(text):
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of options, got {text!r}")
    return v


def _mnk(text):
    v = tuple(positive_int(t) for t in text.split(","))
    if len(v) != 3:
        raise argparse.ArgumentTypeError(f"three positive integers M,N,K, got {text!r}")
    return v


def _attn(args):
    from .bench_attn import _attn_release_inputs
    from .tilelang import sparse_attn_pp_tl as pp
    from .tilelang import sparse_attn_tl as sa
    a = _attn_release_inputs(args)
    q, kv, sink, scale = a["q"], a["kv"], a["sink"], a["scale"]
    ip128 = sa._pad_idx(a["idx"], 128)
    kw = dict(ctas=torch.cuda.get_device_properties(0).multi_processor_count, **sa.FWD_PP_BOUNDARY)
    kw.update(args.kw)
    if args.diag:
        kw["diag"] = args.diag
    kf = pp.fwd_kernel_pp(q.shape[2], q.shape[3], ip128.shape[-1], scale, **kw)
    return f"fwd_kernel_pp {kw}", lambda: kf(q, kv, sink, ip128)


def _gemm(args):
    from functional_dsv41 import quant as Q
    from .tilelang import fp8_gemm_tl as fg
    M, N, K = args.mnk
    a, a_s = Q.act_quant(torch.randn(M, K, device="cuda").bfloat16(), 32, "ue8m0", Q.E8M0)
    b, b_s = Q.quant_fp8_block(torch.randn(N, K, device="cuda") * 0.02)
    sa, sb = fg._scales(a_s), fg._col_scales(b_s, N)
    kc = fg.default_config(M, N, K, torch.cuda.get_device_properties(0).multi_processor_count)
    if args.kw:                                         # another configuration (its "kernel" key picks the factory)
        kc = dict(args.kw)
    if args.diag:
        kc["diag"] = args.diag
    name = f"fp8_gemm {M}x{N}x{K} {kc}"
    k = fg.kernel_factory(kc.pop("kernel", "pingpong"))(N, K, **kc)
    return name, lambda: k(a, sa, b, sb)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("op", choices=("attn", "gemm"))
    p.add_argument("--diag", default="", help="the kernel's diag ablation ('' = the kernel itself)")
    p.add_argument("--m", type=int, default=4096, help="attn: queries (the release prefill: 4096)")
    p.add_argument("--attn-data", default="random", choices=("random", "settled"))
    p.add_argument("--kw", type=_json_dict, default={},
                   help="attn: more fwd_kernel_pp options; gemm: the configuration in place of the default "
                        "(fp8_gemm's cfg, e.g. '{\"kernel\": \"ws\"}'); as JSON")
    p.add_argument("--mnk", type=_mnk, default=(4096, 5120, 5120), help="gemm: M,N,K")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ncu_one: needs a CUDA GPU")
    name, launch = (_attn if args.op == "attn" else _gemm)(args)
    for _ in range(3):                                  # compile, then warm
        launch()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    launch()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"ncu_one: profiled one launch of {name}", flush=True)


if __name__ == "__main__":
    main()
