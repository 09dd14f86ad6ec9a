"""Shared helpers of the GPU kernel tests (tests/test_gpu_*.py): device, skip rule, bf16 closeness, call recording."""
import contextlib
import os

import pytest
import torch

from functional_dsv41 import kernels as K

# "cuda"; scripts/precompile_kernels.py's ``tests`` mode sets "cpu" to compile the tests' kernels without a GPU
DEV = os.environ.get("DSV41_TEST_DEVICE", "cuda")


def need_tilelang():
    ok, why = K.tilelang_status()
    if not ok:
        pytest.skip(f"TileLang unavailable: {why}")


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


def close_bf16(out, ref, ulps=2):
    """(count, max) of |out - ref| > ulps * 2^-8 * (|ref| + 1e-2 * max|ref|)  (bf16 has 8 significant bits)."""
    o, r = out.float(), ref.float()
    tol = ulps * 2.0 ** -8 * (r.abs() + 1e-2 * r.abs().max())
    bad = (o - r).abs() > tol
    return int(bad.sum()), float((o - r).abs().max())


@contextlib.contextmanager
def record_kernel_calls(names, per_op):
    """Record the first ``per_op`` calls of each kernel op in ``names`` made through ``functional_dsv41.kernels``
    while the block runs: yields {op: [(args, kwargs without impl, output), ...]}; the ops are restored after."""
    calls, real = {}, {n: getattr(K, n) for n in names}

    def recorder(name):
        def f(*a, **k):
            out = real[name](*a, **k)
            if len(calls.setdefault(name, [])) < per_op:
                calls[name].append((a, {n: v for n, v in k.items() if n != "impl"}, out))
            return out
        return f
    try:
        for n in names:
            setattr(K, n, recorder(n))
        yield calls
    finally:
        for n in names:
            setattr(K, n, real[n])
