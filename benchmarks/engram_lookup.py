"""Engram lookup from a memory-mapped fp8 table (SPEC §6.5): rows/s and resident memory.

    .venv/bin/python benchmarks/engram_lookup.py [--rows 20000000] [--dim 256] [--tokens 4096] [--iters 5]

Writes a synthetic table (fp8 e4m3 rows [rows, dim] followed by e8m0 scales [rows, dim/32]) to a
temporary file and gathers random row ids the way a forward does (tokens x 24 ids) with
``engram.lookup``, which dequantises only the gathered rows. Prints rows/s, GB/s of gathered table
bytes, and VmRSS split into anonymous and file-backed memory from /proc/self/status.

Two runs:
- cold: the file is evicted from the page cache (fsync + POSIX_FADV_DONTNEED) and mapped with
  ``numpy.memmap`` + ``MADV_RANDOM``, so every touched 4 KiB page is one disk read and nothing
  else is read ahead: the shape of a real 100 GB table that does not fit in RAM;
- warm: ``torch.from_file`` over pages already in the page cache (after one pass with the same ids):
  the gather + dequant rate itself. Note that the kernel maps whole page-cache folios on a fault,
  so file-backed RSS can grow by far more than the rows touched; it is shared, reclaimable cache.
Anonymous memory grows only by the gathered output: the table is never loaded or dequantised whole.

Disk use is about rows*(dim + dim/32) bytes (5.3 GB at the defaults); with less free space in the
temp folder the row count is scaled down, with a note. The file is deleted at the end.
"""
from __future__ import annotations

import argparse
import mmap
import os
import shutil
import tempfile
import time

import numpy as np
import torch

from functional_dsv41 import engram, quant
from functional_dsv41.kernels._bench_common import positive_int


def proc_status(*keys):
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0]) / 1024  # kB -> MiB
    return out


def fmt_mem(tag):
    m = proc_status("VmRSS", "RssAnon", "RssFile")
    return f"{tag:<28} VmRSS {m['VmRSS']:9.1f} MiB  (anon {m['RssAnon']:8.1f}, file {m['RssFile']:8.1f})"


def write_table(path, rows, dim, chunk_rows=1 << 18):
    """fp8 bytes then e8m0 bytes, written block by block so the writer's memory stays small; fsynced."""
    rng = np.random.default_rng(0)
    block = rng.integers(0, 0x7F, size=(chunk_rows, dim), dtype=np.uint8)       # finite e4m3 codes
    block |= (rng.integers(0, 2, size=block.shape, dtype=np.uint8) << 7)        # random sign
    sblock = rng.integers(120, 128, size=(chunk_rows, dim // quant.BLOCK), dtype=np.uint8)
    with open(path, "wb") as f:
        for start in range(0, rows, chunk_rows):
            f.write(block[:min(chunk_rows, rows - start)].tobytes())
        for start in range(0, rows, chunk_rows):
            f.write(sblock[:min(chunk_rows, rows - start)].tobytes())
        f.flush()
        os.fsync(f.fileno())


def timed_lookup(weight, scale, ids_list, label, dim):
    t0 = time.perf_counter()
    for x in ids_list:
        out = engram.lookup(weight, scale, x)
    dt = time.perf_counter() - t0
    n = sum(x.numel() for x in ids_list)
    gb = n * (dim + dim // quant.BLOCK) / 1e9
    print(f"{label:<34} {n / dt / 1e6:7.3f} M rows/s  {gb / dt:6.3f} GB/s  "
          f"{dt / len(ids_list) * 1e3:8.2f} ms per call of {tuple(ids_list[0].shape)} ids -> {tuple(out.shape)} bf16")


def map_numpy(path, rows, dim, advice=None):
    arr = np.memmap(path, dtype=np.uint8, mode="r", shape=(rows * (dim + dim // quant.BLOCK),))
    if advice is not None:
        arr._mmap.madvise(advice)
    flat = torch.from_numpy(arr)  # read-only mapping; torch warns that it is not writable
    return (flat[:rows * dim].view(rows, dim).view(quant.FP8),
            flat[rows * dim:].view(rows, dim // quant.BLOCK).view(quant.E8M0))


def drop_page_cache(path):
    """Evict the (clean, fsynced) file from the page cache: the next reads come from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=positive_int, default=20_000_000)
    ap.add_argument("--dim", type=positive_int, default=256)
    ap.add_argument("--tokens", type=positive_int, default=4096)
    ap.add_argument("--ids", type=positive_int, default=24, help="row ids per token (3 orders x 8 heads)")
    ap.add_argument("--iters", type=positive_int, default=5)
    ap.add_argument("--decode-steps", type=positive_int, default=200)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    if a.dim % quant.BLOCK:
        ap.error(f"argument --dim: must be a multiple of {quant.BLOCK} (one e8m0 scale per {quant.BLOCK}), got {a.dim}")
    if not os.path.isdir(a.dir):
        ap.error(f"argument --dir: {a.dir!r} is not a directory")

    rows, dim = a.rows, a.dim
    row_bytes = dim + dim // quant.BLOCK
    free = shutil.disk_usage(a.dir).free
    budget = min(6e9, 0.5 * free)
    if rows * row_bytes > budget:
        new = int(budget // row_bytes)
        print(f"NOTE: {rows} rows need {rows * row_bytes / 1e9:.2f} GB but {a.dir} has {free / 1e9:.1f} GB "
              f"free (budget {budget / 1e9:.2f} GB): scaling down to {new} rows")
        rows = new
    print(f"table: {rows} rows x {dim} fp8 + {dim // quant.BLOCK} e8m0 scales = "
          f"{rows * row_bytes / 1e9:.2f} GB in {a.dir}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    g = torch.Generator().manual_seed(1)
    decode_ids = [torch.randint(0, rows, (1, a.ids), generator=g) for _ in range(a.decode_steps)]
    prefill_ids = [torch.randint(0, rows, (a.tokens, a.ids), generator=g) for _ in range(a.iters)]

    fd, path = tempfile.mkstemp(prefix="engram_table_", suffix=".bin", dir=a.dir)
    os.close(fd)
    try:
        t0 = time.perf_counter()
        write_table(path, rows, dim)
        print(f"wrote the table in {time.perf_counter() - t0:.1f} s")
        print(fmt_mem("before mapping"))

        print("-- cold: page cache dropped, numpy.memmap + MADV_RANDOM (no readahead)")
        drop_page_cache(path)
        weight, scale = map_numpy(path, rows, dim, mmap.MADV_RANDOM)
        print(fmt_mem("after mapping"))
        timed_lookup(weight, scale, decode_ids, f"decode, {a.decode_steps} steps", dim)
        print(fmt_mem(f"after {a.decode_steps} decode steps"))
        timed_lookup(weight, scale, prefill_ids[:1], "prefill, 1 call", dim)
        print(fmt_mem("after the prefill call"))
        del weight, scale

        print("-- warm: torch.from_file (MAP_PRIVATE), the same ids again after one pass")
        mm = torch.from_file(path, shared=False, size=rows * row_bytes, dtype=torch.uint8)
        weight = mm[:rows * dim].view(rows, dim).view(quant.FP8)
        scale = mm[rows * dim:].view(rows, dim // quant.BLOCK).view(quant.E8M0)
        for x in prefill_ids:
            engram.lookup(weight, scale, x)
        timed_lookup(weight, scale, prefill_ids, f"prefill, {a.iters} calls", dim)
        timed_lookup(weight, scale, decode_ids, f"decode, {a.decode_steps} steps", dim)
        t0 = time.perf_counter()
        for x in prefill_ids:
            weight.view(torch.uint8).index_select(0, x.flatten())
            scale.view(torch.uint8).index_select(0, x.flatten())
        dt = time.perf_counter() - t0
        print(f"{'  the gather alone':<34} {a.iters * prefill_ids[0].numel() / dt / 1e6:7.3f} M rows/s "
              "(the rest is the fp8 -> bf16 dequant of the gathered rows)")
        print(fmt_mem("after the warm runs"))
        del weight, scale, mm
        print(f"a whole-table dequant to bf16 would need {rows * dim * 2 / 2**20:.0f} MiB of anonymous memory; "
              f"a release table is 384M rows ({384_006_168 * row_bytes / 1e9:.0f} GB in fp8)")
    finally:
        os.unlink(path)
        print(f"deleted {path}")


if __name__ == "__main__":
    import warnings
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    main()
