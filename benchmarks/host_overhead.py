"""Host time of the TileLang ops' Python: dispatch, operand checks and planning, with every kernel launch replaced by
a stand-in. No GPU, no compilation and no memory: each kernel factory builds its TIR, ``compile_kernel`` returns a
stand-in that returns its outputs' shapes, and operands and outputs are tensors on the meta device.

What it measures is what a call costs the CPU before its GPU work. Two parts are left out:
- TileLang's own launch path (argument conversion and the driver call), which needs a GPU;
- allocation, which a GPU's caching allocator does and this CPU's malloc would misstate (a 40 MB CPU output
  alone costs tens of µs).

This host time shows through wherever the kernels take less, as at decode-sized GEMMs. BENCHMARKS.md (run 167)
found a group=128 linear at 4096 x 2304 x 5120 bound by the host.

    source scripts/local_tilelang_env.sh && .venv/bin/python benchmarks/host_overhead.py [--calls 2000] [--profile]

``--profile`` adds cProfile's top functions for the two linears at the release's M = 4096.
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optree  # noqa: E402
import torch  # noqa: E402

from functional_dsv41 import kernels, quant as Q  # noqa: E402
from functional_dsv41.kernels._bench_common import positive_int  # noqa: E402
from functional_dsv41.linear import align_fp8_weights, linear  # noqa: E402
from scripts.precompile_kernels import output_shapes, route_to_stand_ins  # noqa: E402


class _Outputs:
    """Stands in for a compiled kernel: returns meta tensors of the outputs its prim_func declares, their dynamic
    dimensions bound from the inputs' shapes; the shapes are worked out once per input-shape signature, as a
    launch does no such work."""

    launches = 0                # every stand-in call: main() checks that each row's calls reached TileLang's path

    def __init__(self, func, out_idx):
        self.func, self.out_idx = func, list(out_idx or [])
        self.plans = {}

    def __call__(self, *args):
        _Outputs.launches += 1
        sig = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        plan = self.plans.get(sig)
        if plan is None:
            plan = self.plans[sig] = output_shapes(self.func, self.out_idx, args)
        outs = [torch.empty(shape, dtype=dt, device="meta") for shape, dt in plan]
        return None if not outs else outs[0] if len(outs) == 1 else outs


def install():
    """``impl="auto"`` routed to the TileLang ops on CPU tensors, each kernel a ``_Outputs`` stand-in."""
    try:
        import tilelang  # noqa: F401
    except Exception as e:
        sys.exit(f"host_overhead.py: tilelang does not import here ({type(e).__name__}: {e}); run `source "
                 f"scripts/local_tilelang_env.sh` first")
    route_to_stand_ins(lambda real: lambda func, out_idx=None, *a, **k: _Outputs(func, out_idx), "host_overhead")


def per_call_us(fn, calls: int) -> float:
    for _ in range(max(10, calls // 20)):
        fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


# (name, fn(o)): each row's call, on the operands ``o`` of its own shape (main() builds them)
CALLS = [
    ("act_quant (dispatch + wrapper)", lambda o: kernels.act_quant(o["x"], impl="auto")),
    ("fp8_gemm (dispatch + wrapper)",
     lambda o: kernels.fp8_gemm(o["xq"], o["xs"], o["p32"]["weight"], o["p32"]["scale"], impl="auto")),
    ("fp8_gemm group=128", lambda o: kernels.fp8_gemm(o["xq128"], o["xs128"], o["p128"]["weight"],
                                                      o["p128"]["scale"], group=128, impl="auto")),
    ("linear, 32 x 32 blocks", lambda o: linear(o["x"], o["p32"], impl="auto")),
    ("linear, 32 x 128 (align_fp8_weights)", lambda o: linear(o["x"], o["p128"], impl="auto")),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=positive_int, default=2000)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    install()
    g = torch.Generator().manual_seed(0)
    rows = []
    for N, K in ((2304, 5120), (5120, 5120)):
        p32 = dict(zip(("weight", "scale"), Q.quant_fp8_block(torch.randn(N, K, generator=g) * 0.02)))
        p128 = align_fp8_weights({"w": p32})["w"]
        for M in (1, 64, 4096):
            x = torch.randn(M, K, generator=g).bfloat16()
            o = dict(zip(("x", "xq", "xs", "xq128", "xs128", "p32", "p128"),
                         (x, *Q.act_quant(x), *Q.act_quant(x, group=128), p32, p128)))
            o = optree.tree_map(lambda t: t.to("meta"), o)      # (see the module docstring: no allocations)
            rows += [(f"{M} x {N} x {K}", name, functools.partial(fn, o)) for name, fn in CALLS]
    print(f"host time a call, TileLang launches replaced by stand-ins (meta tensors, nothing allocated); medians of 3 runs of {a.calls} calls "
          f"(torch {torch.__version__}, one thread)")
    print(f"{'M x N x K':>18}  {'call':<38} {'us':>7}  launches")
    for shape, name, fn in rows:
        before = _Outputs.launches
        us = sorted(per_call_us(fn, a.calls) for _ in range(3))[1]
        launches = (_Outputs.launches - before) / (3 * (a.calls + max(10, a.calls // 20)))
        if launches < 1:                # (a torch fallback would time the reference ops instead)
            sys.exit(f"host_overhead.py: {name} at {shape} did not reach the TileLang kernels")
        print(f"{shape:>18}  {name:<38} {us:7.1f}  {launches:.0f}")
    if a.profile:                       # (o: the loop's last operands, 4096 x 5120 x 5120)
        for name, p in (("linear, 32 x 32 blocks", o["p32"]), ("linear, 32 x 128", o["p128"])):
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(a.calls):
                linear(o["x"], p, impl="auto")
            pr.disable()
            print(f"\n{name}, 4096 x 5120 x 5120, {a.calls} calls:")
            pstats.Stats(pr).sort_stats("tottime").print_stats(12)

if __name__ == "__main__":
    main()
