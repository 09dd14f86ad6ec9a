"""Does FFMA issue overlap an in-flight fp8 WGMMA on Hopper?  A micro-benchmark for the fp8 GEMM's promotion.

The fp8 GEMM with 32-wide block scales promotes every k = 32 WGMMA with one FFMA per accumulator element,
so per 128 x 192 x 32 slice each SM sub-partition issues 192 FFMAs against 192 nominal tensor-core cycles.
Run 44's halves kernel takes ~586 cycles a slice where the same structure without the FFMAs takes ~394
(ws diag, run 41): time ~ tensor time + FFMA issue time, as if the two did not overlap. This measures it
directly, with no data dependencies between the two: one CTA per SM, each warpgroup given a role

  mma   back-to-back m64nBNk32 e4m3 WGMMAs from shared memory (8 per round, drained once a round)
  ffma  rounds of x += y * s, y += x * s over two [64, 96] fp32 fragments (48 FFMAs a thread, REPS times a
        round; each FFMA reads the previous one's result, so the compiler cannot fold them)
  both  the WGMMAs of a round issued, then the FFMAs of a round on registers the WGMMAs do not touch, then
        the drain (overlap inside one warpgroup, as the halves kernel needs)
  copy  rounds of COPY_KB KB copied from global memory (an L2-resident buffer per CTA) into shared memory with
        16-byte cp.async, waited on an mbarrier: the sparse-attention forward's KV gathers (no WGMMA reads it)
  idle  nothing

and prints the time of each role mix with the WGMMA rate (TFLOP/s) and the FFMA rate (warp FFMAs per
sub-partition per cycle at the SM clock the driver reports). If the mix (mma, ffma) takes about the sum of
(mma, idle) and (ffma, idle), FFMA issue and the tensor core do not overlap on this machine.

    python3 benchmarks/micro_ffma_wgmma.py                # on the GPU
    python3 benchmarks/micro_ffma_wgmma.py --dtype bf16 --bn 256 96   # the sparse-attention forward's WGMMAs
    python3 benchmarks/micro_ffma_wgmma.py --dtype bf16 --bn 64 256 --mixes mma copy mma,copy mma,mma mma,mma,copy

The ``copy`` mixes ask a second question: do shared-memory writes (cp.async gathers) slow down WGMMAs that read
their operands from shared memory? A bf16 m64n64k16 reads 2 KB of A and 2 KB of B in its 32 tensor cycles, the
whole 128 B a cycle an SM's shared memory delivers, so the forward's QK (N = 64, the block's slots) would leave
no bandwidth for the gathers beside it; m64n256k16 reads 10 KB in 128 cycles (80 B a cycle). If ``mma,copy``
takes about ``mma`` + ``copy`` at BN = 64 but about ``mma`` at BN = 256, the QK is shared-memory bound.
    DSV41_TL_TARGET='{"kind":"cuda","arch":"sm_90a"}' python3 benchmarks/micro_ffma_wgmma.py --compile-only
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tilelang.language as T  # noqa: E402

from kernels.tilelang._common import compile_kernel  # noqa: E402

F32, FP8, BF16 = "float32", "float8_e4m3fn", "bfloat16"
MMAS_PER_ROUND = 8
FFMA_W = 96                     # fragment columns of the ffma role: 48 FFMAs a thread per repetition
COPY_KB = 32                    # the copy role's bytes a round (and its L2-resident source per CTA)
ROLES = ("mma", "ffma", "both", "copy", "idle")

MIXES = [("mma",), ("mma", "mma"), ("ffma",), ("ffma", "ffma"), ("mma", "ffma"), ("mma", "mma", "ffma"),
         ("both",), ("both", "both"), ("mma", "idle")]


@functools.lru_cache(maxsize=None)
def micro_kernel(roles: tuple, rounds: int, reps: int, BN: int = 192, dtype: str = FP8):
    """One CTA per SM (grid = ctas at launch), 128 threads a role. Out [ctas, 64 * roles, BN] sinks every
    accumulator so that nothing is dead code. ``reps`` must be even (the FFMA chains alternate two fragments).
    ``dtype``: the WGMMA operands, e4m3 (a 32-deep slice is one m64nBNk32) or bf16 (two m64nBNk16)."""
    nw = len(roles)
    threads = 128 * nw
    CT = T.dynamic("CT")
    rr = tuple(roles) + ("idle",) * (3 - nw)
    assert 1 <= nw <= 3 and all(r in ROLES for r in roles) and reps % 2 == 0
    assert BN >= FFMA_W or not {"ffma", "both"} & set(roles), "the ffma role's fragment needs BN >= FFMA_W"
    PAD_KB = 160 if dtype == FP8 else 100            # beside the operands: more than half the shared memory

    @T.macro
    def mma_round(w, a_s, b_s, acc):
        for kk in T.unroll(MMAS_PER_ROUND):
            T.wgmma_gemm(a_s[w * 64:(w + 1) * 64, (kk % 4) * 32:(kk % 4 + 1) * 32],
                         b_s[:, (kk % 4) * 32:(kk % 4 + 1) * 32], acc, transpose_B=True, clear_accum=False)

    @T.macro
    def ffma_round(f_acc, f_tmp, sp):
        for r in T.unroll(reps // 2):   # x += y s; y += x s: every FFMA needs the last one's result (no folding)
            for i, j in T.Parallel(64, FFMA_W):
                f_acc[i, j] += f_tmp[i, j] * sp[i, j // 32]
            for i, j in T.Parallel(64, FFMA_W):
                f_tmp[i, j] += f_acc[i, j] * sp[i, j // 32]

    @T.macro
    def copy_round(it, pad, Src, bar, bx):
        """COPY_KB KB from Src[bx] into pad, 16 bytes a cp.async, then wait for all of them (mbarrier)."""
        tp = T.get_thread_binding() % 128
        for r in T.unroll(COPY_KB * 1024 // (16 * 128)):
            off = (r * 128 + tp) * 16
            T.ptx_cp_async(T.access_ptr(pad[off], "w", 16), T.access_ptr(Src[bx, off], "r", 16), 16)
        T.cp_async_barrier_noinc(bar[0])
        T.barrier_wait(bar[0], it % 2)

    @T.macro
    def role(w, what, a_s, b_s, Out, Sc, bx, pad, Src, bar):
        if what in ("mma", "both"):
            acc = T.alloc_fragment([64, BN], F32)
            T.clear(acc)
        if what in ("ffma", "both"):
            f_acc = T.alloc_fragment([64, FFMA_W], F32)
            f_tmp = T.alloc_fragment([64, FFMA_W], F32)
            sp = T.alloc_fragment([64, FFMA_W // 32], F32)
            # one WGMMA before the timed rounds gives the FFMA fragments the accumulator layout (as in the GEMM)
            T.wgmma_gemm(a_s[w * 64:(w + 1) * 64, 0:32], b_s[0:FFMA_W, 0:32], f_tmp, transpose_B=True,
                         clear_accum=True)
            T.wait_wgmma(0)
            for i, j in T.Parallel(64, FFMA_W):
                f_acc[i, j] = 0.0
                f_tmp[i, j] += T.cast(i * 3 + j, F32) * 1e-3
            for i, c in T.Parallel(64, FFMA_W // 32):
                sp[i, c] = Sc[c]
        if what == "copy":
            for it in T.serial(rounds):
                copy_round(it, pad, Src, bar, bx)
        elif what != "idle":
            for _ in T.serial(rounds):
                if what in ("mma", "both"):
                    mma_round(w, a_s, b_s, acc)
                if what in ("ffma", "both"):
                    ffma_round(f_acc, f_tmp, sp)
                if what in ("mma", "both"):
                    T.wait_wgmma(0)
        if what in ("mma", "both"):
            for i, j in T.Parallel(64, BN):
                Out[bx, w * 64 + i, j] = acc[i, j]
        if what in ("ffma", "both"):
            for i, j in T.Parallel(64, FFMA_W):
                Out[bx, w * 64 + i, BN - FFMA_W + j] += f_acc[i, j]

    @T.prim_func
    def micro(Out: T.Tensor([CT, 64 * nw, BN], F32), Sc: T.Tensor([FFMA_W // 32], F32),
              Src: T.Tensor([CT, COPY_KB * 1024], "uint8")):
        with T.Kernel(CT, threads=threads) as bx:
            a_s = T.alloc_shared([64 * nw, 128], dtype)
            b_s = T.alloc_shared([BN, 128], dtype)
            pad = T.alloc_shared([PAD_KB * 1024], "uint8")   # one CTA per SM; the copy role's destination
            bar = T.alloc_barrier(arrive_count=[128])
            for i, j in T.Parallel(64 * nw, 128):
                a_s[i, j] = T.cast(0.0, dtype)
            for i, j in T.Parallel(BN, 128):
                b_s[i, j] = T.cast(0.0, dtype)
            pad[T.get_thread_binding()] = 0
            T.sync_threads()
            tx = T.get_thread_binding()
            if tx < 128:                 # static roles, one branch per warpgroup
                role(0, rr[0], a_s, b_s, Out, Sc, bx, pad, Src, bar)
            else:
                if nw >= 2:
                    if tx < 256:
                        role(1, rr[1], a_s, b_s, Out, Sc, bx, pad, Src, bar)
                    else:
                        if nw >= 3:
                            role(2, rr[2], a_s, b_s, Out, Sc, bx, pad, Src, bar)

    return compile_kernel(micro)


def _mix(text: str) -> tuple:
    roles = tuple(text.split(","))
    if not 1 <= len(roles) <= 3 or not set(roles) <= set(ROLES):
        raise argparse.ArgumentTypeError(f"a mix is 1 to 3 comma-separated roles of {ROLES}, got {text!r}")
    return roles


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=8, help="FFMA repetitions (48 FFMAs a thread each) a round, even")
    ap.add_argument("--bn", type=int, nargs="+", default=[192, 96])
    ap.add_argument("--mixes", type=_mix, nargs="+", default=MIXES,
                    help="role mixes to time, each 1-3 comma-separated roles (default: the FFMA overlap set)")
    ap.add_argument("--clock-mhz", type=float, default=1965.0,
                    help="SM clock under load for the FFMA rate (run 42: nvidia-smi read 1965 MHz; torch reports idle)")
    ap.add_argument("--dtype", choices=["e4m3", "bf16"], default="e4m3", help="WGMMA operand type")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args(argv)
    if args.reps < 2 or args.reps % 2:
        ap.error(f"--reps must be even and at least 2 (the FFMA chains alternate two fragments), got {args.reps}")
    dt = FP8 if args.dtype == "e4m3" else BF16
    for bn in args.bn:
        if bn % 8 or not 8 <= bn <= 256:
            ap.error(f"--bn {bn}: a WGMMA's N is a multiple of 8 up to 256")
        if bn < FFMA_W and any({"ffma", "both"} & set(m) for m in args.mixes):
            ap.error(f"--bn {bn} < {FFMA_W}: the ffma role's fragment is set up by one WGMMA of that width; "
                     f"time mixes without ffma / both at that width (--mixes)")
    for bn in args.bn:
        for mix in args.mixes:
            micro_kernel(mix, args.rounds, args.reps, bn, dt)
    if args.compile_only:
        print(f"compiled {len(args.mixes) * len(args.bn)} micro kernels")
        return
    import torch
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    ctas = props.multi_processor_count
    clock_hz = args.clock_mhz * 1e6
    print(f"{props.name}, {ctas} SMs, {args.dtype} WGMMAs, rates at {args.clock_mhz:.0f} MHz; {args.rounds} "
          f"rounds, {MMAS_PER_ROUND} 32-deep WGMMA slices, {args.reps} x 48 FFMAs a thread or {COPY_KB} KB of "
          f"cp.async per round")
    print(f"{'BN':>4} {'roles':<22} {'us':>9} {'WGMMA TFLOP/s':>14} {'FFMA/cycle/sub-part.':>21} "
          f"{'copy B/cycle/SM':>16}")
    src = torch.randint(0, 255, (ctas, COPY_KB * 1024), dtype=torch.uint8, device=dev)
    for bn in args.bn:
        for mix in args.mixes:
            k = micro_kernel(mix, args.rounds, args.reps, bn, dt)
            out = torch.zeros(ctas, 64 * len(mix), bn, device=dev)
            sc = torch.tensor([0.5, 1.0, 1.5], device=dev)       # runtime scales: no immediates in the FFMAs
            for _ in range(2):
                k(out, sc, src)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ts = []
            for _ in range(5):
                ev[0].record()
                k(out, sc, src)
                ev[1].record()
                torch.cuda.synchronize()
                ts.append(ev[0].elapsed_time(ev[1]) * 1e-3)
            t = min(ts)
            n_mma = sum(r in ("mma", "both") for r in mix)
            n_ffma = sum(r in ("ffma", "both") for r in mix)
            n_copy = sum(r == "copy" for r in mix)
            flops = ctas * n_mma * args.rounds * MMAS_PER_ROUND * 2 * 64 * bn * 32
            ffma_warp = ctas * n_ffma * 4 * args.rounds * args.reps * 48     # warp instructions
            rate = ffma_warp / (t * clock_hz * ctas * 4)
            copy = n_copy * args.rounds * COPY_KB * 1024 / (t * clock_hz)
            print(f"{bn:>4} {','.join(mix):<22} {t * 1e6:9.1f} {flops / t / 1e12:14.1f} {rate:21.3f} {copy:16.1f}")


if __name__ == "__main__":
    main()
