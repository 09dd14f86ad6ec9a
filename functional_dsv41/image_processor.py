"""Image preprocessing for the vision tower (SPEC §12 "Preprocessing"; reference ``image_processor.py``).

    image (PIL / PNG bytes / uint8 array [h, w, 3] or [3, h, w]: to_rgb_array)
      -> plan: upscale below min_pixels, ceil to patch multiples, shrink over the token budget
      -> ImageOps.pad equivalent: aspect-kept bicubic resize into [best_h, best_w], centred, grey 127
      -> (x/255 - 0.5)/0.5 -> bf16 -> patches [n_vit_h*n_vit_w, 3, 14, 14] (row-major patch order)

Pillow is optional. Without it, inputs are uint8 arrays or PNG bytes (decoded here with ``zlib``;
8-bit, non-interlaced PNGs only), and the resize is a reimplementation of Pillow's 8-bit bicubic
resampler (separable, fixed point with 22 fraction bits, horizontal pass then vertical, uint8 between
passes), so the patches are bit-identical with the reference's on the tiny-vl fixture. With Pillow
importable, ``to_rgb_array`` decodes any format Pillow knows; the resize stays this one.

Token layout of one image (``span_types``): ``IMAGE_START, ([IMAGE]*n_llm_w + [NEW_LINE])*n_llm_h,
IMAGE_END`` with token types 0, 1, 2, 3 (TEXT = -1); every span position carries ``image_token_id``.
"""
from __future__ import annotations

import io
import math
import operator
import struct
import zlib

import numpy as np
import torch

TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3
PAD_COLOR = 127
_PRECISION_BITS = 32 - 8 - 2   # Pillow Resample.c, 8 bits per channel


# ----------------------------------------------------------------------------------------------- decode
def decode_png(data: bytes) -> np.ndarray:
    """PNG bytes -> uint8 [h, w, c] (c = 1, 2, 3, 4 as stored). 8-bit, non-interlaced only (stdlib zlib).
    A damaged file (bad chunk CRC, truncated or corrupt image data) is a ValueError saying so."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("decode_png: not a PNG file (other formats need Pillow: pip install pillow)")
    pos, idat, hdr = 8, [], None
    while pos + 8 <= len(data):
        n, typ = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + n]
        crc = data[pos + 8 + n:pos + 12 + n]
        if len(chunk) != n or len(crc) != 4:
            raise ValueError(f"decode_png: truncated file (chunk {typ!r} at byte {pos} needs {n + 12} bytes)")
        if zlib.crc32(typ + chunk) != struct.unpack(">I", crc)[0]:
            raise ValueError(f"decode_png: corrupt file (CRC mismatch in chunk {typ!r} at byte {pos})")
        pos += 12 + n
        if typ == b"IHDR":
            hdr = struct.unpack(">IIBBBBB", chunk)
        elif typ == b"IDAT":
            idat.append(chunk)
        elif typ == b"IEND":
            break
    if hdr is None:
        raise ValueError("decode_png: no IHDR chunk")
    w, h, depth, ctype, _, _, interlace = hdr
    if depth != 8 or interlace or ctype not in (0, 2, 4, 6):
        raise ValueError(f"decode_png: only 8-bit non-interlaced grey/RGB(A) PNGs are supported without Pillow "
                         f"(bit depth {depth}, colour type {ctype}, interlace {interlace}); pip install pillow")
    if w < 1 or h < 1:
        raise ValueError(f"decode_png: empty image ({w} x {h})")
    bpp = {0: 1, 2: 3, 4: 2, 6: 4}[ctype]
    stride = w * bpp
    try:
        raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8)
    except zlib.error as e:
        raise ValueError(f"decode_png: corrupt image data ({e})") from None
    if raw.size != h * (stride + 1):
        raise ValueError(f"decode_png: the image data holds {raw.size} bytes, a {w} x {h} image with {bpp} "
                         f"byte(s) a pixel needs {h * (stride + 1)}")
    rows = raw.reshape(h, stride + 1)
    out = np.zeros((h, stride), np.int32)
    prev = np.zeros(stride, np.int32)
    for y in range(h):
        f, line = rows[y, 0], rows[y, 1:].astype(np.int32)
        if f == 0:
            cur = line
        elif f == 1:                                     # Sub: a running sum along the row, per channel
            cur = (np.cumsum(line.reshape(w, bpp), axis=0) & 255).reshape(stride).astype(np.int32)
        elif f == 2:
            cur = (line + prev) & 255
        elif f in (3, 4):                                # Average / Paeth: left-to-right per pixel
            cur = np.zeros(stride, np.int32)
            for i in range(0, stride, bpp):
                a = cur[i - bpp:i] if i else np.zeros(bpp, np.int32)
                b = prev[i:i + bpp]
                c = prev[i - bpp:i] if i else np.zeros(bpp, np.int32)
                if f == 3:
                    p = (a + b) >> 1
                else:
                    pa, pb, pc = np.abs(b - c), np.abs(a - c), np.abs(a + b - 2 * c)
                    p = np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, c))
                cur[i:i + bpp] = (line[i:i + bpp] + p) & 255
        else:
            raise ValueError(f"decode_png: bad filter type {f} in row {y}")
        out[y] = cur
        prev = cur
    return out.reshape(h, w, bpp).astype(np.uint8)


_CHANNELS = (1, 2, 3, 4)        # grey, grey + alpha, RGB, RGBA
_LAYOUTS = (None, "hwc", "chw")


def to_rgb_array(image, layout: str | None = None) -> np.ndarray:
    """PIL image, encoded bytes (PNG; any format with Pillow) or a uint8 array/tensor -> uint8 RGB array [h, w, 3].

    An array or tensor is [h, w] (grey) or 3-D with c = 1 (grey), 2 (grey + alpha), 3 (RGB) or 4 (RGBA) channels
    (alpha is dropped, as Pillow's ``convert("RGB")`` does), laid out as ``layout`` says: "hwc", channels last
    (numpy's and PIL's [h, w, c]), or "chw", channels first (torch's [c, h, w], e.g. torchvision's ``read_image``).
    With ``layout=None`` the shape decides: channels last when only the last dim is 1-4, channels first when only the
    first is; a shape whose first and last dims are both 1-4 (``[3, h, 4]``: an RGB image 4 pixels wide, or an RGBA
    image 3 pixels tall) is a ValueError asking for ``layout``. PIL images and bytes decode to [h, w, c], so
    ``layout`` is "hwc" or None for them.
    """
    if layout not in _LAYOUTS:
        raise ValueError(f"to_rgb_array: layout must be None, 'hwc' or 'chw', got {layout!r}")
    decoded = False
    if isinstance(image, dict) and "data" in image:            # the reference's {'data': bytes}
        image = image["data"]
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        decoded = True
        try:
            from PIL import Image
            image = Image.open(io.BytesIO(data))
        except ImportError:
            image = decode_png(data)
    if hasattr(image, "convert") and hasattr(image, "size"):    # PIL.Image
        image = np.asarray(image.convert("RGB"))
        decoded = True
    if decoded:
        if layout == "chw":
            raise ValueError("to_rgb_array: layout='chw' is for arrays and tensors; a PIL image or encoded bytes "
                             "decode to [h, w, c]")
        layout = "hwc"
    arr = image.numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if arr.dtype != np.uint8 or arr.ndim not in (2, 3):
        raise ValueError(f"image: expected uint8 [h, w], [h, w, c] or [c, h, w], got {arr.dtype} {arr.shape}")
    given = tuple(arr.shape)
    if arr.ndim == 2:
        arr = arr[..., None]
    elif layout is None:
        first, last = arr.shape[0] in _CHANNELS, arr.shape[2] in _CHANNELS
        if first and last:
            raise ValueError(f"image: the shape {given} reads as [h, w, c] or as [c, h, w] (both end dims "
                             f"could be 1-4 channels); say which with layout='hwc' or layout='chw' "
                             f"(to_rgb_array / load_image)")
        if not (first or last):
            raise ValueError(f"image: the shape {given} has no channel dim: neither its first nor its last dim is "
                             f"1-4 (grey, grey + alpha, RGB, RGBA)")
        layout = "chw" if first else "hwc"
    if layout == "chw":
        arr = arr.transpose(1, 2, 0)
    c = arr.shape[2]
    if c in (1, 2):          # grey (+alpha): alpha dropped as Pillow's convert("RGB") does
        arr = np.repeat(arr[..., :1], 3, axis=2)
    elif c == 4:
        arr = arr[..., :3]
    elif c != 3:
        shape = "[c, h, w]" if layout == "chw" else "[h, w, c]"
        raise ValueError(f"image: {c} channels in the {shape} shape {given} (1-4: grey, grey + alpha, "
                         f"RGB, RGBA)")
    return np.ascontiguousarray(arr)


# ------------------------------------------------------------------------------------------------ plan
def llm_grid(best_w: int, best_h: int, patch: int, ratio: int) -> tuple[int, int]:
    """(n_llm_h, n_llm_w) of a best_w x best_h canvas."""
    return math.ceil(best_h // patch / ratio), math.ceil(best_w // patch / ratio)


def n_image_tokens(n_llm_h: int, n_llm_w: int) -> int:
    """Span length: START + n_llm_h rows of (n_llm_w IMAGE + NEW_LINE) + END."""
    return n_llm_h * (n_llm_w + 1) + 2


def _shrink_to_budget(w: int, h: int, p: int, r: int, max_tokens: int) -> tuple[int, int]:
    """Canvas (best_w, best_h) of a w x h image whose canvas costs more than ``max_tokens``: the reference's
    ``solve_resize_ratio``, a closed form (not a search). The largest LLM grid width n_w with
    ``(n_w * ratio) * (n_w + 1) + 2 <= max_tokens`` at this aspect is ``sqrt((max_tokens - 2) / ratio + 1/4) - 1/2``
    (real-valued), the height ``n_h = n_w * ratio``; both floored to whole p*r cells, the image is scaled so its
    tighter side fits them, and each side is floored to a patch multiple. A side under one cell collapses the grid
    to one column (tall) or one row (wide)."""
    ratio = h / w
    max_w = math.sqrt((max_tokens - 2) / ratio + 0.25) - 0.5
    max_h = max_w * ratio
    cell = p * r
    if max_w < 1.0:                                   # very tall: one column of (max_tokens - 2) // 2 cells
        return cell, (max_tokens - 2) // 2 * cell
    if max_h < 1.0:                                   # very wide: one row of max_tokens - 3 cells
        return (max_tokens - 3) * cell, cell
    beta = min(math.floor(max_w) * cell / w, math.floor(max_h) * cell / h)
    return math.floor(w * beta / p) * p, math.floor(h * beta / p) * p


def plan_image_grid(w: int, h: int, cfg) -> dict:
    """Canvas and grids for a w x h image (SPEC §12). Returns best_w, best_h, n_vit_h, n_vit_w, n_llm_h,
    n_llm_w, n_tokens.

    Upscale when 0 < w*h < vision_min_pixels by int(side * sqrt(min_pixels / (w*h))); canvas =
    sides rounded up to patch multiples. Over the token budget, the canvas is the reference's
    ``solve_resize_ratio`` of the (upscaled) size (``_shrink_to_budget``).
    """
    p, r = cfg.vision_patch_size, cfg.vision_downsample_ratio
    if w <= 0 or h <= 0:
        raise ValueError(f"image: empty size {w}x{h}")
    if w * h < cfg.vision_min_pixels:
        s = math.sqrt(cfg.vision_min_pixels / (w * h))
        w, h = int(w * s), int(h * s)

    bw, bh = math.ceil(w / p) * p, math.ceil(h / p) * p
    if n_image_tokens(*llm_grid(bw, bh, p, r)) > cfg.vision_max_n_token:
        bw, bh = _shrink_to_budget(w, h, p, r, cfg.vision_max_n_token)
    n_llm_h, n_llm_w = llm_grid(bw, bh, p, r)
    n = n_image_tokens(n_llm_h, n_llm_w)
    if n > cfg.vision_max_n_token or bw < p or bh < p:          # (after a shrink) the reference asserts the fit
        raise ValueError(f"image {w} x {h}: no canvas within {cfg.vision_max_n_token} image tokens "
                         f"(the shrunk {bw} x {bh} costs {n})")
    return dict(best_w=bw, best_h=bh, n_vit_h=bh // p, n_vit_w=bw // p, n_llm_h=n_llm_h, n_llm_w=n_llm_w,
                n_tokens=n)


# ---------------------------------------------------------------------------------------------- resize
def _bicubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0.0))


def _coeffs(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pillow ``precompute_coeffs`` + ``normalize_coeffs_8bpc`` as bands: (first input index [out_size], int64
    fixed-point weights [out_size, K]), output xx = sum_k w[xx, k] * in[first[xx] + k] (weights past an output's
    support are 0). Banded rather than a dense [out_size, in_size] matrix: a 4032-pixel side costs K ~ 10
    weights an output, not 4032 (the dense form took minutes and gigabytes on a phone photo)."""
    if in_size < 1 or out_size < 1:
        raise ValueError(f"resize: sizes must be >= 1, got {in_size} -> {out_size}")
    scale = in_size / out_size
    fscale = max(scale, 1.0)
    support = 2.0 * fscale
    K = int(math.ceil(support)) * 2 + 1
    first = np.zeros(out_size, np.int64)
    w = np.zeros((out_size, K), np.int64)
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size)
        k = _bicubic((np.arange(xmin, xmax) - center + 0.5) / fscale)
        ww = k.sum()
        if ww != 0:
            k = k / ww
        q = k * (1 << _PRECISION_BITS)
        first[xx] = xmin
        w[xx, :xmax - xmin] = np.where(q < 0, np.trunc(q - 0.5), np.trunc(q + 0.5)).astype(np.int64)
    return first, w


def resize_bicubic(img: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """uint8 [h, w, c] -> uint8 [H, W, c], size = (W, H): Pillow ``Image.resize(size, BICUBIC)`` bit for bit
    (horizontal pass, clip to uint8, vertical pass; each pass skipped when that side keeps its size). Integer
    arithmetic throughout, so the order of the sums cannot change a bit."""
    W, H = size
    x = img.astype(np.int64)
    half = 1 << (_PRECISION_BITS - 1)

    def apply(v, out_size, axis):
        n = v.shape[axis]
        first, w = _coeffs(n, out_size)
        y = 0
        for k in range(w.shape[1]):
            idx = np.minimum(first + k, n - 1)            # past the support the weight is 0
            shape = [1] * v.ndim
            shape[axis] = out_size
            y = y + w[:, k].reshape(shape) * np.take(v, idx, axis=axis)
        return np.clip((y + half) >> _PRECISION_BITS, 0, 255)

    if W != x.shape[1]:
        x = apply(x, W, 1)
    if H != x.shape[0]:
        x = apply(x, H, 0)
    return x.astype(np.uint8)


def pad_to(img: np.ndarray, best_w: int, best_h: int) -> np.ndarray:
    """``ImageOps.pad(img, (best_w, best_h), BICUBIC, color=(127,)*3)``: resize keeping the aspect so it
    fits (``ImageOps.contain``), paste centred (Python ``round`` of half the slack) on grey."""
    h, w = img.shape[:2]
    nw, nh = best_w, best_h
    if w / h != best_w / best_h:
        if w / h > best_w / best_h:
            nh = round(h / w * best_w)
        else:
            nw = round(w / h * best_h)
    if nw < 1 or nh < 1:
        raise ValueError(f"image {w} x {h}: its aspect ratio is too extreme for a {best_w} x {best_h} canvas (it "
                         f"would be resized to {nw} x {nh})")
    r = resize_bicubic(img, (nw, nh)) if (nw, nh) != (w, h) else img
    if (nw, nh) == (best_w, best_h):
        return r
    out = np.full((best_h, best_w, img.shape[2]), PAD_COLOR, np.uint8)
    if nw != best_w:
        x0 = round((best_w - nw) * 0.5)
        out[:, x0:x0 + nw] = r
    else:
        y0 = round((best_h - nh) * 0.5)
        out[y0:y0 + nh] = r
    return out


# ------------------------------------------------------------------------------------------------ main
def patchify(canvas: np.ndarray, patch: int) -> torch.Tensor:
    """uint8 [H, W, 3] (multiples of patch) -> bf16 [H/p * W/p, 3, p, p], pixels (x/255 - 0.5)/0.5."""
    x = torch.from_numpy(canvas).float().permute(2, 0, 1)          # [3, H, W]
    x = ((x / 255 - 0.5) / 0.5).to(torch.bfloat16)
    c, H, W = x.shape
    x = x.view(c, H // patch, patch, W // patch, patch).permute(1, 3, 0, 2, 4)
    return x.reshape(-1, c, patch, patch).contiguous()


def load_image(image, cfg, *, layout: str | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
    """Image -> (patches bf16 [n_vit_h*n_vit_w, 3, p, p], (n_vit_h, n_vit_w)): the value that
    ``batch["images"]`` takes per image (SPEC §12; see ``functional_dsv41.vision``). ``image`` and ``layout``
    as :func:`to_rgb_array` takes them."""
    rgb = to_rgb_array(image, layout)
    plan = plan_image_grid(rgb.shape[1], rgb.shape[0], cfg)
    canvas = pad_to(rgb, plan["best_w"], plan["best_h"])
    return patchify(canvas, cfg.vision_patch_size), (plan["n_vit_h"], plan["n_vit_w"])


def span_types(n_vit_h: int, n_vit_w: int, ratio: int) -> torch.Tensor:
    """int64 token types of one image span: [0] + ([1]*n_llm_w + [2])*n_llm_h + [3]."""
    n_llm_h, n_llm_w = math.ceil(n_vit_h / ratio), math.ceil(n_vit_w / ratio)
    row = [IMAGE] * n_llm_w + [IMAGE_NEW_LINE]
    return torch.tensor([IMAGE_START] + row * n_llm_h + [IMAGE_END], dtype=torch.long)


def _grid_pair(g, i: int) -> tuple[int, int]:
    """grids[i] as (n_vit_h, n_vit_w) Python ints >= 1, else a ValueError naming what was given."""
    out = None
    try:
        if not isinstance(g, (str, bytes, dict)) and len(g) == 2 and \
                not any(isinstance(v, (bool, np.bool_)) for v in (g[0], g[1])):
            out = tuple(operator.index(v) for v in (g[0], g[1]))     # ints, numpy / 0-d torch integers
            out = out if min(out) >= 1 else None
    except (TypeError, IndexError, KeyError, ValueError):      # no length (None, an int, a 0-d tensor) / no items
        out = None
    if out is None:
        if isinstance(g, (tuple, list)) and len(g) == 2 and isinstance(g[0], torch.Tensor) and g[0].dim() == 4:
            got = f"a (patches {tuple(g[0].shape)}, grid {g[1]!r}) pair"
        elif isinstance(g, (torch.Tensor, np.ndarray)):
            got = f"a{' tensor' if isinstance(g, torch.Tensor) else 'n array'} {tuple(g.shape)}"
        else:
            got = repr(g) if len(repr(g)) <= 60 else type(g).__name__
        raise ValueError(f"expand_image_tokens: grids[{i}] must be a pair of integers >= 1 (n_vit_h, n_vit_w), got "
                         f"{got}; load_image returns (patches, grid): pass the grid, its second element "
                         f"(grids=[img[1] for img in images])")
    return out


def expand_image_tokens(ids: list[int], grids: list[tuple[int, int]], cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids with one ``image_token_id`` per image -> (ids [s'], token_types [s']) with each image
    token expanded to its span (all positions keep ``image_token_id``). ``grids[i]`` = (n_vit_h, n_vit_w), a
    pair of integers >= 1: the SECOND element of what ``load_image`` returns (``(patches, grid)``), not the pair
    itself (refused with a ValueError saying so)."""
    out_ids, out_types, i = [], [], 0
    for t in ids:
        if t == cfg.image_token_id:
            if i >= len(grids):
                raise ValueError(f"expand_image_tokens: more image tokens than the {len(grids)} images given")
            ty = span_types(*_grid_pair(grids[i], i), cfg.vision_downsample_ratio).tolist()
            out_ids += [t] * len(ty)
            out_types += ty
            i += 1
        else:
            out_ids.append(t)
            out_types.append(TEXT)
    if i != len(grids):
        raise ValueError(f"expand_image_tokens: {len(grids)} images but {i} image tokens")
    return torch.tensor(out_ids, dtype=torch.long), torch.tensor(out_types, dtype=torch.long)
