"""Compile, on a machine WITHOUT a GPU, the TileLang kernels that a GPU run will ask for, so that the kernel cache
(``scripts/pack_tl_cache.sh``) carries them and the device spends no time compiling.

It runs a code path with CPU tensors and ``impl="auto"`` forced onto TileLang: every op does its host-side
planning and calls its kernel factories, each kernel is really compiled (for ``DSV41_TL_TARGET``), and each
launch is replaced by zero outputs of the kernel's declared shapes, so the op goes on and its later kernels
(e.g. the backward's second and third) are planned and compiled too. Values are meaningless; what matters is
the set of compiled kernels, which is printed (a kernel already in the cache loads in ~0 s).

    source scripts/local_tilelang_env.sh
    .venv/bin/python scripts/precompile_kernels.py release-layers --seq 1024 4096
    .venv/bin/python scripts/precompile_kernels.py train-gpu
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16, "int32": torch.int32,
           "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
           "float8_e4m3fn": torch.float8_e4m3fn, "float8_e4m3": torch.float8_e4m3fn}
COMPILED: list[str] = []


class _NoLaunch:
    """Stands in for a compiled kernel: returns zero outputs with the shapes its prim_func declares, the
    dynamic dimensions bound from the inputs' shapes."""

    def __init__(self, kernel, name):
        self.kernel, self.name = kernel, name

    def __call__(self, *args):
        import tilelang  # noqa: F401  (puts TileLang's tvm on the path)
        from tvm import arith, tirx as tir
        pf = self.kernel.prim_func
        outs = list(self.kernel.out_idx or [])
        ins = [p for i, p in enumerate(pf.params) if i not in outs]
        for a in args:              # a launch reads real storage: catches functorch wrappers reaching a kernel
            if isinstance(a, torch.Tensor):
                a.data_ptr()
        env = {}
        for p, a in zip(ins, args):
            buf = pf.buffer_map.get(p)
            if buf is None or not isinstance(a, torch.Tensor):
                continue
            for dim, n in zip(buf.shape, a.shape):
                if isinstance(dim, tir.Var):
                    env[dim] = int(n)
        ana = arith.Analyzer()
        res = []
        for i in outs:
            buf = pf.buffer_map[pf.params[i]]
            shape = [int(ana.simplify(tir.stmt_functor.substitute(d, env))) for d in buf.shape]
            res.append(torch.zeros(shape, dtype=_DTYPES[str(buf.dtype)]))
        if not res:
            return None
        return res[0] if len(res) == 1 else res


def install():
    """Route ``impl="auto"`` on CPU tensors to the TileLang ops, with launches replaced by ``_NoLaunch``."""
    from functional_dsv41 import kernels
    import functional_dsv41.kernels.tilelang as tl
    kernels.tilelang_status = lambda: (True, "ok (precompile: no launches)")
    kernels._first_tensor_is_cuda = lambda args: True
    kernels._tilelang_op.cache_clear()
    for m in pkgutil.iter_modules(tl.__path__):
        mod = importlib.import_module(f"{tl.__name__}.{m.name}")
        if hasattr(mod, "compile_kernel") and not hasattr(mod.compile_kernel, "no_launch"):
            real = mod.compile_kernel

            def compile_kernel(func, *a, _real=real, **k):
                t = time.perf_counter()
                kern = _real(func, *a, **k)
                name = getattr(func, "attrs", {}).get("global_symbol", "?") if hasattr(func, "attrs") else "?"
                COMPILED.append(f"{name} ({time.perf_counter() - t:.1f} s)")
                print("  compiled", COMPILED[-1], flush=True)
                return _NoLaunch(kern, name)
            compile_kernel.no_launch = True
            mod.compile_kernel = compile_kernel
        if hasattr(mod, "sm_count"):
            mod.sm_count = lambda device: 132          # the H200's SMs (planning only)


def release_layers(seqs):
    import functional_dsv41 as fd
    from benchmarks.release_layers import release_layers_cfg
    cfg = release_layers_cfg(16, max(8192, *seqs))
    params = fd.init_params(cfg, seed=0, draw_on_device=True)
    for s in seqs:
        ids = torch.randint(0, cfg.vocab_size, (1, s))
        with torch.no_grad():
            fd.forward(params, {"input_ids": ids}, cfg=cfg, impl="auto", validate=False)


def train_gpu():
    """tests/test_gpu_train.py's model: forward and backward under torch.func.grad."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    torch.Tensor.cuda = lambda self, *a, **k: self
    import test_gpu_train as t
    cfg, tr, fr, batch = t.setup._get_wrapped_function()()
    t._loss_and_grads(cfg, tr, fr, batch, "auto")
    from functional_dsv41.train import loss as L, step as S
    import functional_dsv41 as fd
    dtypes = S.compute_dtypes(cfg, tr)
    torch.func.grad(lambda x: L.compute_losses(S.assemble(x, fr, dtypes), batch, cfg=cfg, coefs={"ce": 1.0},
                                               forward=fd.forward, pad_id=2,
                                               forward_kwargs={"impl": "auto"})[0])(tr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["release-layers", "train-gpu"])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 4096])
    args = ap.parse_args(argv)
    if "DSV41_TL_TARGET" not in os.environ:
        raise SystemExit("set DSV41_TL_TARGET (source scripts/local_tilelang_env.sh) to compile for the H200")
    install()
    t = time.perf_counter()
    if args.what == "release-layers":
        release_layers(args.seq)
    else:
        train_gpu()
    print(f"{len(COMPILED)} kernels compiled or loaded from the cache in {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
