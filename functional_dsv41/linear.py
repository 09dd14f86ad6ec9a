"""``linear(x, p)``: one entry point for every weight storage format (SPEC §9 "linear() dispatch").

``p`` is a parameter subtree ``{"weight": W}`` or ``{"weight": W, "scale": S}`` (and optionally
``"bias"``). The storage dtype of ``W`` decides the path:

- fp8 e4m3 + e8m0 32x32 scale, or fp4 e2m1 (packed) + e8m0 1x32 scale:
  - ``mode="reference"``: activations quantised per 1x32 to fp8 (``act_quant``), block-scaled GEMM
    (``fp8_gemm`` / ``fp4_gemm``), exactly as the release runs; bf16 out. An fp8 weight with 32x128 scales
    (``align_fp8_weights``, opt-in) runs both at one scale per 128 columns (``fp8_gemm(..., group=128)``).
  - ``mode="dequant"``: weight dequantised to x's dtype, plain matmul (differentiable w.r.t. x; ``"reference"``
    is not, and refuses an x that requires grad).
- bf16/fp32 weights: ``F.linear(x, W)`` in x's dtype (the reference's default Linear); the caller
  casts x first where the release computes in fp32 (router, compressor of ratio 2, heads).
- ``mode="qat"``: training fake-quant. Where the caller passes ``fake="fp8"`` (the layers the release
  stores in fp8: ``qat_format(cfg, "dense")``) or ``fake="fp4"`` (routed experts), float master weights
  go through that storage format's QDQ and activations through fp8 1x32 QDQ, with straight-through
  gradients; ``fake=None`` (bf16 layers of the release: compressor, indexer keys, router...) is a
  plain matmul.
"""
from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

from functional_dsv41 import kernels, quant
from functional_dsv41.invariant import linear_rows

MODES = ("reference", "dequant", "qat")


def qat_format(cfg, kind: str = "dense") -> str | None:
    """The fake-quant format of a layer kind under ``mode="qat"``: how the config stores it."""
    fmt = cfg.dtype if kind == "dense" else cfg.experts_dtype
    return fmt if fmt in ("fp8", "fp4") else None


def ste(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Value of ``y``, gradient of identity w.r.t. ``x`` (straight-through). Bit-exact: x - x == 0."""
    return y.detach() + (x - x.detach())


def is_quantized(w: torch.Tensor) -> bool:
    return w.dtype in (quant.FP8, quant.FP4X2)


def _block_scales(w: torch.Tensor, width: int) -> tuple[int, int]:
    """The scale shape of a 2-D fp8 weight [N, K] in 32 x ``width`` blocks."""
    return -(-w.shape[0] // 32), -(-w.shape[1] // width)


def fp8_scale_group(w: torch.Tensor, scale: torch.Tensor) -> int:
    """The K width of an fp8 weight's scales: 32 (the release's 32 x 32 blocks, [ceil(N/32), ceil(K/32)]) or 128
    (``align_fp8_weights``'s 32 x 128 blocks, [ceil(N/32), K/128]); any other scale shape is refused."""
    if w.dim() != 2:
        raise ValueError(f"fp8 weight: must be 2-D [N, K], got {list(w.shape)}")
    b32, b128 = _block_scales(w, 32), _block_scales(w, 128)
    if tuple(scale.shape) == b32:
        return 32
    if w.shape[1] % 128 == 0 and tuple(scale.shape) == b128:
        return 128
    also = f" or {list(b128)} (align_fp8_weights's 32 x 128)" if w.shape[1] % 128 == 0 else ""
    raise ValueError(f"fp8 weight {list(w.shape)}: its scale must be {list(b32)} (32 x 32 blocks){also}, got "
                     f"{list(scale.shape)}")


def align_fp8_weights(params, group: int = 128):
    """The tree with every fp8 weight whose K is a multiple of ``group`` re-expressed at one scale per 32 x 128
    block (``quant.align_fp8_groups``; its scale [ceil(N/32), K/128]); fp4 experts, float weights and weights
    already aligned are kept as they are (shared, not copied). Under ``mode="reference"`` ``linear`` then
    quantises their activations the same way and runs ``fp8_gemm(..., group=128)``: on Hopper under TileLang a
    quarter of the fp32 promotions of SPEC §10.3's order (BENCHMARKS.md, runs 164-165: 1062 against 653 TFLOP/s
    at 4096 x 5120 x 5120), not its summation order (cosine diff ~2e-7 of the output there); the torch path
    expands the scales and differs from the unaligned model only by the alignment's rounding of values far below
    their group's largest. A load-time transform for inference: the checkpoint format (``save_params``) stays the
    release's 32 x 32 blocks."""
    if group != 128:
        raise ValueError(f"align_fp8_weights: group must be 128 (the fp8 GEMM's), got {group!r}")

    def walk(node):
        if isinstance(node, dict):
            w, s = node.get("weight"), node.get("scale")
            if (isinstance(w, torch.Tensor) and w.dtype == quant.FP8 and w.dim() == 2 and isinstance(s, torch.Tensor)
                    and w.shape[1] % group == 0 and tuple(s.shape) == _block_scales(w, 32)):
                # (a 32 x 32-block weight; Engram's fp8 rows [R, D/32] are looked up, not multiplied: kept)
                q, sg = quant.align_fp8_groups(w, s, group)
                return {**node, "weight": q, "scale": sg}
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v) for v in node)
        return node
    return walk(params)


def dequantize(p: dict, dtype=torch.bfloat16) -> torch.Tensor:
    """The weight of subtree ``p`` as a plain ``dtype`` matrix."""
    w = p["weight"]
    if w.dtype == quant.FP8:
        s = p["scale"]
        if fp8_scale_group(w, s) != 32:
            s = quant.expand_group_scales(s, 128)
        return quant.dequant_fp8_block(w, s, dtype)
    if w.dtype == quant.FP4X2:
        return quant.dequant_fp4(w, p["scale"], dtype)
    return w.to(dtype)


def fake_quant_weight(w: torch.Tensor, fmt: str = "fp8") -> torch.Tensor:
    """QDQ of a float master weight in the release's storage format, straight-through gradient."""
    with torch.no_grad():
        if fmt == "fp8":
            q = quant.dequant_fp8_block(*quant.quant_fp8_block(w, check=False), w.dtype)
        elif fmt == "fp4":
            q = quant.dequant_fp4(*quant.quant_fp4(w, check=False), w.dtype)
        else:
            raise ValueError(f"fake_quant_weight: fmt must be fp8 or fp4, got {fmt!r}")
    return ste(w, q)


def fake_quant_act(x: torch.Tensor) -> torch.Tensor:
    """fp8 1x32 QDQ of activations (ue8m0 scales), straight-through gradient."""
    with torch.no_grad():
        q = quant.act_quant_dequant(x.detach().to(torch.bfloat16)).to(x.dtype)
    return ste(x, q)


def fp8_qdq(x: torch.Tensor, enabled: bool = True) -> torch.Tensor:
    """1x32 fp8 QDQ with ue8m0 scales (``act_quant(..., inplace=True)``; SPEC §3: the KV), straight-through
    gradient."""
    if not enabled:
        return x
    with torch.no_grad():
        y = quant.act_quant_dequant(x.detach())
    return ste(x, y)


def fp4_qdq(x: torch.Tensor, block: int, scale_dtype, enabled: bool = True) -> torch.Tensor:
    """E2M1 QDQ with ``block``-element groups and ``scale_dtype`` scales (SPEC §3, §5: the compressed KV, the
    indexer q / k), straight-through gradient (the release quantises these in place)."""
    if not enabled:
        return x
    with torch.no_grad():
        y = quant.fp4_act_quant_dequant(x.detach(), block, scale_dtype)
    return ste(x, y)


def linear(x: torch.Tensor, p: dict, *, mode: str = "reference", fake: str | None = None,
           impl: str | None = None) -> torch.Tensor:
    """y = x W^T (+ b). x [..., K] -> [..., N]. See the module docstring for the modes."""
    w = p["weight"]
    b = p.get("bias")
    if mode not in MODES:
        raise ValueError(f"linear: mode must be one of {MODES}, got {mode!r}")
    if is_quantized(w):
        if mode == "reference":
            if (x.requires_grad and torch.is_grad_enabled()) or fwAD.unpack_dual(x).tangent is not None:
                # the fp8 activation cast is recorded by autograd and its backward fails deep in torch
                # ('"add_stub" not implemented for Float8_e4m3fn'); forward AD (jvp) rounds the tangent to fp8
                # with the activation and returns a meaningless derivative: say what to do instead
                raise ValueError("linear: mode='reference' (fp8 activations, block-scaled GEMM) has no gradient "
                                 "with respect to its input; differentiate with mode='dequant' (or 'qat': "
                                 "forward(..., mode='dequant'))")
            if w.dtype == quant.FP8 and fp8_scale_group(w, p["scale"]) == 128:     # align_fp8_weights's layout
                if x.shape[-1] != w.shape[1]:
                    raise ValueError(f"linear: x [..., {x.shape[-1]}] does not match the fp8 weight "
                                     f"{list(w.shape)} (K = {w.shape[1]})")
                xq, xs = kernels.act_quant(x.to(torch.bfloat16), 32, "ue8m0", quant.E8M0, 128, impl=impl)
                y = kernels.fp8_gemm(xq, xs, w, p["scale"], quant.E8M0, 32, group=128, impl=impl)
            else:
                xq, xs = kernels.act_quant(x.to(torch.bfloat16), 32, "ue8m0", quant.E8M0, impl=impl)
                gemm = kernels.fp8_gemm if w.dtype == quant.FP8 else kernels.fp4_gemm
                y = gemm(xq, xs, w, p["scale"], quant.E8M0, 32, impl=impl)
        else:  # dequant (qat on already-quantized storage is the same thing)
            y = F.linear(x, dequantize(p, x.dtype))
    else:
        if mode == "qat" and fake is not None and w.is_floating_point():
            y = F.linear(fake_quant_act(x), fake_quant_weight(w, fake).to(x.dtype))
        else:
            y = linear_rows(x, w.to(x.dtype))
    if b is not None:
        y = y + b.to(y.dtype)
    return y
