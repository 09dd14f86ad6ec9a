"""Vision tower, aligner, preprocessing and image-span merge (SPEC §12) against the tiny-vl golden run.

Figures (CPU): preprocessing patches, vit_out, aligner_out and the merged prefill.embed equal the
reference bit for bit (asserted by ``conftest.assert_golden_bits``: on a CPU whose bf16 GEMMs sum in another order,
AVX2 without AVX-512, a rare value may be one ulp off); every block output too; tolerances asserted are DESIGN.md's (tiny-vl is an fp8
config: cosine diff < 1e-3 per block, top-k sets and expert choices exact, logits max-abs
< 2e-2 * max|logit| with equal argmax).
"""
import numpy as np
import pytest
import torch

import functional_dsv41 as fd
from functional_dsv41 import image_processor as ip
from functional_dsv41 import vision

from conftest import (assert_golden_bits, cosine_diff, fixture_dir, golden, skip_past_flip,
                      trajectory_divergence)

NAME = "tiny-vl"
_CACHE = {}


def setup():
    if "p" not in _CACHE:
        d = fixture_dir(NAME)
        cfg = fd.Config.from_json(d / "config.json")
        _CACHE["p"] = cfg, fd.load_params(d, cfg), golden(NAME)
    return _CACHE["p"]


def images_of(g, b):
    """batch["images"] from the golden per-image tensors: row_start [row, pos] says where each one goes."""
    rows = [None] * b
    i = 0
    while f"image.{i}.patches" in g:
        r = int(g[f"image.{i}.row_start"][0])
        rows[r] = (rows[r] or []) + [(g[f"image.{i}.patches"], tuple(g[f"image.{i}.grid"].tolist()))]
        i += 1
    return rows


def vl_batch(g, P):
    return {"input_ids": g["input_ids"][:, :P], "token_types": g["token_types"][:, :P],
            "images": images_of(g, g["input_ids"].shape[0])}


def prefill():
    if "prefill" not in _CACHE:
        cfg, params, g = setup()
        P = int(g["prefill_len"])
        dbg = {}
        st = fd.init_state(cfg, 2, cfg.max_seq_len)
        out = fd.forward(params, vl_batch(g, P), cfg=cfg, state=st, return_hidden=True, debug=dbg)
        _CACHE["prefill"] = out, dbg
    return _CACHE["prefill"]


def divergence():
    """conftest.trajectory_divergence of the image prefill."""
    cfg, params, g = setup()
    return trajectory_divergence(NAME, prefill()[1], g, cfg, params)


def report(name, ours, ref):
    d = (ours.float() - ref.float()).abs().max().item()
    c = cosine_diff(ours, ref)
    print(f"{name}: max-abs {d:.3g} cosine diff {c:.2e} bit-exact {torch.equal(ours, ref)}")
    return d, c


# --------------------------------------------------------------------------------------- preprocessing
def test_preprocess_png_matches_golden_patches():
    cfg, _, g = setup()
    patches, grid = ip.load_image(bytes(g["image.0.png"].tolist()), cfg)
    assert grid == tuple(g["image.0.grid"].tolist())
    assert patches.dtype == torch.bfloat16 and patches.shape == g["image.0.patches"].shape
    assert torch.equal(patches, g["image.0.patches"])
    assert torch.equal(ip.span_types(*grid, cfg.vision_downsample_ratio), g["image.0.types"])


def test_expand_image_tokens_matches_golden_layout():
    cfg, _, g = setup()
    r, a = g["image.0.row_start"].tolist()
    n = g["image.0.types"].numel()
    ids = g["input_ids"][r, :a].tolist() + [cfg.image_token_id] + g["input_ids"][r, a + n:41].tolist()
    ids2, types = ip.expand_image_tokens(ids, [tuple(g["image.0.grid"].tolist())], cfg)
    assert torch.equal(ids2, g["input_ids"][r, :41]) and torch.equal(types, g["token_types"][r])
    with pytest.raises(ValueError, match="images but"):
        ip.expand_image_tokens(ids, [(5, 7), (5, 7)], cfg)


@pytest.mark.parametrize("w, h, canvas", [
    (1920, 1080, (1708, 966)),      # a search for the largest fitting scale gave 1722 x 980 (1010 tokens, not 968)
    (3000, 1000, (2268, 756)),
    (1000, 3000, (714, 2142)),
    (4032, 3024, (1512, 1134)),
    (50000, 600, (10500, 126)),
    (600, 50000, (126, 10500)),
    (200000, 100, (1021 * 42, 42)),  # wider than one row of cells at the budget: one row of 1021 cells
    (100, 200000, (42, 511 * 42)),   # taller than one column: one column of 511 cells
])
def test_plan_over_budget_is_the_release_closed_form(w, h, canvas):
    """Over the 1024-token budget the release shrinks with solve_resize_ratio's closed form (floor the real-valued
    grid that fits the aspect to whole 42-pixel cells, scale the tighter side onto it, floor sides to 14): other
    fitting canvases give other pixels and another span length. Expected canvases are that formula's."""
    cfg = fd.Config.flash()
    plan = ip.plan_image_grid(w, h, cfg)
    assert (plan["best_w"], plan["best_h"]) == canvas
    assert plan["n_tokens"] == ip.n_image_tokens(plan["n_llm_h"], plan["n_llm_w"]) <= cfg.vision_max_n_token


def test_plan_and_resize_basics():
    cfg, _, _ = setup()
    plan = ip.plan_image_grid(84, 56, cfg)
    assert (plan["n_vit_h"], plan["n_vit_w"], plan["n_llm_h"], plan["n_llm_w"], plan["n_tokens"]) == (5, 7, 2, 3, 10)
    big = ip.plan_image_grid(4000, 1000, cfg)                  # over the token budget: shrunk to fit
    assert big["n_tokens"] <= cfg.vision_max_n_token and big["n_vit_w"] > big["n_vit_h"]
    img = torch.randint(0, 256, (9, 13, 3), dtype=torch.uint8).numpy()
    assert (ip.resize_bicubic(img, (13, 9)) == img).all()        # identity size: untouched
    flat = torch.full((9, 13, 3), 77, dtype=torch.uint8).numpy()
    assert (ip.resize_bicubic(flat, (20, 5)) == 77).all()          # normalised kernels keep constants
    out = ip.pad_to(flat, 28, 28)
    assert out.shape == (28, 28, 3) and (out[0] == ip.PAD_COLOR).all()
    # centred as ImageOps.pad does, at Python round(slack / 2) (half to even): slack 3 -> 2, 5 -> 2, 7 -> 4; a
    # floor division (1, 2, 3) passed before
    img = np.full((20, 10, 3), 200, np.uint8)
    for best_w, x0 in ((13, 2), (15, 2), (17, 4)):
        out = ip.pad_to(img, best_w, 20)
        cols = (out[0, :, 0] == 200).nonzero()[0]
        assert (cols[0], cols[-1]) == (x0, x0 + 9), (best_w, cols)
        assert (out[:, :x0] == ip.PAD_COLOR).all() and (out[:, x0 + 10:] == ip.PAD_COLOR).all()
    tall = np.full((10, 20, 3), 200, np.uint8)           # the same along the height
    rows = (ip.pad_to(tall, 20, 17)[:, 0, 0] == 200).nonzero()[0]
    assert (rows[0], rows[-1]) == (4, 13)


# --------------------------------------------------------------------------------------- ViT + aligner
def test_vit_and_aligner_match_golden():
    cfg, params, g = setup()
    grid = tuple(g["image.0.grid"].tolist())
    feats = vision.vit(params["vision"], g["image.0.patches"], grid, cfg=cfg)
    d, c = report("vit_out", feats, g["prefill.image.0.vit_out"])
    assert c < 1e-4 and d <= 2e-2 * g["prefill.image.0.vit_out"].float().abs().max()
    assert_golden_bits(feats, g["prefill.image.0.vit_out"], "vit_out")    # bit-exact where bf16 GEMMs sum alike
    rows = vision.aligner(params["aligner"], g["prefill.image.0.vit_out"], grid, cfg=cfg)   # teacher-forced
    d, c = report("aligner_out", rows, g["prefill.image.0.aligner_out"])
    assert c < 1e-4
    assert_golden_bits(rows, g["prefill.image.0.aligner_out"], "aligner_out")


def test_vision_rope_is_rotate_half_2d():
    cfg, _, _ = setup()
    cos, sin = vision.vision_cos_sin(2, 3, cfg=cfg)
    d = cfg.vision_dim // cfg.vision_n_heads // 2
    assert cos.shape == (6, d)
    # patch (r=1, c=2) is row-major index 5: first half rows the r angles, second half the c angles
    inv = 1.0 / cfg.vision_rope_theta ** (torch.arange(0, d, 2).float() / d)
    torch.testing.assert_close(cos[5], torch.cat([(1 * inv).cos(), (2 * inv).cos()]))
    x = torch.randn(6, 2, 2 * d).to(torch.bfloat16)
    y = vision.apply_vision_rope(x, cos, sin)
    torch.testing.assert_close(y.float().norm(dim=-1), x.float().norm(dim=-1), rtol=1e-2, atol=1e-2)
    assert torch.equal(y[0], x[0])                                  # patch (0, 0): no rotation
    # rotate-half, not interleaved pairs: a unit vector on coordinate j of the first half goes to
    # cos(theta_j) on j and sin(theta_j) on j + d (the pair (j, j + d)); interleaved would use (j, j + 1)
    for j in (0, 1, d // 2, d - 1):
        e = torch.zeros(6, 1, 2 * d, dtype=torch.bfloat16)
        e[..., j] = 1
        r = vision.apply_vision_rope(e, cos, sin).float()[:, 0]
        want = torch.zeros(6, 2 * d)
        want[:, j], want[:, j + d] = cos[:, j], sin[:, j]
        torch.testing.assert_close(r, want, atol=4e-3, rtol=0)     # bf16 output: 2^-8 relative
    assert sin[5, 0] > 0.5 and sin[5, d // 2] > 0.5                 # patch 5 is rotated for real (1 and 2 rad)


# -------------------------------------------------------------------------------------------- forward
def test_prefill_vl_every_block():
    cfg, params, g = setup()
    out, dbg = prefill()
    assert_golden_bits(dbg["image.0.vit_out"], g["prefill.image.0.vit_out"], "vit_out")
    assert_golden_bits(dbg["image.0.aligner_out"], g["prefill.image.0.aligner_out"], "aligner_out")
    assert_golden_bits(dbg["embed"], g["prefill.embed"], "embed")   # the aligner rows merged into the spans
    div = divergence()                                 # (asserted to be a near-tie flip)
    worst = 0.0
    for L in cfg.layer_ids:
        if div is not None and L == div["layer"]:      # past a near-tie flip: another trajectory (conftest)
            break
        for key in ("h", "pre_mix", "attn_out", "ffn_out"):
            c = cosine_diff(dbg[f"layer.{L}.{key}"], g[f"prefill.layer.{L}.{key}"])
            worst = max(worst, c)
            assert c < 1e-3, f"layer {L} {key}: cosine diff {c:.2e}"
        assert torch.equal(dbg[f"layer.{L}.gate_idx"], g[f"prefill.layer.{L}.gate_idx"]), f"layer {L} experts"
        if f"prefill.layer.{L}.engram_out" in g:
            assert cosine_diff(dbg[f"layer.{L}.engram_out"], g[f"prefill.layer.{L}.engram_out"]) < 1e-3
    assert torch.equal(out.engram_ids, g["prefill.engram_hash"])
    print(f"tiny-vl prefill: worst per-block cosine diff {worst:.1e}")


def test_prefill_vl_topk_and_logits():
    skip_past_flip(NAME, divergence())
    cfg, params, g = setup()
    out, _ = prefill()
    P = int(g["prefill_len"])
    for L in cfg.index_source_layers:
        ref = g[f"prefill.layer.{L}.topk_idxs"].long()
        ours = torch.where(out.topk[L] >= 0, out.topk[L] + P, -1)
        assert torch.equal(ours.sort(-1).values, ref.sort(-1).values), f"layer {L} top-k sets differ"
    c = cfg.candidate_source_layer
    assert torch.equal(out.candidates.to(torch.uint8), g[f"prefill.layer.{c}.candidates"])
    lg, ref = out.logits[:, -1], g["prefill.logits"]
    d, _ = report("prefill logits", lg, ref)
    assert d < 2e-2 * ref.abs().max()
    assert torch.equal(lg.argmax(-1), g["prefill.out_ids"])


def test_decode_after_vl_prefill():
    skip_past_flip(NAME, divergence())
    cfg, params, g = setup()
    out, _ = prefill()
    P = int(g["prefill_len"])
    st = out.state
    for k in range(g["input_ids"].shape[1] - P):
        o = fd.forward(params, {"input_ids": g["input_ids"][:, P + k:P + k + 1]}, cfg=cfg, state=st)
        st = o.state
        lg, ref = o.logits[:, -1], g[f"decode.{k}.logits"]
        d = (lg - ref).abs().max().item()
        assert d < 2e-2 * ref.abs().max(), f"decode {k}: max-abs {d:.3g}"
        assert torch.equal(lg.argmax(-1), g[f"decode.{k}.out_ids"]), f"decode {k}: argmax"
    print(f"decode after VL prefill: last step max-abs {d:.3g}")


def test_chunked_prefill_after_image_chunk():
    """Image spans in the first chunk, text in the next: same logits as one prefill (golden prefill_logits)."""
    skip_past_flip(NAME, divergence())
    cfg, params, g = setup()
    P = int(g["prefill_len"])
    k = 3
    n = P + k + 1                                            # the prefix decode.{k}.prefill_logits covers
    ids = g["input_ids"][:, :n]
    tt = torch.cat([g["token_types"], torch.full((2, k + 1), -1, dtype=torch.long)], 1)
    st = fd.init_state(cfg, 2, cfg.max_seq_len)
    cut = 20
    o = fd.forward(params, {"input_ids": ids[:, :cut], "token_types": tt[:, :cut],
                            "images": images_of(g, 2)}, cfg=cfg, state=st)
    o = fd.forward(params, {"input_ids": ids[:, cut:], "token_types": tt[:, cut:]}, cfg=cfg, state=o.state)
    lg, ref = o.logits[:, -1], g[f"decode.{k}.prefill_logits"]
    d, _ = report("chunked VL prefill logits", lg, ref)
    assert d < 2e-2 * ref.abs().max()
    assert torch.equal(lg.argmax(-1), ref.argmax(-1))


def test_merge_is_differentiable_wrt_vision_params():
    cfg, params, g = setup()
    grid = tuple(g["image.0.grid"].tolist())
    vp = {"vision": params["vision"], "aligner": params["aligner"]}

    def f(vp):
        rows = vision.encode_image(vp, g["image.0.patches"], grid, cfg=cfg)
        return rows.float().square().sum()

    grads = torch.func.grad(f)(vp)
    gw = grads["vision"]["blocks"][0]["attn"]["wqkv"]["weight"]
    assert gw.shape == params["vision"]["blocks"][0]["attn"]["wqkv"]["weight"].shape and gw.abs().sum() > 0


# ------------------------------------------------------------------------------------------ bad input
def test_bad_image_inputs():
    cfg, params, g = setup()
    P = int(g["prefill_len"])
    b = vl_batch(g, P)
    img = b["images"][0][0]
    # images without token_types
    with pytest.raises(ValueError, match="no 'token_types'"):
        fd.forward(params, {"input_ids": b["input_ids"], "images": b["images"]}, cfg=cfg)
    # images in a chunk that does not start at position 0
    st = fd.forward(params, {"input_ids": b["input_ids"][:, :4]}, cfg=cfg,
                    state=fd.init_state(cfg, 2, cfg.max_seq_len)).state
    with pytest.raises(ValueError, match="position 0"):
        fd.forward(params, {"input_ids": b["input_ids"][:, 4:], "token_types": b["token_types"][:, 4:],
                            "images": b["images"]}, cfg=cfg, state=st)
    # a patch grid whose token count does not match the span
    with pytest.raises(ValueError, match="does not fit"):
        fd.forward(params, dict(b, images=[[(img[0][:30], (5, 6))], None]), cfg=cfg)
    with pytest.raises(ValueError, match="does not fit"):
        fd.forward(params, dict(b, images=[[(img[0], (7, 5))], None]), cfg=cfg)   # 3x2 cells: 3*(2+1)+2 = 11
    # patches inconsistent with the grid
    with pytest.raises(ValueError, match="do not match grid"):
        fd.forward(params, dict(b, images=[[(img[0][:34], (5, 7))], None]), cfg=cfg)
    # image count vs spans
    with pytest.raises(ValueError, match="1 image spans in token_types but 0 images"):
        fd.forward(params, dict(b, images=[None, None]), cfg=cfg)
    with pytest.raises(ValueError, match="row 1 has 0 image spans in token_types but 1 images"):
        fd.forward(params, dict(b, images=[[img], [img]]), cfg=cfg)
    with pytest.raises(ValueError, match="one entry per row"):
        fd.forward(params, dict(b, images=[[img]]), cfg=cfg)
    # one image passed as the whole images entry (a tuple of 2 = b rows would read each patch as an image)
    with pytest.raises(ValueError, match=r"is one image \(patches, grid\).*\[\[\(patches, grid\)\], None\]"):
        fd.forward(params, dict(b, images=img), cfg=cfg)
    # malformed entries are named by row and position
    with pytest.raises(ValueError, match=r"images'\]\[1\] must be None or a list .* got Tensor"):
        fd.forward(params, dict(b, images=[img, img[0]]), cfg=cfg)
    with pytest.raises(ValueError, match=r"images'\]\[0\]\[0\] must be an image .* got a tensor \(35, 3, 14, 14\)"):
        fd.forward(params, dict(b, images=[[img[0]], None]), cfg=cfg)
    with pytest.raises(ValueError, match=r"images'\]\[0\]\[0\] must be an image .* got a tuple of 2: \(a tensor"):
        fd.forward(params, dict(b, images=[[(img[0], 5)], None]), cfg=cfg)
    # the dict form of an image is the tuple's
    as_dict = [[{"patches": img[0], "grid": img[1]}], None]
    assert torch.equal(fd.forward(params, dict(b, images=as_dict), cfg=cfg).logits,
                       fd.forward(params, dict(b, images=[[img], None]), cfg=cfg).logits)
    # a span cut by the chunk end
    with pytest.raises(ValueError, match="does not end in this chunk"):
        fd.forward(params, {"input_ids": b["input_ids"][:, :10], "token_types": b["token_types"][:, :10],
                            "images": b["images"]}, cfg=cfg)
    # span positions must carry the image token id
    bad_ids = b["input_ids"].clone()
    bad_ids[0, 7] = 3
    with pytest.raises(ValueError, match="image_token_id"):
        fd.forward(params, dict(b, input_ids=bad_ids), cfg=cfg)


def test_images_without_vision_params_are_refused_before_encoding(monkeypatch):
    """Params without the vision tower (a text-only load) and a batch with images: a bare
    KeyError: 'image_start' before; now a ValueError naming the missing params, raised before any encode."""
    cfg, params, g = setup()
    b = vl_batch(g, int(g["prefill_len"]))
    calls = []
    real = vision.encode_image
    monkeypatch.setattr(vision, "encode_image", lambda *a, **k: calls.append(1) or real(*a, **k))
    text_only = {k: v for k, v in params.items()
                 if k not in ("vision", "aligner", "image_start", "image_end", "image_newline")}
    with pytest.raises(ValueError, match=r"params lack vision, aligner, image_start, image_end, image_newline.*"
                                         r"vision tower"):
        fd.forward(params=text_only, batch=b, cfg=cfg)
    for k in ("image_newline", "aligner"):                       # one piece missing is named alone
        with pytest.raises(ValueError, match=rf"params lack {k}: images need"):
            fd.forward({kk: v for kk, v in params.items() if kk != k}, b, cfg=cfg)
    assert calls == []                                           # refused before the first encode
    fd.forward(text_only, dict(b, images=[None, None], token_types=torch.full_like(b["token_types"], -1)), cfg=cfg)


def test_integer_patches_are_refused():
    """uint8 patches (raw pixels, 0..255) were cast to bf16 and encoded as if normalised: named instead."""
    cfg, params, g = setup()
    b = vl_batch(g, int(g["prefill_len"]))
    raw = [[(p.to(torch.uint8), grid) for p, grid in row] if row else row for row in b["images"]]
    with pytest.raises(ValueError, match=r"patches are torch.uint8; they are normalised floats .*load_image"):
        fd.forward(params, dict(b, images=raw), cfg=cfg)


def test_expand_image_tokens_wants_grids_not_load_image_pairs():
    """load_image's (patches, grid) pairs given as grids failed with torch's "only one element tensors can
    be converted to Python scalars"; now a ValueError saying grids[i] must be the grid (the pair's second
    element). Bare grids of any integer kind still work; other malformed grids are refused alike."""
    cfg, _, _ = setup()
    img = ip.load_image(np.zeros((40, 60, 3), np.uint8), cfg)
    ids = [0, cfg.image_token_id, 5]
    want = ip.expand_image_tokens(ids, [img[1]], cfg)
    assert len(want[0]) == 12
    with pytest.raises(ValueError, match=r"grids\[0\] must be a pair of integers >= 1 .* got a \(patches "
                                         r"\(35, 3, 14, 14\), grid \(5, 7\)\) pair; load_image returns "
                                         r"\(patches, grid\): pass the grid, its second element"):
        ip.expand_image_tokens(ids, [img], cfg)
    for bad in [(0, 7), (5, -1), (5.0, 7), (True, 7), (5,), (5, 7, 1), "57", None, torch.zeros(2, 2, dtype=torch.long)]:
        with pytest.raises(ValueError, match=r"grids\[0\] must be a pair of integers >= 1"):
            ip.expand_image_tokens(ids, [bad], cfg)
    for ok in ([5, 7], (np.int64(5), np.int32(7)), torch.tensor([5, 7]), (torch.tensor(5), torch.tensor(7))):
        got = ip.expand_image_tokens(ids, [ok], cfg)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_text_only_rows_unchanged_by_images_key():
    """images=[None, None] with all-TEXT types is the text forward, bit for bit."""
    cfg, params, g = setup()
    ids = g["input_ids"][:, 15:27]
    tt = torch.full_like(ids, -1)
    a = fd.forward(params, {"input_ids": ids, "token_types": tt}, cfg=cfg).logits
    b = fd.forward(params, {"input_ids": ids, "token_types": tt, "images": [None, None]}, cfg=cfg).logits
    assert torch.equal(a, b)
    c = fd.forward(params, {"input_ids": ids, "images": [None, []]}, cfg=cfg).logits       # no token_types either
    assert torch.equal(a, c)
    st = fd.forward(params, {"input_ids": ids[:, :5]}, cfg=cfg, state=fd.init_state(cfg, 2, 32)).state
    d = fd.forward(params, {"input_ids": ids[:, 5:], "images": [None, None]}, cfg=cfg, state=st).logits   # chunk 2
    assert torch.equal(d, fd.forward(params, {"input_ids": ids[:, 5:]}, cfg=cfg, state=fd.forward(
        params, {"input_ids": ids[:, :5]}, cfg=cfg, state=fd.init_state(cfg, 2, 32)).state).logits)
    with pytest.raises(ValueError, match="row 0"):            # image types with no image: the span checks refuse
        fd.forward(params, {"input_ids": ids, "token_types": torch.zeros_like(ids), "images": [None, None]}, cfg=cfg)


def test_generate_with_images_matches_golden_tokens():
    """fd.generate with the image prompts: the golden greedy tokens (prefill + 8 decode steps)."""
    skip_past_flip(NAME, divergence())
    cfg, params, g = setup()
    P = int(g["prefill_len"])
    prompts = g["input_ids"][:, :P].tolist()
    res = fd.generate(params, prompts, cfg=cfg, max_new_tokens=g["generated_ids"].shape[1],
                      images=images_of(g, len(prompts)), token_types=g["token_types"][:, :P].tolist())
    assert [list(r) for r in res] == g["generated_ids"].tolist()
    with pytest.raises(ValueError, match="need token_types"):
        fd.generate(params, prompts, cfg=cfg, max_new_tokens=2, images=images_of(g, len(prompts)))


def test_cli_with_an_image(tmp_path):
    import subprocess
    import sys
    cfg, params, g = setup()
    img = tmp_path / "img.png"
    img.write_bytes(bytes(g["image.0.png"].tolist()))
    r = subprocess.run([sys.executable, "-m", "functional_dsv41.generate", "--ckpt", str(fixture_dir(NAME)),
                        "--prompt", "Describe the picture.", "--image", str(img), "--max-new-tokens", "4"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "4 tokens in" in r.stdout and "tokens/s" in r.stdout


def test_generate_refuses_image_spans_past_the_first_chunk():
    cfg, params, g = setup()
    P = int(g["prefill_len"])
    prompts = g["input_ids"][:, :P].tolist()
    r = int(g["image.0.row_start"][0])
    prompts[1 - r] = prompts[1 - r][:5]            # the other row is short: the prefill chunk ends at 5
    types = g["token_types"][:, :P].tolist()
    types[1 - r] = types[1 - r][:5]
    with pytest.raises(ValueError, match="image tokens past position 5"):
        fd.generate(params, prompts, cfg=cfg, max_new_tokens=2, images=images_of(g, 2), token_types=types)


def _dense_bicubic(img, size):
    """Pillow's two-pass bicubic as dense [out, in] fixed-point matrices (the former implementation): the
    banded resize must give the same bits."""
    def coeffs(n_in, n_out):
        scale, m = n_in / n_out, np.zeros((n_out, n_in), np.int64)
        fscale = max(scale, 1.0)
        for xx in range(n_out):
            c = (xx + 0.5) * scale
            lo, hi = max(int(c - 2 * fscale + 0.5), 0), min(int(c + 2 * fscale + 0.5), n_in)
            k = ip._bicubic((np.arange(lo, hi) - c + 0.5) / fscale)
            k = k / k.sum() if k.sum() != 0 else k
            q = k * (1 << ip._PRECISION_BITS)
            m[xx, lo:hi] = np.where(q < 0, np.trunc(q - 0.5), np.trunc(q + 0.5))
        return m

    x, half = img.astype(np.int64), 1 << (ip._PRECISION_BITS - 1)
    for axis, n in ((1, size[0]), (0, size[1])):
        if n != x.shape[axis]:
            y = np.moveaxis(np.tensordot(coeffs(x.shape[axis], n), x, axes=([1], [axis])), 0, axis)
            x = np.clip((y + half) >> ip._PRECISION_BITS, 0, 255)
    return x.astype(np.uint8)


@pytest.mark.parametrize("src, size", [((37, 23), (100, 61)), ((300, 200), (41, 97)), ((64, 48), (64, 17)),
                                       ((5, 400), (3, 1000)), ((1, 1), (14, 28))])
def test_banded_resize_is_the_dense_pillow_resize(src, size):
    img = np.random.default_rng(0).integers(0, 256, (src[1], src[0], 3), dtype=np.uint8)
    assert np.array_equal(ip.resize_bicubic(img, size), _dense_bicubic(img, size))


def test_large_and_extreme_images():
    cfg, _, _ = setup()
    wide = np.random.default_rng(1).integers(0, 256, (1, 20000, 3), dtype=np.uint8)
    out = ip.resize_bicubic(wide, (700, 1))                    # a dense matrix here took ~7 GB and 44 s
    assert out.shape == (1, 700, 3)
    with pytest.raises(ValueError, match="aspect ratio is too extreme"):
        ip.pad_to(np.zeros((1, 100000, 3), np.uint8), 28, 1400)


def _png(pixels: np.ndarray, filt: int = 0, width=None) -> bytes:
    """A minimal 8-bit RGB PNG writer (every row with filter ``filt``: 0 None or 1 Sub; ``width``: the width
    the header declares, if not the pixels')."""
    import struct
    import zlib
    h, w, c = pixels.shape
    rows = []
    for row in pixels.reshape(h, w * c).astype(np.int32):
        if filt == 1:
            row = (row - np.concatenate([np.zeros(c, np.int32), row[:-c]])) & 255
        rows.append(bytes([filt]) + row.astype(np.uint8).tobytes())

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width or w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b""))


def test_decode_png_filters_and_damaged_files():
    px = np.random.default_rng(2).integers(0, 256, (7, 11, 3), dtype=np.uint8)
    for filt in (0, 1):
        assert np.array_equal(ip.decode_png(_png(px, filt)), px)
    good = _png(px, 1)
    bad_crc = bytearray(good)
    bad_crc[40] ^= 1                                           # a byte of the IDAT data
    for data, match in [(bytes(bad_crc), "CRC mismatch"), (good[:60], "truncated file"),
                        (_png(px[:, :5], width=11), "image data holds 112 bytes, a 11 x 7 image"),
                        (b"\xff\xd8\xff\xe0 a jpeg", "pip install pillow")]:
        with pytest.raises(ValueError, match=match):
            ip.decode_png(data)


def test_to_rgb_array_layout():
    """A [3, h, w] array or tensor with w <= 4 was read as channels last (an image 3 pixels tall), with w > 4 it was
    'image: w channels'. The rule now: channels last where only the last dim is 1-4 (as before), channels first where
    only the first is, and a shape where both are is refused unless ``layout`` says which."""
    rng = np.random.default_rng(3)
    hwc = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
    chw = np.ascontiguousarray(hwc.transpose(2, 0, 1))
    for x in (hwc, torch.from_numpy(hwc)):                       # channels last: as before
        assert np.array_equal(ip.to_rgb_array(x), hwc)
        assert np.array_equal(ip.to_rgb_array(x, layout="hwc"), hwc)
    for x in (chw, torch.from_numpy(chw)):                       # channels first: torch's [c, h, w]
        assert np.array_equal(ip.to_rgb_array(x), hwc)
        assert np.array_equal(ip.to_rgb_array(x, layout="chw"), hwc)
    rgba = rng.integers(0, 256, (5, 7, 4), dtype=np.uint8)       # alpha dropped, grey repeated, either layout
    assert np.array_equal(ip.to_rgb_array(rgba), rgba[..., :3])
    assert np.array_equal(ip.to_rgb_array(rgba.transpose(2, 0, 1)), rgba[..., :3])
    grey = rng.integers(0, 256, (5, 7), dtype=np.uint8)
    for x in (grey, grey[..., None], grey[None]):
        assert np.array_equal(ip.to_rgb_array(x), np.repeat(grey[..., None], 3, axis=2))
    # ambiguous: [3, 5, 4] is a 3 x 5 RGBA image or an RGB image 5 tall and 4 wide
    amb = rng.integers(0, 256, (3, 5, 4), dtype=np.uint8)
    for x in (amb, torch.from_numpy(amb)):
        with pytest.raises(ValueError, match=r"\(3, 5, 4\) reads as \[h, w, c\] or as \[c, h, w\].*layout='hwc' or "
                                             r"layout='chw'"):
            ip.to_rgb_array(x)
        assert np.array_equal(ip.to_rgb_array(x, layout="hwc"), amb[..., :3])
        assert np.array_equal(ip.to_rgb_array(x, layout="chw"), amb.transpose(1, 2, 0))
    cfg, _, _ = setup()
    with pytest.raises(ValueError, match="reads as"):
        ip.load_image(amb, cfg)
    a, grid_a = ip.load_image(amb, cfg, layout="chw")
    b, grid_b = ip.load_image(np.ascontiguousarray(amb.transpose(1, 2, 0)), cfg)   # (5, 4, 3): unambiguous
    assert grid_a == grid_b and torch.equal(a, b)
    # decoded images are channels last whatever their size: a 3 x 4 PNG is not ambiguous
    png = _png(amb[..., :3].copy())
    assert np.array_equal(ip.to_rgb_array(png), amb[..., :3])
    assert np.array_equal(ip.to_rgb_array({"data": png}, layout="hwc"), amb[..., :3])
    with pytest.raises(ValueError, match="layout='chw' is for arrays and tensors"):
        ip.to_rgb_array(png, layout="chw")
    with pytest.raises(ValueError, match="layout must be None, 'hwc' or 'chw', got 'CHW'"):
        ip.to_rgb_array(hwc, layout="CHW")
    # no channel dim at either end, or a stated layout whose channel dim is not 1-4
    with pytest.raises(ValueError, match=r"\(6, 5, 7\) has no channel dim"):
        ip.to_rgb_array(np.zeros((6, 5, 7), np.uint8))
    with pytest.raises(ValueError, match=r"5 channels in the \[c, h, w\] shape \(5, 7, 3\)"):
        ip.to_rgb_array(hwc, layout="chw")


def test_span_layout_checked_beyond_its_length():
    """SPEC §12: a span is START + ([IMAGE]*n_llm_w + NEW_LINE)*n_llm_h + END. A span of the right length with another
    layout (a NEW_LINE moved one slot), a stray IMAGE_START before the span, or patches whose element count matches
    [N, 3, 14, 14] in another shape are refused, not merged."""
    cfg, params, g = setup()
    b = vl_batch(g, int(g["prefill_len"]))
    r, a = g["image.0.row_start"].tolist()
    j = g["image.0.types"].tolist().index(2)               # first IMAGE_NEW_LINE of the span
    tt = b["token_types"].clone()
    tt[r, a + j - 1], tt[r, a + j] = 2, 1                  # same length and type counts, other layout
    with pytest.raises(ValueError, match="does not fit"):
        fd.forward(params, dict(b, token_types=tt), cfg=cfg)
    tt = b["token_types"].clone()
    tt[r, a - 1] = 0                                       # a stray IMAGE_START on the text token before the span
    with pytest.raises(ValueError, match=rf"IMAGE_START at {a} inside the span opened at {a - 1}"):
        fd.forward(params, dict(b, token_types=tt), cfg=cfg)
    patches, grid = b["images"][r][0]
    for bad in (patches.reshape(patches.shape[0], 12, 7, 7), patches[:, :1]):
        with pytest.raises(ValueError, match="do not match grid"):
            fd.forward(params, dict(b, images=[[(bad, grid)] if i == r else None for i in range(2)]), cfg=cfg)


@pytest.mark.parametrize("w, h, canvas", [
    # grid width sqrt(1022 / (5636/1500) + 1/4) - 1/2 = 16.00004 -> 16 cells (60 tall at this aspect): beta =
    # min(16*42/1500, 60*42/5636) = 2520/5636 -> 1500*beta/14 = 47.9 -> 658, 5636*beta/14 = 180 -> 2520 (1022 tokens);
    # without the 1/4 the width floors to 15 cells and the canvas to 630 x 2366
    (1500, 5636, (658, 2520)),
    # exactly at the budget: ceil to 14 gives 3024 x 588, 216 x 42 patches = 72 x 14 cells, 14 * (72 + 1) + 2 = 1024
    # tokens, not over it: kept (a shrink of 3020 x 580 would give 2842 x 546)
    (3020, 580, (3024, 588)),
    # under min_pixels: s = sqrt(295936 / 11700) = 5.0293; sides int(502.93) = 502, int(588.43) = 588 -> ceil to
    # 14: 504 x 588 (a rounded-up 589 would take a 43rd patch row, 602)
    (100, 117, (504, 588)),
])
def test_plan_canvas_boundaries_follow_spec(w, h, canvas):
    """SPEC §12 at its boundaries: the upscale truncates the sides (int), shrinking starts only OVER 1024 tokens,
    and the shrink's grid width is the real root of n_w * ratio * (n_w + 1) = 1022 (the 1/4 under the root)."""
    cfg = fd.Config.flash()
    plan = ip.plan_image_grid(w, h, cfg)
    assert (plan["best_w"], plan["best_h"]) == canvas
    assert (plan["n_vit_w"], plan["n_vit_h"]) == (canvas[0] // 14, canvas[1] // 14)
    assert plan["n_tokens"] == ip.n_image_tokens(plan["n_llm_h"], plan["n_llm_w"]) <= cfg.vision_max_n_token


def test_pad_to_rounds_the_contained_side():
    """ImageOps.pad = ImageOps.contain + centred paste: the contained side is round(h / w * best_w) (Python round),
    not truncated: a 20 x 9 image on a 28 x 28 canvas is 28 x round(12.6) = 13 rows tall, from row round(7.5) = 8."""
    img = np.full((9, 20, 3), 200, np.uint8)
    out = ip.pad_to(img, 28, 28)
    rows = (out[:, 0, 0] == 200).nonzero()[0]
    assert (rows[0], rows[-1]) == (8, 20)
    assert (out[:8] == ip.PAD_COLOR).all() and (out[21:] == ip.PAD_COLOR).all()
    wide = np.full((20, 9, 3), 200, np.uint8)                 # the same along the width
    cols = (ip.pad_to(wide, 28, 28)[0, :, 0] == 200).nonzero()[0]
    assert (cols[0], cols[-1]) == (8, 20)


def _png_filtered(pixels: np.ndarray, filters) -> bytes:
    """An 8-bit PNG (grey, grey + alpha, RGB or RGBA by the channel count) whose row y uses filter ``filters[y]`` (0 None,
    1 Sub, 2 Up, 3 Average, 4 Paeth), filtered per the PNG specification from the raw bytes: a = left, b = up,
    c = up-left (0 outside the image)."""
    import struct
    import zlib
    h, w, c = pixels.shape
    raw = pixels.reshape(h, w * c).astype(np.int64)
    out = []
    for y in range(h):
        f = filters[y % len(filters)]
        row, up = raw[y], raw[y - 1] if y else np.zeros(w * c, np.int64)
        left = np.concatenate([np.zeros(c, np.int64), row[:-c]])
        upleft = np.concatenate([np.zeros(c, np.int64), up[:-c]])
        if f == 0:
            pred = np.zeros_like(row)
        elif f == 1:
            pred = left
        elif f == 2:
            pred = up
        elif f == 3:
            pred = (left + up) // 2
        else:
            p = left + up - upleft
            pa, pb, pc = np.abs(p - left), np.abs(p - up), np.abs(p - upleft)
            pred = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, upleft))
        out.append(bytes([f]) + ((row - pred) & 255).astype(np.uint8).tobytes())

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    ctype = {1: 0, 2: 4, 3: 2, 4: 6}[c]
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, ctype, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"".join(out))) + chunk(b"IEND", b""))


def test_decode_png_every_filter_and_colour_type():
    """All five PNG row filters (the test above writes only None and Sub; Pillow's writer picks any per row), in
    every 8-bit colour type; grey + alpha becomes RGB from the grey channel (alpha dropped, as convert("RGB"))."""
    rng = np.random.default_rng(4)
    for c in (1, 2, 3, 4):
        px = rng.integers(0, 256, (9, 6, c), dtype=np.uint8)
        for filters in ([2], [3], [4], [0, 1, 2, 3, 4]):
            assert np.array_equal(ip.decode_png(_png_filtered(px, filters)), px), (c, filters)
    la = rng.integers(0, 256, (5, 7, 2), dtype=np.uint8)
    want = np.repeat(la[..., :1], 3, axis=2)
    assert np.array_equal(ip.to_rgb_array(la), want)
    assert np.array_equal(ip.to_rgb_array(_png_filtered(la, [4])), want)
