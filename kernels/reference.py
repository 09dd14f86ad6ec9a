"""Pure-torch implementations of the release's six kernels (SPEC §10): the executable spec.

They run everywhere (CPU CI included), are differentiable with ``torch.autograd`` and ``torch.func``
(the quantizers are not: rounding has no gradient; model code wraps them in straight-through
estimators), and the TileLang implementations are tested against them.

Shape legend: B batch, M queries, H heads, D head dim, T index slots, N kv rows / output cols, K reduce.
"""
from __future__ import annotations

import numbers

import torch

from functional_dsv41 import invariant, quant

from .reference_indexer import index_candidates, index_scores, index_topk  # noqa: F401  (indexer ops, SPEC §5)

act_quant = quant.act_quant
fp4_act_quant = quant.fp4_act_quant


def _scales_to_float(s: torch.Tensor) -> torch.Tensor:
    return quant.e8m0_to_float(s) if s.dtype == quant.E8M0 else s.float()


def _block_scaled_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor, block: int,
                       out_dtype) -> torch.Tensor:
    """sum over K blocks, in K order, of (A_kb @ B_kb^T) * a_s[:, kb] * b_s[:, kb], fp32 (the kernels' order).

    a [..., K] fp32 values, a_s [..., K/block] fp32, b [N, K] fp32 values, b_s [N, K/block] fp32.
    Each block product is exact in fp32 (fp8 x fp8 / fp4 x fp8 products), so only the sum order inside a
    block can differ from a tensor core.
    """
    K = a.shape[-1]
    lead = a.shape[:-1]
    nk = K // block
    a2, as2 = a.reshape(-1, K), a_s.reshape(-1, nk)
    M = a2.shape[0]
    pad = (-M) % 8   # same BLAS kernel whatever the row count (see invariant.linear_rows)
    if pad:
        a2 = torch.cat([a2, a2.new_zeros(pad, K)])
        as2 = torch.cat([as2, as2.new_ones(pad, nk)])
    a3 = a2.reshape(-1, nk, block).transpose(0, 1)                   # [nk, M, block]
    b3 = b.reshape(b.shape[0], nk, block).transpose(0, 1)            # [nk, N, block]
    partial = torch.bmm(a3, b3.transpose(1, 2))                      # [nk, M, N], one product per K block
    partial = partial * as2.T[:, :, None] * b_s.T[:, None, :]
    acc = partial[0]
    for kb in range(1, nk):                                          # sequential fp32 adds in K order
        acc = acc + partial[kb]
    return acc[:M].to(out_dtype).reshape(*lead, b.shape[0])


def _shape_error(op: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"{op}: " + "; ".join(problems))


def _check_int(name: str, v, multiple_of: int = 1, note: str = "") -> str | None:
    """A positive int ``v`` (a multiple of ``multiple_of``), else the problem."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v <= 0 or v % multiple_of:
        what = "a positive int" if multiple_of == 1 else f"a positive multiple of {multiple_of}"
        return f"{name} must be {what}{note}, got {v!r}"
    return None


def _check_gemm_dtypes(p: list, a, a_s, b, b_s, b_dtypes: tuple, b_what: str) -> None:
    """The block-scaled GEMMs' operand dtypes: a e4m3, b ``b_dtypes``, scales e8m0 or fp32 VALUES. uint8 scales
    are refused rather than read: the TileLang path's scale expansion (``_gemm.scales_f32``) takes every non-e8m0
    scale as values, so e8m0 bytes must come as e8m0 (``.view(torch.float8_e8m0fnu)``) to mean the same to both.
    ``b`` / ``b_s``: a tensor, or the grouped GEMM's list of them (every one is checked)."""
    def bad(ts, ok):            # the dtypes of ts (a tensor or a list) outside ok, as text; None if none
        got = sorted(map(str, {t.dtype for t in ([ts] if isinstance(ts, torch.Tensor) else ts)} - set(ok)))
        return None if not got else (got[0] if len(got) == 1 else str(got))

    if a.dtype != quant.FP8:
        p.append(f"a must be e4m3 (float8_e4m3fn) activations, got {a.dtype}")
    if (got := bad(b, b_dtypes)) is not None:
        p.append(f"b must be {b_what}, got {got}")
    for name, sc in (("a_s", a_s), ("b_s", b_s)):
        if (got := bad(sc, (quant.E8M0, torch.float32))) is not None:
            hint = f" (e8m0 exponent bytes: pass {name}.view(torch.float8_e8m0fnu))" if "uint8" in got else ""
            p.append(f"{name} must be e8m0 (float8_e8m0fnu) or float32 scales, got {got}{hint}")


def check_fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                   block_size: int = 32, group: int | None = None) -> None:
    """fp8_gemm's operands (every implementation checks them before it runs): a e4m3 [..., K], a_s [...,
    K/group], b e4m3 [N, K], b_s [ceil(N/bs), K/group] (group: the scales' K width, by default block_size),
    scales e8m0 or fp32, K >= 1. A scale of another shape would broadcast into a wrong product."""
    p = []
    bad_bs = _check_int("block_size", block_size)
    if not bad_bs and group is not None and group != block_size:
        if group != 128:
            bad_bs = f"group must be 32 (SPEC §10.3's blocks) or 128 (quant.align_fp8_groups's), got {group!r}"
        elif block_size != 32:
            bad_bs = f"group=128 re-expresses 32-wide blocks: block_size must be 32, got {block_size}"
    if bad_bs or a.dim() == 0:
        _shape_error("fp8_gemm", [bad_bs or "a must be [..., K], got a 0-d tensor"])
    gk = group or block_size                        # the scales' K width
    _check_gemm_dtypes(p, a, a_s, b, b_s, (quant.FP8,), "e4m3 (float8_e4m3fn) [N, K]")
    K, N = a.shape[-1], b.shape[0] if b.dim() else 0
    if b.dim() != 2 or b.shape[-1] != K:
        p.append(f"b must be [N, K={K}] like a's last dim, got {list(b.shape)}")
    elif K == 0:
        p.append(f"K=0: a [..., K] and b [N, K] need K >= 1 (a multiple of block_size {block_size})")
    elif K % gk:
        p.append(f"K={K} is not a multiple of the {'block size' if gk == block_size else 'group'} {gk}")
    elif tuple(a_s.shape) != (*a.shape[:-1], K // gk):
        p.append(f"a_s must be {[*a.shape[:-1], K // gk]} (one scale per {gk} of a's K), got {list(a_s.shape)}")
    elif tuple(b_s.shape) != (-(-N // block_size), K // gk):
        p.append(f"b_s must be [{-(-N // block_size)}, {K // gk}] (one scale per {block_size} x {gk} block of b "
                 f"[{N}, {K}]), got {list(b_s.shape)}")
    _shape_error("fp8_gemm", p)


def check_fp4_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                   act_block_size: int = 32) -> None:
    """fp4_gemm's operands: a e4m3 [..., K], a_s [..., K/act_block_size], b packed e2m1 [N, K/2]
    (float4_e2m1fn_x2, or its uint8 bytes), b_s [N, K/32], scales e8m0 or fp32, K >= 1, act_block_size a
    multiple of 32 (SPEC §10.4: 32 or 128)."""
    p = []
    bad_bs = _check_int("act_block_size", act_block_size, 32, " (SPEC §10.4: 32 or 128)")
    if bad_bs or a.dim() == 0:
        _shape_error("fp4_gemm", [bad_bs or "a must be [..., K], got a 0-d tensor"])
    _check_gemm_dtypes(p, a, a_s, b, b_s, (quant.FP4X2, torch.uint8),
                       "packed e2m1 (float4_e2m1fn_x2, or its uint8 bytes) [N, K/2]")
    K = a.shape[-1]
    if b.dim() != 2 or 2 * b.shape[-1] != K:
        p.append(f"b must be packed e2m1 [N, K/2={K // 2}] for a's K={K}, got {list(b.shape)}")
    elif K == 0:
        p.append(f"K=0: a [..., K] and b [N, K/2] need K >= 1 (a multiple of 32 and of act_block_size "
                 f"{act_block_size})")
    elif K % 32 or K % act_block_size:
        p.append(f"K={K} is not a multiple of 32 and of act_block_size {act_block_size}")
    elif tuple(a_s.shape) != (*a.shape[:-1], K // act_block_size):
        p.append(f"a_s must be {[*a.shape[:-1], K // act_block_size]}, got {list(a_s.shape)}")
    elif tuple(b_s.shape) != (b.shape[0], K // 32):
        p.append(f"b_s must be [{b.shape[0]}, {K // 32}] (one scale per 32 of each row of b), got {list(b_s.shape)}")
    _shape_error("fp4_gemm", p)


def fp8_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
             scale_dtype=quant.E8M0, block_size: int = 32, out_dtype=torch.bfloat16,
             group: int | None = None) -> torch.Tensor:
    """C = A @ B^T with block scales (SPEC §10.3).

    a e4m3 [..., K] with a_s [..., K/bs]; b e4m3 [N, K] with b_s [ceil(N/bs), K/bs]; scales e8m0 or fp32 values
    (uint8 e8m0 bytes are refused: view them as e8m0). fp32 accumulation of the scaled K-block partial products,
    in K order. Operands of another dtype or shape: ValueError (``check_fp8_gemm``).
    ``group`` (default: block_size): the scales' K width. ``group=128`` (block_size 32): one scale per 128
    columns, a_s [..., K/128] and b_s [ceil(N/32), K/128], the operands ``quant.align_fp8_groups`` writes; here
    expanded to the 32-wide blocks and summed as above (the TileLang kernel sums each group's 128 products in the
    tensor core first, in its narrower fixed-point accumulator: within 2^-7 of |A| |B|^T, test_gpu_gemm.py).
    """
    check_fp8_gemm(a, a_s, b, b_s, block_size, group)
    if group is not None and group != block_size:
        a_s, b_s = quant.expand_group_scales(a_s, group), quant.expand_group_scales(b_s, group)
    N = b.shape[0]
    bs = _scales_to_float(b_s).repeat_interleave(block_size, 0)[:N]
    return _block_scaled_gemm(a.float(), _scales_to_float(a_s), b.float(), bs, block_size, out_dtype)


def fp4_gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
             scale_dtype=quant.E8M0, act_block_size: int = 32, out_dtype=torch.bfloat16) -> torch.Tensor:
    """C = A @ fp4(B)^T (SPEC §10.4): a e4m3 [..., K] with per-act_block_size scales (a multiple of 32); b packed
    e2m1 [N, K/2] (float4_e2m1fn_x2 or uint8 bytes) with e8m0 [N, K/32]; scales e8m0 or fp32 values. Operands of
    another dtype or shape: ValueError (``check_fp4_gemm``)."""
    check_fp4_gemm(a, a_s, b, b_s, act_block_size)
    w = quant.fp4_unpack_decode(b)
    a_s32 = _scales_to_float(a_s).repeat_interleave(act_block_size // 32, -1)
    return _block_scaled_gemm(a.float(), a_s32, w, _scales_to_float(b_s), 32, out_dtype)


def check_groups(a: torch.Tensor, a_s: torch.Tensor, b, b_s, counts, what: str) -> list[int]:
    """Validate a grouped GEMM's groups: ``counts`` [G] non-negative ints summing to a's rows, ``b`` / ``b_s``
    G weights (a list, or a tensor stacked on dim 0); the operands' dtypes. Returns counts as ints."""
    counts = [int(n) for n in counts]
    G = len(b)
    if len(b_s) != G or len(counts) != G:
        raise ValueError(f"{what}: {G} weights, {len(b_s)} scales and {len(counts)} counts; they must agree")
    p = []
    _check_gemm_dtypes(p, a, a_s, b, b_s, (quant.FP4X2, torch.uint8),
                       "packed e2m1 (float4_e2m1fn_x2, or its uint8 bytes) [N, K/2]")
    _shape_error(what, p)
    if any(n < 0 for n in counts) or sum(counts) != a.shape[0]:
        raise ValueError(f"{what}: counts must be >= 0 and sum to a's {a.shape[0]} rows, got sum {sum(counts)}")
    return counts


def fp4_gemm_grouped(a: torch.Tensor, a_s: torch.Tensor, b, b_s, counts, scale_dtype=quant.E8M0,
                     act_block_size: int = 32, out_dtype=torch.bfloat16) -> torch.Tensor:
    """The routed experts' GEMM over expert-sorted rows: a e4m3 [S, K] (+ a_s [S, K/act_block_size]) holds G
    consecutive groups of ``counts[g]`` rows, and group g is multiplied by weight g, ``fp4_gemm(a_g, a_s_g,
    b[g], b_s[g])``; ``b`` / ``b_s``: G packed e2m1 [N, K/2] weights and their e8m0 [N, K/32] scales, as lists
    or stacked [G, N, K/2] / [G, N, K/32]. Returns [S, N]; each row exactly as the per-group ``fp4_gemm``."""
    counts = check_groups(a, a_s, b, b_s, counts, "fp4_gemm_grouped")
    outs, start = [], 0
    for g, n in enumerate(counts):
        if n:
            outs.append(fp4_gemm(a[start:start + n], a_s[start:start + n], b[g], b_s[g], scale_dtype,
                                 act_block_size, out_dtype))
            start += n
    if not outs:
        return torch.empty(0, b[0].shape[0], dtype=out_dtype, device=a.device)
    return torch.cat(outs)


def check_sparse_attn(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, topk_idxs: torch.Tensor) -> None:
    """sparse_attn's operand shapes and index dtype (every implementation checks them before it runs)."""
    p = []
    if q.dim() != 4 or kv.dim() != 3 or topk_idxs.dim() != 3:
        p.append(f"q must be [B, M, H, D], kv [B, N, D], topk_idxs [B, M, T]; got {list(q.shape)}, "
                 f"{list(kv.shape)}, {list(topk_idxs.shape)}")
    else:
        B, M, H, D = q.shape
        if kv.shape[0] != B or kv.shape[2] != D:
            p.append(f"kv must be [B={B}, N, D={D}] for q {list(q.shape)}, got {list(kv.shape)}")
        if tuple(topk_idxs.shape[:2]) != (B, M):
            p.append(f"topk_idxs must be [B={B}, M={M}, T] for q {list(q.shape)}, got {list(topk_idxs.shape)}")
        if tuple(attn_sink.shape) != (H,):
            p.append(f"attn_sink must be [H={H}], got {list(attn_sink.shape)}")
    if topk_idxs.dtype.is_floating_point or topk_idxs.dtype.is_complex or topk_idxs.dtype == torch.bool:
        p.append(f"topk_idxs must be an integer tensor, got {topk_idxs.dtype}")
    _shape_error("sparse_attn", p)


def _out_of_range(topk_idxs: torch.Tensor, N: int) -> str:
    """sparse_attn's error for an index >= N (only built once the gather failed: it reads the indices)."""
    try:
        v = int(topk_idxs[topk_idxs >= N].max())
    except Exception:                                                   # e.g. under vmap: name no value
        v = None
    got = f"holds {v}" if v is not None else "holds an index"
    return (f"sparse_attn: topk_idxs {got} >= N={N} (the kv rows); indices must be in [0, N), or negative for "
            f"a hole")


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, topk_idxs: torch.Tensor,
                softmax_scale: float, block: int = 64) -> torch.Tensor:
    """Single shared KV head attention over index lists (SPEC §10.5).

    q [B, M, H, D] bf16, kv [B, N, D] bf16 (K = V), attn_sink [H] fp32, topk_idxs [B, M, T] int
    (-1 = none; every negative index is a hole, as in the kernels, whose bounds check skips it). Indices must be
    in [0, N) or negative: one >= N is an error on CPU tensors (ValueError naming it; not checked beforehand, as
    that would read the indices back) and undefined on CUDA (a device-side assert here, a zero row in TileLang).
    N = 0 is allowed when every index is a hole (the output is then 0, as for any all-hole row). Online softmax
    over index blocks of ``block`` exactly as the release kernel runs it: running max starts at -1e30 (an
    all-invalid row returns 0, and its sink gets a zero gradient), probabilities are cast to bf16 before
    P @ V, the sink adds ``exp(sink - m)`` to the denominator only. Returns o [B, M, H, D] bf16.
    (fp32 q/kv - the unquantised fp32 model used for gradient checks - keep fp32 probabilities and output;
    the arithmetic is fp32 whatever the input dtype.)
    """
    check_sparse_attn(q, kv, attn_sink, topk_idxs)
    B, M, H, D = q.shape
    T = topk_idxs.shape[-1]
    qf = q.float()
    m = torch.full((B, M, H), -1e30, dtype=torch.float32, device=q.device)
    l = torch.zeros((B, M, H), dtype=torch.float32, device=q.device)
    acc = torch.zeros((B, M, H, D), dtype=torch.float32, device=q.device)
    N = kv.shape[1]
    if N == 0 and T and not topk_idxs.is_cuda and bool((topk_idxs >= 0).any()):   # CPU, no kv rows: any index is out
        raise ValueError(_out_of_range(topk_idxs, N))
    bidx = torch.arange(B, device=q.device)[:, None, None]
    for t0 in range(0, T, block):
        idx = topk_idxs[..., t0:t0 + block].long()                      # [B, M, t]
        valid = idx >= 0
        if N == 0:                                                      # every slot a hole: nothing to gather
            kv_t = kv.new_zeros(*idx.shape, D)
        else:
            try:
                kv_t = kv[bidx, idx.clamp_min(0)]                       # [B, M, t, D] bf16
            except IndexError as e:                                     # CPU: an index >= N (CUDA asserts)
                raise ValueError(_out_of_range(topk_idxs, N)) from e
        s = torch.einsum("bmhd,bmtd->bmht", qf, kv_t.float()) * softmax_scale
        s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("bmht,bmtd->bmhd", p.to(q.dtype).float(), kv_t.float())
        m = m_new
    # an all-hole row keeps m = -1e30: the release's exp(sink - m) is then inf and o = 0 / inf = 0. The same 0
    # with a finite denominator (1), so that the backward does not form 0 * inf = NaN for the sink's gradient
    seen = m > -1e30
    sink = torch.where(seen, torch.exp(torch.where(seen, attn_sink.float() - m, 0.0)), 1.0)
    l = l + sink
    return (acc / l[..., None]).to(q.dtype)


def check_hc_split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, hc_mult: int) -> None:
    """hc_split_sinkhorn's operand shapes: mixes [..., (2+hc)*hc], hc_scale [3], hc_base [(2+hc)*hc]."""
    bad = _check_int("hc_mult", hc_mult)
    if bad:
        _shape_error("hc_split_sinkhorn", [bad])
    n = (2 + hc_mult) * hc_mult
    p = []
    if mixes.dim() == 0 or mixes.shape[-1] != n:
        p.append(f"mixes must be [..., (2 + hc_mult) * hc_mult = {n}] for hc_mult={hc_mult}, got {list(mixes.shape)}")
    if tuple(hc_scale.shape) != (3,):
        p.append(f"hc_scale must be [3] (the pre, post and comb scales), got {list(hc_scale.shape)}")
    if tuple(hc_base.shape) != (n,):
        p.append(f"hc_base must be [(2 + hc_mult) * hc_mult = {n}] for hc_mult={hc_mult}, got {list(hc_base.shape)}")
    _shape_error("hc_split_sinkhorn", p)


def hc_split_sinkhorn(mixes: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor,
                      hc_mult: int = 4, sinkhorn_iters: int = 20, eps: float = 1e-6):
    """Split the (2+hc)*hc mixes into pre [.., hc], post [.., hc], comb [.., hc, hc] (SPEC §2, §10.6). fp32 (the
    arithmetic and the outputs, whatever the inputs' dtype: fp64 inputs do not make it an fp64 op).

    comb = softmax over the last dim + eps, column-normalise, then (iters-1) x (row, column) normalise.
    mixes [..., (2+hc)*hc], hc_scale [3] (pre, post, comb), hc_base [(2+hc)*hc]; others: ValueError, as is
    ``sinkhorn_iters`` < 1 (SPEC §2's loop runs at least the first column normalisation: 0 would mean 1).
    """
    check_hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult)
    if isinstance(sinkhorn_iters, bool) or not isinstance(sinkhorn_iters, numbers.Integral) or sinkhorn_iters < 1:
        raise ValueError(f"hc_split_sinkhorn: sinkhorn_iters must be an int >= 1 (the config's hc_sinkhorn_iters, "
                         f"20 in the release), got {sinkhorn_iters!r}")
    hc = hc_mult
    mixes, hc_scale, hc_base = mixes.float(), hc_scale.float(), hc_base.float()   # fp32 arithmetic, whatever comes in
    pre = invariant.sigmoid(mixes[..., :hc] * hc_scale[0] + hc_base[:hc]) + eps
    post = 2 * invariant.sigmoid(mixes[..., hc:2 * hc] * hc_scale[1] + hc_base[hc:2 * hc])
    c = (mixes[..., 2 * hc:] * hc_scale[2] + hc_base[2 * hc:]).unflatten(-1, (hc, hc))

    # softmax spelled out as the kernel computes it (max-shifted exp, then one division), + eps
    c = torch.exp(c - c.amax(dim=-1, keepdim=True))
    c = c / invariant.ordered_sum(c, -1, keepdim=True) + eps
    c = c / (invariant.ordered_sum(c, -2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        c = c / (invariant.ordered_sum(c, -1, keepdim=True) + eps)
        c = c / (invariant.ordered_sum(c, -2, keepdim=True) + eps)
    return pre, post, c


# ----------------------------------------------------------------------------- mHC applications (SPEC §2)
def check_hc_pre(h: torch.Tensor, pre: torch.Tensor) -> None:
    """hc_pre's operand shapes: h [..., hc, dim], pre [..., hc] (the same leading dims)."""
    if h.dim() < 2 or tuple(pre.shape) != tuple(h.shape[:-1]):
        _shape_error("hc_pre", [f"h must be [..., hc, dim] and pre [..., hc] with h's leading dims, got h "
                                f"{list(h.shape)} and pre {list(pre.shape)}"])


def check_hc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> None:
    """hc_post's operand shapes: y [..., dim], res [..., hc, dim], post [..., hc], comb [..., hc, hc]."""
    p = []
    if res.dim() < 2:
        p.append(f"res must be [..., hc, dim], got {list(res.shape)}")
    else:
        lead, hc, dim = tuple(res.shape[:-2]), res.shape[-2], res.shape[-1]
        if tuple(y.shape) != lead + (dim,):
            p.append(f"y must be {list(lead + (dim,))} (res's leading dims and dim), got {list(y.shape)}")
        if tuple(post.shape) != lead + (hc,):
            p.append(f"post must be {list(lead + (hc,))}, got {list(post.shape)}")
        if tuple(comb.shape) != lead + (hc, hc):
            p.append(f"comb must be {list(lead + (hc, hc))}, got {list(comb.shape)}")
    _shape_error("hc_post", p)


def hc_pre(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse the streams: x = sum_j pre_j * h_j in fp32 (the products rounded, summed in index order) -> h's
    dtype. h [..., hc, dim], pre [..., hc] -> [..., dim]."""
    check_hc_pre(h, pre)
    return invariant.ordered_sum(pre.unsqueeze(-1) * h.float(), -2).to(h.dtype)


def hc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand: out_k = post_k * y + sum_j comb[j, k] * res_j (fp32, products rounded, the sum over j in index order)
    -> y's dtype. y [..., dim] the sublayer output, res [..., hc, dim] its input streams, post [..., hc],
    comb [..., hc, hc] -> [..., hc, dim]."""
    check_hc_post(y, res, post, comb)
    mixed = invariant.ordered_sum(comb.unsqueeze(-1) * res.float().unsqueeze(-2), -3)
    return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(y.dtype)


def hc_pre_bwd(h: torch.Tensor, pre: torch.Tensor, dx: torch.Tensor):
    """(dh, dpre) of ``hc_pre`` given dx [..., dim]: what autograd computes through it (dh = pre_j dx in h's dtype,
    dpre_j = sum_d dx h_j in fp32), for the fused kernels' autograd."""
    g = dx.float()
    dh = (pre.unsqueeze(-1) * g.unsqueeze(-2)).to(h.dtype)
    dpre = torch.matmul(h.float(), g.unsqueeze(-1)).squeeze(-1).to(pre.dtype)
    return dh, dpre


def hc_post_bwd(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, dout: torch.Tensor):
    """(dy, dres, dpost, dcomb) of ``hc_post`` given dout [..., hc, dim], by batched matmuls over the hc axis and
    dim (no [..., hc, hc, dim] temporary): dy = sum_k post_k dout_k, dres_j = sum_k comb[j, k] dout_k,
    dpost_k = sum_d dout_k y, dcomb[j, k] = sum_d res_j dout_k."""
    g = dout.float()
    dy = torch.matmul(post.unsqueeze(-2), g).squeeze(-2).to(y.dtype)
    dres = torch.matmul(comb, g).to(res.dtype)
    dpost = torch.matmul(g, y.float().unsqueeze(-1)).squeeze(-1).to(post.dtype)
    dcomb = torch.matmul(res.float(), g.transpose(-1, -2)).to(comb.dtype)
    return dy, dres, dpost, dcomb
