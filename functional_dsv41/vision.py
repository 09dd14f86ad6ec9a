"""Vision tower, aligner and image-span merge (SPEC §12; reference ``vision.py`` and
``Transformer.merge_image_embeddings``).

    patches [N, 3, 14, 14] bf16 --PatchEmbed--> x [N, C]
      --(RMSNorm -> 2D-RoPE bidirectional attention -> +) --(RMSNorm -> SiLU-gated MLP -> +)  x n_layers
      --RMSNorm--> vit_out [N, C]                                       N = n_vit_h * n_vit_w, C = vision_dim
    vit_out --[n_vit_h, n_vit_w, C], zero-pad to multiples of r, unfold r x r--> [n_llm_h*n_llm_w, C*r*r]
      --W1+b, GELU(erf), W2+b--> aligner_out [n_llm_h*n_llm_w, dim]
    h = embed(ids); span positions: START/END/NEW_LINE <- image_start/image_end/image_newline,
                                    IMAGE <- aligner rows in reading order

Batch format (``forward(params, batch)``): ``batch["images"]`` is a list with one entry per batch row:
``None`` (no image in the row), one image, or a list of images in the order of the row's spans. An
image is a pair ``(patches, (n_vit_h, n_vit_w))`` with patches bf16 ``[n_vit_h*n_vit_w, 3, p, p]``
(row-major patch order, pixels normalised to [-1, 1]) -- what ``image_processor.load_image`` returns.
``batch["token_types"]`` int64 ``[b, s]`` is then required (TEXT -1, IMAGE_START 0, IMAGE 1,
IMAGE_NEW_LINE 2, IMAGE_END 3; ``image_processor.expand_image_tokens`` builds ids and types), every
span must carry ``image_token_id`` and lie in a chunk that starts at position 0.

Dtype flow (bit-exact with the reference's ``vit_out`` / ``aligner_out`` on tiny-vl, CPU): everything
bf16 (Linear = ``F.linear`` with its bias in bf16); RMSNorm statistics in fp32, times the fp32 weight,
then cast to bf16; RoPE in fp32 on the bf16 q/k, cast back; SDPA in bf16; SiLU and GELU in bf16.

Shape legend: N patches, C vision_dim, H heads, D head dim, G llm grid cells, M model dim.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from .config import Config
from .image_processor import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, span_types

VIT_EPS = 1e-6


# --------------------------------------------------------------------------------------------- ViT
def _linear(x: torch.Tensor, p: dict) -> torch.Tensor:
    w, b = p["weight"], p.get("bias")
    return F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))


def vit_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = VIT_EPS) -> torch.Tensor:
    """x [..., C] bf16, weight [C] fp32 -> bf16: fp32 statistics, fp32 weight product, one cast at the end."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def vision_cos_sin(n_vit_h: int, n_vit_w: int, *, cfg: Config, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """2D RoPE tables (SPEC §12 ``get_vision_cos_sin``): cos, sin fp32 [N, D/2].

    rope_dim = D/2 angles per patch (r, c) in row-major order: ``[r*inv_freq ; c*inv_freq]`` with
    ``inv_freq = theta^(-(0, 2, ..., rope_dim-2)/rope_dim)`` (rope_dim/2 frequencies each)."""
    d = cfg.vision_dim // cfg.vision_n_heads // 2
    inv = 1.0 / (cfg.vision_rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    r = torch.arange(n_vit_h, device=device, dtype=torch.float32).repeat_interleave(n_vit_w)
    c = torch.arange(n_vit_w, device=device, dtype=torch.float32).repeat(n_vit_h)
    ang = torch.cat([r[:, None] * inv, c[:, None] * inv], -1)
    return ang.cos(), ang.sin()


def apply_vision_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on every head: x [N, H, D] bf16, cos/sin [N, D/2] fp32 -> [N, H, D] bf16.
    ``[x1 cos - x2 sin ; x2 cos + x1 sin]`` with x1, x2 the two halves (not the LLM's interleaved pairs)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None], sin[:, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)


def vit_block(p: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, cfg: Config) -> torch.Tensor:
    """One pre-norm ViT block: x [N, C] bf16 -> [N, C]. Bidirectional attention, scale 1/sqrt(D)."""
    n, C = x.shape
    H = cfg.vision_n_heads
    D = C // H
    y = vit_rms_norm(x, p["norm1"]["weight"])
    q, k, v = _linear(y, p["attn"]["wqkv"]).view(n, 3, H, D).unbind(1)
    q, k = apply_vision_rope(q, cos, sin), apply_vision_rope(k, cos, sin)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=D ** -0.5)
    x = x + _linear(o.transpose(0, 1).reshape(n, C), p["attn"]["wo"])
    y = vit_rms_norm(x, p["norm2"]["weight"])
    gate, up = _linear(y, p["mlp"]["w1"]).chunk(2, -1)            # fused w1 = [gate; up]
    return x + _linear(F.silu(gate) * up, p["mlp"]["w2"])


def vit(p: dict, patches: torch.Tensor, grid: tuple[int, int], *, cfg: Config) -> torch.Tensor:
    """ViT (SPEC §12): p = params["vision"], patches [N, 3, ps, ps] bf16, grid (n_vit_h, n_vit_w)
    -> vit_out [N, C] bf16 (after the final RMSNorm)."""
    n_vit_h, n_vit_w = grid
    n = patches.shape[0]
    x = _linear(patches.reshape(n, -1).to(torch.bfloat16), p["patch_embed"]["proj"])
    cos, sin = vision_cos_sin(n_vit_h, n_vit_w, cfg=cfg, device=x.device)
    for bp in p["blocks"]:
        x = vit_block(bp, x, cos, sin, cfg=cfg)
    return vit_rms_norm(x, p["norm"]["weight"])


def aligner(p: dict, feats: torch.Tensor, grid: tuple[int, int], *, cfg: Config) -> torch.Tensor:
    """Aligner (SPEC §12): p = params["aligner"], feats [N, C] bf16 -> [G, M] bf16, G = n_llm_h*n_llm_w.

    The [n_vit_h, n_vit_w, C] grid is zero-padded (bottom/right) to multiples of r and unfolded r x r
    with stride r; feature index c*r*r + ky*r + kx (channel-major, ``F.unfold``), cells row-major."""
    n_vit_h, n_vit_w = grid
    r = cfg.vision_downsample_ratio
    f = feats.reshape(n_vit_h, n_vit_w, -1).permute(2, 0, 1)[None]          # [1, C, h, w]
    f = F.pad(f, (0, (-n_vit_w) % r, 0, (-n_vit_h) % r))
    u = F.unfold(f, kernel_size=r, stride=r)[0].transpose(0, 1)            # [G, C*r*r]
    return _linear(F.gelu(_linear(u, p["w1"])), p["w2"])


def encode_image(params: dict, patches: torch.Tensor, grid: tuple[int, int], *, cfg: Config,
                 debug: dict | None = None, index: int = 0) -> torch.Tensor:
    """patches [N, 3, ps, ps] -> aligner rows [G, M] bf16 (ViT then aligner); debug gets
    ``image.{index}.vit_out`` / ``.aligner_out`` (the golden files' ``prefill.image.{i}.*``)."""
    feats = vit(params["vision"], patches, grid, cfg=cfg)
    rows = aligner(params["aligner"], feats, grid, cfg=cfg)
    if debug is not None:
        debug[f"image.{index}.vit_out"] = feats
        debug[f"image.{index}.aligner_out"] = rows
    return rows


# ------------------------------------------------------------------------------------------- merge
def _is_image(e) -> bool:
    """``(patches tensor, (n_vit_h, n_vit_w))`` as ``image_processor.load_image`` returns it."""
    return (isinstance(e, (tuple, list)) and len(e) == 2 and isinstance(e[0], torch.Tensor)
            and isinstance(e[1], (tuple, list, torch.Size)) and len(e[1]) == 2)


def _row_images(entry, row: int) -> list:
    """One row's entry of batch["images"] (None, one image, or a list of images; an image may also be a
    dict with "patches" and "grid") as a list of ``(patches, grid)``; anything else is refused by name
    (a bare patches tensor would otherwise be read as one image per patch)."""
    if entry is None:
        return []
    if _is_image(entry):
        return [entry]
    if isinstance(entry, dict):
        entry = [entry]
    if not isinstance(entry, (list, tuple)):
        raise ValueError(f"forward: batch['images'][{row}] must be None or a list of (patches, (n_vit_h, n_vit_w)) "
                         f"images (image_processor.load_image), got {type(entry).__name__}")
    out = []
    for j, e in enumerate(entry):
        if isinstance(e, dict) and {"patches", "grid"} <= e.keys():
            e = (e["patches"], tuple(e["grid"]))
        if not _is_image(e):
            raise ValueError(f"forward: batch['images'][{row}][{j}] must be an image (patches tensor, (n_vit_h, "
                             f"n_vit_w)) as image_processor.load_image returns, got {_describe(e)}")
        out.append(e)
    return out


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor {tuple(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}: (" + ", ".join(_describe(v) for v in x[:3]) + \
            (", ..." if len(x) > 3 else "") + ")"
    return type(x).__name__


def image_spans(types_row: list[int], row: int) -> list[tuple[int, int]]:
    """[(start, end_inclusive)] of the IMAGE_START..IMAGE_END spans of one row of token types."""
    spans, open_at = [], None
    for i, t in enumerate(types_row):
        if t == IMAGE_START:
            if open_at is not None:
                raise ValueError(f"forward: row {row}: IMAGE_START at {i} inside the span opened at {open_at}")
            open_at = i
        elif t == IMAGE_END:
            if open_at is None:
                raise ValueError(f"forward: row {row}: IMAGE_END at {i} without IMAGE_START")
            spans.append((open_at, i))
            open_at = None
        elif t in (IMAGE, IMAGE_NEW_LINE):
            if open_at is None:
                raise ValueError(f"forward: row {row}: image token type {t} at {i} outside an image span")
        elif t != -1:
            raise ValueError(f"forward: row {row}: unknown token type {t} at {i} (TEXT -1, image spans 0..3)")
    if open_at is not None:
        raise ValueError(f"forward: row {row}: the image span opened at {open_at} does not end in this chunk "
                         "(spans must lie whole in the first prefill chunk)")
    return spans


VISION_PARAMS = ("vision", "aligner", "image_start", "image_end", "image_newline")


def _check_vision_params(params: dict) -> None:
    """Refuse a batch with images when the params lack the vision tower (a text-only load, or vision keys
    dropped to save memory), before anything is encoded (a bare KeyError: 'image_start' before)."""
    missing = [k for k in VISION_PARAMS if params.get(k) is None]
    if missing:
        raise ValueError(f"forward: the batch has images but the params lack {', '.join(missing)}: images need the "
                         f"vision tower ('vision'), the aligner ('aligner') and the image_start / image_end / "
                         f"image_newline rows (fd.load_params of a checkpoint with vision weights)")


def merge_image_embeddings(params: dict, h: torch.Tensor, batch: dict, *, cfg: Config, start: int = 0,
                           debug: dict | None = None) -> torch.Tensor:
    """Overwrite the image spans of the token embeddings (SPEC §1 "if images", §12 "Insertion").

    h [b, s, M] bf16 (``embed(input_ids)``), batch with "images" (module docstring) and "token_types"
    [b, s] -> h' [b, s, M] (a new tensor; out-of-place, differentiable w.r.t. the vision params).
    Raises ValueError when the config has no vision tower or the params lack it (``VISION_PARAMS``; rows
    that are all None pass), when images come with a chunk not starting at 0, without token types, or
    when the spans in token_types do not match the images (count, grid, layout, image token id).
    """
    images = batch["images"]
    b, s = h.shape[:2]
    if isinstance(images, (list, tuple)) and len(images) == b and all(i is None or (isinstance(i, (list, tuple))
                                                                               and not i) for i in images):
        # no row has an image: the text forward, at any chunk and without token_types (image spans in
        # token_types fall through to the checks below, which name the rows whose images are missing)
        tt = batch.get("token_types")
        if tt is None or not bool((tt >= 0).any()):
            return h
    if not cfg.vision_enabled:
        raise ValueError(f"forward: this config has no vision tower (vision_n_layers = {cfg.vision_n_layers}): "
                         "batch['images'] is not supported")
    if start != 0:
        raise ValueError(f"forward: images are only allowed in a chunk that starts at position 0 (this chunk "
                         f"starts at {start}); put every image span in the first prefill chunk")
    tt = batch.get("token_types")
    if tt is None:
        raise ValueError("forward: batch has 'images' but no 'token_types' (int64 [b, s]: -1 text, 0 IMAGE_START, "
                         "1 IMAGE, 2 IMAGE_NEW_LINE, 3 IMAGE_END); see image_processor.expand_image_tokens")
    if _is_image(images):
        raise ValueError(f"forward: batch['images'] is one image (patches, grid); it takes one entry per row "
                         f"({b}), each a list of that row's images: e.g. [[(patches, grid)]" +
                         ", None" * (b - 1) + "]")
    if not isinstance(images, (list, tuple)) or len(images) != b:
        raise ValueError(f"forward: batch['images'] must be a list with one entry per row ({b}), "
                         f"got {type(images).__name__}" + (f" of {len(images)}" if hasattr(images, '__len__') else ""))
    if tuple(tt.shape) != (b, s):
        raise ValueError(f"forward: token_types {tuple(tt.shape)} must match input_ids {(b, s)}")
    ids = batch["input_ids"]
    types = tt.tolist()
    rows_i, cols_i, vals = [], [], []
    delim = None                    # the delimiter rows, read when there is an image (vision params only then)
    n_img = 0
    for r in range(b):
        imgs = _row_images(images[r], r)
        spans = image_spans(types[r], r)
        if len(spans) != len(imgs):
            raise ValueError(f"forward: row {r} has {len(spans)} image spans in token_types but {len(imgs)} images")
        for (a, e), (patches, grid) in zip(spans, imgs):
            grid = tuple(int(g) for g in grid)
            want = span_types(*grid, cfg.vision_downsample_ratio).tolist()
            if len(want) != e - a + 1 or types[r][a:e + 1] != want:
                raise ValueError(f"forward: row {r}: the image span at {a}..{e} ({e - a + 1} positions) does not fit "
                                 f"an image of patch grid {grid}, which needs {len(want)} positions laid out as "
                                 f"START + ([IMAGE]*n_llm_w + NEW_LINE)*n_llm_h + END")
            if patches.dim() != 4 or patches.shape[0] != grid[0] * grid[1] or \
                    patches.shape[1:] != (3, cfg.vision_patch_size, cfg.vision_patch_size):
                raise ValueError(f"forward: row {r}: patches {tuple(patches.shape)} do not match grid {grid} "
                                 f"([{grid[0] * grid[1]}, 3, {cfg.vision_patch_size}, {cfg.vision_patch_size}])")
            if not patches.is_floating_point():
                raise ValueError(f"forward: row {r}: patches are {patches.dtype}; they are normalised floats "
                                 f"((pixel/255 - 0.5)/0.5, bf16, SPEC §12): pass the image through "
                                 f"image_processor.load_image, not raw pixel values")
            if bool((ids[r, a:e + 1] != cfg.image_token_id).any()):
                raise ValueError(f"forward: row {r}: image span {a}..{e} holds ids other than image_token_id "
                                 f"{cfg.image_token_id}")
            if delim is None:
                _check_vision_params(params)
                delim = {IMAGE_START: params["image_start"], IMAGE_END: params["image_end"],
                         IMAGE_NEW_LINE: params["image_newline"]}
            rows = encode_image(params, patches.to(h.device), grid, cfg=cfg, debug=debug, index=n_img)
            n_img += 1
            k = 0
            for pos in range(a, e + 1):
                t = types[r][pos]
                vals.append(rows[k] if t == IMAGE else delim[t])
                k += t == IMAGE
            rows_i += [r] * (e - a + 1)
            cols_i += list(range(a, e + 1))
    if not vals:
        return h
    idx = (torch.tensor(rows_i, device=h.device), torch.tensor(cols_i, device=h.device))
    return h.index_put(idx, torch.stack(vals).to(h.dtype))
