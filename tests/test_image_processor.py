"""The image preprocessing of SPEC §12 (``image_processor``): the token-budget plan and its canvas, the bicubic
resize, ``pad_to``, the PNG decoder and the array layouts. The ViT, the aligner and image spans in the model are in
test_vision.py."""
import numpy as np
import pytest
import torch

import functional_dsv41 as fd
from functional_dsv41 import image_processor as ip

from conftest import fixture_dir


def vl_config() -> fd.Config:
    """The tiny-vl fixture's config (its vision settings); skips where the fixtures are absent."""
    return fd.Config.from_json(fixture_dir("tiny-vl") / "config.json")


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


def test_plan_and_resize_basics():
    cfg = vl_config()
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
    wide = np.random.default_rng(1).integers(0, 256, (1, 20000, 3), dtype=np.uint8)
    out = ip.resize_bicubic(wide, (700, 1))                    # a dense matrix here took ~7 GB and 44 s
    assert out.shape == (1, 700, 3)
    with pytest.raises(ValueError, match="aspect ratio is too extreme"):
        ip.pad_to(np.zeros((1, 100000, 3), np.uint8), 28, 1400)


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


def _png(pixels: np.ndarray, filters=(0,), width=None) -> bytes:
    """An 8-bit PNG (grey, grey + alpha, RGB or RGBA by the channel count) whose row y uses filter
    ``filters[y % len(filters)]`` (0 None, 1 Sub, 2 Up, 3 Average, 4 Paeth; ``width``: the width the header declares,
    if not the pixels'), filtered per the PNG specification from the raw bytes: a = left, b = up,
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
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width or w, h, 8, ctype, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"".join(out))) + chunk(b"IEND", b""))


def test_decode_png_filters_and_damaged_files():
    px = np.random.default_rng(2).integers(0, 256, (7, 11, 3), dtype=np.uint8)
    for filt in (0, 1):
        assert np.array_equal(ip.decode_png(_png(px, [filt])), px)
    good = _png(px, [1])
    bad_crc = bytearray(good)
    bad_crc[40] ^= 1                                           # a byte of the IDAT data
    for data, match in [(bytes(bad_crc), "CRC mismatch"), (good[:60], "truncated file"),
                        (_png(px[:, :5], width=11), "image data holds 112 bytes, a 11 x 7 image"),
                        (b"\xff\xd8\xff\xe0 a jpeg", "pip install pillow")]:
        with pytest.raises(ValueError, match=match):
            ip.decode_png(data)


def test_decode_png_every_filter_and_colour_type():
    """All five PNG row filters (the test above writes only None and Sub; Pillow's writer picks any per row), in
    every 8-bit colour type; grey + alpha becomes RGB from the grey channel (alpha dropped, as convert("RGB"))."""
    rng = np.random.default_rng(4)
    for c in (1, 2, 3, 4):
        px = rng.integers(0, 256, (9, 6, c), dtype=np.uint8)
        for filters in ([2], [3], [4], [0, 1, 2, 3, 4]):
            assert np.array_equal(ip.decode_png(_png(px, filters)), px), (c, filters)
    la = rng.integers(0, 256, (5, 7, 2), dtype=np.uint8)
    want = np.repeat(la[..., :1], 3, axis=2)
    assert np.array_equal(ip.to_rgb_array(la), want)
    assert np.array_equal(ip.to_rgb_array(_png(la, [4])), want)


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
    cfg = vl_config()
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
