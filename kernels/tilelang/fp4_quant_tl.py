"""FP4 (E2M1) activation quantization with 1 x block scales (SPEC §10.2), TileLang.

Bit-exact with ``quant.fp4_act_quant`` for both scale formats:

- e8m0 (block 32, indexer q/k): ``amax = max(max|x|, 6*2^-126)``; ``e = exponent(amax * fp32(1/6)) - 127
  + (mantissa != 0)`` (the exponent-bit trick on the integer bits); ``v = x * 2^-e`` (a multiplication by
  an exact power of two, the same real number as the reference's division); scale byte ``e + 127``.
- e4m3 (block 16, compressed KV): ``s = e4m3(min(max(max|x|, 6*2^-9) / 6, 448))`` and ``v = x / s``, both
  divisions IEEE round-to-nearest (``T.ieee_fdiv``: the build's fast-math would otherwise approximate).

Codes: ``|v|`` against the reference's thresholds (ties to the even code; the clamp to ±6 changes no
code), the sign bit taken from x's bits (x/s keeps x's sign, -0 included); element 2j in the low nibble
of byte j. One thread quantizes one block (loads of 32/64 contiguous bytes, memory-bound op).
"""
import functools

import torch
import tilelang.language as T

from functional_dsv41 import quant

from ._common import compile_kernel

BF16, F32, FP8 = "bfloat16", "float32", "float8_e4m3fn"


@functools.lru_cache(maxsize=None)
def fp4_act_quant_kernel(bs: int, e8m0: bool, threads: int = 128):
    """x viewed [NB, bs] bf16 -> packed [NB, bs/2] uint8, scales [NB] (uint8 e8m0 bytes or e4m3)."""
    NB = T.dynamic("NB")
    half = bs // 2
    sdt = "uint8" if e8m0 else FP8
    inv6 = 1.0 / 6.0
    min_amax = 6.0 * 2.0 ** -126 if e8m0 else 6.0 * 2.0 ** -9

    @T.prim_func
    def fp4_act_quant(
        X: T.Tensor([NB, bs], BF16),
        P: T.Tensor([NB, half], "uint8"),
        S: T.Tensor([NB], sdt),
    ):
        with T.Kernel(T.ceildiv(NB, threads), threads=threads) as bx:
            tx = T.get_thread_binding()
            xl = T.alloc_local([bs], F32)
            sign = T.alloc_local([bs], "int32")
            code = T.alloc_local([bs], "int32")
            amax = T.alloc_local([1], F32)
            sinv = T.alloc_local([1], F32)
            e = T.alloc_local([1], "int32")
            s8 = T.alloc_local([1], FP8)
            sf = T.alloc_local([1], F32)
            b = bx * threads + tx
            if b < NB:
                for k in T.vectorized(bs):
                    xl[k] = T.Cast(F32, X[b, k])
                amax[0] = T.float32(0)
                for k in T.unroll(bs):
                    amax[0] = T.max(amax[0], T.abs(xl[k]))
                amax[0] = T.max(amax[0], T.float32(min_amax))
                if e8m0:
                    bits = T.reinterpret(amax[0] * T.float32(inv6), "int32")
                    e[0] = ((bits >> 23) & 255) - 127 + T.if_then_else((bits & 0x7FFFFF) != 0, 1, 0)
                    sinv[0] = T.reinterpret((127 - e[0]) << 23, F32)
                    for k in T.unroll(bs):
                        sign[k] = (T.reinterpret(xl[k], "int32") >> 31) & 1
                        xl[k] = T.abs(xl[k]) * sinv[0]
                else:
                    s8[0] = T.Cast(FP8, T.min(T.ieee_fdiv(amax[0], T.float32(6.0)), T.float32(448.0)))
                    sf[0] = T.Cast(F32, s8[0])
                    for k in T.unroll(bs):
                        sign[k] = (T.reinterpret(xl[k], "int32") >> 31) & 1
                        xl[k] = T.ieee_fdiv(T.abs(xl[k]), sf[0])
                for k in T.unroll(bs):
                    a = xl[k]
                    code[k] = (T.if_then_else(a > T.float32(0.25), 1, 0)
                               + T.if_then_else(a >= T.float32(0.75), 1, 0)
                               + T.if_then_else(a > T.float32(1.25), 1, 0)
                               + T.if_then_else(a >= T.float32(1.75), 1, 0)
                               + T.if_then_else(a > T.float32(2.5), 1, 0)
                               + T.if_then_else(a >= T.float32(3.5), 1, 0)
                               + T.if_then_else(a > T.float32(5.0), 1, 0)) | (sign[k] << 3)
                for j in T.unroll(half):
                    P[b, j] = T.Cast("uint8", code[2 * j] | (code[2 * j + 1] << 4))
                if e8m0:
                    S[b] = T.Cast("uint8", e[0] + 127)
                else:
                    S[b] = s8[0]

    return compile_kernel(fp4_act_quant, out_idx=[1, 2])


def fp4_act_quant(x: torch.Tensor, block_size: int = quant.BLOCK, scale_dtype: torch.dtype = quant.E8M0):
    """Same contract as ``quant.fp4_act_quant``: (packed uint8 [..., N/2], scales [..., N/bs]) with e8m0 or
    e4m3 scales. Inputs other than bf16 go to the torch implementation."""
    quant._check_fp4_act("fp4_act_quant", x, block_size)
    if x.dtype != torch.bfloat16 or scale_dtype not in (quant.E8M0, quant.FP8) or block_size % 2:
        return quant.fp4_act_quant(x, block_size, scale_dtype)
    N = x.shape[-1]
    e8m0 = scale_dtype == quant.E8M0
    x2 = x.reshape(-1, block_size).contiguous()
    if x2.shape[0] == 0:
        return quant.fp4_act_quant(x, block_size, scale_dtype)
    p, s = fp4_act_quant_kernel(block_size, e8m0)(x2)
    p = p.reshape(*x.shape[:-1], N // 2)
    s = s.reshape(*x.shape[:-1], N // block_size)
    return p, (s.view(quant.E8M0) if e8m0 else s)
