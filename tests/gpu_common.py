"""Shared helpers of the GPU kernel tests (tests/test_gpu_*.py): device, skip rule, bf16 closeness, call recording."""
import contextlib
import os

import pytest
import torch

from functional_dsv41 import kernels as K

from conftest import cosine_diff

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


@contextlib.contextmanager
def tilelang_runs():
    """Which kernel ops the model dispatched on CUDA tensors and which of those ran on TileLang (returned, rather
    than raising ``Unsupported`` for the torch fallback) while the block runs: yields (called, ran), each
    {op: count}, filled by a spy on the dispatcher's ``resolve``; restored after. A test of ``impl="auto"`` asserts
    on ``ran``, since comparing outputs alone passes just as well when every op fell back to torch."""
    called, ran, real = {}, {}, K.resolve

    def resolve(name, impl=None, *, on_cuda=True):
        fn = real(name, impl, on_cuda=on_cuda)
        if not on_cuda:
            return fn
        called[name] = called.get(name, 0) + 1
        if fn is getattr(K.reference, name):
            return fn

        def run(*a, **k):
            out = fn(*a, **k)
            ran[name] = ran.get(name, 0) + 1
            return out
        return run
    try:
        K.resolve = resolve
        yield called, ran
    finally:
        K.resolve = real


# ----------------------------------------------------------------------------- sparse-attention operands
def attn_inputs(B, M, H, D, N, T, seed=0, holes=0.1, empty_row=True):
    """Sparse-attention operands: random q [B, M, H, D], kv [B, N, D] (bf16), sink [H], idx [B, M, T] with a share
    ``holes`` of -1 and (``empty_row``) one all-hole row."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, M, H, D, device=DEV, generator=g).bfloat16()
    kv = torch.randn(B, N, D, device=DEV, generator=g).bfloat16()
    sink = torch.randn(H, device=DEV, generator=g)
    idx = torch.randint(0, N, (B, M, T), device=DEV, generator=g, dtype=torch.int32)
    idx = idx.masked_fill(torch.rand(B, M, T, device=DEV, generator=g) < holes, -1)
    if empty_row:
        idx[0, M // 2] = -1                 # an all-hole row must give 0
    return q, kv, sink, idx


def release_idx(M, N_window, n_comp, topk=512, window=128, seed=0):
    """Prefill indices as the release builds them: window i-127..i (-1 before 0) + top-k compressed."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    i = torch.arange(M, device=DEV)[:, None]
    w = i - (window - 1) + torch.arange(window, device=DEV)[None]
    w = torch.where(w >= 0, w, -1)
    visible = ((i + 1) // 2).clamp(max=n_comp)                                # ratio 2
    r = torch.rand(M, n_comp, device=DEV, generator=g)
    r = r.masked_fill(torch.arange(n_comp, device=DEV)[None] >= visible, -1.0)
    top = r.topk(topk, dim=-1)
    c = torch.where(top.values >= 0, top.indices, -1)
    c = torch.where(c >= 0, c + N_window, -1).sort(-1).values
    return torch.cat([w, c], -1).int()[None]


def release_inputs(seed, idx_seed, with_do=False):
    """q, kv, sink (+ do) drawn from one generator seeded ``seed``, and idx = ``release_idx(seed=idx_seed)``:
    a release prefill, 4096 queries, 64 heads x 512, 128 window + 512 of 2048 compressed rows."""
    M, H, D, n_comp = 4096, 64, 512, 2048
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(1, M, H, D, device=DEV, generator=g).bfloat16()
    kv = torch.randn(1, M + n_comp, D, device=DEV, generator=g).bfloat16()
    sink = torch.randn(H, device=DEV, generator=g)
    do = torch.randn(1, M, H, D, device=DEV, generator=g).bfloat16() if with_do else None
    idx = release_idx(M, M, n_comp, seed=idx_seed)
    return q, kv, sink, do, idx


def lse_ref(q, kv, sink, idx, scale, chunk=256):
    """LSE in log2 units from fp32 logits: log2(sum_valid exp(scale q.kv) + exp(sink)) (chunked over M)."""
    B, M, H, D = q.shape
    out = []
    bidx = torch.arange(B, device=q.device)[:, None, None]
    for m0 in range(0, M, chunk):
        ix = idx[:, m0:m0 + chunk].long()
        kv_t = kv[bidx, ix.clamp_min(0)].float()                                      # [B, m, T, D]
        s = torch.einsum("bmhd,bmtd->bmht", q[:, m0:m0 + chunk].float(), kv_t) * scale
        s = s.masked_fill((ix < 0)[:, :, None, :], float("-inf"))
        s = torch.cat([s, sink.float().expand(*s.shape[:3])[..., None]], -1)
        out.append(torch.logsumexp(s, -1) / torch.log(torch.tensor(2.0)))
    return torch.cat(out, 1)


def check_fwd_out(o, lse, q, kv, sink, idx, scale, eff, tag):
    """o, lse of a sparse-attention forward kernel against reference.sparse_attn(block=eff): cosine diff < 1e-4,
    <= 1e-4 of outputs beyond 2 bf16 ulps, all-hole rows exactly 0, LSE within 1e-3 of the fp32 truth."""
    from functional_dsv41.kernels import reference
    ref = reference.sparse_attn(q, kv, sink, idx, scale, eff)
    assert o.dtype == torch.bfloat16 and o.shape == ref.shape and lse.shape == q.shape[:3]
    assert torch.isfinite(o.float()).all()
    empty = (idx < 0).all(-1)                                                          # [B, M]
    assert (o[empty] == 0).all()
    cd = cosine_diff(o, ref)
    nbad, mx = close_bf16(o, ref)
    lr = lse_ref(q, kv, sink, idx, scale)
    lerr = (lse - lr)[~empty].abs().max().item() if (~empty).any() else 0.0
    print(f"FWDCHK {tag} {tuple(q.shape)} T={idx.shape[-1]}: cos diff {cd:.2e}, "
          f"{nbad} beyond 2 ulps (max abs {mx:.2e}), lse max err {lerr:.2e}")
    assert cd < 1e-4
    assert nbad <= o.numel() * 1e-4, (nbad, mx)
    assert not torch.isnan(lse).any() and lerr < 1e-3
