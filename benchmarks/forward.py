"""CPU benchmark: forward (prefill) tokens/s of a small config at sequence lengths 64 .. 4096.

Each query reads at most ``window + index_topk`` KV rows, so the attention part grows linearly with
the sequence; the indexer's scoring (every query against every visible compressed entry, then the
candidate blocks and the top-k) is the one quadratic term. The table prints the time per token at
each length, the indexer's share of it (from a profile of one more forward), and the time per token
of everything else, which stays flat (linear total cost) past the window.

    .venv/bin/python benchmarks/forward.py [--lengths 64,128,...] [--batch 1] [--repeat 2] [--threads N]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import functional_dsv41 as fd  # noqa: E402
from functional_dsv41.kernels._bench_common import positive_int  # noqa: E402


def int_list(s: str) -> list[int]:
    """argparse type: comma-separated integers >= 1."""
    try:
        return [positive_int(x) for x in s.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{s!r}: {e}") from None


def indexer_share(params, ids, cfg, mode) -> float:
    """Share of the forward spent in the indexer's all-pairs work (scores, candidate blocks, top-k)."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    with torch.no_grad():
        prof.runcall(fd.forward, params, {"input_ids": ids}, cfg=cfg, mode=mode)
    st = pstats.Stats(prof).stats
    total = max(v[3] for (f, _, name), v in st.items() if name == "forward" and f.endswith("model.py"))
    idx = sum(v[3] for (f, _, name), v in st.items()
              if os.path.basename(f) == "indexer.py" and name in ("index_scores", "candidate_mask", "select_topk"))
    # (the model's indexer.py only: kernels/reference_indexer.py's index_scores runs inside it, counted once)
    return idx / total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int_list, default="64,128,256,512,1024,2048,4096")
    ap.add_argument("--batch", type=positive_int, default=1)
    ap.add_argument("--repeat", type=positive_int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--mode", default="reference", choices=["reference", "dequant"])
    args = ap.parse_args(argv)
    if args.threads < 0:
        ap.error(f"argument --threads: must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = args.lengths
    cfg = fd.Config.tiny(max_seq_len=max(lengths), index_topk=16, window_size=16, candidate_topk_blocks=8)
    params = fd.init_params(cfg, seed=0)
    params["engram_token_map"] = torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size
    print(f"config: Config.tiny (dim {cfg.dim}, {cfg.n_layers} layers, window {cfg.window_size}, "
          f"index_topk {cfg.index_topk}), batch {args.batch}, mode {args.mode}, torch threads "
          f"{torch.get_num_threads()}")
    print(f"each query reads <= window + top-k = {cfg.window_size + cfg.index_topk} KV rows")
    print(f"{'seq':>6} {'ms/forward':>11} {'tokens/s':>10} {'us/token':>9} {'indexer':>8} "
          f"{'rest us/token':>14}")
    gen = torch.Generator().manual_seed(0)
    for n in lengths:
        ids = torch.randint(0, cfg.vocab_size, (args.batch, n), generator=gen)
        fd.forward(params, {"input_ids": ids[:, :min(n, 32)]}, cfg=cfg, mode=args.mode)  # warm up
        best = float("inf")
        for _ in range(args.repeat):
            t = time.perf_counter()
            with torch.no_grad():
                fd.forward(params, {"input_ids": ids}, cfg=cfg, mode=args.mode)
            best = min(best, time.perf_counter() - t)
        per_tok = best / (n * args.batch) * 1e6
        share = indexer_share(params, ids, cfg, args.mode)
        print(f"{n:>6} {best * 1e3:>11.1f} {n * args.batch / best:>10.0f} {per_tok:>9.1f} {share:>7.0%} "
              f"{per_tok * (1 - share):>14.1f}")


if __name__ == "__main__":
    main()
