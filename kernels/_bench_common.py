"""Timing and row printing shared by the kernel benchmark sections (``bench.py``, ``bench_gemm.py``)."""


def bench(fn, warmup=25, rep=100):
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")  # ms


def row(name, ms, flops=None, nbytes=None, note=""):
    tf = f"{flops / ms / 1e9:9.1f}" if flops else " " * 9
    gb = f"{nbytes / ms / 1e6:9.1f}" if nbytes else " " * 9
    print(f"{name:<48s} {ms:9.3f} {tf} {gb}  {note}", flush=True)
    return {"name": name, "ms": ms, "tflops": flops / ms / 1e9 if flops else None,
            "gbps": nbytes / ms / 1e6 if nbytes else None, "note": note}
