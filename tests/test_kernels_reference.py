"""The torch kernels against the release kernels' golden file (SPEC §10; fixtures/kernels)."""
import pytest
import torch

from functional_dsv41 import kernels as K
from functional_dsv41 import quant as Q
from functional_dsv41.kernels import reference

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


def test_fp8_gemm_sums_its_k_blocks_in_k_order():
    """SPEC §10.3's summation: each 32-wide K block's product, scaled, added to an fp32 accumulator in K order.
    Block partials 1, 2^27, -2^27 (scales 2^13 x 2^14 on the last two) sum to 0 in that order (1 + 2^27 rounds to
    2^27) and to 1 in the reverse one, which the fp8 fixture (within one ulp) did not tell apart."""
    a = torch.zeros(1, 96)
    b = torch.zeros(1, 96)
    a[0, [0, 32, 64]] = 1.0
    b[0, [0, 32, 64]] = torch.tensor([1.0, 1.0, -1.0])
    a_s, b_s = torch.tensor([[1.0, 2.0 ** 13, 2.0 ** 13]]), torch.tensor([[1.0, 2.0 ** 14, 2.0 ** 14]])

    def gemm(a, a_s, b, b_s):
        return reference.fp8_gemm(a.to(Q.FP8), Q.float_to_e8m0(a_s), b.to(Q.FP8), Q.float_to_e8m0(b_s), Q.E8M0, 32,
                                  torch.float32).tolist()
    assert gemm(a, a_s, b, b_s) == [[0.0]]
    assert gemm(a.flip(-1), a_s.flip(-1), b.flip(-1), b_s.flip(-1)) == [[1.0]]    # -2^27 + 2^27 + 1


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
            # the reference rounds P to bf16 before P V and the output to bf16: each a relative error of at most
            # 2^-8 (bf16's unit roundoff), so |o - ref| <= 2^-8 (p @ |k|) + 2^-8 |ref|
            bound = 2 ** -8 * (p @ k.abs()) + 2 ** -8 * ref.abs() + 1e-6
            assert ((o[0, m, h].float() - ref).abs() <= bound).all(), (m, h)


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


# ----------------------------------------------------------------------------- operand contract (review 31)
def _gemm_operands(seed=0, M=3, N=64, Kd=64):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, Kd, generator=g)
    a, a_s = Q.act_quant(torch.randn(M, Kd, generator=g).bfloat16(), 32, "ue8m0", Q.E8M0)
    return a, a_s, W, Q.quant_fp8_block(W), Q.quant_fp4(W)


def test_block_scaled_gemms_check_operand_dtypes():
    """Dtypes were never checked: uint8 e8m0 bytes were read as scale VALUES (products off by 10^4..10^6) and a
    bf16 or e4m3 tensor where the quantised weight belongs ran silently. Now a ValueError names the op, the operand
    and its dtype; e8m0 bytes are to be viewed as e8m0 (what the TileLang path also reads as bytes)."""
    a, a_s, W, (w8, s8), (w4, s4) = _gemm_operands()
    u8 = torch.uint8
    cases = [
        (K.fp8_gemm, (a, a_s, w8, s8.view(u8)), r"fp8_gemm: b_s must be e8m0 .* got torch\.uint8 .*b_s\.view\("),
        (K.fp8_gemm, (a, a_s.view(u8), w8, s8), r"fp8_gemm: a_s must be e8m0 .* got torch\.uint8"),
        (K.fp8_gemm, (a, a_s, W.bfloat16(), s8), r"fp8_gemm: b must be e4m3 .* got torch\.bfloat16"),
        (K.fp8_gemm, (a.float(), a_s, w8, s8), r"fp8_gemm: a must be e4m3 .* got torch\.float32"),
        (K.fp8_gemm, (a, a_s, w8, Q.e8m0_to_float(s8).bfloat16()), r"fp8_gemm: b_s must be .* got torch\.bfloat16"),
        (K.fp4_gemm, (a, a_s, w4, s4.view(u8)), r"fp4_gemm: b_s must be e8m0 .* got torch\.uint8"),
        (K.fp4_gemm, (a, a_s.view(u8), w4, s4), r"fp4_gemm: a_s must be e8m0 .* got torch\.uint8"),
        (K.fp4_gemm, (a, a_s, w8[:, :32], s4), r"fp4_gemm: b must be packed e2m1 .* got torch\.float8_e4m3fn"),
        (K.fp4_gemm, (a.bfloat16(), a_s, w4, s4), r"fp4_gemm: a must be e4m3 .* got torch\.bfloat16"),
    ]
    for f, args, match in cases:
        with pytest.raises(ValueError, match=match):
            f(*args, impl="torch")
    with pytest.raises(ValueError, match=r"fp4_gemm_grouped: b_s must be e8m0 .*uint8"):
        K.fp4_gemm_grouped(a, a_s, [w4, w4], [s4, s4.view(u8)], [1, 2], impl="torch")
    with pytest.raises(ValueError, match=r"fp4_gemm_grouped: b must be packed e2m1 .*float8_e4m3fn"):
        K.fp4_gemm_grouped(a, a_s, [w4, w8[:, :32]], [s4, s4], [1, 2], impl="torch")
    with pytest.raises(ValueError, match=r"fp4_gemm_grouped: a_s must be e8m0 .*uint8"):
        K.fp4_gemm_grouped(a, a_s.view(u8), [w4, w4], [s4, s4], [1, 2], impl="torch")
    # the accepted forms: fp32 scale values, packed fp4 as uint8 bytes
    c8 = K.fp8_gemm(a, a_s, w8, s8, impl="torch")
    assert torch.equal(K.fp8_gemm(a, Q.e8m0_to_float(a_s), w8, Q.e8m0_to_float(s8), impl="torch"), c8)
    c4 = K.fp4_gemm(a, a_s, w4, s4, impl="torch")
    assert torch.equal(K.fp4_gemm(a, a_s, w4.view(u8), Q.e8m0_to_float(s4), impl="torch"), c4)
    torch.testing.assert_close(c8.float(), (a.float() * Q.e8m0_to_float(a_s).repeat_interleave(32, -1))
                               @ Q.dequant_fp8_block(w8, s8, torch.float32).T, rtol=2 ** -7, atol=1e-3)


def test_block_scaled_gemms_refuse_bad_sizes_naming_the_op():
    """K = 0 failed in a reshape, act_block_size=16 in a broadcast and block_size=0 with ZeroDivisionError."""
    a, a_s, W, (w8, s8), (w4, s4) = _gemm_operands()
    with pytest.raises(ValueError, match=r"fp8_gemm: K=0: .*K >= 1"):
        K.fp8_gemm(a[:, :0], a_s[:, :0], w8[:, :0], s8[:, :0], impl="torch")
    with pytest.raises(ValueError, match=r"fp4_gemm: K=0: .*K >= 1"):
        K.fp4_gemm(a[:, :0], a_s[:, :0], w4[:, :0], s4[:, :0], impl="torch")
    a16, a16s = Q.act_quant(torch.randn(3, 64).bfloat16(), 16, "ue8m0", Q.E8M0)
    for bs in (16, 0, 48):
        with pytest.raises(ValueError, match=rf"fp4_gemm: act_block_size must be a positive multiple of 32 "
                                             rf"\(SPEC §10.4: 32 or 128\), got {bs}"):
            K.fp4_gemm(a16, a16s, w4, s4, act_block_size=bs, impl="torch")
    for bs in (0, -32):
        with pytest.raises(ValueError, match=rf"fp8_gemm: block_size must be a positive int, got {bs}"):
            K.fp8_gemm(a, a_s, w8, s8, block_size=bs, impl="torch")
    with pytest.raises(ValueError, match=r"fp8_gemm: a must be \[\.\.\., K\], got a 0-d"):
        K.fp8_gemm(a[0, 0], a_s, w8, s8, impl="torch")
    assert K.fp8_gemm(a[:0], a_s[:0], w8, s8, impl="torch").shape == (0, 64)      # M = 0 stays fine


def test_hc_split_sinkhorn_refuses_wrong_lengths_naming_them():
    """Wrong mixes / base / scale lengths failed in a broadcast, an unflatten or with an IndexError."""
    m, s, b = torch.randn(2, 24), torch.rand(3), torch.randn(24)
    cases = [((torch.randn(2, 25), s, b), {}, r"mixes must be \[\.\.\., \(2 \+ hc_mult\) \* hc_mult = 24\] for "
                                               r"hc_mult=4, got \[2, 25\]"),
             ((m, s, b), {"hc_mult": 3}, r"mixes must be \[\.\.\., .* = 15\] for hc_mult=3"),
             ((m, s, torch.randn(20)), {}, r"hc_base must be \[\(2 \+ hc_mult\) \* hc_mult = 24\].*got \[20\]"),
             ((m, torch.rand(1), b), {}, r"hc_scale must be \[3\].*got \[1\]"),
             ((m, s, b), {"hc_mult": 0}, r"hc_mult must be a positive int, got 0")]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=r"^hc_split_sinkhorn: .*" + match):
            K.hc_split_sinkhorn(*args, **kw, impl="torch")


def test_sparse_attn_index_out_of_range_and_empty_kv():
    """An index >= N raised a bare IndexError on CPU (naming neither the op nor N); N = 0 with every slot a hole
    raised IndexError although the result is defined (0). The valid path still reads nothing back."""
    from test_host_sync import count_host_reads
    g = torch.Generator().manual_seed(0)
    q, kv, sink = torch.randn(1, 3, 2, 16, generator=g).bfloat16(), torch.randn(1, 150, 16, generator=g).bfloat16(), \
        torch.randn(2, generator=g)
    idx = torch.randint(0, 150, (1, 3, 70), generator=g, dtype=torch.int32)
    idx[0, 1, ::3] = -1
    with count_host_reads() as calls:
        o = K.sparse_attn(q, kv, sink, idx, 0.25, impl="torch")
    assert calls == [] and torch.isfinite(o.float()).all()
    for v in (150, 10 ** 6):
        bad = idx.clone()
        bad[0, 2, 66] = v                                                  # in the second block of 64
        with pytest.raises(ValueError, match=rf"^sparse_attn: topk_idxs holds {v} >= N=150"):
            K.sparse_attn(q, kv, sink, bad, 0.25, impl="torch")
    holes = torch.full((1, 3, 4), -1)
    o0 = K.sparse_attn(q, kv[:, :0], sink, holes, 0.25, impl="torch")
    assert o0.shape == q.shape and o0.dtype == q.dtype and (o0 == 0).all()
    holes[0, 1, 2] = 0
    with pytest.raises(ValueError, match=r"^sparse_attn: topk_idxs holds 0 >= N=0"):
        K.sparse_attn(q, kv[:, :0], sink, holes, 0.25, impl="torch")
    doc = K.reference.sparse_attn.__doc__
    assert "[0, N)" in doc and "undefined on CUDA" in doc


def test_impl_is_validated_not_defaulted_when_falsy():
    """impl="" or 0 ran the default implementation (``impl or default_impl()``)."""
    x = torch.randn(2, 64).bfloat16()
    for bad in ("", 0, False, "Torch"):
        with pytest.raises(ValueError, match=r"^act_quant: impl must be one of \('auto', 'torch', 'tilelang'\)"):
            K.act_quant(x, 32, impl=bad)
        with pytest.raises(ValueError, match="impl must be one of"):
            K.resolve("act_quant", bad)
    assert K.act_quant(x, 32, impl=None)[1].shape == (2, 2)


@pytest.fixture
def tilelang_wrappers():
    """kernels.tilelang with CPU tensors, for the host-side code that runs before any kernel is built: the real
    package where tilelang imports, else imported against a stand-in ``tilelang`` module (then removed again)."""
    import importlib
    import importlib.util
    import sys
    from unittest import mock
    if importlib.util.find_spec("tilelang") is not None:
        yield importlib.import_module("functional_dsv41.kernels.tilelang")
        return
    pkg = "functional_dsv41.kernels.tilelang"
    saved = {n: sys.modules.pop(n) for n in list(sys.modules) if n == pkg or n.startswith(pkg + ".")}
    had, attr = hasattr(K, "tilelang"), getattr(K, "tilelang", None)
    stub = mock.MagicMock()
    sys.modules["tilelang"], sys.modules["tilelang.language"] = stub, stub.language
    try:
        yield importlib.import_module(pkg)
    finally:
        for n in [n for n in sys.modules if n in ("tilelang", "tilelang.language") or n == pkg
                  or n.startswith(pkg + ".")]:
            del sys.modules[n]
        sys.modules.update(saved)
        if had:
            K.tilelang = attr
        elif hasattr(K, "tilelang"):
            del K.tilelang


def test_tilelang_fp8_gemm_other_block_size_falls_back_under_auto(tilelang_wrappers, monkeypatch):
    """TileLang fp8_gemm raised NotImplementedError for block_size 64, so impl="auto" failed instead of running the
    torch op: it raises ``Unsupported`` (after the shared operand checks, which still raise ValueError)."""
    tl = tilelang_wrappers
    g = torch.Generator().manual_seed(0)
    a, a_s = Q.act_quant(torch.randn(3, 128, generator=g).bfloat16(), 64, "ue8m0", Q.E8M0)
    w8 = Q.quant_fp8_block(torch.randn(64, 128, generator=g))[0]
    b_s = Q.float_to_e8m0(torch.tensor([[0.5, 0.25]]))                   # [ceil(64/64), 128/64]
    with pytest.raises(K.Unsupported, match=r"fp8_gemm \(tilelang\): block_size 32 only, got 64"):
        tl.fp8_gemm(a, a_s, w8, b_s, block_size=64)
    with pytest.raises(ValueError, match=r"fp8_gemm: b_s must be \[1, 2\]") as e:
        tl.fp8_gemm(a, a_s, w8, b_s[:, :1], block_size=64)
    assert not isinstance(e.value, K.Unsupported)
    real = K.resolve
    monkeypatch.setattr(K, "resolve", lambda name, impl=None, on_cuda=True:
                        real(name, "torch") if impl == "torch" else tl.fp8_gemm)
    ref = K.reference.fp8_gemm(a, a_s, w8, b_s, block_size=64)
    assert torch.equal(K.fp8_gemm(a, a_s, w8, b_s, block_size=64, impl="auto"), ref)
    with pytest.raises(K.Unsupported, match="block_size 32 only"):
        K.fp8_gemm(a, a_s, w8, b_s, block_size=64, impl="tilelang")


def test_tilelang_wrappers_name_the_op_and_refuse_what_their_kernels_do_not_cover(tilelang_wrappers):
    """The TileLang wrappers' own pre-launch checks: the shared shape errors naming the op (they said "last dim 40
    is not a multiple..." or divided by a zero block), hc_split_sinkhorn's shared operand check and a validated
    ``bwd`` (a falsy one ran the default), and sparse_attn's ``block``: a block the kernels' recurrence does not
    have is ``Unsupported`` (impl="auto" runs the torch op; it silently ran block 64)."""
    tl = tilelang_wrappers
    x = torch.randn(2, 40).bfloat16()
    for fn, op in ((tl.act_quant, "act_quant"), (tl.fp4_act_quant, "fp4_act_quant")):
        with pytest.raises(ValueError, match=rf"{op}: x's last dim 40 is not a multiple of block_size 32"):
            fn(x, 32)
        with pytest.raises(ValueError, match=rf"{op}: block_size must be a positive int, got 0"):
            fn(x, 0)
    mixes, scale, base = torch.randn(3, 24), torch.ones(3), torch.zeros(24)
    with pytest.raises(ValueError, match=r"hc_split_sinkhorn: .*hc_base must be \[\(2 \+ hc_mult\) \* hc_mult = 24\]"):
        tl.hc_split_sinkhorn(mixes, scale, base[:20], 4)
    with pytest.raises(ValueError, match=r"hc_split_sinkhorn: bwd must be one of"):
        tl.hc_split_sinkhorn(mixes, scale, base, 4, bwd="")
    q, kv = torch.randn(1, 3, 64, 64).bfloat16(), torch.randn(1, 10, 64).bfloat16()
    sink, idx = torch.zeros(64), torch.randint(0, 10, (1, 3, 16), dtype=torch.int32)
    for block, heads in ((32, 64), (128, 16), (True, 64)):
        with pytest.raises(K.Unsupported, match=r"sparse_attn \(tilelang\): block 64, or 128"):
            tl.sparse_attn(q[..., :heads, :], kv, sink[:heads], idx, 0.125, block)


@pytest.mark.parametrize("iters", [0, -1, 2.5, True])
def test_hc_split_sinkhorn_needs_at_least_one_iteration(iters):
    """sinkhorn_iters=0 ran as 1 (the first column normalisation is outside the loop): refused, as other
    non-positive or non-int counts."""
    m, s, b = torch.randn(2, 24), torch.rand(3), torch.randn(24)
    with pytest.raises(ValueError, match=r"hc_split_sinkhorn: sinkhorn_iters must be an int >= 1"):
        K.hc_split_sinkhorn(m, s, b, 4, iters, impl="torch")
    K.hc_split_sinkhorn(m, s, b, 4, 1, impl="torch")


def test_hc_pre_post_backwards_are_autograd_through_the_reference():
    """reference.hc_pre_bwd / hc_post_bwd (the fused kernels' backwards) against autograd through hc_pre / hc_post,
    fp32 operands so that only the summation order of the reductions over dim differs."""
    g = torch.Generator().manual_seed(3)
    h, y = torch.randn(2, 5, 4, 64, generator=g), torch.randn(2, 5, 64, generator=g)
    pre, post = torch.rand(2, 5, 4, generator=g), 2 * torch.rand(2, 5, 4, generator=g)
    comb = torch.softmax(torch.randn(2, 5, 4, 4, generator=g), -1)
    dx, dout = torch.randn(2, 5, 64, generator=g), torch.randn(2, 5, 4, 64, generator=g)
    ins = [t.clone().requires_grad_() for t in (h, pre)]
    want = torch.autograd.grad(reference.hc_pre(*ins), ins, dx)
    for got, w in zip(reference.hc_pre_bwd(h, pre, dx), want):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)
    ins = [t.clone().requires_grad_() for t in (y, h, post, comb)]
    want = torch.autograd.grad(reference.hc_post(*ins), ins, dout)
    for got, w in zip(reference.hc_post_bwd(y, h, post, comb, dout), want):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)


def test_hc_pre_post_refuse_mismatched_shapes_naming_them():
    h, pre = torch.zeros(2, 4, 8), torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"hc_pre: h must be \[\.\.\., hc, dim\] and pre \[\.\.\., hc\]"):
        K.hc_pre(h, pre[:, :3])
    with pytest.raises(ValueError, match=r"hc_post: y must be \[2, 8\] .*; comb must be \[2, 4, 4\], got \[2, 4\]"):
        K.hc_post(torch.zeros(2, 7), h, pre, pre)


def test_fp8_gemm_group128_scales():
    """group=128 (quant.align_fp8_groups's operands: one scale per 128 columns) is SPEC §10.3 on the scales
    expanded to the 32-wide blocks, and within fp8 rounding of the release's own operands; its scale shapes are
    checked like the 32-wide ones."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 24, 512, generator=g) * torch.exp2(torch.randint(-4, 5, (2, 24, 16), generator=g)
                                                           .float()).repeat_interleave(32, -1)
    a, a_s = Q.act_quant(x.bfloat16())
    b, b_s = Q.quant_fp8_block(torch.randn(80, 512, generator=g) * 0.02)
    a2, a2_s = Q.align_fp8_groups(a, a_s)
    b2, b2_s = Q.align_fp8_groups(b, b_s)
    c = K.fp8_gemm(a2, a2_s, b2, b2_s, group=128, impl="torch")
    deq_a = a2.double() * Q.e8m0_to_float(a2_s).double().repeat_interleave(128, -1)     # by hand, in fp64
    deq_b = b2.double() * Q.e8m0_to_float(b2_s).double().repeat_interleave(32, 0)[:80].repeat_interleave(128, 1)
    want = deq_a @ deq_b.T
    assert c.shape == (2, 24, 80) and c.dtype == torch.bfloat16
    assert bool(((c.double() - want).abs() <= 2.0 ** -8 * want.abs() + 1e-6 * want.abs().max()).all())
    from conftest import cosine_diff
    assert cosine_diff(c, K.fp8_gemm(a, a_s, b, b_s, impl="torch")) < 1e-6
    with pytest.raises(ValueError, match=r"a_s must be \[2, 24, 4\] \(one scale per 128"):
        K.fp8_gemm(a, a_s, b2, b2_s, group=128, impl="torch")
    with pytest.raises(ValueError, match=r"b_s must be \[3, 4\] \(one scale per 32 x 128 block"):
        K.fp8_gemm(a2, a2_s, b, b_s, group=128, impl="torch")
    with pytest.raises(ValueError, match="group must be 32 .* or 128"):
        K.fp8_gemm(a2, a2_s, b2, b2_s, group=64, impl="torch")
    with pytest.raises(ValueError, match="group=128 re-expresses 32-wide blocks: block_size must be 32, got 64"):
        K.fp8_gemm(a2, a2_s, b2, b2_s, block_size=64, group=128, impl="torch")
    with pytest.raises(ValueError, match="K=96 is not a multiple of the group 128"):
        K.fp8_gemm(a[..., :96], a_s[..., :3], b[:, :96], b_s[:, :3], group=128, impl="torch")
