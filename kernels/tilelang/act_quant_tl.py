"""FP8 activation quantization with 1 x 32 power-of-two (ue8m0) blocks (SPEC §10.1), TileLang.

Bit-exact with ``quant.act_quant(x, 32, "ue8m0", e8m0)``: ``amax = max(|x|, 1e-4)``;
``e = exponent(amax * fp32(1/448)) - 127 + (mantissa != 0)`` (the release's bit trick, on the integer
bits, no log2); ``q = e4m3_RNE(clamp(x * 2^-e, -448, 448))`` (a multiplication by an exact power of
two equals the division); the scale byte is ``e + 127``.
"""
import functools

import torch
import tilelang.language as T

from functional_dsv41 import quant

from ._common import compile_kernel

BF16, F32, FP8 = "bfloat16", "float32", "float8_e4m3fn"


@T.macro
def _ue8m0_exponent(e, amax, i, g):
    """e[i, g] = block (i, g)'s power-of-two exponent from its absolute maximum amax[i, g]: the release's
    ``exponent(max(amax, 1e-4) / 448)`` rounded up, on the fp32 bits (both kernels' one copy; a macro, so
    act_quant_kernel's TIR, and the key of its cached binary, are what they were when it spelled this out)."""
    bits = T.reinterpret(T.max(amax[i, g], T.float32(1e-4)) * T.float32(1.0 / 448.0), "int32")
    e[i, g] = ((bits >> 23) & 255) - 127 + T.if_then_else((bits & 0x7FFFFF) != 0, 1, 0)


@functools.lru_cache(maxsize=None)
def act_quant_kernel(G: int, bs: int = 32, BR: int = 16, GB: int = 16, threads: int = 128):
    """x viewed [R, G, bs] -> q [R, G, bs] e4m3, s [R, G] uint8 (e8m0 bytes)."""
    R = T.dynamic("R")
    GB = min(GB, G)
    while G % GB:
        GB //= 2

    @T.prim_func
    def act_quant(
        X: T.Tensor([R, G, bs], BF16),
        Q: T.Tensor([R, G, bs], FP8),
        S: T.Tensor([R, G], "uint8"),
    ):
        with T.Kernel(T.ceildiv(R, BR), G // GB, threads=threads) as (bx, by):
            x = T.alloc_fragment([BR, GB, bs], F32)
            amax = T.alloc_fragment([BR, GB], F32)
            e = T.alloc_fragment([BR, GB], "int32")
            T.copy(X[bx * BR:(bx + 1) * BR, by * GB:(by + 1) * GB, :], x)
            T.reduce_absmax(x, amax, dim=2)
            for i, g in T.Parallel(BR, GB):
                _ue8m0_exponent(e, amax, i, g)
            for i, g, k in T.Parallel(BR, GB, bs):
                x[i, g, k] = T.clamp(x[i, g, k] * T.reinterpret((127 - e[i, g]) << 23, F32), -448.0, 448.0)
            T.copy(x, Q[bx * BR:(bx + 1) * BR, by * GB:(by + 1) * GB, :])
            for i, g in T.Parallel(BR, GB):
                if bx * BR + i < R:
                    S[bx * BR + i, by * GB + g] = T.Cast("uint8", e[i, g] + 127)

    return compile_kernel(act_quant, out_idx=[1, 2])


@functools.lru_cache(maxsize=None)
def act_quant_grouped_kernel(G: int, group: int = 128, BR: int = 16, GB: int = 4, threads: int = 128):
    """x viewed [R, G * NB, 32] (NB = group / 32 blocks a group) -> q [R, G * NB, 32] e4m3 and s [R, G] (e8m0
    bytes, one per group): ``quant.align_fp8_groups(act_quant(x), group)`` in one pass. Each
    32-wide block is quantised at its own scale 2^e as act_quant does, then re-expressed at the group's largest,
    2^emax: ``q' = e4m3_RNE(e4m3_RNE(x * 2^-e) * 2^(e - emax))`` (the second rounding is exact unless the value
    falls below e4m3's normals)."""
    R = T.dynamic("R")
    if group != 128:
        raise ValueError(f"act_quant_grouped: group=128 only (the fp8 GEMM's), got {group}")
    NB = group // 32
    GB = min(GB, G)
    while G % GB:
        GB //= 2

    @T.prim_func
    def act_quant_grouped(
        X: T.Tensor([R, G * NB, 32], BF16),
        Q: T.Tensor([R, G * NB, 32], FP8),
        S: T.Tensor([R, G], "uint8"),
    ):
        with T.Kernel(T.ceildiv(R, BR), G // GB, threads=threads) as (bx, by):
            x = T.alloc_fragment([BR, GB * NB, 32], F32)
            amax = T.alloc_fragment([BR, GB * NB], F32)
            e_s = T.alloc_shared([BR, GB * NB], "int32")
            emax_s = T.alloc_shared([BR, GB], "int32")
            T.copy(X[bx * BR:(bx + 1) * BR, by * GB * NB:(by + 1) * GB * NB, :], x)
            T.reduce_absmax(x, amax, dim=2)
            for i, b in T.Parallel(BR, GB * NB):
                _ue8m0_exponent(e_s, amax, i, b)
            for i, g in T.Parallel(BR, GB):             # (one expression: no shared read-back in a loop)
                emax_s[i, g] = T.max(T.max(e_s[i, g * NB], e_s[i, g * NB + 1]),
                                     T.max(e_s[i, g * NB + 2], e_s[i, g * NB + 3]))
            for i, b, k in T.Parallel(BR, GB * NB, 32):
                q1 = T.Cast(FP8, T.clamp(x[i, b, k] * T.reinterpret((127 - e_s[i, b]) << 23, F32), -448.0, 448.0))
                x[i, b, k] = T.Cast(F32, q1) * T.reinterpret(     # 2^(e - emax), or 0 below 2^-126 (where every
                    T.max(127 + e_s[i, b] - emax_s[i, b // NB], 0) << 23, F32)   # e4m3 value rounds to 0 anyway)
            T.copy(x, Q[bx * BR:(bx + 1) * BR, by * GB * NB:(by + 1) * GB * NB, :])
            for i, g in T.Parallel(BR, GB):
                if bx * BR + i < R:
                    S[bx * BR + i, by * GB + g] = T.Cast("uint8", emax_s[i, g] + 127)

    return compile_kernel(act_quant_grouped, out_idx=[1, 2])


def act_quant_grouped(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 x [..., K] -> (e4m3 [..., K], e8m0 [..., K/128]) equal to ``quant.align_fp8_groups(quant.act_quant(x,
    32, "ue8m0", e8m0), group)`` bit for bit, in one kernel: the activation operands of ``fp8_gemm(...,
    group=128)``."""
    quant._check_blocks("act_quant_grouped", x, group)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"act_quant_grouped expects bf16 input, got {x.dtype}")
    K = x.shape[-1]
    q, s = act_quant_grouped_kernel(K // group, group)(x.reshape(-1, K // 32, 32).contiguous())
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], K // group).view(quant.E8M0)


def act_quant(x: torch.Tensor, block_size: int = 32, scale_fmt: str | None = "ue8m0",
              scale_dtype: torch.dtype = quant.E8M0, group: int | None = None):
    """Same contract as ``quant.act_quant`` for the release's call (bf16, ue8m0, e8m0 or fp32 scales), and with
    ``group=128`` (``act_quant_grouped``); other configurations go to the torch implementation."""
    quant._check_blocks("act_quant", x, block_size)
    if x.dtype != torch.bfloat16 or scale_fmt is None or scale_dtype not in (quant.E8M0, torch.float32):
        return quant.act_quant(x, block_size, scale_fmt, scale_dtype, group)
    if group is not None and group != block_size:
        if block_size != 32 or group != 128 or x.shape[-1] % 128:
            return quant.act_quant(x, block_size, scale_fmt, scale_dtype, group)   # its errors, or torch's result
        q, s = act_quant_grouped(x, group)
        return q, (quant.e8m0_to_float(s) if scale_dtype == torch.float32 else s)
    N = x.shape[-1]
    G = N // block_size
    x3 = x.reshape(-1, G, block_size).contiguous()
    q, s = act_quant_kernel(G, block_size)(x3)
    q = q.reshape(x.shape)
    s = s.reshape(*x.shape[:-1], G).view(quant.E8M0)
    if scale_dtype == torch.float32:
        s = quant.e8m0_to_float(s)
    return q, s
