"""Storage formats of the release and the activation QDQ of its kernels (SPEC §9, §10.1-10.2).

Formats (all scales are e8m0 = a pure power of two 2^(e-127), unless noted):

- fp8 dense weight: ``q`` e4m3 ``[N, K]`` + ``scale`` e8m0 ``[ceil(N/32), ceil(K/32)]`` (32x32 blocks),
  ``W = q * 2^(E-127)``, with ``scale = 2^ceil(log2(amax/448))`` per block.
- fp4 routed expert: ``q`` float4_e2m1fn_x2 ``[N, K/2]`` (element 2j in the LOW nibble of byte j, element
  2j+1 in the high nibble) + ``scale`` e8m0 ``[N, K/32]`` (1x32 blocks), ``scale = 2^ceil(log2(amax/6))``.
- fp8 rows (Engram tables): e4m3 ``[R, D]`` + e8m0 ``[R, D/32]``: a 1x32 block per row.

Activation QDQ (``act_quant``, ``fp4_act_quant``) reproduces the release's quantizers bit for bit; the
``kernels`` package exposes them behind its implementation switch.

Shape suffixes: N = output rows, K = input columns, B = blocks.
"""
from __future__ import annotations

import numbers

import torch

FP8 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
FP4X2 = torch.float4_e2m1fn_x2
FP8_MAX = 448.0
FP4_MAX = 6.0
BLOCK = 32

# E2M1 code -> value; bit 3 is the sign (SPEC §9).
FP4_TABLE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                          -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)


# ----------------------------------------------------------------------------- e8m0 scales
def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """e8m0 (or its uint8 bytes) -> fp32 2^(e-127). Any other dtype is refused: its values are not exponent bytes.

    Byte 255 decodes to +inf (2^(255-127) = 2^128 overflows fp32), whereas torch's own float8_e8m0fnu cast (OCP MX)
    reads it as NaN. It is no valid scale: the quantizers write it only for a block holding a NaN / inf (see
    ``_pow2_e8m0``), where the dequantised block is then inf / NaN either way. The TileLang kernels decode it the same
    way (+inf), and their GPU tests pin that, so the two agree.
    """
    if s.dtype not in (E8M0, torch.uint8):
        raise TypeError(f"e8m0_to_float: expected e8m0 (float8_e8m0fnu) or uint8 exponent bytes, got {s.dtype}")
    e = s.view(torch.uint8) if s.dtype == E8M0 else s
    e = e.to(torch.int32) - 127
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)


def float_to_e8m0(p: torch.Tensor) -> torch.Tensor:
    """Exact powers of two (fp32) -> e8m0. Refuses anything that is not a power of two in e8m0's range 2^-127
    (byte 0) .. 2^127 (byte 254; byte 255 is NaN): fp32 also holds 2^-149 .. 2^-128 (subnormals), whose byte
    would wrap (2^-130 -> 253 = 2^126). One host sync (the check); ``_pow2_e8m0`` is the unchecked form."""
    p = p.float()
    m, e = torch.frexp(p)  # p = m * 2^e, m in [0.5, 1): p = 2^(e-1), byte e-1+127
    ok = (m == 0.5) & (p > 0) & (e >= -126) & (e <= 128)
    if not bool(ok.all()):
        bad = p[~ok][0].item()
        raise ValueError(f"float_to_e8m0: every scale must be a positive power of two within e8m0's range "
                         f"2^-127 .. 2^127, got {bad!r}")
    return (e - 1 + 127).to(torch.uint8).view(E8M0)


def _pow2_e8m0(s: torch.Tensor) -> torch.Tensor:
    """e8m0 of scales known to be powers of two (``pow2_ceil_scale``'s), without ``float_to_e8m0``'s check, which
    reads the device (a host sync per call). A non-finite scale (a NaN or inf activation in its block) becomes
    byte 255, so the bad value travels on rather than failing as a malformed scale."""
    b = (torch.frexp(s)[1] - 1 + 127).clamp(0, 254)
    return torch.where(torch.isfinite(s), b, 255).to(torch.uint8).view(E8M0)


def pow2_ceil_scale(amax: torch.Tensor, inv_max: float) -> torch.Tensor:
    """2^ceil(log2(amax * inv_max)) computed with the release's exponent-bit trick (fp32, exact).

    ``amax * fp32(inv_max)`` is a multiplication by the rounded reciprocal, as the kernels do; the
    exponent is then rounded up whenever the mantissa is non-zero.
    """
    v = (amax.float() * torch.tensor(inv_max, dtype=torch.float32))
    bits = v.view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp)


def _check_blocks(op: str, x: torch.Tensor, block_size) -> None:
    """x [..., N] with N a multiple of a positive int block_size (a shape check: no host sync)."""
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size <= 0:
        raise ValueError(f"{op}: block_size must be a positive int, got {block_size!r}")
    if x.dim() == 0:
        raise ValueError(f"{op}: x must be [..., N] with N a multiple of block_size {block_size}, got a 0-d tensor")
    if x.shape[-1] % block_size:
        raise ValueError(f"{op}: x's last dim {x.shape[-1]} is not a multiple of block_size {block_size} "
                         f"(x must be [..., N] with N % {block_size} == 0), got {list(x.shape)}")


def _blocks(x: torch.Tensor, block: int, op: str = "quant") -> torch.Tensor:
    _check_blocks(op, x, block)
    return x.unflatten(-1, (x.shape[-1] // block, block))


# ----------------------------------------------------------------------------- fp4 codes
def fp4_encode(v: torch.Tensor) -> torch.Tensor:
    """Round values already scaled into [-6, 6] to E2M1 codes (uint8 0..15), ties to the even code.

    Ties: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (SPEC §10.2).
    """
    a = v.abs()
    code = torch.zeros_like(a, dtype=torch.uint8)
    # thresholds (value, inclusive?) where the code steps up; <= keeps ties on the even code
    for bound, inclusive in ((0.25, True), (0.75, False), (1.25, True), (1.75, False),
                             (2.5, True), (3.5, False), (5.0, True)):
        code += (a > bound) if inclusive else (a >= bound)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def fp4_decode(code: torch.Tensor) -> torch.Tensor:
    return FP4_TABLE.to(code.device)[code.long()]


# byte -> (low nibble value, high nibble value): decodes packed fp4 with one gather
_FP4_PAIRS = torch.stack((FP4_TABLE[torch.arange(256) & 0xF], FP4_TABLE[torch.arange(256) >> 4]), -1)


def fp4_unpack_decode(packed: torch.Tensor) -> torch.Tensor:
    """Packed fp4 bytes [..., K/2] -> fp32 values [..., K] (element 2j from the low nibble)."""
    b = packed.view(torch.uint8)
    return _FP4_PAIRS.to(b.device)[b.long()].flatten(-2)


def pack_fp4(code: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> bytes [..., K/2] uint8: element 2j low nibble, 2j+1 high nibble."""
    c = code.unflatten(-1, (-1, 2))
    return (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., K/2] (uint8 or float4_e2m1fn_x2) -> uint8 codes [..., K]."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- weights
def _check_storage(op: str, q: torch.Tensor, q_dtypes: tuple, scale: torch.Tensor, want: tuple) -> None:
    """A dequantiser's operands: ``q`` of a storage dtype, ``scale`` e8m0 (or uint8 bytes) of exactly the
    shape ``want``. A scale of another layout (1x32 rows for 32x32 blocks, ...) would otherwise broadcast or
    be sliced into silently wrong values, and a float scale would be read as exponent bytes."""
    if q.dtype not in q_dtypes:
        raise TypeError(f"{op}: weight must be {' or '.join(map(str, q_dtypes))}, got {q.dtype}")
    if not isinstance(scale, torch.Tensor) or scale.dtype not in (E8M0, torch.uint8):
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"{op}: scale must be e8m0 (float8_e8m0fnu, or its uint8 bytes), got {got}")
    if tuple(scale.shape) != tuple(want):
        raise ValueError(f"{op}: scale must be {list(want)} for the weight {list(q.shape)}, got {list(scale.shape)}")


def dequant_fp8_block(q: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """fp8 e4m3 [N, K] with e8m0 [ceil(N/32), ceil(K/32)] -> dtype [N, K]."""
    if q.dim() != 2:
        raise ValueError(f"dequant_fp8_block: weight must be 2-D [N, K], got {list(q.shape)}")
    N, K = q.shape
    _check_storage("dequant_fp8_block", q, (FP8,), scale, (-(-N // BLOCK), -(-K // BLOCK)))
    s = e8m0_to_float(scale).repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    return (q.float() * s).to(dtype)


def _check_finite(op: str, w: torch.Tensor) -> None:
    """Weight quantizers: a NaN or inf has no storage encoding (its block's scale would be the e8m0 NaN byte)."""
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"{op}: the weight {list(w.shape)} has {int(bad.sum())} non-finite value(s) (first at "
                         f"{at}: {w[tuple(at)].item()}), which fp8/fp4 storage cannot encode")


def quant_fp8_block(w: torch.Tensor, *, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (e4m3 [N, K], e8m0 [ceil(N/32), ceil(K/32)]) with 2^ceil(log2(amax/448)) scales.

    Zero blocks get the smallest normal-range scale so that they round-trip as zeros. A non-finite value is
    refused (ValueError), as by ``quant_fp4`` and ``quant_fp8_rows``; ``check=False`` skips that test (a host
    sync, and data-dependent control flow that ``vmap`` refuses): QAT's fake quantisation, whose NaN propagates
    to the loss, where the train step's own check names it.
    """
    if check:
        _check_finite("quant_fp8_block", w)
    N, K = w.shape
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    wp = torch.nn.functional.pad(w.float(), (0, kb * BLOCK - K, 0, nb * BLOCK - N))   # zeros; vmap-safe (no
    blk = wp.view(nb, BLOCK, kb, BLOCK)                                                # in-place write)
    amax = blk.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    s = pow2_ceil_scale(amax, 1.0 / FP8_MAX)
    q = (blk / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * BLOCK, kb * BLOCK)[:N, :K].to(FP8)
    return q, (float_to_e8m0(s) if check else _pow2_e8m0(s))


def dequant_fp4(q: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """fp4 [N, K/2] packed with e8m0 [N, K/32] -> dtype [N, K]."""
    if q.dim() < 1 or (2 * q.shape[-1]) % BLOCK:
        raise ValueError(f"dequant_fp4: weight must be packed [..., K/2] with K a multiple of {BLOCK}, "
                         f"got {list(q.shape)}")
    _check_storage("dequant_fp4", q, (FP4X2, torch.uint8), scale, (*q.shape[:-1], 2 * q.shape[-1] // BLOCK))
    vals = fp4_unpack_decode(q)
    s = e8m0_to_float(scale).repeat_interleave(BLOCK, -1)
    return (vals * s).to(dtype)


def quant_fp4(w: torch.Tensor, *, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (float4_e2m1fn_x2 [N, K/2], e8m0 [N, K/32]), scales 2^ceil(log2(amax/6)); ``check`` as
    ``quant_fp8_block``'s."""
    if check:
        _check_finite("quant_fp4", w)
    blk = _blocks(w.float(), BLOCK, "quant_fp4")
    amax = blk.abs().amax(-1).clamp_min(FP4_MAX * 2.0 ** -126)
    s = pow2_ceil_scale(amax, 1.0 / FP4_MAX)
    codes = fp4_encode((blk / s[..., None]).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    return pack_fp4(codes).view(FP4X2), (float_to_e8m0(s) if check else _pow2_e8m0(s))


def dequant_fp8_rows(q: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """fp8 rows [..., D] with e8m0 per-32-column scales [..., D/32] -> dtype [..., D] (Engram rows)."""
    _check_storage("dequant_fp8_rows", q, (FP8,), scale, (*q.shape[:-1], q.shape[-1] // BLOCK))
    s = e8m0_to_float(scale)
    return (_blocks(q.float(), BLOCK, "dequant_fp8_rows") * s[..., None]).flatten(-2).to(dtype)


def quant_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., D] -> (e4m3 [..., D], e8m0 [..., D/32]): 1x32 blocks with power-of-two scales."""
    _check_finite("quant_fp8_rows", w)
    q, s = act_quant(w, BLOCK, scale_fmt="ue8m0", _allow_float=True)
    return q, s


def _check_group(op: str, group) -> None:
    """A scale group width: a positive int multiple of the 32-wide blocks it gathers."""
    if isinstance(group, bool) or not isinstance(group, numbers.Integral) or group <= 0 or group % BLOCK:
        raise ValueError(f"{op}: group must be a positive multiple of {BLOCK}, got {group!r}")


def align_fp8_groups(q: torch.Tensor, scale: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-express 32-wide-block fp8 data at one power-of-two scale per ``group`` columns, the largest of the group's
    block scales: ``q' = e4m3_RNE(q * 2^(e - e_max))`` and ``scale'`` = 2^e_max, one per group (K/group columns,
    the input's dtype). ``expand_group_scales(scale', group)`` gives them back in SPEC §10.3's 32-wide layout.

    What for: the fp8 GEMM with ``group=128`` (``kernels.tilelang.fp8_gemm_ws_tl``) lets the tensor core sum a
    group's four 32-deep slices before one fp32 promotion, which needs one scale per group; SPEC §10.3's operands
    have one per 32 columns. Exactness: ``q' * scale'`` equals ``q * scale`` element for element, except where
    ``|q| * 2^(e - e_max)`` falls below e4m3's smallest normal 2^-6 and has bits below its subnormal step 2^-9
    (then q' is that value rounded to the step: an error of at most 2^-10 * scale', below 2^-18 of the group's
    largest representable magnitude 448 * scale'). A block whose scale equals the group's is copied unchanged.

    q: e4m3 [..., K]; scale: e8m0 (or uint8 bytes) or fp32 powers of two, either per row [..., K/32] (activations,
    ``act_quant``) or per 32 x 32 block [ceil(N/32), K/32] of a 2-D q [N, K] (weights, ``quant_fp8_block``)
    -> (q' e4m3 [..., K], scale' [..., K/group] or [ceil(N/32), K/group]).
    """
    op = "align_fp8_groups"
    if q.dtype != FP8:
        raise TypeError(f"{op}: q must be e4m3 (float8_e4m3fn), got {q.dtype}")
    _check_group(op, group)
    if q.dim() == 0 or q.shape[-1] % group:
        raise ValueError(f"{op}: q's last dim must be a multiple of group={group}, got {list(q.shape)}")
    K = q.shape[-1]
    lead = tuple(scale.shape[:-1])
    if scale.dim() == 0 or scale.shape[-1] != K // BLOCK:
        raise ValueError(f"{op}: scale must have K/32 = {K // BLOCK} columns for q {list(q.shape)}, got "
                         f"{list(scale.shape)}")
    if lead == tuple(q.shape[:-1]):
        rep = 1                                     # one scale per row and 32 columns
    elif q.dim() == 2 and lead == (-(-q.shape[0] // BLOCK),):
        rep = BLOCK                                 # 32 x 32 weight blocks
    else:
        raise ValueError(f"{op}: scale {list(scale.shape)} fits neither per-row blocks [..., K/32] nor 32 x 32 "
                         f"blocks [ceil(N/32), K/32] of q {list(q.shape)}")
    if scale.dtype in (E8M0, torch.uint8):
        e = scale.view(torch.uint8).to(torch.int32) - 127
    elif scale.dtype == torch.float32:
        m, e = torch.frexp(scale)
        if not bool(((m == 0.5) & (scale > 0)).all()):
            raise ValueError(f"{op}: fp32 scales must be positive powers of two (act_quant's scale_fmt='ue8m0'); "
                             f"another scale has no exact ratio to its group's largest")
        e = e - 1
    else:
        raise TypeError(f"{op}: scale must be e8m0, uint8 exponent bytes or fp32, got {scale.dtype}")
    eg = e.unflatten(-1, (K // group, group // BLOCK))
    emax = eg.amax(-1)
    shift = (eg - emax[..., None]).flatten(-2)      # <= 0 per 32-wide block
    if rep > 1:
        shift = shift.repeat_interleave(rep, 0)[:q.shape[0]]
    qa = torch.ldexp(_blocks(q.float(), BLOCK, op), shift[..., None].float()).flatten(-2).to(FP8)
    if scale.dtype == torch.float32:
        return qa, torch.ldexp(torch.ones_like(emax, dtype=torch.float32), emax)
    return qa, (emax + 127).to(torch.uint8).view(scale.dtype)


def expand_group_scales(scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    """One scale per ``group`` columns [..., K/group] (``align_fp8_groups``) -> the same in each of the group's
    32-wide slots [..., K/32]: SPEC §10.3's layout, for any fp8 consumer (the torch reference, dequantisers)."""
    _check_group("expand_group_scales", group)
    if scale.dim() == 0:
        raise ValueError("expand_group_scales: scale must be [..., K/group], got a 0-d tensor")
    b = scale.view(torch.uint8) if scale.dtype == E8M0 else scale
    return b.repeat_interleave(group // BLOCK, -1).view(scale.dtype)


# ----------------------------------------------------------------------------- activations (SPEC §10.1-10.2)
def act_quant(x: torch.Tensor, block_size: int = BLOCK, scale_fmt: str | None = "ue8m0",
              scale_dtype: torch.dtype = E8M0, group: int | None = None, *, _allow_float: bool = False):
    """Per-row 1 x block_size fp8 quantization: returns (q e4m3 [..., N], s [..., N/bs]).

    ``amax = max(|x|, 1e-4)``; ue8m0: ``s = 2^ceil(log2(amax/448))``, else ``s = amax/448``;
    ``q = e4m3(clamp(x/s, -448, 448))``. Input is bf16 in the release (``_allow_float`` lets weight
    export use the same rule on fp32 values).

    The defaults (``scale_fmt="ue8m0"``, ``scale_dtype=e8m0``) are the V4.1 linear's call (SPEC §9), not SPEC
    §10.1's signature defaults (``scale_fmt=None, scale_dtype=fp32``): spell both out for the latter.
    ``scale_fmt=None`` with an e8m0 ``scale_dtype`` is refused (ValueError): amax/448 is no power of two, and the
    stored (rounded) scale would not be the one q was divided by.

    Non-finite input (torch reference): a NaN or +-inf makes its block's scale non-finite (e8m0 byte 255; an fp32
    scale inf); the block's finite elements quantise to 0 and the bad one to NaN, so the dequantised block is all
    NaN; other blocks are unaffected. This is outside the tested contract of the TileLang kernel, which differs: it
    leaves NaN out of the block max, and for an inf writes byte 255 with finite elements as +-448.

    ``group`` (not the release's call): the result re-expressed at one scale per ``group`` columns,
    ``align_fp8_groups(q, s, group)`` (s [..., N/group]): the activation operands of ``fp8_gemm(..., group=128)``.
    There a non-finite block's scale (byte 255) is its whole group's, so the group dequantises to inf / NaN.
    """
    op = "act_quant"
    if x.dtype != torch.bfloat16 and not _allow_float:
        raise TypeError(f"act_quant expects bf16 input, got {x.dtype}")
    _check_blocks(op, x, block_size)
    if scale_fmt is None and scale_dtype == E8M0:
        raise ValueError("act_quant: scale_fmt=None (s = amax/448, not a power of two) cannot be stored in an e8m0 "
                         "scale_dtype (float8_e8m0fnu): pass scale_dtype=torch.float32 with scale_fmt=None (SPEC "
                         "§10.1's defaults), or scale_fmt='ue8m0' for e8m0 scales")
    blk = _blocks(x.float(), block_size, op)
    amax = blk.abs().amax(-1).clamp_min(1e-4)
    if scale_fmt is not None:
        s = pow2_ceil_scale(amax, 1.0 / FP8_MAX)
    else:
        s = amax / FP8_MAX
    q = (blk / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(-2)
    if group is not None and group != block_size:
        if block_size != BLOCK or scale_fmt is None:
            raise ValueError(f"act_quant: group={group} re-expresses 32-wide blocks with power-of-two scales: "
                             f"block_size 32 and scale_fmt='ue8m0' only, got {block_size}, {scale_fmt!r}")
        q, s = align_fp8_groups(q, _pow2_e8m0(s), group)     # exponent bytes: no check, no host sync
        return q, (s if scale_dtype == E8M0 else e8m0_to_float(s).to(scale_dtype))
    return q, (_pow2_e8m0(s) if scale_dtype == E8M0 else s.to(scale_dtype))


def act_quant_dequant(x: torch.Tensor, block_size: int = BLOCK) -> torch.Tensor:
    """The ``inplace=True`` form of act_quant: fp8 QDQ with ue8m0 scales, result in x's dtype."""
    q, s = act_quant(x, block_size, "ue8m0", torch.float32, _allow_float=True)
    return (_blocks(q.float(), block_size, "act_quant_dequant") * s[..., None]).flatten(-2).to(x.dtype)


def _fp4_scale(blk: torch.Tensor, scale_dtype) -> torch.Tensor:
    """fp32 scales [..., B] of 1 x block groups [..., B, block] (SPEC §10.2)."""
    amax = blk.abs().amax(-1)
    if scale_dtype == E8M0:
        return pow2_ceil_scale(amax.clamp_min(FP4_MAX * 2.0 ** -126), 1.0 / FP4_MAX)
    if scale_dtype == FP8:
        return (amax.clamp_min(FP4_MAX * 2.0 ** -9) / FP4_MAX).clamp(max=FP8_MAX).to(FP8).float()
    raise ValueError(f"fp4_act_quant: scale_dtype must be e8m0 or e4m3, got {scale_dtype}")


def _check_fp4_act(op: str, x: torch.Tensor, block_size) -> None:
    _check_blocks(op, x, block_size)
    if x.shape[-1] % 2:
        raise ValueError(f"{op}: x's last dim {x.shape[-1]} must be even (two E2M1 codes a byte), got {list(x.shape)}")


def fp4_act_quant(x: torch.Tensor, block_size: int = BLOCK, scale_dtype: torch.dtype = E8M0):
    """Per-row 1 x block_size E2M1 quantization: returns (packed uint8 [..., N/2], scales [..., N/bs]).

    e8m0 scales (indexer q/k, block 32): ``amax >= 6*2^-126``, ``s = 2^ceil(log2(amax/6))``.
    e4m3 scales (compressed KV, block 16): ``amax >= 6*2^-9``, ``s = e4m3(amax/6)`` (saturating).

    Non-finite input (torch reference): e8m0 scales: a NaN or +-inf makes its block's scale byte 255, all the
    block's codes 0 (+-0) and its dequantised values NaN. e4m3 scales: a NaN makes the scale NaN (block NaN); an
    inf saturates the scale at 448 and the inf element at code +-6, the block's finite elements are quantised
    against that scale (mostly to 0).
    Outside the tested contract of the TileLang kernel, which differs on NaN: it leaves NaN out of the block max.
    """
    op = "fp4_act_quant"
    _check_fp4_act(op, x, block_size)
    blk = _blocks(x.float(), block_size, op)
    s = _fp4_scale(blk, scale_dtype)
    codes = fp4_encode((blk / s[..., None]).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    s_out = _pow2_e8m0(s) if scale_dtype == E8M0 else s.to(FP8)
    return pack_fp4(codes), s_out


def fp4_act_quant_dequant(x: torch.Tensor, block_size: int = BLOCK,
                          scale_dtype: torch.dtype = E8M0) -> torch.Tensor:
    """The ``inplace=True`` form: E2M1 QDQ, result in x's dtype (no host sync: usable under vmap)."""
    blk = _blocks(x.float(), block_size, "fp4_act_quant_dequant")
    s = _fp4_scale(blk, scale_dtype)
    vals = fp4_decode(fp4_encode((blk / s[..., None]).clamp(-FP4_MAX, FP4_MAX))) * s[..., None]
    return vals.flatten(-2).to(x.dtype)
