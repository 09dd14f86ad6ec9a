"""Storage round trip: quantize(dequantize(q, s)) == (q, s) bit for bit for every quantized tensor of the
fixtures (SPEC §9: fp8 32x32 blocks, fp4 experts 1x32, Engram fp8 rows 1x32)."""
import pytest
import torch

from functional_dsv41 import quant

from conftest import fixture_dir


def _b(t):
    return t.contiguous().view(torch.uint8)


def _quantized(name):
    from safetensors.torch import load_file
    sd = load_file(str(fixture_dir(name) / "model.safetensors"))
    out = []
    for n, q in sd.items():
        if n.endswith(".weight") and q.dtype in (quant.FP8, quant.FP4X2):
            out.append((n, q, sd[n[: -len("weight")] + "scale"]))
    return out


def _requant_given_scale(kind, v, s):
    """Quantize values ``v`` with the stored scales ``s`` (no scale choice): e4m3 / E2M1 RNE."""
    f = quant.e8m0_to_float(s)
    if kind == "fp8":
        f = f.repeat_interleave(32, 0)[: v.shape[0]].repeat_interleave(32, 1)[:, : v.shape[1]]
        return (v / f).to(quant.FP8)
    f = f.repeat_interleave(32, -1)
    if kind == "rows":
        return (v / f).to(quant.FP8)
    return quant.pack_fp4(quant.fp4_encode(v / f)).view(quant.FP4X2)


def _kind(n, q):
    if q.dtype == quant.FP4X2:
        return "fp4", quant.dequant_fp4, quant.quant_fp4
    if ".engram.embed." in n:
        return "rows", quant.dequant_fp8_rows, quant.quant_fp8_rows
    return "fp8", quant.dequant_fp8_block, quant.quant_fp8_block


def _block_max(kind, q):
    """max |value code| per scale block: [ceil(N/32), ceil(K/32)] (fp8) or [N, K/32] (rows, fp4)."""
    a = quant.fp4_decode(quant.unpack_fp4(q)).abs() if kind == "fp4" else q.float().abs()
    if kind == "fp8":
        N, K = a.shape
        a = torch.nn.functional.pad(a, (0, -K % 32, 0, -N % 32))
        return a.view(a.shape[0] // 32, 32, a.shape[1] // 32, 32).amax((1, 3))
    return a.unflatten(-1, (-1, 32)).amax(-1)


@pytest.mark.parametrize("name,n_expected", [("tiny-bf16", 2), ("tiny-fp8", 356), ("tiny-vl", 356)])
def test_fixture_storage_round_trip(name, n_expected):
    """For every quantized tensor of the fixture:

    1. re-quantizing the dequantized values with the stored scale gives the stored codes bit for bit;
    2. quantize(dequantize(q, s)) gives back the same VALUES, and the same bits (q, s) for every
       block except those whose largest code sits exactly at half the range (|q| = 224 for e4m3,
       3 for E2M1): there the stored encoding (q, s) and the canonical (2q, s/2) are the same numbers,
       and the power-of-two-ceiling rule (SPEC §9) picks s/2 from the decoded values. Such blocks
       arise when the float amax lay just above a power-of-two boundary and rounded down onto it.
    """
    kinds = {"fp8": 0, "fp4": 0, "rows": 0}
    items = _quantized(name)
    assert len(items) == n_expected
    n_half = n_blocks = 0
    for n, q, s in items:
        kind, deq, qf = _kind(n, q)
        kinds[kind] += 1
        v = deq(q, s, torch.float32)
        assert torch.equal(_b(_requant_given_scale(kind, v, s)), _b(q)), n
        q2, s2 = qf(v)
        assert q2.dtype == q.dtype and s2.dtype == s.dtype and q2.shape == q.shape and s2.shape == s.shape, n
        assert torch.equal(deq(q2, s2, torch.float32), v), n
        same = _b(s2) == _b(s)
        half = _block_max(kind, q) == (3.0 if kind == "fp4" else 224.0)
        assert bool((same | half).all()), n                       # a scale differs only in half-range blocks
        assert bool((_b(s2).to(torch.int16) == _b(s).to(torch.int16) - 1)[~same].all()), n  # and then by s/2
        exp = lambda t: t.repeat_interleave(32, 0)[: q.shape[0]].repeat_interleave(32, 1)[:, : q.shape[1]] \
            if kind == "fp8" else t.repeat_interleave(32 if kind == "rows" else 16, -1)
        keep = exp(same)
        assert torch.equal(_b(q2)[keep], _b(q)[keep]), n          # canonical blocks: codes bit for bit
        n_half += int((~same).sum())
        n_blocks += same.numel()
    assert kinds["rows"] == 2  # both Engram tables, fp8 also in the bf16 fixture
    if name != "tiny-bf16":
        assert kinds["fp4"] == 3 * (10 * 8 + 2 * 4) and kinds["fp8"] == n_expected - 2 - kinds["fp4"]
    assert 0 < n_half < n_blocks


def test_round_trip_catches_a_wrong_format():
    """Decoding Engram fp8 rows as 32x32 blocks (a wrong format) changes values."""
    n, q, s = next(x for x in _quantized("tiny-fp8") if ".engram.embed." in x[0])
    assert s.shape == (q.shape[0], 1)
    v = quant.dequant_fp8_rows(q, s, torch.float32)
    q2, s2 = quant.quant_fp8_block(v)
    assert not torch.equal(quant.dequant_fp8_block(q2, s2, torch.float32), v)


def test_fp8_block_scales_follow_spec_down_to_zero_blocks():
    """SPEC §10.1's weight scale: amax = max(|x|, 1e-4) over a 32 x 32 block, s = 2^ceil(log2(amax / 448)), stored
    as the e8m0 byte 127 + log2(s). An all-zero or tiny block thus gets byte 105 (a 1e-6 floor, 99, passed before:
    nothing checked the scale bytes of such blocks)."""
    import math
    w = torch.zeros(32, 128)
    w[:, 32:64] = 1e-6                                   # below the floor
    w[3, 64] = 3.0                                       # one value sets its block's amax
    w[:, 96:] = torch.linspace(-200.0, 448.0, 32 * 32).view(32, 32)
    q, s = quant.quant_fp8_block(w)
    want = [127 + math.ceil(math.log2(max(a, 1e-4) / 448)) for a in (0.0, 1e-6, 3.0, 448.0)]
    assert want == [105, 105, 120, 127]
    assert s.view(torch.uint8).tolist() == [want]
    assert (quant.dequant_fp8_block(q, s, torch.float32)[:, :32] == 0).all()


def test_dequantisers_refuse_a_scale_of_another_layout():
    """A scale of the wrong layout or dtype is an error naming it, not silently wrong values: 1x32 row scales
    given for a 32x32-block weight were sliced into place, float scales read as exponent bytes, and
    ``linear(mode="dequant")`` ran on them where ``mode="reference"`` refused."""
    from functional_dsv41.linear import linear
    w = torch.randn(64, 96)
    q, s = quant.quant_fp8_block(w)
    _, s_rows = quant.quant_fp8_rows(w)                                       # [64, 3]: another format
    x = torch.randn(2, 96, dtype=torch.bfloat16)
    for mode in ("reference", "dequant"):
        with pytest.raises(ValueError, match=r"\[2, 3\]"):
            linear(x, {"weight": q, "scale": s_rows}, mode=mode)
    with pytest.raises(ValueError, match=r"dequant_fp8_block: scale must be \[2, 3\]"):
        quant.dequant_fp8_block(q, s_rows)
    with pytest.raises(TypeError, match="e8m0"):
        quant.dequant_fp8_block(q, quant.e8m0_to_float(s))                  # fp32 scales: values, not bytes
    with pytest.raises(TypeError, match="e8m0"):
        linear(x, {"weight": q, "scale": quant.e8m0_to_float(s)}, mode="dequant")
    with pytest.raises(TypeError, match="weight must be"):
        quant.dequant_fp8_block(w.to(torch.bfloat16), s)                     # already dequantised
    q4, s4 = quant.quant_fp4(w)
    with pytest.raises(ValueError, match=r"dequant_fp4: scale must be \[64, 3\]"):
        quant.dequant_fp4(q4, s4[:, :2])
    with pytest.raises(TypeError, match="e8m0"):
        quant.dequant_fp4(q4, quant.e8m0_to_float(s4))
    qr, sr = quant.quant_fp8_rows(w)
    with pytest.raises(ValueError, match=r"dequant_fp8_rows: scale must be \[64, 3\]"):
        quant.dequant_fp8_rows(qr, sr[:, :1])
    with pytest.raises(TypeError, match="e8m0_to_float"):
        quant.e8m0_to_float(torch.ones(3))
    # the right operands still decode, also as uint8 exponent bytes
    assert torch.equal(quant.dequant_fp8_block(q, s.view(torch.uint8)), quant.dequant_fp8_block(q, s))
    assert torch.equal(quant.dequant_fp4(q4.view(torch.uint8), s4), quant.dequant_fp4(q4, s4))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weight_quantizers_refuse_non_finite_values_alike(bad):
    """A NaN / inf weight made quant_fp8_block and quant_fp4 fail with "every scale must be a positive power of
    two" while quant_fp8_rows (Engram tables) stored it silently with the e8m0 NaN byte as its scale."""
    w = torch.randn(64, 64)
    w[3, 5] = bad
    for f in (quant.quant_fp8_block, quant.quant_fp4, quant.quant_fp8_rows):
        with pytest.raises(ValueError, match=rf"{f.__name__}: the weight \[64, 64\] has 1 non-finite value.*\[3, 5\]"):
            f(w)


# ----------------------------------------------------------------------------- activation quantizers: edge contract
def test_act_quant_scale_fmt_none_needs_a_float_scale_dtype():
    """SPEC §10.1's call act_quant(x, 32, None) (s = amax/448) with the library's default e8m0 scale_dtype stored
    a floored power of two that is not the s q was divided by (dequant off by up to 2x): it is refused, and with
    the fp32 scale SPEC §10.1 defaults to, q * s gives x back."""
    from functional_dsv41 import kernels as K
    x = torch.tensor([[3.0] * 31 + [5.0], [0.1] * 32], dtype=torch.bfloat16)
    for f in (quant.act_quant, lambda *a: K.act_quant(*a, impl="torch")):
        with pytest.raises(ValueError, match=r"act_quant: scale_fmt=None .* e8m0 .*scale_dtype=torch\.float32"):
            f(x, 32, None)
        with pytest.raises(ValueError, match=r"act_quant: scale_fmt=None"):
            f(x, 32, None, quant.E8M0)
    q, s = quant.act_quant(x, 32, None, torch.float32)
    assert s.dtype == torch.float32 and torch.equal(s[:, 0], x.float().abs().amax(-1) / 448)
    torch.testing.assert_close(q.float() * s, x.float(), rtol=2 ** -3, atol=0)
    q8, s8 = quant.act_quant(x, 32)                                       # the linear's call is unchanged
    assert s8.dtype == quant.E8M0 and quant.e8m0_to_float(s8)[0, 0] == 2.0 ** -6


@pytest.mark.parametrize("f", [quant.act_quant, quant.fp4_act_quant], ids=lambda f: f.__name__)
def test_activation_quantizers_refuse_bad_shapes_naming_the_op(f):
    """A last dim off the block said "last dim 40 ..." without the op, block_size=0 raised ZeroDivisionError and
    a 0-d input IndexError."""
    op = f.__name__
    with pytest.raises(ValueError, match=rf"^{op}: x's last dim 40 is not a multiple of block_size 32"):
        f(torch.randn(2, 40).bfloat16(), 32)
    for bs in (0, -32, 1.5):
        with pytest.raises(ValueError, match=rf"^{op}: block_size must be a positive int, got {bs}"):
            f(torch.randn(2, 64).bfloat16(), bs)
    with pytest.raises(ValueError, match=rf"^{op}: x must be \[\.\.\., N\].*0-d tensor"):
        f(torch.tensor(1.0).bfloat16(), 32)
    f(torch.randn(0, 64).bfloat16(), 32)                                  # no rows: fine


def test_fp4_act_quant_needs_an_even_last_dim():
    with pytest.raises(ValueError, match=r"^fp4_act_quant: x's last dim 9 must be even"):
        quant.fp4_act_quant(torch.randn(2, 9).bfloat16(), 3)


def test_float_to_e8m0_refuses_powers_of_two_outside_e8m0():
    """2^-130 (an fp32 subnormal) wrapped to byte 253 = 2^126; e8m0 holds 2^-127 (byte 0) .. 2^127 (byte 254)."""
    ok = torch.tensor([2.0 ** -127, 2.0 ** -126, 1.0, 2.0 ** 127])
    b = quant.float_to_e8m0(ok)
    assert b.view(torch.uint8).tolist() == [0, 1, 127, 254]
    assert torch.equal(quant.e8m0_to_float(b), ok)
    for bad in (2.0 ** -128, 2.0 ** -130, 2.0 ** -149, float("inf"), 0.0, 3.0, -2.0):
        with pytest.raises(ValueError, match=r"float_to_e8m0: .*positive power of two within e8m0's range"):
            quant.float_to_e8m0(torch.tensor([1.0, bad]))
    with pytest.raises(ValueError, match="float_to_e8m0"):
        quant.float_to_e8m0(torch.tensor([2.0 ** -200], dtype=torch.float64))


def test_e8m0_to_float_decodes_byte_255_as_inf():
    """Documented, not changed (the TileLang kernels decode it alike): byte 255 -> +inf (2^128 overflows fp32),
    where torch's float8_e8m0fnu cast gives NaN."""
    b = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)
    assert quant.e8m0_to_float(b).tolist() == [2.0 ** -127, 2.0 ** -126, 1.0, 2.0 ** 127, float("inf")]
    assert torch.equal(quant.e8m0_to_float(b.view(quant.E8M0)), quant.e8m0_to_float(b))
    assert "255" in quant.e8m0_to_float.__doc__ and "NaN" in quant.e8m0_to_float.__doc__


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_activation_quantizers_non_finite_input(bad):
    """The torch reference's documented behaviour on a NaN / inf (outside the TileLang kernels' tested contract):
    the block's scale is non-finite (e8m0 byte 255) and its dequantised values NaN; other blocks are unaffected;
    e4m3 fp4 scales saturate at 448 for an inf."""
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    x[0, 3] = bad
    q, s = quant.act_quant(x, 32)
    assert s.view(torch.uint8).tolist() == [[255, 119]]
    qdq = quant.act_quant_dequant(x)
    assert torch.isnan(qdq[0, :32]).all() and (qdq[0, 32:] == 1).all()
    p, s4 = quant.fp4_act_quant(x, 32)
    assert s4.view(torch.uint8).tolist() == [[255, 125]] and (quant.unpack_fp4(p)[0, :32] & 7 == 0).all()
    assert torch.isnan(quant.fp4_act_quant_dequant(x)[0, :32]).all()
    p16, s16 = quant.fp4_act_quant(x, 16, quant.FP8)
    codes = quant.unpack_fp4(p16)[0]
    if bad != bad:
        assert torch.isnan(s16[0, 0].float())
        assert torch.isnan(quant.fp4_act_quant_dequant(x, 16, quant.FP8)[0, :16]).all()
    else:
        assert s16[0, 0].float() == 448 and codes[3] == (7 if bad > 0 else 15) and (codes[:3] == 0).all()
    for f in (quant.act_quant, quant.fp4_act_quant):
        assert "TileLang" in f.__doc__ and "NaN" in f.__doc__


# ----------------------------------------------------------------------------- align_fp8_groups (fp8 GEMM group=128)
def _spread_operands(seed=0, rows=48, K=512, spread=8):
    """act_quant operands whose 32-wide blocks' scales differ by up to 2^spread within a 128-column group, with
    values down to 2^-12 of their block's largest: both exact and rounded re-expressions occur."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-spread, 1, (rows, K // 32), generator=g).float()).repeat_interleave(32, 1)
    tiny = torch.exp2(-12 * torch.rand(rows, K, generator=g))
    x = torch.randn(rows, K, generator=g) * mag * tiny
    return quant.act_quant(x.bfloat16(), 32, "ue8m0", quant.E8M0)


def _check_aligned(q, s, q2, s2, rep):
    """q2 * s2 == q * s where q * s is representable at the group's scale; else within half e4m3's subnormal
    step (2^-10 * s2); s2 = the group's largest scale in each of its slots."""
    assert s2.shape[-1] * 4 == s.shape[-1] and s2.shape[:-1] == s.shape[:-1]     # one scale per 128 columns
    f = quant.e8m0_to_float(s).repeat_interleave(rep, 0)[: q.shape[0]]
    f2 = quant.e8m0_to_float(quant.expand_group_scales(s2, 128)).repeat_interleave(rep, 0)[: q.shape[0]]
    want = torch.stack([f[:, 4 * i:4 * i + 4].amax(1) for i in range(f.shape[1] // 4)], 1).repeat_interleave(4, 1)
    assert torch.equal(f2, want)
    v, v2 = q.double() * f.double().repeat_interleave(32, 1), q2.double() * f2.double().repeat_interleave(32, 1)
    at_group = q.double() * (f / f2).double().repeat_interleave(32, 1)       # q in the group's units, exact
    exact = at_group.to(quant.FP8).double() == at_group
    assert torch.equal(v2[exact], v[exact])
    err = (v2 - v).abs()[~exact]
    assert bool((err <= 2.0 ** -10 * f2.double().repeat_interleave(32, 1)[~exact]).all())
    return int((~exact).sum())


def test_align_fp8_groups_per_row_blocks():
    q, s = _spread_operands()
    q2, s2 = quant.align_fp8_groups(q, s, 128)
    assert q2.dtype == quant.FP8 and s2.dtype == quant.E8M0 and q2.shape == q.shape
    rounded = _check_aligned(q, s, q2, s2, 1)
    assert 0 < rounded < q.numel() // 4            # both branches occur
    same = (quant.expand_group_scales(s2).view(torch.uint8) == s.view(torch.uint8)).repeat_interleave(32, 1)
    assert torch.equal(q2.view(torch.uint8)[same], q.view(torch.uint8)[same])   # the group's own block: unchanged
    q3, s3 = quant.align_fp8_groups(q2, quant.expand_group_scales(s2), 128)   # aligned operands: a fixed point
    assert torch.equal(q3.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s3.view(torch.uint8),
                                                                                    s2.view(torch.uint8))
    qf, sf = quant.align_fp8_groups(q, quant.e8m0_to_float(s), 128)        # fp32 scales: the same operands
    assert sf.dtype == torch.float32 and torch.equal(sf, quant.e8m0_to_float(s2))
    assert torch.equal(qf.view(torch.uint8), q2.view(torch.uint8))


def test_align_fp8_groups_weight_blocks_and_leading_dims():
    g = torch.Generator().manual_seed(1)
    blk = torch.exp2(torch.randint(-10, -3, (3, 8), generator=g).float())
    w = torch.randn(70, 256, generator=g) * blk.repeat_interleave(32, 0)[:70].repeat_interleave(32, 1)
    q, s = quant.quant_fp8_block(w)                # [70, 256] with [3, 8] 32 x 32 block scales
    q2, s2 = quant.align_fp8_groups(q, s)
    assert s2.shape == (3, 2)
    _check_aligned(q, s, q2, s2, 32)
    qa, sa = _spread_operands(seed=2, rows=12)
    q3, s3 = quant.align_fp8_groups(qa.view(3, 4, 512), sa.view(3, 4, 16))
    ref_q, ref_s = quant.align_fp8_groups(qa, sa)
    assert torch.equal(q3.reshape(12, 512).view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(s3.reshape(12, 4).view(torch.uint8), ref_s.view(torch.uint8))
    e = quant.expand_group_scales(ref_s, 128)
    assert e.dtype == quant.E8M0 and e.shape == (12, 16)
    assert torch.equal(e.view(torch.uint8)[:, 4:8], ref_s.view(torch.uint8)[:, 1:2].expand(12, 4))


def test_align_fp8_groups_refusals():
    q, s = _spread_operands(rows=4, K=256)
    with pytest.raises(TypeError, match="q must be e4m3"):
        quant.align_fp8_groups(q.float(), s)
    with pytest.raises(ValueError, match="group must be a positive multiple of 32"):
        quant.align_fp8_groups(q, s, 48)
    with pytest.raises(ValueError, match="multiple of group=256"):
        quant.align_fp8_groups(q[:, :128], s[:, :4], 256)
    with pytest.raises(ValueError, match="K/32 = 8 columns"):
        quant.align_fp8_groups(q, s[:, :4])
    with pytest.raises(ValueError, match="fits neither"):
        quant.align_fp8_groups(q, s[:3])
    with pytest.raises(ValueError, match="powers of two"):
        quant.align_fp8_groups(q, quant.e8m0_to_float(s) * 1.5)
    with pytest.raises(TypeError, match="scale must be e8m0"):
        quant.align_fp8_groups(q, quant.e8m0_to_float(s).bfloat16())
    with pytest.raises(ValueError, match="group must be a positive multiple of 32"):
        quant.expand_group_scales(s, 100)


def test_align_fp8_weights_and_linear_group128():
    """linear.align_fp8_weights re-expresses 32 x 32-block fp8 weights with K % 128 == 0 and leaves the rest; linear
    then runs act_quant(group=128) + fp8_gemm(group=128) (torch here: SPEC §10.3 on the expanded scales), within
    the alignment's rounding of the unaligned weight, and refuses what does not fit."""
    from functional_dsv41.linear import align_fp8_weights, dequantize, fp8_scale_group, linear
    g = torch.Generator().manual_seed(4)
    blk = torch.exp2(torch.randint(-12, -3, (3, 8), generator=g).float())     # block scales 2^9 apart: it rounds
    w, s = quant.quant_fp8_block(torch.randn(80, 256, generator=g) * blk.repeat_interleave(32, 0)[:80]
                                 .repeat_interleave(32, 1))
    w96, s96 = quant.quant_fp8_block(torch.randn(40, 96, generator=g))        # K % 128 != 0: kept
    f4, f4s = quant.quant_fp4(torch.randn(16, 256, generator=g))              # fp4: kept
    rows, rows_s = quant.quant_fp8_rows(torch.randn(40, 256, generator=g))    # Engram-style fp8 rows: kept
    tree = {"a": {"weight": w, "scale": s}, "b": [{"weight": w96, "scale": s96}], "c": {"weight": f4, "scale": f4s},
            "e": {"weight": rows, "scale": rows_s}, "f": torch.ones(3)}
    out = align_fp8_weights(tree)
    assert out["a"]["scale"].shape == (3, 2) and fp8_scale_group(out["a"]["weight"], out["a"]["scale"]) == 128
    for k in ("c", "e", "f"):
        assert out[k] is tree[k] or all(out[k][n] is tree[k][n] for n in tree[k])
    assert out["b"][0]["weight"] is w96 and out["b"][0]["scale"] is s96
    assert tree["a"]["scale"].shape == (3, 8)                                 # the input tree is unchanged
    again = align_fp8_weights(out)
    assert again["a"]["weight"] is out["a"]["weight"]                         # aligned weights are kept
    wd, wd2 = dequantize(tree["a"], torch.float32), dequantize(out["a"], torch.float32)
    assert not torch.equal(wd, wd2)                                           # some values rounded ...
    assert bool(((wd - wd2).abs() <= 2.0 ** -10 * quant.e8m0_to_float(out["a"]["scale"]).repeat_interleave(32, 0)
                 [:80].repeat_interleave(128, 1)).all())                      # ... by at most half e4m3's step
    x = torch.randn(5, 256, generator=g).bfloat16()
    y, y2 = linear(x, tree["a"]).float(), linear(x, out["a"]).float()
    from conftest import cosine_diff
    assert cosine_diff(y2, y) < 1e-4 and cosine_diff(y2, (x.float() @ wd2.T)) < 1e-3
    with pytest.raises(ValueError, match=r"linear: x \[\.\.\., 128\] does not match the fp8 weight \[80, 256\]"):
        linear(x[:, :128], out["a"])
    with pytest.raises(ValueError, match=r"its scale must be \[3, 8\] \(32 x 32 blocks\) or \[3, 2\]"):
        fp8_scale_group(w, s[:, :3])
    with pytest.raises(ValueError, match=r"its scale must be \[2, 3\] \(32 x 32 blocks\), got"):
        fp8_scale_group(w96, s96[:, :1])
    with pytest.raises(ValueError, match="fp8 weight: must be 2-D"):
        fp8_scale_group(w[None], s)
    with pytest.raises(ValueError, match="align_fp8_weights: group must be 128"):
        align_fp8_weights(tree, 64)
