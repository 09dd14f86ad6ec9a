"""Decode throughput on CPU for a small config, with and without DSpark speculation, and the decode
state's bytes per cached token.

    .venv/bin/python benchmarks/decode.py [--batch 2] [--prompt 32] [--new 32] [--threads 1] [--peaked]

Random weights: a random drafter never agrees with a random main model, so speculation then costs a
draft + verify (+ sometimes a rollback re-run) per token. ``--peaked`` scales a few LM-head rows so
that the main model and the drafter (which shares the head) often agree - a stand-in for a trained
drafter that shows the accepted-tokens-per-forward mechanics, not a real acceptance rate.
"""
from __future__ import annotations

import argparse
import time

import torch

import functional_dsv41 as fd
from functional_dsv41.kernels._bench_common import positive_int
from functional_dsv41.state import init_state, state_bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=positive_int, default=2)
    ap.add_argument("--prompt", type=positive_int, default=32)
    ap.add_argument("--new", type=positive_int, default=32)
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--peaked", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = fd.Config.tiny(max_seq_len=256)
    params = fd.init_params(cfg, seed=0)
    params["engram_token_map"] = torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size
    if a.peaked:
        params["head"]["weight"][5:9] *= 30
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (a.batch, a.prompt), generator=g).tolist()
    print(f"config: Config.tiny (dim {cfg.dim}, {cfg.n_layers} layers + {cfg.n_mtp_layers} DSpark stages, "
          f"block {cfg.dspark_block_size}); batch {a.batch}, prompt {a.prompt}, {a.new} new tokens, "
          f"{a.threads} thread(s){', peaked head' if a.peaked else ''}")
    fd.generate(params, prompts, cfg=cfg, max_new_tokens=2)                      # warm-up
    ref = None
    for spec in (False, True):
        t0 = time.perf_counter()
        r = fd.generate(params, prompts, cfg=cfg, max_new_tokens=a.new, speculative=spec)
        dt = time.perf_counter() - t0
        # prefill time, to report decode-only throughput
        t1 = time.perf_counter()
        fd.forward(params, {"input_ids": torch.tensor(prompts)}, cfg=cfg, state=init_state(cfg, a.batch, 256))
        pre = time.perf_counter() - t1
        n = sum(len(x) for x in r)
        line = (f"{'speculative' if spec else 'plain      '}: {n} tokens in {dt:.2f} s = {n / dt:.1f} tok/s "
                f"(decode only ~{n / max(dt - pre, 1e-9):.1f} tok/s), {r.stats['main_forwards']} main forwards")
        if spec:
            line += (f", {r.stats['tokens_per_forward']:.2f} tokens/verify forward, "
                     f"{r.stats['reruns']} rollback re-runs, identical to plain: {list(r) == list(ref)}")
        ref = r
        print(line)
    L = 4096
    for name, c in (("tiny", cfg), ("release (Config.flash)", fd.Config.flash())):
        b0 = state_bytes(init_state(c, 1, L, device="meta"))
        b1 = state_bytes(init_state(c, 1, 2 * L, device="meta"))
        print(f"state bytes per cached token, {name}: {(b1 - b0) / L:.0f} B/token/row "
              f"(+ {b0 - (b1 - b0):.0f} B fixed per row: windows, partial groups, n-gram tail, DSpark rings)")


if __name__ == "__main__":
    main()
