"""Shared bits of the TileLang kernels: compile target, pass configs, small helpers.

Kernels are built lazily (first call) and cached per static configuration; shapes that vary between
calls (batch, queries, kv rows, GEMM M) are dynamic symbols so one build serves every size.
"""
from __future__ import annotations

import functools
import json
import os
import re

import tilelang
import torch
import tilelang.language as T  # noqa: F401  (re-exported for the kernel modules)

from .. import Unsupported  # noqa: F401  (raised by the ops for inputs their tiles do not cover)

LOG2E = 1.4426950408889634


def target():
    """``DSV41_TL_TARGET`` (a target string or JSON dict, e.g. '{"kind":"cuda","arch":"sm_90a"}' to
    build on a machine without a GPU), else TileLang's auto-detection."""
    t = os.environ.get("DSV41_TL_TARGET", "auto")
    return json.loads(t) if t.startswith("{") else t


PASS_CFG = {
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
}


WIDE_SWIZZLE_SUFFIX = "_sw128"


def _install_wide_swizzle() -> None:
    """Let a WGMMA read a K slice of a shared tile laid out with the swizzle of the tile's FULL row.

    TileLang 0.1.15 lays out a WGMMA operand by the GEMM's own K (``GemmWGMMA.infer_layout``: continuity = K),
    so a k = 32 fp8 GEMM on a [rows, 128] tile stores it as four [rows, 32] panels with a 32-byte swizzle, and
    the TMA that fills it moves 32-byte rows (four boxes per tile). For a K-major shared operand whose buffer
    name ends in ``_sw128`` this makes the layout the one its whole row allows (128-byte swizzle for 128 fp8):
    one TMA box per tile, and each k = 32 WGMMA's descriptor starts 32 bytes into the swizzle atom (TileLang's
    descriptor code restricts the layout to the sliced region, as CuTe's ``make_gmma_desc`` does). Buffers
    without the suffix are untouched, and the name keeps such kernels apart in TileLang's cache."""
    try:
        from tilelang.cuda.op.gemm.gemm_wgmma import GemmWGMMA
    except ImportError:             # another TileLang layout: *_sw128 buffers keep TileLang's own layout
        return                      # (correct, only slower; test_swizzle128_layout_in_generated_code says so)
    if getattr(GemmWGMMA, "_dsv41_wide", False):
        return
    original = GemmWGMMA.infer_layout

    def infer_layout(self, target, thread_nums):
        layouts = original(self, target, thread_nums)
        operands = [(self.B, self.trans_B)] + ([(self.A, not self.trans_A)] if self.is_gemm_ss() else [])
        for buf, k_major in operands:
            if k_major and buf.name.endswith(WIDE_SWIZZLE_SUFFIX):
                layouts[buf] = self.infer_shared_layout(int(buf.shape[-1]))(buf)
        return layouts

    GemmWGMMA.infer_layout = infer_layout
    GemmWGMMA._dsv41_wide = True


_install_wide_swizzle()


def compile_kernel(func, out_idx=None, pass_configs=None, workspace_alias_ok: bool = False):
    """tilelang.compile with our target and pass configs, then ``check_reduction_workspace``.
    ``workspace_alias_ok``: the kernel's author has checked (and barriered) every store into a buffer that
    shares its shared memory with a cross-warp reduction's workspace."""
    cfg = dict(PASS_CFG)
    cfg.update(pass_configs or {})
    kernel = tilelang.compile(func, out_idx=out_idx, target=target(), pass_configs=cfg)
    if not workspace_alias_ok:
        check_reduction_workspace(kernel.get_kernel_source())
    return kernel


_SMEM_BUF = re.compile(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);")


def check_reduction_workspace(cuda_source: str) -> None:
    """Refuse generated CUDA in which a cross-warp reduction's shared workspace (``workspace*``, used by
    ``tl::AllReduce`` over more than 32 threads) starts at the same shared-memory offset as one of the kernel's
    own buffers. TileLang 0.1.15 lets the two share memory when their live ranges do not overlap, but the
    reduction ends without a barrier: a warp that finishes it and stores into the other buffer can overwrite
    partial results a slower warp still reads (a data-dependent wrong answer: the lock-step sparse attention's
    P store, H200 run 19). Such a kernel needs a barrier before that store and ``workspace_alias_ok=True``."""
    bufs = _SMEM_BUF.findall(cuda_source)
    work = {int(o) for n, o in bufs if n.startswith("workspace")}
    clash = sorted(n for n, o in bufs if not n.startswith("workspace") and int(o) in work)
    if clash:
        m = re.search(r"__launch_bounds__\(\d+(?:, \d+)?\) (\w+)", cuda_source)
        raise RuntimeError(f"TileLang kernel {m.group(1) if m else '?'}: a reduction workspace shares shared "
                           f"memory with {clash}; the reduction ends without a barrier, so a store into "
                           f"{clash} can race with it. Add T.sync_threads() before that store and pass "
                           f"workspace_alias_ok=True (kernels/tilelang/_common.py).")


def softmax_macros(H: int, BI: int, c: float, lazy: bool = False):
    """The release's block softmax step (SPEC §10.5), shared by every sparse-attention forward kernel, as two
    TileLang macros over a [H, BI] fp32 score fragment (c = softmax scale * log2 e). Each kernel takes the new
    running max its own way (in place, into a second buffer, exchanged with its peer warpgroup), then:

    - ``factor(a, m_from, m_to)``: a = exp2(c (m_from - m_to)), the factor that moves sums taken under m_from to
      m_to; ``lazy`` (the pp kernel's opt-in FA4-style max): exactly 1.0 where m_from == m_to.
    - ``probs(acc, m_old, m, a, ls, l)``, with m = max(m_old, rowmax S) already in ``m``: a = factor(m_old, m);
      acc <- exp2(c S - c m) (fp32: P before its bf16 rounding); ls = rowsum acc; l <- l a + ls.
    """

    @T.macro
    def factor(a, m_from, m_to):
        for h in T.Parallel(H):
            if lazy:
                a[h] = T.if_then_else(m_from[h] == m_to[h], 1.0, T.exp2((m_from[h] - m_to[h]) * c))
            else:
                a[h] = T.exp2((m_from[h] - m_to[h]) * c)

    @T.macro
    def probs(acc, m_old, m, a, ls, l):
        factor(a, m_old, m)
        for h, t in T.Parallel(H, BI):
            acc[h, t] = T.exp2(acc[h, t] * c - m[h] * c)
        T.reduce_sum(acc, ls, dim=1)
        for h in T.Parallel(H):
            l[h] = l[h] * a[h] + ls[h]

    return factor, probs


@functools.lru_cache(maxsize=None)
def sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` without torch.func's gradient wrappers: a kernel launch needs the real storage. Use it inside
    ``torch._C._DisableFuncTorch()`` (while functorch is on, every new tensor, a kernel's output included, is a
    storage-less wrapper), for ops that have no gradient (top-k indices) or whose gradient an autograd.Function
    supplies. Under ``vmap`` a launch would drop the batch dimension, so a batched tensor raises
    ``Unsupported`` (``impl="auto"`` then runs the torch reference, which vmaps)."""
    from torch._C import _functorch as F
    while F.is_functorch_wrapped_tensor(t):
        if F.is_batchedtensor(t):
            raise Unsupported("a TileLang kernel cannot run under torch.func.vmap (batched tensor)")
        t = F.get_unwrapped(t)
    return t


def check_nreg(kernel: str, nreg: tuple, consumers: int = 2, threads: int = 384) -> None:
    """Refuse setmaxnreg budgets ``nreg`` = (each of ``consumers`` consumer warpgroups, the producer) over the CTA's
    register pool (``register_pool_per_row``: a larger increase waits forever) or not multiples of 8 in [24, 256]."""
    pool = register_pool_per_row(threads)
    if consumers * nreg[0] + nreg[1] > pool or any(r % 8 or not 24 <= r <= 256 for r in nreg):
        raise ValueError(f"{kernel}: nreg {nreg}: {consumers} * nreg[0] + nreg[1] must be <= {pool} (the {threads}-thread "
                         "CTA's register pool; more makes setmaxnreg.inc wait forever), multiples of 8 in [24, 256]")


def register_pool_per_row(threads: int) -> int:
    """setmaxnreg budget: a CTA of ``threads`` threads launches with floor(65536 / threads) registers a thread
    rounded down to 8 (168 at 384 threads, 128 at 512), and ``setmaxnreg`` only moves registers within that
    pool; so the per-warpgroup budgets must sum to at most ``threads / 128 * that``, or a warpgroup's increase
    waits forever (the seesaw forward's hang, H200 run 15)."""
    return threads // 128 * (65536 // threads // 8 * 8)
