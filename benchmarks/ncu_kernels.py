"""Launch the kernels whose speed targets are open (issue #7) a few times each, for Nsight Compute.

    ncu --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats \
        --section WarpStateStats --section MemoryWorkloadAnalysis -k regex:'fp8_gemm|sparse_attn_fwd' \
        --launch-skip 1 --launch-count 3 python3 benchmarks/ncu_kernels.py

Kernels, at the release shapes: the fp8 GEMM 4096x5120x5120 (default ping-pong, then the 3-consumer "ws", or the
configurations --gemm-cfgs lists),
and the sparse-attention forward (default warp-specialised kernel), each launched twice (the first launch
of each may include module loading; skip it with --launch-skip / -k).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", default="gemm,attn")
    ap.add_argument("--gemm-cfgs", default='[{"kernel": "pingpong"}, {"kernel": "ws"}]',
                    help="JSON list of fp8_gemm configurations to launch (default: the ping-pong, then ws)")
    args = ap.parse_args(argv)
    from functional_dsv41 import quant
    from functional_dsv41.kernels import bench
    from functional_dsv41.kernels.tilelang import fp8_gemm_tl as fg
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    if "gemm" in args.what:
        M, N, K = 4096, 5120, 5120
        g = torch.Generator(device="cuda").manual_seed(0)
        a, a_s = quant.act_quant(torch.randn(M, K, device="cuda", generator=g).bfloat16())
        w, w_s = quant.quant_fp8_block(torch.randn(N, K, device="cuda", generator=g) / K ** 0.5)
        for cfg in json.loads(args.gemm_cfgs):
            for _ in range(2):
                fg.fp8_gemm(a, a_s, w, w_s, **cfg)
        torch.cuda.synchronize()
    if "attn" in args.what:
        x = bench._attn_release_inputs(types.SimpleNamespace(m=4096))
        for _ in range(2):
            sa._fwd(x["q"], x["kv"], x["sink"], x["idx"], x["scale"], 64)
        torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
