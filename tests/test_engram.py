"""Engram (SPEC §6): token map, layout, hashing, lookup and the gated write against the golden fixtures.

Integer outputs (token map, primes, hash ids) must be exact; the write is compared bit for bit
(teacher-forced: golden block input and golden hash ids in) and by the cosine-diff tolerance.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.utils._pytree as torch_pytree
from conftest import assert_golden_bits, cosine_diff, fixture_dir, golden

import functional_dsv41 as fd
from functional_dsv41 import engram, quant

TINY = ("tiny-bf16", "tiny-fp8", "tiny-vl")

# SPEC §6.2-6.3, quoted
FLASH_PRIMES_L1_2GRAM = [16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183]
FLASH_PRIMES_L14_4GRAM = [16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889]
FLASH_MULT = [[76632096046245, 4839876093313, 35959672319349, 73987337458391],
              [67716810739261, 51510806800915, 30921347202721, 82619226485591]]


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def release_map():
    d = fixture_dir("release-engram")
    return engram.build_token_map(d / "tokenizer.json", expected_size=99092)


_TINY_CACHE: dict = {}


def tiny(name):
    """(cfg, token_map, golden, image_mask of the prompt or None), built once per module."""
    if name not in _TINY_CACHE:
        d = fixture_dir(name)
        cfg = fd.Config.from_json(d / "config.json")
        tmap = engram.build_token_map(d / "tokenizer.json", expected_size=cfg.engram_compressed_vocab_size)
        g = golden(name)
        im = (g["token_types"] >= 0) if "token_types" in g else None
        _TINY_CACHE[name] = (cfg, tmap, g, im)
    return _TINY_CACHE[name]


def engram_params(name, L):
    """params["layers"][L]["engram"] of a tiny fixture, built from the released names."""
    from safetensors.torch import load_file
    key = (name, "params")
    if key not in _TINY_CACHE:
        _TINY_CACHE[key] = load_file(str(fixture_dir(name) / "model.safetensors"))
    w = _TINY_CACHE[key]
    pre = f"layers.{L}.engram."
    sub = lambda n: {k: w[f"{pre}{n}.{k}"] for k in ("weight", "scale") if f"{pre}{n}.{k}" in w}
    return {"embed": sub("embed"), "wkv": sub("wkv"),
            "q_weight": w[pre + "q_weight"], "k_weight": w[pre + "k_weight"]}


def naive_hash(tokens, dead, cfg, tmap):
    """Position-by-position §6.4 in plain Python ints (an independent reading of the spec)."""
    lays = engram.layout(cfg)
    pad = int(tmap[cfg.engram_pad_id])
    G, H = cfg.engram_max_ngram_size - 1, cfg.engram_n_heads
    out = []
    for p in range(len(tokens)):
        per_layer = []
        for lay in lays:
            toks, blocked = [], False
            for s in range(G + 1):
                blocked = blocked or p < s or dead[p - s]
                toks.append(pad if blocked else int(tmap[tokens[p - s]]))
            r, row = 0, []
            for s in range(G + 1):
                r ^= toks[s] * int(lay.multipliers[s])
                if s:
                    row += [r % int(lay.primes[s - 1, h]) + int(lay.offsets[(s - 1) * H + h]) for h in range(H)]
            per_layer.append(row)
        out.append(per_layer)
    return torch.tensor(out, dtype=torch.int64)


# ----------------------------------------------------------------------------- §6.1 token map
def test_token_map_release_equals_golden(release_map):
    g = golden("release-engram")
    assert release_map.dtype == torch.int64 and release_map.shape == (129280,)
    assert int(release_map.max()) + 1 == 99092
    assert torch.equal(release_map, g["token_map"].long())


def test_token_map_size_mismatch_is_clear():
    d = fixture_dir("tiny-bf16")
    with pytest.raises(ValueError, match=r"334 .*99092"):
        engram.build_token_map(d / "tokenizer.json", expected_size=99092)


@pytest.mark.parametrize("name", TINY)
def test_token_map_tiny(name):
    cfg, tmap, _, _ = tiny(name)
    assert tmap.shape == (cfg.vocab_size,)
    assert len(torch.unique(tmap)) == int(tmap.max()) + 1 == 334
    # first-seen numbering: class k first appears before class k+1
    first = [int((tmap == k).nonzero()[0]) for k in range(334)]
    assert first == sorted(first)


# ----------------------------------------------------------------------------- §6.2-6.3 layout
def test_layout_flash_matches_spec_and_golden():
    lays = engram.layout(fd.Config.flash())
    g = golden("release-engram")
    assert [l.rows for l in lays] == [384006168, 384016682]
    assert lays[0].primes[0].tolist() == FLASH_PRIMES_L1_2GRAM
    assert lays[1].primes[2].tolist() == FLASH_PRIMES_L14_4GRAM
    assert [l.multipliers.tolist() for l in lays] == FLASH_MULT
    for i, l in enumerate(lays):
        assert l.primes.dtype == l.offsets.dtype == l.multipliers.dtype == torch.int64
        assert l.primes.shape == (3, 8) and l.offsets.shape == (24,) and l.multipliers.shape == (4,)
        assert torch.equal(l.primes, g["primes"][i]) and torch.equal(l.offsets, g["offsets"][i])
        assert torch.equal(l.multipliers, g["multipliers"][i])
        assert bool((l.multipliers % 2 == 1).all())
    allp = torch.cat([l.primes.flatten() for l in lays]).tolist()
    assert len(set(allp)) == 48


def test_layout_tiny_rows():
    cfg = tiny("tiny-bf16")[0]
    lays = engram.layout(cfg)
    assert [l.rows for l in lays] == [2514, 2712]
    assert lays[0].primes.tolist() == [[401, 409], [419, 421], [431, 433]]


def test_layout_rows_mismatch_is_clear():
    cfg = fd.Config.flash(engram_num_embeddings=(384006168, 384016681))
    with pytest.raises(ValueError, match=r"384016682.*384016681"):
        engram.layout(cfg)


# ----------------------------------------------------------------------------- §6.4 hashing
def test_hash_release_equals_golden(release_map):
    g = golden("release-engram")
    ids, _ = engram.hash_ids(g["input_ids"], cfg=fd.Config.flash(), token_map=release_map,
                             image_mask=g["token_mask"] == 0)
    assert ids.dtype == torch.int64 and ids.shape == (4, 41, 2, 24)
    for b, n in enumerate(g["lengths"].tolist()):
        assert torch.equal(ids[b, :n], g["engram_hash"][b, :n]), f"row {b}"
    # the image span matters: without the mask the row with it differs
    ids2, _ = engram.hash_ids(g["input_ids"], cfg=fd.Config.flash(), token_map=release_map)
    assert not torch.equal(ids2[1, :39], g["engram_hash"][1, :39])


@pytest.mark.parametrize("name", TINY)
def test_hash_tiny_prefill_and_decode(name):
    cfg, tmap, g, im = tiny(name)
    P = int(g["prefill_len"])
    ids, cache = engram.hash_ids(g["input_ids"][:, :P], cfg=cfg, token_map=tmap, image_mask=im)
    assert torch.equal(ids, g["prefill.engram_hash"])
    assert isinstance(cache, engram.NgramCache) and cache.tail.shape == (2, 3)
    for k in range(g["input_ids"].shape[1] - P):
        ids, cache = engram.hash_ids(g["input_ids"][:, P + k:P + k + 1], cfg=cfg, token_map=tmap, cache=cache)
        assert torch.equal(ids, g[f"decode.{k}.engram_hash"]), f"decode step {k}"
    if im is not None:
        bare, _ = engram.hash_ids(g["input_ids"][:, :P], cfg=cfg, token_map=tmap)
        assert not torch.equal(bare, g["prefill.engram_hash"])


def _prompts(release_map):
    """(cfg, tmap, input_ids [1, n], image_mask [1, n] or None) for every fixture prompt row."""
    out = []
    for name in TINY:
        cfg, tmap, g, im = tiny(name)
        P = int(g["prefill_len"])
        for b in range(g["input_ids"].shape[0]):
            out.append((cfg, tmap, g["input_ids"][b:b + 1, :P], None if im is None else im[b:b + 1]))
    g = golden("release-engram")
    for b, n in enumerate(g["lengths"].tolist()):
        out.append((fd.Config.flash(), release_map, g["input_ids"][b:b + 1, :n], (g["token_mask"] == 0)[b:b + 1, :n]))
    return out


def test_chunked_equals_whole_every_split(release_map):
    for cfg, tmap, x, im in _prompts(release_map):
        whole, wcache = engram.hash_ids(x, cfg=cfg, token_map=tmap, image_mask=im)
        n = x.shape[1]
        for t in range(1, n):
            a, c = engram.hash_ids(x[:, :t], cfg=cfg, token_map=tmap, image_mask=None if im is None else im[:, :t])
            b, c = engram.hash_ids(x[:, t:], cfg=cfg, token_map=tmap, cache=c,
                                   image_mask=None if im is None else im[:, t:])
            assert torch.equal(torch.cat([a, b], 1), whole), f"split at {t}"
            assert torch.equal(c.tail, wcache.tail)
        # token by token
        c, parts = engram.init_ngram_cache(cfg, 1), []
        for t in range(n):
            y, c = engram.hash_ids(x[:, t:t + 1], cfg=cfg, token_map=tmap, cache=c,
                                   image_mask=None if im is None else im[:, t:t + 1])
            parts.append(y)
        assert torch.equal(torch.cat(parts, 1), whole)


def test_hash_matches_naive_spec_with_dead_spans():
    cfg, tmap, _, _ = tiny("tiny-bf16")
    rng = random.Random(0)
    for trial in range(6):
        n = rng.randint(1, 30)
        toks = [rng.randrange(cfg.vocab_size) for _ in range(n)]
        dead = [rng.random() < 0.2 for _ in range(n)]
        ids, _ = engram.hash_ids(torch.tensor([toks]), cfg=cfg, token_map=tmap, image_mask=torch.tensor([dead]))
        assert torch.equal(ids[0], naive_hash(toks, dead, cfg, tmap)), f"trial {trial}"


def test_packed_positions_equal_separate_samples():
    cfg, tmap, g, _ = tiny("tiny-bf16")
    x = g["input_ids"][0, :30]
    lens = [7, 2, 12, 9]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    packed, _ = engram.hash_ids(x[None], cfg=cfg, token_map=tmap, positions=pos)
    sep, start = [], 0
    for n in lens:
        sep.append(engram.hash_ids(x[None, start:start + n], cfg=cfg, token_map=tmap)[0])
        start += n
    assert torch.equal(packed, torch.cat(sep, 1))
    # and chunked across the packed row, split inside a sample and at a boundary
    for t in (5, 9, 10, 21):
        a, c = engram.hash_ids(x[None, :t], cfg=cfg, token_map=tmap, positions=pos[:, :t])
        b, _ = engram.hash_ids(x[None, t:], cfg=cfg, token_map=tmap, positions=pos[:, t:], cache=c)
        assert torch.equal(torch.cat([a, b], 1), packed)


def test_hash_bad_input_is_clear():
    cfg, tmap, g, _ = tiny("tiny-bf16")
    x = g["input_ids"][:, :5].clone()
    x[1, 3] = cfg.vocab_size + 7
    with pytest.raises(ValueError, match=str(cfg.vocab_size + 7)):
        engram.hash_ids(x, cfg=cfg, token_map=tmap)
    x[1, 3] = -3
    with pytest.raises(ValueError, match="-3"):
        engram.hash_ids(x, cfg=cfg, token_map=tmap)
    with pytest.raises(ValueError, match=r"\(600,\).*512"):
        engram.hash_ids(g["input_ids"][:, :5], cfg=cfg, token_map=torch.zeros(600, dtype=torch.int64))
    big = tmap.clone()
    big[5] = 334
    with pytest.raises(ValueError, match="334"):
        engram.hash_ids(g["input_ids"][:, :5], cfg=cfg, token_map=big)


def test_hash_without_engram_layers_names_the_cause():
    """A config with no Engram layers failed inside torch.stack ("stack expects a non-empty TensorList")."""
    cfg, tmap, g, _ = tiny("tiny-bf16")
    none = cfg.replace(engram_layer_ids=(), engram_num_embeddings=())
    with pytest.raises(ValueError, match="no Engram layers.*engram_layer_ids is empty"):
        engram.hash_ids(g["input_ids"][:, :3], cfg=none, token_map=tmap)


def test_ngram_cache_is_a_pytree():
    cfg = tiny("tiny-bf16")[0]
    c = engram.init_ngram_cache(cfg, 3)
    assert c.tail.shape == (3, 3) and bool((c.tail == engram.BEFORE_START).all())
    leaves, spec = torch_pytree.tree_flatten(c)
    assert len(leaves) == 1 and torch.equal(torch_pytree.tree_unflatten(leaves, spec).tail, c.tail)


# ----------------------------------------------------------------------------- §6.5 lookup
def test_lookup_fp8_bf16_and_memmap(tmp_path):
    g = torch.Generator().manual_seed(0)
    R, D = 1000, 64
    w = torch.randn(R, D, generator=g)
    q, s = quant.quant_fp8_rows(w)
    ids = torch.randint(0, R, (2, 3, 5), generator=g)
    full = quant.dequant_fp8_rows(q, s, torch.bfloat16)
    want = full[ids].flatten(-2)
    got = engram.lookup(q, s, ids)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 5 * D)
    assert torch.equal(got, want)
    wb = w.to(torch.bfloat16)
    assert torch.equal(engram.lookup(wb, None, ids), wb[ids].flatten(-2))
    # memory-mapped storage: weight and scale bytes in one file
    path = tmp_path / "table.bin"
    blob = torch.cat([q.view(torch.uint8).flatten(), s.view(torch.uint8).flatten()])
    blob.numpy().tofile(path)
    mm = torch.from_file(str(path), shared=False, size=blob.numel(), dtype=torch.uint8)
    qm = mm[:R * D].view(R, D).view(quant.FP8)
    sm = mm[R * D:].view(R, D // 32).view(quant.E8M0)
    assert torch.equal(engram.lookup(qm, sm, ids), want)
    with pytest.raises(ValueError, match=f"row id {R}"):
        engram.lookup(q, s, torch.tensor([[0, R]]))
    with pytest.raises(ValueError, match="row id -1"):
        engram.lookup(q, s, torch.tensor([[-1, 0]]))


def test_table_rows_mismatch_is_clear():
    cfg, _, g, _ = tiny("tiny-fp8")
    p = engram_params("tiny-fp8", 1)
    engram.validate_table(p["embed"], cfg=cfg, layer_id=1)
    short = {"weight": p["embed"]["weight"][:-1], "scale": p["embed"]["scale"][:-1]}
    with pytest.raises(ValueError, match=r"2513.*2514"):
        engram.validate_table(short, cfg=cfg, layer_id=1)
    with pytest.raises(ValueError, match="2514"):
        engram.engram_write({**p, "embed": short}, g["prefill.layer.0.h"][:, :2],
                            g["prefill.engram_hash"][:, :2, 0], cfg=cfg, layer_id=1)
    with pytest.raises(ValueError, match=r"2712"):   # layer 4's table is not layer 1's
        engram.validate_table(p["embed"], cfg=cfg, layer_id=4)


# ----------------------------------------------------------------------------- §6.5 gated write
@pytest.mark.parametrize("name", TINY)
def test_engram_write_teacher_forced_bit_exact(name):
    cfg, _, g, im = tiny(name)
    n_dec = g["input_ids"].shape[1] - int(g["prefill_len"])
    for i, L in enumerate(cfg.engram_layer_ids):
        p = engram_params(name, L)
        for tag in ["prefill"] + [f"decode.{k}" for k in range(n_dec)]:
            h = g[f"{tag}.layer.{L - 1}.h"]
            mask = im if tag == "prefill" else None
            out = engram.engram_write(p, h, g[f"{tag}.engram_hash"][:, :, i], cfg=cfg, image_mask=mask, layer_id=L)
            ref = g[f"{tag}.layer.{L}.engram_out"]
            assert out.dtype == torch.bfloat16 and out.shape == ref.shape
            assert cosine_diff(out, ref) < 1e-4
            assert_golden_bits(out, ref, f"{name} {tag} layer {L}")
            assert not torch.equal(out, h)
    if im is not None:   # image positions pass through untouched
        L = cfg.engram_layer_ids[0]
        h = g[f"prefill.layer.{L - 1}.h"]
        out = engram.engram_write(engram_params(name, L), h, g["prefill.engram_hash"][:, :, 0], cfg=cfg, image_mask=im)
        assert torch.equal(out[im], h[im])


def test_engram_write_dequant_mode_close():
    cfg, _, g, _ = tiny("tiny-fp8")
    L = cfg.engram_layer_ids[1]
    out = engram.engram_write(engram_params("tiny-fp8", L), g[f"prefill.layer.{L - 1}.h"],
                              g["prefill.engram_hash"][:, :, 1], cfg=cfg, mode="dequant")
    assert cosine_diff(out, g[f"prefill.layer.{L}.engram_out"]) < 1e-3


def test_hash_then_write_end_to_end_tiny():
    """hash_ids -> engram_write with our own ids reproduces the golden engram_out."""
    cfg, tmap, g, im = tiny("tiny-vl")
    P = int(g["prefill_len"])
    ids, _ = engram.hash_ids(g["input_ids"][:, :P], cfg=cfg, token_map=tmap, image_mask=im)
    L = cfg.engram_layer_ids[1]
    out = engram.engram_write(engram_params("tiny-vl", L), g[f"prefill.layer.{L - 1}.h"], ids[:, :, 1],
                              cfg=cfg, image_mask=im)
    assert_golden_bits(out, g[f"prefill.layer.{L}.engram_out"], f"tiny-vl hash -> write, layer {L}")
    assert np.isfinite(out.float().numpy()).all()


def test_assert_golden_bits_tolerance(monkeypatch):
    """The golden comparison's one allowance: on a CPU whose bf16 GEMMs sum in another order than the golden run's
    (conftest.bf16_gemm_sums_like_golden), values one bf16 ulp off in a small fraction; nothing more, and nothing
    at all elsewhere."""
    import conftest
    ref = torch.linspace(-3, 3, 1000).bfloat16()
    ulp = torch.ldexp(torch.ones(1000), torch.frexp(ref.float()).exponent - 8)   # bf16: 8 significant bits
    one, two, many = ref.clone(), ref.clone(), ref.clone()
    one[7] = ref[7].float() + ulp[7]                                               # one ulp up (exact in bf16)
    two[7] = ref[7].float() + 2 * ulp[7]                                           # two ulps up
    many[::20] = ref[::20].float() + ulp[::20]                                     # one ulp, in 5% of the values
    assert (one != ref).sum() == 1 and (two != ref).sum() == 1 and (many != ref).sum() == 50
    conftest.assert_golden_bits(ref.clone(), ref, "equal")
    monkeypatch.setattr(conftest, "bf16_gemm_sums_like_golden", lambda: False)
    conftest.assert_golden_bits(one, ref, "one ulp")
    for bad in (two, many):
        with pytest.raises(AssertionError, match="differ from the golden"):
            conftest.assert_golden_bits(bad, ref, "bad")
    monkeypatch.setattr(conftest, "bf16_gemm_sums_like_golden", lambda: True)
    with pytest.raises(AssertionError, match="should give the golden bits"):
        conftest.assert_golden_bits(one, ref, "one ulp")


# ----------------------------------------------------------------------------- mutation-audit additions
@pytest.mark.parametrize("vocab", [120, 127])
def test_layout_small_vocab_primes_follow_spec(vocab):
    """SPEC §6.2 by hand for engram_vocab_size 120 (121 = 11^2, 125 = 5^3 are composites a weak primality test
    could pass) and 127 (itself prime: the search starts at vocab - 1, so 127 is the first prime taken).
    One layer, orders 2..3, 2 heads: primes >= vocab, never reused, restarting per order."""
    cfg = fd.Config.tiny().replace(engram_layer_ids=(1,), engram_num_embeddings=(534,), engram_vocab_size=vocab,
                                   engram_max_ngram_size=3)
    (lay,) = engram.layout(cfg)
    assert lay.primes.tolist() == [[127, 131], [137, 139]]
    assert lay.offsets.tolist() == [0, 127, 127 + 131, 127 + 131 + 137]
    assert lay.rows == 127 + 131 + 137 + 139 == 534


def test_hash_id_equal_to_vocab_size_is_refused():
    """The range check's upper edge: id == vocab_size is outside [0, vocab_size) (a clear ValueError, not torch's
    IndexError from the token-map gather)."""
    cfg, tmap, g, _ = tiny("tiny-bf16")
    x = g["input_ids"][:, :5].clone()
    x[0, 2] = cfg.vocab_size
    with pytest.raises(ValueError, match=rf"token id {cfg.vocab_size} is outside the vocabulary"):
        engram.hash_ids(x, cfg=cfg, token_map=tmap)


def test_hash_shape_mismatches_are_refused():
    """A cache, image mask or positions of another shape than the chunk's must be refused, not broadcast or read
    at a shifted offset (a tail one longer silently hashes other tokens)."""
    cfg, tmap, g, _ = tiny("tiny-bf16")
    x = g["input_ids"][:, :5]
    B, G = x.shape[0], cfg.engram_max_ngram_size - 1
    long_tail = engram.NgramCache(torch.full((B, G + 1), engram.BEFORE_START, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"NgramCache.tail has shape \(2, 4\), expected \(2, 3\)"):
        engram.hash_ids(x, cfg=cfg, token_map=tmap, cache=long_tail)
    with pytest.raises(ValueError, match="image_mask shape"):
        engram.hash_ids(x, cfg=cfg, token_map=tmap, image_mask=torch.zeros(1, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="positions shape"):
        engram.hash_ids(x, cfg=cfg, token_map=tmap, positions=torch.arange(5)[None])


def test_hash_token_map_must_be_integer():
    cfg, tmap, g, _ = tiny("tiny-bf16")
    for bad in (tmap.float(), tmap > 0):
        with pytest.raises(TypeError, match="must be an integer tensor"):
            engram.hash_ids(g["input_ids"][:, :5], cfg=cfg, token_map=bad)


def test_lookup_scale_mismatches_are_refused():
    g = torch.Generator().manual_seed(1)
    R, D = 50, 64
    q, s = quant.quant_fp8_rows(torch.randn(R, D, generator=g))
    ids = torch.tensor([[0, 7, 49]])
    with pytest.raises(ValueError, match=r"needs an e8m0 scale \[50, 2\], got \(50, 1\)"):
        engram.lookup(q, s[:, :1], ids)
    with pytest.raises(ValueError, match=r"needs an e8m0 scale \[50, 2\], got None"):
        engram.lookup(q, None, ids)
    with pytest.raises(ValueError, match="takes no scale"):        # a float table with a scale: not silently ignored
        engram.lookup(quant.dequant_fp8_rows(q, s, torch.bfloat16), s, ids)


def test_validate_table_scale_rows_mismatch_is_clear():
    cfg = tiny("tiny-fp8")[0]
    p = engram_params("tiny-fp8", 1)
    with pytest.raises(ValueError, match=r"scale of layer 1 has 2513 rows, expected 2514"):
        engram.validate_table({"weight": p["embed"]["weight"], "scale": p["embed"]["scale"][:-1]}, cfg=cfg,
                              layer_id=1)


def test_engram_gate_clamps_tiny_dots_as_spec():
    """SPEC §6.5: g = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))). With q_weight scaled down by 2^-30 every dot is
    below 1e-6 in magnitude, so g = sigmoid(+-1e-3) exactly; h scaled by 2^-20 (dot does not depend on h's scale)
    keeps the output ~ g * value. The dot, the gate and the write are written out here from §6.5."""
    from functional_dsv41.linear import linear
    cfg, _, g, _ = tiny("tiny-bf16")
    L = cfg.engram_layer_ids[0]
    p = engram_params("tiny-bf16", L)
    p = {**p, "q_weight": p["q_weight"] * 2.0 ** -30}
    ids = g["prefill.engram_hash"][:, :, 0]
    h = g[f"prefill.layer.{L - 1}.h"] * 2.0 ** -20
    B, S, N, M = h.shape
    e = engram.lookup(p["embed"]["weight"], p["embed"].get("scale"), ids)
    kv = linear(e, p["wkv"]).to(torch.bfloat16)
    key, value = kv[..., :N * M].unflatten(-1, (N, M)).float(), kv[..., N * M:].float()
    h32 = h.float()
    dot = (h32 * p["q_weight"].float() * p["k_weight"].float() * key).sum(-1)
    dot = dot * torch.rsqrt(h32.square().mean(-1) + cfg.norm_eps) * torch.rsqrt(key.square().mean(-1) + cfg.norm_eps)
    dot = dot / M ** 0.5
    assert float(dot.abs().max()) < 1e-6 and bool((dot > 0).any()) and bool((dot < 0).any())
    gate = torch.sigmoid(torch.sign(dot) * 1e-3)
    want = (h32 + gate[..., None] * value[:, :, None, :]).to(torch.bfloat16)
    out = engram.engram_write(p, h, ids, cfg=cfg)
    assert torch.equal(out, want)
