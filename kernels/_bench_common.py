"""Timing, row printing and the clock under load, shared by the kernel benchmark sections (``bench.py``,
``bench_gemm.py``, ``bench_attn.py``), and the argparse type of every benchmark's sizes (``positive_int``:
``kernels.bench`` and ``benchmarks/*.py``)."""
import argparse

import torch



def bench(fn, warmup=25, rep=100):
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")  # ms


def graph_ms(fn, n=20):
    """GPU time of one fn() without the host: n calls captured in one CUDA graph, replayed (a warm-up call first,
    on a side stream, so that kernels are built and memory pools set before the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for _ in range(n):
            fn()
    return bench(gr.replay) / n


def row(name, ms, flops=None, nbytes=None, note=""):
    tf = f"{flops / ms / 1e9:9.1f}" if flops else " " * 9
    gb = f"{nbytes / ms / 1e6:9.1f}" if nbytes else " " * 9
    print(f"{name:<48s} {ms:9.3f} {tf} {gb}  {note}", flush=True)
    return {"name": name, "ms": ms, "tflops": flops / ms / 1e9 if flops else None,
            "gbps": nbytes / ms / 1e6 if nbytes else None, "note": note}


def interleaved_rounds(results, rounds, variants):
    """Time each of ``variants`` (name, fn, flops, nbytes, note) once a round over ``rounds`` rounds, in order, so
    that clock drift falls on all of them alike; a row per round, then a row per variant with its median and
    ``note(median_ms)``'s text (``note`` may be None). Returns {name: median ms}."""
    import statistics
    times: dict[str, list[float]] = {v[0]: [] for v in variants}
    for rnd in range(rounds):
        for name, fn, flops, nbytes, _ in variants:
            r = row(f"  {name} (round {rnd + 1})", bench(fn), flops, nbytes)
            results.append(r)
            times[name].append(r["ms"])
    print(f"  -- median over {rounds} rounds", flush=True)
    medians = {}
    for name, _, flops, nbytes, note in variants:
        medians[name] = med = statistics.median(times[name])
        results.append(row(f"  {name} (median of {rounds})", med, flops, nbytes, note(med) if note else ""))
    return medians


def positive_int(s: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def clock_under_load(fn, seconds=1.0):
    """SM clock (MHz) and board power (W) that nvidia-smi reports while ``fn`` runs back to back for about
    ``seconds``: the kernels are queued first, the query runs while the GPU works through them. Returns "" where
    nvidia-smi is missing."""
    import shutil
    import subprocess
    import time
    if not shutil.which("nvidia-smi"):
        return ""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    n = max(1, int(seconds * 1e3 / max(start.elapsed_time(end), 1e-3)))
    for _ in range(n):
        fn()
    time.sleep(seconds / 2)                          # past the ramp: mid-run
    q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    torch.cuda.synchronize()
    if not q:
        return ""
    mhz, watts = (v.strip() for v in q[0].split(",")[:2])
    return f"SM {mhz} MHz, {watts} W under load"
