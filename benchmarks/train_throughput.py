"""Training throughput on CPU: tokens/s of the full functional train step, and peak memory (RSS).

    .venv/bin/python benchmarks/train_throughput.py [--config tiny] [--batch 8] [--seq 128] [--steps 8]
                                          [--threads 1] [--mode dequant|qat] [--remat]

The step is the one ``train/run.py`` runs (``torch.func.grad_and_value`` over the fp32 master leaves,
clipping, AdamW) on packed rows of the shipped corpus. The first two steps are warm-up and not timed.
tokens/s counts every row slot (padding included); "target tokens/s" only positions with a target.
Peak RSS is the process maximum (``getrusage``), so it includes Python, torch and the data.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import functional_dsv41 as fd
from functional_dsv41.kernels._bench_common import positive_int
from functional_dsv41.train import data as D
from functional_dsv41.train import optim, run
from functional_dsv41.train import step as S
from functional_dsv41.linear import MODES
from functional_dsv41.train.tokenizer import CORPUS_TXT, TOKENIZER_JSON


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny", choices=sorted(run.PRESETS))
    ap.add_argument("--batch", type=positive_int, default=8)
    ap.add_argument("--seq", type=positive_int, default=128)
    ap.add_argument("--steps", type=positive_int, default=8)
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--mode", default=None, choices=MODES, help="linear() mode (default: the preset's: dequant, or qat)")
    ap.add_argument("--remat", action="store_true", help="per-block activation checkpointing (needs the hook)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rc = run.parse_args([f"--config={a.config}", f"--batch_size={a.batch}", f"--seq_len={a.seq}"])
    cfg = run.model_config(rc)
    from functional_dsv41.engram import build_token_map
    tm = torch.as_tensor(build_token_map(TOKENIZER_JSON), dtype=torch.int64)
    tr, fr = run.init_train_params(cfg, rc, tm)
    mode = a.mode or ("qat" if rc.qat else rc.mode)
    fkw = S.remat_forward_kwargs(fd.forward) if a.remat else None
    step = S.make_step(cfg, frozen=fr, dtypes=S.compute_dtypes(cfg, tr), forward=fd.forward, coefs=rc.coefs,
                       mode=mode, pad_id=2, forward_kwargs=fkw,     # as train/run.py builds it (the draft loss too)
                       draft_forward=run._draft_forward() if rc.loss_draft > 0 else None,
                       draft_anchor_stride=rc.draft_anchor_stride)
    it = D.PackedData(list(D.shipped_samples(CORPUS_TXT, TOKENIZER_JSON)), row_len=a.seq, batch_size=a.batch,
                      pad_id=2)
    opt = optim.adamw_init(tr)
    n_params = sum(v.numel() for v in tr.values())
    times, tgt = [], 0
    for i in range(a.steps + 2):
        batch = it.next_batch()
        t0 = time.perf_counter()
        tr, opt, m = step(tr, opt, batch, lr=1e-3, step_no=i + 1)
        if i >= 2:
            times.append(time.perf_counter() - t0)
            tgt += m["tokens"]
    dt = sum(times)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    print(f"config {a.config} ({cfg.n_layers} layers, dim {cfg.dim}, {n_params / 1e6:.2f}M trainable), mode {mode}, "
          f"remat {a.remat}, batch {a.batch} x {a.seq}, {a.threads} thread(s), {torch.__version__}")
    print(f"train step: {dt / len(times) * 1e3:.0f} ms (median {sorted(times)[len(times) // 2] * 1e3:.0f} ms) "
          f"over {len(times)} steps")
    print(f"tokens/s: {a.batch * a.seq * len(times) / dt:.0f} (target tokens/s {tgt / dt:.0f}); "
          f"peak RSS {rss:.0f} MiB; last loss {m['loss/total']:.3f}")


if __name__ == "__main__":
    main()
