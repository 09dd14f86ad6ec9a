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
    .venv/bin/python scripts/precompile_kernels.py train-run  # train/run.py --config tiny --device cuda
    .venv/bin/python scripts/precompile_kernels.py gemm       # tests/test_gpu_gemm.py + the GEMM bench sections
    .venv/bin/python scripts/precompile_kernels.py tests tests/test_gpu_sparse_attn.py -k sp   # any pytest args
    .venv/bin/python scripts/precompile_kernels.py attn-bench # the attention forward's bench rows (attndiag)
    .venv/bin/python scripts/precompile_kernels.py attn-pp    # the bench's attnpp, attnnreg, attnbound rows

``--keys-out FILE`` adds the cache keys of every kernel a run compiled or loaded to FILE; ``KEEP=FILE
scripts/pack_tl_cache.sh`` then packs only those kernels (the whole cache holds every kernel ever compiled here, and
with it, the fixtures and the working tree a device call passes its 64 MiB).

``tests`` runs GPU tests on CPU tensors with the launches stubbed: their assertions fail (the outputs are zeros)
and tests that need CUDA itself error, but every kernel a test builds before that point is compiled.
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
KEYS: list[str] = []        # TileLang cache keys of the kernels compiled or loaded (--keys-out)


def output_shapes(prim_func, out_idx, args) -> list[tuple[list[int], torch.dtype]]:
    """(shape, dtype) of each output (``out_idx``) a kernel's prim_func declares, its dynamic dimensions bound
    from the shapes of the inputs ``args`` (the kernel's call arguments, outputs left out)."""
    import tilelang  # noqa: F401  (puts TileLang's tvm on the path)
    from tvm import arith, tirx as tir
    outs = list(out_idx or [])
    ins = [p for i, p in enumerate(prim_func.params) if i not in outs]
    env = {}
    for p, a in zip(ins, args):
        buf = prim_func.buffer_map.get(p)
        if buf is None or not isinstance(a, torch.Tensor):
            continue
        for dim, n in zip(buf.shape, a.shape):
            if isinstance(dim, tir.Var):
                env[dim] = int(n)
    ana = arith.Analyzer()
    res = []
    for i in outs:
        buf = prim_func.buffer_map[prim_func.params[i]]
        res.append(([int(ana.simplify(tir.stmt_functor.substitute(d, env))) for d in buf.shape],
                    _DTYPES[str(buf.dtype)]))
    return res


class _NoLaunch:
    """Stands in for a compiled kernel: returns zero outputs with the shapes its prim_func declares, the
    dynamic dimensions bound from the inputs' shapes."""

    def __init__(self, kernel, name):
        self.kernel, self.name = kernel, name

    def __call__(self, *args):
        for a in args:              # a launch reads real storage: catches functorch wrappers reaching a kernel
            if isinstance(a, torch.Tensor):
                a.data_ptr()
        res = [torch.zeros(shape, dtype=dt) for shape, dt in
               output_shapes(self.kernel.prim_func, self.kernel.out_idx, args)]
        if not res:
            return None
        return res[0] if len(res) == 1 else res


def install():
    """Route ``impl="auto"`` on CPU tensors to the TileLang ops, with launches replaced by ``_NoLaunch``; record
    each kernel's cache key (TileLang's KernelCache._generate_key) in ``KEYS``."""
    from tilelang.cache.kernel_cache import KernelCache
    if not hasattr(KernelCache._generate_key, "recorded"):
        real_key = KernelCache._generate_key

        def _generate_key(self, *a, **k):
            key = real_key(self, *a, **k)
            KEYS.append(key)
            return key
        _generate_key.recorded = True
        KernelCache._generate_key = _generate_key

    def compile_and_stand_in(real):
        def compile_kernel(func, *a, **k):
            t = time.perf_counter()
            kern = real(func, *a, **k)
            name = getattr(func, "attrs", {}).get("global_symbol", "?") if hasattr(func, "attrs") else "?"
            COMPILED.append(f"{name} ({time.perf_counter() - t:.1f} s)")
            print("  compiled", COMPILED[-1], flush=True)
            return _NoLaunch(kern, name)
        return compile_kernel
    route_to_stand_ins(compile_and_stand_in, "precompile")


def route_to_stand_ins(make_compile, who: str) -> None:
    """Route ``impl="auto"`` on CPU tensors to the TileLang ops: every TileLang module's ``compile_kernel``
    becomes ``make_compile(real compile_kernel)`` (once: a second call keeps the first's), and ``sm_count`` the
    H200's 132 SMs (planning only). Shared by ``install`` and benchmarks/host_overhead.py."""
    from functional_dsv41 import kernels
    import functional_dsv41.kernels.tilelang as tl
    kernels.tilelang_status = lambda: (True, f"ok ({who}: no launches)")
    kernels._first_tensor_is_cuda = lambda args, kwargs=None: True
    kernels._tilelang_op.cache_clear()
    for m in pkgutil.iter_modules(tl.__path__):
        mod = importlib.import_module(f"{tl.__name__}.{m.name}")
        if hasattr(mod, "compile_kernel") and not hasattr(mod.compile_kernel, "stand_in"):
            mod.compile_kernel = make_compile(mod.compile_kernel)
            mod.compile_kernel.stand_in = True
        if hasattr(mod, "sm_count"):
            mod.sm_count = lambda device: 132


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


def train_run():
    """train/run.py's presets on a GPU (the main job with ``--device cuda``, tests/test_gpu_train_run.py): a step's
    forward and backward (tiny at the main job's batch shape; every preset at the tests', the indexer KL on) and
    the greedy sample's prefill and decode."""
    import tempfile
    import functional_dsv41 as fd
    from functional_dsv41.engram import build_token_map
    from functional_dsv41.train import run, step as S
    # the main job's shape (the zero outputs make step 1's gradient non-finite: the run stops there); the tests'
    # (4, 64) below, with every preset
    with tempfile.TemporaryDirectory() as out:
        run.train(run.preset_config(name="tiny", steps=1, batch_size=8, seq_len=128, ckpt_every=0, export=False,
                                    sample_tokens=0, out=out, progress="off"))
    from functional_dsv41.params import train_state as C
    for name in run.PRESETS:                     # the other presets' steps (draft loss, QAT, indexer KL), and the
        with tempfile.TemporaryDirectory() as out:   # samples: a QAT run's from the export in mode "reference"
            run.train(run.preset_config(name=name, steps=1, batch_size=4, seq_len=64, ckpt_every=0, export=False,
                                        sample_tokens=0, out=out, progress="off", loss_indexer_kl=0.1))
        rc = run.preset_config(name=name)
        cfg = run.model_config(rc)
        tr, fr = run.init_train_params(cfg, rc, torch.as_tensor(build_token_map(rc.tokenizer), dtype=torch.int64))
        with torch.no_grad():
            if rc.qat:
                params = fd.unflatten_from_paths(C.to_storage(fd.flatten_with_paths(S.assemble(tr, fr)), cfg))
                run.greedy_sample(params, cfg, [0, 5, 6, 7], 3, 1, "reference")
            else:
                run.greedy_sample(S.assemble(tr, fr, S.compute_dtypes(cfg, tr)), cfg, [0, 5, 6, 7], 3, 1, "dequant")


def gemm():
    """The block-scaled GEMMs of tests/test_gpu_gemm.py (its shape and configuration lists) and of the bench's
    "gemmwide" / "gemmsmall" sections, through the wrappers (so each wrapper's own kernel choice is compiled), and
    the kernels the bench's "gemm", "gemmprobe" and "gemmsmall" sections build directly."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import test_gpu_gemm as t
    from functional_dsv41 import quant as Q
    from functional_dsv41.kernels import bench_gemm as bg
    from functional_dsv41.kernels.tilelang import fp4_gemm_tl as f4, fp8_gemm_tl as fg
    from functional_dsv41.kernels.tilelang._gemm import dequant_bf16

    def fp8(M, N, K, **cfg):
        a, a_s = Q.act_quant(torch.randn(M, K).bfloat16(), 32, "ue8m0", Q.E8M0)
        b, b_s = Q.quant_fp8_block(torch.randn(N, K) * 0.02)
        try:
            fg.fp8_gemm(a, a_s, b, b_s, **cfg)
        except ValueError as e:         # the tests' expected refusals (e.g. the ping-pong at K % 128)
            print(f"  refused {M}x{N}x{K} {cfg}: {e}")

    def fp4(M, N, K, act_block=32, **cfg):
        a, a_s = Q.act_quant(torch.randn(M, K).bfloat16(), act_block, "ue8m0", Q.E8M0)
        b, b_s = Q.quant_fp4(torch.randn(N, K) * 0.02)
        f4.fp4_gemm(a, a_s, b, b_s, act_block_size=act_block, **cfg)

    for shape in t.GEMM_SHAPES:
        for cfg in [{}] + t.FP8_CFGS:
            fp8(*shape, **cfg)
    for shape in [(300, 5120, 2304), (4096, 5120, 5120)]:
        for cfg in t.FP8_WIDE_CFGS:
            fp8(*shape, **cfg)
    for shape in [(1000, 5120, 5120), (4096, 2304, 5120), (4096, 5120, 2304)]:
        for cfg in t.FP8_WS_RELEASE_CFGS:
            fp8(*shape, **cfg)
    for shape in [(300, 5120, 2304), (1000, 2304, 5120), (4096, 5120, 5120)]:
        for cfg in t.FP8_SW128_CFGS:
            for sw in (False, True):
                fp8(*shape, **cfg, swizzle128=sw)
    for shape in [(300, 5120, 2304), (1000, 2304, 5120), (4096, 5120, 5120), (4096, 5120, 2304)]:
        for cfg in t.FP8_SAME_AS_PINGPONG:
            fp8(*shape, **cfg)
    for M, N, K in [(300, 5120, 2304), (1000, 2304, 5120), (4096, 5120, 5120)]:   # group=128 (aligned operands)
        for cfg in t.FP8_GROUP128:
            kc = dict(cfg or fg.group_config(M, N))
            fg.kernel_factory(kc.pop("kernel"))(N, K, group=128, **{k: v for k, v in kc.items() if k != "group"})
    from functional_dsv41.kernels.tilelang import act_quant_tl
    for K in (128, 256, 2304, 5120):                    # act_quant_grouped: its GPU test and the gemm128 section
        act_quant_tl.act_quant_grouped(torch.randn(3, K).bfloat16(), 128)
        act_quant_tl.act_quant(torch.randn(3, K).bfloat16())
    for N, K in [(5120, 5120), (2304, 5120), (5120, 2304)]:   # the bench's "gemm128" section
        for cfg in [*bg.GEMM128_CFGS, fg.group_config(4096, N)]:
            kc = dict(cfg)
            fg.kernel_factory(kc.pop("kernel"))(N, K, **kc)
        # the group=128 wrapper end to end: its scale kernels spread a group's scale (krep=4)
        a, a_s = Q.align_fp8_groups(*Q.act_quant(torch.randn(4096, K).bfloat16(), 32, "ue8m0", Q.E8M0))
        fg.fp8_gemm(a, a_s, *Q.align_fp8_groups(*Q.quant_fp8_block(torch.randn(N, K) * 0.02)), group=128)
    for cfg in bg.GEMM_PROBE_CFGS:                      # the bench's gemmprobe rows (kernels launched directly)
        kc = dict(cfg)
        fg.kernel_factory(kc.pop("kernel"))(5120, 5120, **kc)
    for N, K in [(5120, 5120), (2304, 5120), (5120, 2304)]:   # the bench's "gemm" sweep, built as it builds them
        for cfg in [fg.default_config(4096, N, K), *bg.GEMM_CFGS, *bg.FP8_WS_CFGS]:   # (run 162 compiled 20 there)
            kc = dict(cfg)
            try:
                fg.kernel_factory(kc.pop("kernel", "pingpong"))(N, K, **kc)
            except ValueError as e:                     # a configuration the bench prints as FAILED too
                print(f"  refused gemm sweep {N}x{K} {cfg}: {e}")
    fp8(6, 256, 512)
    for shape in t.FP4_GEMM_SHAPES:
        for cfg in [{}, dict(kernel="loop"), dict(kernel="bf16")] + t.FP4_CFGS:
            fp4(*shape, **cfg)
    for shape in [(300, 5120, 2304), (4096, 2304, 5120)]:
        for cfg in t.FP4_WIDE_CFGS:
            fp4(*shape, **cfg)
    for shape in [(300, 5120, 2304), (1000, 2304, 5120)]:
        for cfg in [dict(kernel="loop"), dict(BN=128, async_promote=True)]:
            for sw in (False, True):
                fp4(*shape, **cfg, swizzle128=sw)
    fp4(6, 256, 512, act_block=128)
    for shape in [(5, 70, 96), (300, 5120, 2304), (1000, 2304, 5120)]:
        fp8(*shape, kernel="bf16")
    for rows, K in [(70, 96), (300, 2304), (1000, 5120)]:
        b, b_s = Q.quant_fp8_block(torch.randn(rows, K))
        dequant_bf16(b, b_s, "e4m3", row_rep=32)
    for M, N in [(64, 2304), (256, 2304), (512, 2304)]:
        fp8(M, N, 5120)
        fp8(M, N, 5120, **fg.default_config(M, N, 5120))
    for M in (f4.BF16_MIN_M - 1, f4.BF16_MIN_M):
        fp4(M, 2304, 5120)
    # bench: gemmsmall's kernels (launched directly there) and gemmwide's
    for N in (5120, 2304):
        fg.fp8_gemm_pingpong_kernel(N, 5120)
        for cfg in bg.GEMM_SMALL_CFGS:
            fg.fp8_gemm_kernel(N, 5120, **{k: v for k, v in cfg.items() if k != "kernel"})
    for (N, K) in [(2304, 5120), (5120, 2304)]:
        for cfg in bg.FP4_SMALL_CFGS:
            f4.fp4_gemm_kernel(N, K, **cfg)
        fp4(64, N, K, kernel="bf16")
        fp4(64, N, K, kernel="loop")
    fp4(f4.BF16_MIN_M + 3, 256, 512)
    fp4(f4.BF16_MIN_M - 1, 256, 512)
    # grouped fp4 GEMM: the tests (and the plain kernel at the same tile, which they compare with) and the bench
    for (N, K) in [(2304, 5120), (5120, 2304), (320, 256)]:
        fp4(64, N, K, BM=f4.GROUPED_BM, BN=f4.GROUPED_BN, threads=2 * f4.GROUPED_BM)
        for cfg in bg.FP4_GROUPED_CFGS if N != 320 else [{}]:
            f4.fp4_gemm_grouped_kernel(N, K, **cfg)


def _meta_references(min_numel=1 << 22):
    """The torch reference kernels, on inputs with a tensor of at least ``min_numel`` elements, run on the meta
    device (shapes only) and return zeros: a release-shape test's reference would take minutes and gigabytes on
    CPU, and the values are meaningless here anyway. Ops meta cannot trace run for real."""
    import optree
    from functional_dsv41.kernels import reference, reference_indexer

    def wrap(f):
        def g(*a, **k):
            leaves = [x for x in optree.tree_leaves((a, k)) if isinstance(x, torch.Tensor)]
            if not any(x.numel() >= min_numel for x in leaves):
                return f(*a, **k)
            ma, mk = optree.tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, (a, k))
            try:
                out = f(*ma, **mk)
            except Exception:
                return f(*a, **k)
            return optree.tree_map(lambda x: torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) else x,
                                   out)
        return g

    for mod in (reference, reference_indexer):
        for name in dir(mod):
            f = getattr(mod, name)
            if callable(f) and not name.startswith("_") and getattr(f, "__module__", "") == mod.__name__:
                setattr(mod, name, wrap(f))


def gpu_tests(pytest_args):
    """Run GPU tests with CPU tensors (``DSV41_TEST_DEVICE=cpu``, read by tests/gpu_common.py and conftest.py when
    pytest collects them) through the stub."""
    import pytest
    os.environ["DSV41_TEST_DEVICE"] = "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    # a test that synchronises between its kernels (test_sparse_attn_fwd_pp_diag_ablations) would stop at its first
    # one here (no CUDA), leaving the rest for the GPU to compile (run 117 ran out of time doing that)
    torch.cuda.synchronize = lambda *a, **k: None
    _meta_references()
    pytest.main(["-q", "-p", "no:cacheprovider", "--tb=no", "-o", "addopts=", *pytest_args])


def attn_bench():
    """The forward kernels of the bench's "attndiag", "attntrace" and "attncl" sections at the release shape (T = 640
    and the random-slot rows), the default forward of "attnfwd", and attnfwd's and attnbwd's configuration sweeps."""
    from functional_dsv41.kernels import bench_attn as ba
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    from functional_dsv41.kernels.tilelang import sparse_attn_sp_tl as sp
    H, D, scale = 64, 512, 512 ** -0.5
    ws = sa.FWD_WS_CFG[64]
    for diag in ba.WS_DIAGS:
        sa.fwd_kernel_ws(H, D, 640, scale, **ws, diag=diag)
    for kw in ba.SP_DIAG_ROWS:
        sp.fwd_kernel_sp(H, D, 640, scale, **{**sp.FWD_SP_CFG, **kw})
    from functional_dsv41.kernels.tilelang import sparse_attn_pp_tl as pp
    for T_ in (640 * m for m in ba.SLOT_MULTS):
        if T_ > 640:
            sa.fwd_kernel_ws(H, D, T_, scale, **ws)
            sp.fwd_kernel_sp(H, D, T_, scale, **sp.FWD_SP_CFG)
        pp.fwd_kernel_pp(H, D, T_, scale)
        for kw in ba.PP_ROUND_OPTS:
            if pp.pp_fits(H, D, T_, **kw):
                pp.fwd_kernel_pp(H, D, T_, scale, **kw)
    for kw in ba.PP_DIAG_ROWS:
        pp.fwd_kernel_pp(H, D, 640, scale, **kw)
    for kw in ({},) + ba.PP_ROUND_OPTS:             # attntrace
        pp.fwd_kernel_pp(H, D, 640, scale, diag="trace", **kw)
    for kw in ba.PP_TRACEB_EXTRA:                   # attntraceb
        pp.fwd_kernel_pp(H, D, 640, scale, diag="traceb", ctas=132, **sa.FWD_PP_BOUNDARY, **kw)
    from functional_dsv41.kernels.tilelang import sparse_attn_cl_tl as cl
    sms = 132                                       # attncl: the H200's (and H100's) SM count
    pp.fwd_kernel_pp(H, D, 640, scale, ctas=sms)
    for diag in ("",) + ba.CL_DIAGS + ("trace",):
        cl.fwd_kernel_cl(H, D, 640, scale, sms, diag=diag)
    cl.fwd_kernel_cl(H, D, 2560, scale, sms)
    sa.fwd_kernel(H, D, 640, scale, BI=64, stages=2)  # the lock-step kernel attnfwd compares with
    for cfg in ba.ATTN_FWD_SWEEP:                   # attnfwd's sweep (T = 640 is a multiple of every BI pair)
        kc = dict(cfg)
        (sa.fwd_kernel_ws if kc.pop("kernel", "lockstep") == "ws" else sa.fwd_kernel)(H, D, 640, scale, **kc)
    from functional_dsv41.kernels.tilelang import sparse_attn_bwd_tl as sb
    for cfg in ba.ATTN_BWD_SWEEP:                   # attnbwd's sweep of the atomic backward kernel
        sb.bwd_kernel(H, D, 640, scale, **cfg)


def attn_pp():
    """The kernels of the bench's "attnpp", "attnnreg" and "attnbound" sections at the release shape: the default
    forward and the persistent pp kernel with each of PP_ROUND_OPTS, each register split of PP_NREG_SPLITS and each
    ablation of PP_BOUND_DIAGS."""
    from functional_dsv41.kernels import bench_attn as ba
    from functional_dsv41.kernels.tilelang import sparse_attn_pp_tl as pp
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    H, D, scale = 64, 512, 512 ** -0.5
    q = torch.zeros(1, 4096, H, D, dtype=torch.bfloat16)
    kv = torch.zeros(1, 5120, D, dtype=torch.bfloat16)
    sa._fwd(q, kv, torch.zeros(H), torch.zeros(1, 4096, 640, dtype=torch.int32), scale)
    for kw in ba.PP_ROUND_OPTS:
        pp.fwd_kernel_pp(H, D, 640, scale, **kw)
    for nreg in ba.PP_NREG_SPLITS:                  # attnnreg
        pp.fwd_kernel_pp(H, D, 640, scale, ctas=132, nreg=nreg, **sa.FWD_PP_BOUNDARY)
    for d in ba.PP_BOUND_DIAGS:                     # attnbound
        pp.fwd_kernel_pp(H, D, 640, scale, ctas=132, **sa.FWD_PP_BOUNDARY, **d)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["release-layers", "train-gpu", "train-run", "gemm", "tests", "attn-bench",
                                     "attn-pp"])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--keys-out", default=None, metavar="FILE",
                    help="add the cache keys of the kernels this run compiled or loaded to FILE (one a line, kept "
                         "sorted and unique), for scripts/pack_tl_cache.sh's KEEP=FILE: an archive of just those")
    args, rest = ap.parse_known_args(argv)
    if rest and args.what != "tests":
        ap.error(f"unrecognised arguments: {' '.join(rest)}")
    if "DSV41_TL_TARGET" not in os.environ:
        raise SystemExit("set DSV41_TL_TARGET (source scripts/local_tilelang_env.sh) to compile for the H200")
    install()
    t = time.perf_counter()
    if args.what == "release-layers":
        release_layers(args.seq)
    elif args.what == "gemm":
        gemm()
    elif args.what == "tests":
        gpu_tests(rest)
    elif args.what == "attn-bench":
        attn_bench()
    elif args.what == "attn-pp":
        attn_pp()
    elif args.what == "train-run":
        train_run()
    else:
        train_gpu()
    print(f"{len(COMPILED)} kernels compiled or loaded from the cache in {time.perf_counter() - t:.0f} s")
    if args.keys_out:
        old = set()
        if os.path.exists(args.keys_out):
            with open(args.keys_out) as f:
                old = {ln.strip() for ln in f if ln.strip()}
        keys = sorted(old | set(KEYS))
        tmp = args.keys_out + ".tmp"
        with open(tmp, "w") as f:
            f.write("".join(k + "\n" for k in keys))
        os.replace(tmp, args.keys_out)              # (a good list is never left half-written)
        print(f"{len(set(KEYS))} cache keys from this run; {len(keys)} in {args.keys_out}")


if __name__ == "__main__":
    main()
