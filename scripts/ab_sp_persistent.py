"""A/B of fwd_kernel_sp against fwd_kernel_sp_persistent at the release shape, interleaved (4 rounds, each variant
once a round, same process and inputs), so that the machine's drift between calls does not decide (H200 run 39)."""
import torch
from functional_dsv41.kernels import bench as B
from functional_dsv41.kernels.tilelang import sparse_attn_sp_tl as sp
class A: m = 4096
a = B._attn_release_inputs(A)
q, kv, sink, idx, scale, fl = (a[k] for k in ("q", "kv", "sink", "idx", "scale", "fl"))
base = dict(BI=64, stages=2, gather="rows")
V = {"sp": sp.fwd_kernel_sp(64, 512, 640, scale, **sp.FWD_SP_CFG),
     "p132": sp.fwd_kernel_sp_persistent(64, 512, 640, scale, 132, **base),
     "p132 cols": sp.fwd_kernel_sp_persistent(64, 512, 640, scale, 132, **{**base, "gather": "cols"}),
     "p132 nopf": sp.fwd_kernel_sp_persistent(64, 512, 640, scale, 132, **base, prefetch=False),
     "p4096": sp.fwd_kernel_sp_persistent(64, 512, 640, scale, 4096, **base)}
res = {k: [] for k in V}
for r in range(4):
    for k, kf in V.items():
        res[k].append(B.bench(lambda: kf(q, kv, sink, idx), warmup=50, rep=300))
for k, v in res.items():
    print(f"{k:12s} " + " ".join(f"{x:.3f}" for x in v) + f"  min {min(v):.3f} ms = {fl / min(v) / 1e9:.1f} TFLOP/s", flush=True)
