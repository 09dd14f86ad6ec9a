"""The torch kernels against the release kernels' golden file (SPEC §10; fixtures/kernels)."""
import pytest
import torch

from functional_dsv41 import kernels as K
from functional_dsv41 import quant as Q

from conftest import golden


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def test_act_quant_bit_exact():
    g = golden("kernels")
    q, s = K.act_quant(g["act_quant.x"], 32, "ue8m0", Q.E8M0, impl="torch")
    assert torch.equal(_bytes(q), _bytes(g["act_quant.q"]))
    assert torch.equal(_bytes(s), _bytes(g["act_quant.s"]))
    assert torch.equal(Q.act_quant_dequant(g["act_quant.x"]), g["act_quant.qdq"])


@pytest.mark.parametrize("name,bs,sd", [("e8m0_b32", 32, Q.E8M0), ("e4m3_b16", 16, Q.FP8)])
def test_fp4_act_quant_bit_exact(name, bs, sd):
    g = golden("kernels")
    x = g["fp4_act_quant.x"]
    packed, s = K.fp4_act_quant(x, bs, sd, impl="torch")
    assert torch.equal(packed, _bytes(g[f"fp4_act_quant.{name}.packed"]))
    assert torch.equal(_bytes(s), _bytes(g[f"fp4_act_quant.{name}.s"]))
    assert torch.equal(Q.fp4_act_quant_dequant(x, bs, sd), g[f"fp4_act_quant.{name}.qdq"])


def _within_ulp(a, b, ulps=1):
    # one bf16 ulp of |b| (relative 2^-8), plus a small absolute floor
    tol = ulps * (b.float().abs() * 2 ** -8 + 1e-6)
    return bool(((a.float() - b.float()).abs() <= tol).all())


def test_fp8_gemm():
    g = golden("kernels")
    c = K.fp8_gemm(g["fp8_gemm.a"], g["fp8_gemm.a_s"], g["fp8_gemm.b"], g["fp8_gemm.b_s"], impl="torch")
    assert c.dtype == torch.bfloat16 and c.shape == g["fp8_gemm.c"].shape
    assert _within_ulp(c, g["fp8_gemm.c"])


def test_fp4_gemm():
    g = golden("kernels")
    b = g["fp4_gemm.b_packed"].view(torch.float4_e2m1fn_x2)
    c = K.fp4_gemm(g["fp4_gemm.a"], g["fp4_gemm.a_s"], b, g["fp4_gemm.b_s"], impl="torch")
    assert _within_ulp(c, g["fp4_gemm.c"])


def test_sparse_attn():
    g = golden("kernels")
    o = K.sparse_attn(g["sparse_attn.q"], g["sparse_attn.kv"], g["sparse_attn.sink"], g["sparse_attn.idx"],
                      64 ** -0.5, impl="torch")
    assert _within_ulp(o, g["sparse_attn.o"])
    assert (o[1, 2] == 0).all(), "an all -1 index row must give 0, not NaN"


def test_sparse_attn_matches_dense_softmax_with_sink():
    """Independent check of the math: softmax over the selected keys plus the sink logit."""
    torch.manual_seed(0)
    q = torch.randn(1, 3, 2, 32).bfloat16()
    kv = torch.randn(1, 20, 32).bfloat16()
    sink = torch.randn(2)
    idx = torch.tensor([[[0, 5, -1, 7], [1, 2, 3, -1], [19, -1, -1, 4]]], dtype=torch.int32)
    o = K.sparse_attn(q, kv, sink, idx, 0.3, impl="torch")
    for m in range(3):
        sel = [i for i in idx[0, m].tolist() if i >= 0]
        k = kv[0, sel].float()
        for h in range(2):
            logits = torch.cat([q[0, m, h].float() @ k.T * 0.3, sink[h:h + 1]])
            p = torch.softmax(logits, 0)[:-1]
            ref = p @ k
            assert torch.allclose(o[0, m, h].float(), ref, atol=2e-2, rtol=2e-2)


def test_hc_split_sinkhorn():
    g = golden("kernels")
    pre, post, comb = K.hc_split_sinkhorn(g["hc.mixes"], g["hc.scale"], g["hc.base"], 4, 20, 1e-6, impl="torch")
    torch.testing.assert_close(pre, g["hc.pre"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(post, g["hc.post"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(comb, g["hc.comb"], atol=1e-5, rtol=1e-5)
    # doubly stochastic up to eps
    assert torch.allclose(comb.sum(-2), torch.ones(3, 5, 4), atol=1e-4)


def test_impl_switch():
    assert K.resolve("sparse_attn", "torch") is K.reference.sparse_attn
    with pytest.raises(ValueError, match="unknown kernel"):
        K.resolve("nope", "torch")
    with pytest.raises(ValueError, match="impl must be one of"):
        K.resolve("fp8_gemm", "cuda")
    if not K.tilelang_available():
        assert K.resolve("fp8_gemm", "auto", on_cuda=False) is K.reference.fp8_gemm
        with pytest.raises(RuntimeError, match="TileLang cannot run here"):
            K.resolve("fp8_gemm", "tilelang")


def test_auto_falls_back_on_unsupported(monkeypatch):
    """A TileLang op that raises ``Unsupported`` (before launching) is replaced by the torch reference under
    impl="auto" and propagates under impl="tilelang"; any other error propagates under both."""
    calls = []

    def fake_tl(*args, **kwargs):
        calls.append(args)
        raise K.Unsupported("sparse_attn (tilelang): 4 heads")

    monkeypatch.setattr(K, "resolve", lambda name, impl=None, on_cuda=True:
                        K.reference.sparse_attn if impl == "torch" else fake_tl)
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(1, 3, 4, 16, generator=g), torch.randn(1, 5, 16, generator=g)
    sink, idx = torch.zeros(4), torch.tensor([[[0, 1], [2, -1], [4, 3]]])
    out = K.sparse_attn(q, kv, sink, idx, 0.25, impl="auto")
    assert len(calls) == 1
    torch.testing.assert_close(out, K.reference.sparse_attn(q, kv, sink, idx, 0.25), atol=0, rtol=0)
    with pytest.raises(K.Unsupported, match="4 heads"):
        K.sparse_attn(q, kv, sink, idx, 0.25, impl="tilelang")
    assert issubclass(K.Unsupported, ValueError)

    def broken(*args, **kwargs):
        raise RuntimeError("launch failed")
    monkeypatch.setattr(K, "resolve", lambda name, impl=None, on_cuda=True: broken)
    with pytest.raises(RuntimeError, match="launch failed"):
        K.sparse_attn(q, kv, sink, idx, 0.25, impl="auto")


def _fp4_groups(counts, N=64, K=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, a_s = Q.act_quant(torch.randn(sum(counts), K, generator=g).bfloat16(), 32, "ue8m0", Q.E8M0)
    ws = [Q.quant_fp4(torch.randn(N, K, generator=g) * 0.05) for _ in counts]
    return a, a_s, [w for w, _ in ws], [s for _, s in ws]


def test_fp4_gemm_grouped_is_the_per_group_gemm():
    """Group g's rows times weight g, empty groups included, weights as a list or stacked: bitwise the
    per-group fp4_gemm."""
    counts = [3, 0, 5, 1, 0]
    a, a_s, b, b_s = _fp4_groups(counts)
    c = K.fp4_gemm_grouped(a, a_s, b, b_s, counts, impl="torch")
    assert c.shape == (9, 64) and c.dtype == torch.bfloat16
    start = 0
    for g, n in enumerate(counts):
        assert torch.equal(c[start:start + n], K.fp4_gemm(a[start:start + n], a_s[start:start + n], b[g], b_s[g],
                                                          impl="torch"))
        start += n
    assert torch.equal(K.fp4_gemm_grouped(a, a_s, torch.stack(b), torch.stack(b_s), torch.tensor(counts),
                                          impl="torch"), c)


def test_fp4_gemm_grouped_rejects_bad_groups():
    a, a_s, b, b_s = _fp4_groups([2, 3])
    with pytest.raises(ValueError, match="sum to a's 5 rows"):
        K.fp4_gemm_grouped(a, a_s, b, b_s, [2, 2], impl="torch")
    with pytest.raises(ValueError, match="must be >= 0"):
        K.fp4_gemm_grouped(a, a_s, b, b_s, [6, -1], impl="torch")
    with pytest.raises(ValueError, match="2 weights, 2 scales and 3 counts"):
        K.fp4_gemm_grouped(a, a_s, b, b_s, [2, 3, 0], impl="torch")
    with pytest.raises(ValueError, match="2 weights, 1 scales"):
        K.fp4_gemm_grouped(a, a_s, b, b_s[:1], [2, 3], impl="torch")


def test_sparse_attn_all_hole_row_has_zero_output_and_finite_gradients():
    """An all-hole row: o = 0 (the release's 0 / inf), and it adds nothing to any gradient; in particular
    dsink is that of the same inputs without the row (it was NaN: 0 * inf through exp(sink + 1e30))."""
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(1, 3, 2, 8, generator=g), torch.randn(1, 5, 8, generator=g)
    sink = torch.randn(2, generator=g)
    idx = torch.tensor([[[0, 1, 2], [-1, -1, -1], [4, 3, -1]]])
    w = torch.randn(1, 3, 2, 8, generator=g)

    def loss(q_, kv_, s_, i_, w_):
        return (K.sparse_attn(q_, kv_, s_, i_, 0.3, impl="torch") * w_).sum()

    o = K.sparse_attn(q, kv, sink, idx, 0.3, impl="torch")
    assert (o[0, 1] == 0).all()
    dq, dkv, ds = torch.func.grad(loss, argnums=(0, 1, 2))(q, kv, sink, idx, w)
    assert torch.isfinite(ds).all() and (dq[0, 1] == 0).all()
    keep = [0, 2]
    dq2, dkv2, ds2 = torch.func.grad(loss, argnums=(0, 1, 2))(q[:, keep], kv, sink, idx[:, keep], w[:, keep])
    torch.testing.assert_close(ds, ds2, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dkv, dkv2, rtol=1e-6, atol=1e-7)
    qa, kva, sa = (t.clone().requires_grad_() for t in (q, kv, sink))
    loss(qa, kva, sa, idx, w).backward()
    torch.testing.assert_close(sa.grad, ds)


def test_operand_shapes_refused_before_running():
    g = torch.Generator().manual_seed(0)
    a, a_s = Q.act_quant(torch.randn(5, 64, generator=g).bfloat16(), 32, "ue8m0", Q.E8M0)
    W = torch.randn(40, 64, generator=g)
    w4, s4 = Q.quant_fp4(W)
    with pytest.raises(ValueError, match=r"fp4_gemm: b_s must be \[40, 2\]"):
        K.fp4_gemm(a, a_s, w4, s4[:, :1], impl="torch")              # would broadcast over the K blocks
    w8, s8 = Q.quant_fp8_block(W)
    K.fp8_gemm(a, a_s, w8, s8, impl="torch")
    _, per_row = Q.act_quant(W.bfloat16(), 32, "ue8m0", Q.E8M0)     # [40, 2]: per row, not per 32 x 32 block
    with pytest.raises(ValueError, match=r"fp8_gemm: b_s must be \[2, 2\]"):
        K.fp8_gemm(a, a_s, w8, per_row, impl="torch")
    with pytest.raises(ValueError, match=r"fp8_gemm: a_s must be \[5, 2\]"):
        K.fp8_gemm(a, a_s[:, :1], w8, s8, impl="torch")
    with pytest.raises(ValueError, match=r"fp8_gemm: b must be \[N, K=64\]"):
        K.fp8_gemm(a, a_s, w8[:, :32], s8, impl="torch")
    q, sink = torch.randn(1, 3, 2, 16).bfloat16(), torch.zeros(2)
    idx = torch.tensor([[[0, 1], [2, -1], [4, 3]]])
    for kv, i, s, match in [(torch.randn(2, 5, 16).bfloat16(), idx, sink, r"kv must be \[B=1"),
                            (torch.randn(1, 5, 8).bfloat16(), idx, sink, r"kv must be \[B=1, N, D=16\]"),
                            (torch.randn(1, 5, 16).bfloat16(), idx[:, :2], sink, r"topk_idxs must be \[B=1, M=3"),
                            (torch.randn(1, 5, 16).bfloat16(), idx, torch.zeros(1), r"attn_sink must be \[H=2\]"),
                            (torch.randn(1, 5, 16).bfloat16(), idx.float(), sink, "must be an integer tensor")]:
        with pytest.raises(ValueError, match=match):
            K.sparse_attn(q, kv, s, i, 0.25, impl="torch")


def test_auto_sees_keyword_tensors_and_the_signature(monkeypatch):
    import inspect

    class FakeCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    seen, real = [], K.resolve
    monkeypatch.setattr(K, "resolve", lambda n, impl=None, on_cuda=True: (seen.append(on_cuda), real(n, "torch"))[1])
    args = [torch.randn(1, 3, 2, 16).bfloat16(), torch.randn(1, 5, 16).bfloat16(), torch.zeros(2),
            torch.tensor([[[0, 1], [2, -1], [4, 3]]])]
    q, kv, s, i = (t.as_subclass(FakeCuda) for t in args)
    K.sparse_attn(q, kv, s, i, 0.25, impl="auto")
    K.sparse_attn(q=q, kv=kv, attn_sink=s, topk_idxs=i, softmax_scale=0.25, impl="auto")
    assert seen == [True, True]
    params = inspect.signature(K.sparse_attn).parameters
    assert list(params)[:5] == ["q", "kv", "attn_sink", "topk_idxs", "softmax_scale"] and "impl" in params


def test_hc_split_sinkhorn_is_fp32_whatever_the_inputs():
    g = torch.Generator().manual_seed(0)
    m, s, b = torch.randn(2, 3, 24, generator=g), torch.rand(3, generator=g), torch.randn(24, generator=g)
    want = K.hc_split_sinkhorn(m, s, b, impl="torch")
    got = K.hc_split_sinkhorn(m.double(), s.double(), b.double(), impl="torch")
    for w, o in zip(want, got):
        assert o.dtype == torch.float32 and torch.equal(o, w)
