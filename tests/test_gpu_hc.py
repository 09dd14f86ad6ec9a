"""TileLang mHC split + Sinkhorn (forward and backward) against the torch reference (SPEC §10; issue #7). GPU only: tests/conftest.py skips
them without CUDA. fp32: within 1e-5; gradients against autograd of the reference.
"""
import os

import pytest
import torch

from functional_dsv41 import kernels as K
from functional_dsv41.kernels import reference

from conftest import cosine_diff
from gpu_common import DEV, need_tilelang as _need_tilelang

pytestmark = pytest.mark.gpu


# ----------------------------------------------------------------------------- mHC split + Sinkhorn
def _hc_inputs(lead, hc=4, seed=5, spread=3.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    W = (2 + hc) * hc
    m = torch.randn(*lead, W, device=DEV, generator=g) * spread
    sc = torch.rand(3, device=DEV, generator=g) + 0.25
    b = torch.randn(W, device=DEV, generator=g)
    return m, sc, b


HC_SHAPES = [((4096,), 4, 20), ((2, 37), 4, 20), ((1,), 4, 20), ((3, 11), 2, 5), ((130,), 4, 1)]


@pytest.mark.parametrize("lead,hc,iters", HC_SHAPES, ids=lambda c: str(c).replace(" ", ""))
def test_hc_split_sinkhorn_fwd(lead, hc, iters):
    _need_tilelang()
    m, sc, b = _hc_inputs(lead, hc)
    out = K.hc_split_sinkhorn(m, sc, b, hc, iters, 1e-6, impl="tilelang")
    ref = K.hc_split_sinkhorn(m, sc, b, hc, iters, 1e-6, impl="torch")
    for name, o, r in zip(("pre", "post", "comb"), out, ref):
        assert o.dtype == torch.float32 and o.shape == r.shape, name
        err = float((o - r).abs().max())
        print(f"hc_split_sinkhorn {lead} hc={hc} iters={iters} {name}: max abs diff {err:.2e}")
        assert err <= 1e-5, name


def _hc_loss(fn, m, sc, b, hc=4, iters=20):
    pre, post, comb = fn(m, sc, b, hc, iters, 1e-6)
    w = torch.arange(comb.numel(), device=comb.device).reshape(comb.shape).float().sin()
    return (pre * pre.cos()).sum() + post.square().sum() + (comb * w).sum()


def _hc_grad_check(g, g_ref, names=("mixes", "scale", "base")):
    for name, a, r in zip(names, g, g_ref):
        rel = float((a - r).abs().max() / r.abs().max().clamp_min(1e-30))
        cd = cosine_diff(a, r)
        print(f"hc grad {name}: max rel {rel:.2e}, cosine diff {cd:.2e}")
        assert a.shape == r.shape and a.dtype == r.dtype
        assert cd < 1e-8 and rel < 1e-4, name


@pytest.mark.parametrize("lead", [(4096,), (2, 37)], ids=lambda c: "x".join(map(str, c)))
def test_hc_split_sinkhorn_bwd(lead):
    _need_tilelang()
    m, sc, b = _hc_inputs(lead)
    ins = [t.clone().requires_grad_() for t in (m, sc, b)]
    g = torch.autograd.grad(_hc_loss(lambda *a: K.hc_split_sinkhorn(*a, impl="tilelang"), *ins), ins)
    ins_r = [t.double().requires_grad_() for t in (m, sc, b)]
    g_r = torch.autograd.grad(_hc_loss(lambda *a: K.hc_split_sinkhorn(*a, impl="torch"), *ins_r), ins_r)
    _hc_grad_check(g, [t.float() for t in g_r])


def test_hc_split_sinkhorn_torch_func_grad():
    _need_tilelang()
    m, sc, b = _hc_inputs((64,))
    f = lambda impl: torch.func.grad(  # noqa: E731
        lambda *a: _hc_loss(lambda *t: K.hc_split_sinkhorn(*t, impl=impl), *a), argnums=(0, 1, 2))
    g = f("tilelang")(m, sc, b)
    g_r = f("torch")(m, sc, b)
    _hc_grad_check(g, g_r)


def test_auto_picks_tilelang_fp4_hc():
    _need_tilelang()
    from functional_dsv41.kernels import tilelang as tl
    assert K.resolve("hc_split_sinkhorn", "auto", on_cuda=True) is tl.hc_split_sinkhorn
    assert K.resolve("fp4_act_quant", "auto", on_cuda=True) is tl.fp4_act_quant


# ----------------------------------------------------------------------------- TileLang backward kernel
# (hc_split_sinkhorn_bwd_kernel, bwd="tilelang"): vs float64 autograd of the reference. "sat": large
# |mixes| (spread 30: logits up to ~±150, saturated sigmoids and near one-hot softmax rows).
HC_BWD_CASES = [((4096,), 4, 20, 3.0), ((2, 37), 4, 20, 3.0), ((3, 11), 2, 5, 3.0), ((130,), 4, 1, 3.0),
                ((1,), 4, 20, 3.0), ((4096,), 4, 20, 30.0)]


def _hs():
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import hc_sinkhorn_tl as hs
    return hs


def _ref_grads(m, sc, b, hc, iters):
    ins_r = [t.double().requires_grad_() for t in (m, sc, b)]
    g_r = torch.autograd.grad(_hc_loss(lambda *a: K.hc_split_sinkhorn(*a, impl="torch"), *ins_r, hc, iters), ins_r)
    return [t.float() for t in g_r]


@pytest.mark.parametrize("lead,hc,iters,spread", HC_BWD_CASES, ids=lambda c: str(c).replace(" ", ""))
def test_hc_bwd_kernel(lead, hc, iters, spread):
    hs = _hs()
    m, sc, b = _hc_inputs(lead, hc, spread=spread)
    ins = [t.clone().requires_grad_() for t in (m, sc, b)]
    g = torch.autograd.grad(_hc_loss(lambda *a: hs.hc_split_sinkhorn(*a, bwd="tilelang"), *ins, hc, iters), ins)
    _hc_grad_check(g, _ref_grads(m, sc, b, hc, iters))


@pytest.mark.parametrize("threads,div", [(t, d) for t in (128, 64, 32) for d in ("rcp", "approx")])
def test_hc_bwd_kernel_variants(threads, div):
    """The variants the bench sweeps: CTA sizes (partials: one row per CTA, N not a multiple of the CTA)
    and IEEE vs MUFU reciprocals."""
    hs = _hs()
    m, sc, b = _hc_inputs((1000,))
    gp, gq, gc = (torch.randn(1000, *s, device=DEV) for s in ((4,), (4,), (4, 4)))
    out = hs._bwd_tl(m, sc, b, gp, gq, gc, 4, 20, 1e-6, threads=threads, div=div)
    ins_r = [t.double().requires_grad_() for t in (m, sc, b)]
    outs_r = K.hc_split_sinkhorn(*ins_r, 4, 20, 1e-6, impl="torch")
    ref = torch.autograd.grad(outs_r, ins_r, [t.double() for t in (gp, gq, gc)])
    _hc_grad_check(out, [t.float() for t in ref])


def test_hc_bwd_kernel_deterministic():
    """d scale / d base are per-CTA partials summed in a fixed order: bit-identical across runs."""
    hs = _hs()
    m, sc, b = _hc_inputs((4096,))
    gp, gq, gc = (torch.randn(4096, *s, device=DEV) for s in ((4,), (4,), (4, 4)))
    a = hs._bwd_tl(m, sc, b, gp, gq, gc, 4, 20, 1e-6)
    for _ in range(3):
        for x, y in zip(a, hs._bwd_tl(m, sc, b, gp, gq, gc, 4, 20, 1e-6)):
            assert torch.equal(x, y)


@pytest.mark.parametrize("spread", [3.0, 30.0])
def test_hc_bwd_kernel_torch_func_grad(spread):
    hs = _hs()
    m, sc, b = _hc_inputs((64,), spread=spread)
    g = torch.func.grad(lambda *a: _hc_loss(lambda *t: hs.hc_split_sinkhorn(*t, bwd="tilelang"), *a),
                        argnums=(0, 1, 2))(m, sc, b)
    _hc_grad_check(g, _ref_grads(m, sc, b, 4, 20))


def test_hc_bwd_env_default_and_bad_name():
    hs = _hs()
    assert hs.BWD_DEFAULT in ("torch", "tilelang")
    m, sc, b = _hc_inputs((4,))
    with pytest.raises(ValueError):
        hs.hc_split_sinkhorn(m, sc, b, bwd="nope")


# forward variants the bench sweeps (tokens per CTA; IEEE division / IEEE reciprocal / MUFU reciprocal)
@pytest.mark.parametrize("lead,hc,iters", [((4096,), 4, 20), ((4099,), 4, 20), ((3, 11), 2, 5), ((130,), 4, 1)],
                         ids=lambda c: str(c).replace(" ", ""))
@pytest.mark.parametrize("threads,div", [(t, d) for t in (128, 64, 32) for d in ("ieee", "rcp", "approx")])
def test_hc_fwd_variants(lead, hc, iters, threads, div):
    """4099 rows: a last CTA with 3 rows, for every tokens-per-CTA variant (the row count is a runtime size)."""
    hs = _hs()
    if (hc, iters) != (4, 20) and threads != 128:
        pytest.skip("CTA-size variants compiled for the release configuration only")
    m, sc, b = _hc_inputs(lead, hc)
    m2 = m.reshape(-1, m.shape[-1]).contiguous()
    out = hs.hc_split_sinkhorn_kernel(hc, iters, 1e-6, threads, div)(m2, sc, b)
    ref = K.hc_split_sinkhorn(m2, sc, b, hc, iters, 1e-6, impl="torch")
    for name, o, r in zip(("pre", "post", "comb"), out, ref):
        err = float((o.reshape(r.shape) - r).abs().max())
        print(f"hc fwd threads={threads} div={div} {lead} {name}: max abs diff {err:.2e}")
        assert err <= 1e-5, name


# ----------------------------------------------------------------------------- hc_pre / hc_post (fused applications)
# (70000,): more tokens than a grid's y dimension holds (65535); the kernels put tokens on x
APPLY_SHAPES = [((2, 2048), 4, 5120), ((3, 37), 4, 128), ((1, 1), 4, 640), ((5,), 2, 256), ((70000,), 4, 128)]


@pytest.fixture
def hc_apply_on(monkeypatch):
    """The fused kernels are opt-in in the model (hc_apply_tl.ENABLED); these tests run them."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import hc_apply_tl
    monkeypatch.setattr(hc_apply_tl, "ENABLED", True)
    return hc_apply_tl


def _apply_inputs(lead, hc, dim, seed=11):
    g = torch.Generator(device=DEV).manual_seed(seed)
    h = torch.randn(*lead, hc, dim, device=DEV, generator=g).bfloat16()
    y = torch.randn(*lead, dim, device=DEV, generator=g).bfloat16()
    pre = torch.rand(*lead, hc, device=DEV, generator=g) + 1e-6
    post = 2 * torch.rand(*lead, hc, device=DEV, generator=g)
    comb = torch.softmax(torch.randn(*lead, hc, hc, device=DEV, generator=g) * 2, -1)
    return h, y, pre, post, comb


@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("lead,hc,dim", APPLY_SHAPES, ids=lambda c: str(c).replace(" ", ""))
def test_hc_pre_post_fused_give_the_references_bits(lead, hc, dim, staged, monkeypatch, hc_apply_on):
    """The fused kernels round every product and sum as the torch spelling does (no FMA), in the same order."""
    monkeypatch.setattr(hc_apply_on, "STAGED", staged)
    h, y, pre, post, comb = _apply_inputs(lead, hc, dim)
    x, x_ref = K.hc_pre(h, pre, impl="tilelang"), K.hc_pre(h, pre, impl="torch")
    o, o_ref = K.hc_post(y, h, post, comb, impl="tilelang"), K.hc_post(y, h, post, comb, impl="torch")
    assert x.shape == x_ref.shape and x.dtype == torch.bfloat16 and o.shape == o_ref.shape
    print(f"hc_pre {lead} hc={hc} dim={dim}: {int((x != x_ref).sum())} of {x.numel()} differ; "
          f"hc_post: {int((o != o_ref).sum())} of {o.numel()}")
    assert torch.equal(x, x_ref) and torch.equal(o, o_ref)


def test_hc_pre_post_fused_gradients_and_torch_func(hc_apply_on):
    """Through autograd and torch.func.grad: the fused ops' gradients equal autograd through the references within
    fp32 summation-order noise (bf16 gradients of h, y: within one bf16 ulp)."""
    h, y, pre, post, comb = _apply_inputs((2, 64), 4, 512)
    g = torch.Generator(device=DEV).manual_seed(1)
    dx, dout = torch.randn(2, 64, 512, device=DEV, generator=g), torch.randn(2, 64, 4, 512, device=DEV, generator=g)

    def loss(impl, h, y, pre, post, comb):
        return ((K.hc_pre(h, pre, impl=impl).float() * dx).sum()
                + (K.hc_post(y, h, post, comb, impl=impl).float() * dout).sum())
    args = (h, y, pre, post, comb)
    ins = [t.clone().requires_grad_() for t in args]
    want = torch.autograd.grad(loss("torch", *ins), ins)
    ins = [t.clone().requires_grad_() for t in args]
    got = torch.autograd.grad(loss("tilelang", *ins), ins)
    fgot = torch.func.grad(lambda *a: loss("tilelang", *a), argnums=(0, 1, 2, 3, 4))(*args)
    for name, a, b, w in zip(("h", "y", "pre", "post", "comb"), got, fgot, want):
        assert torch.equal(a, b), name
        tol = dict(atol=2e-2, rtol=1e-2) if w.dtype == torch.bfloat16 else dict(atol=1e-3, rtol=1e-5)
        torch.testing.assert_close(a.float(), w.float(), **tol, msg=name)


@pytest.mark.parametrize("lead,hc,dim", APPLY_SHAPES, ids=lambda c: str(c).replace(" ", ""))
def test_hc_pre_post_backward_kernels_against_the_torch_backwards(lead, hc, dim, hc_apply_on):
    """The fused backwards against reference.hc_pre_bwd / hc_post_bwd (autograd's maths): dh is one rounded product,
    so the same bits; dy and dres are four-term fp32 sums rounded to bf16 (within one bf16 ulp where contraction
    differs); dpre, dpost and dcomb are fp32 sums over dim in another order (relative to the sum of |terms|)."""
    h, y, pre, post, comb = _apply_inputs(lead, hc, dim)
    g = torch.Generator(device=DEV).manual_seed(3)
    dx = torch.randn(*lead, dim, device=DEV, generator=g).bfloat16()
    dout = torch.randn(*lead, hc, dim, device=DEV, generator=g).bfloat16()
    got, want = hc_apply_on._bwd_pre(h, pre, dx), reference.hc_pre_bwd(h, pre, dx)
    assert torch.equal(got[0], want[0]), "dh"
    scale = torch.matmul(h.float().abs(), dx.float().abs().unsqueeze(-1)).squeeze(-1)
    assert ((got[1] - want[1]).abs() <= 1e-5 * scale + 1e-6).all(), ("dpre", (got[1] - want[1]).abs().max())
    got, want = hc_apply_on._bwd_post(y, h, post, comb, dout), reference.hc_post_bwd(y, h, post, comb, dout)
    for name, a, b in zip(("dy", "dres"), got[:2], want[:2]):
        assert a.shape == b.shape and a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), atol=1e-6, rtol=2 ** -7, msg=name)
    g32 = dout.float().abs()
    s_post = torch.matmul(g32, y.float().abs().unsqueeze(-1)).squeeze(-1)
    s_comb = torch.matmul(h.float().abs(), g32.transpose(-1, -2))
    for name, a, b, sc in (("dpost", got[2], want[2], s_post), ("dcomb", got[3], want[3], s_comb)):
        assert a.shape == b.shape and a.dtype == torch.float32
        assert ((a - b).abs() <= 1e-5 * sc + 1e-6).all(), (name, (a - b).abs().max())


def test_hc_post_backward_kernel_takes_an_expanded_gradient(hc_apply_on):
    """out.sum()'s gradient reaches the backward as an expanded (stride-0) tensor: it is made contiguous, and the
    gradients match autograd through the torch spelling."""
    h, y, pre, post, comb = _apply_inputs((7,), 4, 256)
    ins = [t.clone().requires_grad_() for t in (y, h, post, comb)]
    K.hc_post(*ins, impl="tilelang").float().sum().backward()
    ref_ins = [t.clone().requires_grad_() for t in (y, h, post, comb)]
    K.hc_post(*ref_ins, impl="torch").float().sum().backward()
    for name, a, b in zip(("y", "res", "post", "comb"), ins, ref_ins):
        torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=1e-4, rtol=1e-2, msg=name)


def test_hc_backward_kernels_are_first_order_and_say_so(hc_apply_on, monkeypatch):
    """A gradient of the fused backward raises, naming the switch; with FUSED_BWD off the torch backward
    differentiates twice."""
    h, y, pre, post, comb = _apply_inputs((5,), 4, 128)
    hg, pg = h.clone().requires_grad_(), pre.clone().requires_grad_()
    (dh,) = torch.autograd.grad(K.hc_pre(hg, pg, impl="tilelang").float().square().sum(), hg, create_graph=True)
    with pytest.raises(NotImplementedError, match="FUSED_BWD = False"):
        torch.autograd.grad(dh.float().sum(), pg)
    monkeypatch.setattr(hc_apply_on, "FUSED_BWD", False)
    (dh,) = torch.autograd.grad(K.hc_pre(hg, pg, impl="tilelang").float().square().sum(), hg, create_graph=True)
    (dp,) = torch.autograd.grad(dh.float().sum(), pg)
    assert dp.shape == pre.shape and torch.isfinite(dp).all()


def test_hc_pre_post_under_vmap_run_the_torch_spelling(hc_apply_on):
    """A launch would drop vmap's batch dimension: under torch.func.vmap impl="auto" runs the torch spelling (the
    same bits as the kernels out of vmap) and "tilelang" says why it cannot."""
    h, y, pre, post, comb = _apply_inputs((3, 5), 4, 256)
    got = torch.func.vmap(lambda a, b: K.hc_pre(a, b, impl="auto"))(h, pre)
    assert torch.equal(got, K.hc_pre(h, pre, impl="tilelang"))
    got = torch.func.vmap(lambda *a: K.hc_post(*a, impl="auto"))(y, h, post, comb)
    assert torch.equal(got, K.hc_post(y, h, post, comb, impl="tilelang"))
    with pytest.raises(K.Unsupported, match="vmap"):
        torch.func.vmap(lambda a, b: K.hc_pre(a, b, impl="tilelang"))(h, pre)


def test_hc_pre_post_auto_falls_back_where_the_kernel_does_not_cover(hc_apply_on):
    """dim 100 (no 128-column tile) and fp32 streams run the torch reference under impl="auto"; "tilelang" says why."""
    h, y, pre, post, comb = _apply_inputs((3,), 4, 100)
    assert torch.equal(K.hc_pre(h, pre, impl="auto"), K.hc_pre(h, pre, impl="torch"))
    assert torch.equal(K.hc_post(y, h, post, comb, impl="auto"), K.hc_post(y, h, post, comb, impl="torch"))
    with pytest.raises(K.Unsupported, match="dim 100 is not a multiple of 128"):
        K.hc_pre(h, pre, impl="tilelang")
    h32 = torch.randn(3, 4, 128, device=DEV)
    assert torch.equal(K.hc_pre(h32, pre, impl="auto"), K.hc_pre(h32, pre, impl="torch"))


def test_hc_apply_kernels_on_by_default_and_the_switch(monkeypatch):
    """On unless DSV41_HC_APPLY=torch: impl="auto" runs them; turned off, impl="tilelang" says how to turn them on
    and "auto" runs the torch spelling; a bad value is an error naming the variable."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import hc_apply_tl
    if os.environ.get("DSV41_HC_APPLY") is None:
        assert hc_apply_tl.ENABLED and hc_apply_tl.MODE == "tilelang"
    h, y, pre, post, comb = _apply_inputs((3,), 4, 128)
    monkeypatch.setattr(hc_apply_tl, "MODE", "torch")
    monkeypatch.setattr(hc_apply_tl, "ENABLED", False)
    with pytest.raises(K.Unsupported, match=r"hc_pre: the fused kernel is turned off \(DSV41_HC_APPLY=torch; unset"):
        K.hc_pre(h, pre, impl="tilelang")
    assert torch.equal(K.hc_post(y, h, post, comb, impl="auto"), K.hc_post(y, h, post, comb, impl="torch"))
    monkeypatch.setattr(hc_apply_tl, "MODE", "triton")
    with pytest.raises(ValueError, match="DSV41_HC_APPLY must be 'tilelang' .* got 'triton'"):
        K.hc_pre(h, pre, impl="auto")
