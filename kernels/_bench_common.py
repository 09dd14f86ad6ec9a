"""Timing and row printing shared by the kernel benchmark sections (``bench.py``, ``bench_gemm.py``), and the
argparse type of every benchmark's sizes (``positive_int``: ``kernels.bench`` and ``benchmarks/*.py``)."""
import argparse



def bench(fn, warmup=25, rep=100):
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")  # ms


def row(name, ms, flops=None, nbytes=None, note=""):
    tf = f"{flops / ms / 1e9:9.1f}" if flops else " " * 9
    gb = f"{nbytes / ms / 1e6:9.1f}" if nbytes else " " * 9
    print(f"{name:<48s} {ms:9.3f} {tf} {gb}  {note}", flush=True)
    return {"name": name, "ms": ms, "tflops": flops / ms / 1e9 if flops else None,
            "gbps": nbytes / ms / 1e6 if nbytes else None, "note": note}


def positive_int(s: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v
