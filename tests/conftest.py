"""Shared test helpers: where the golden fixtures live, and GPU marking.

The fixtures are found through ``DSV41_FIXTURES`` (default: ``../shared/fixtures`` beside the
repository). Where a fixture folder is absent the golden tests skip, saying what is missing.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("DSV41_FIXTURES", REPO.parent / "shared" / "fixtures"))


def fixture_dir(name: str) -> Path:
    """Path of fixtures/<name>; skips the calling test when it is not there."""
    p = FIXTURES / name
    if not p.is_dir():
        pytest.skip(f"golden fixture folder {p} not found (set DSV41_FIXTURES)")
    return p


@pytest.fixture(autouse=True)
def _seed_gpu_tests(request):
    """GPU tests draw some operands from torch's global generator; seed it per test so that a test's inputs do
    not depend on which tests ran before it (a sanitizer run's subset drew a different ``do``: BENCHMARKS run 21)."""
    if request.node.get_closest_marker("gpu") is not None:
        torch.manual_seed(0)
    yield


_GOLDEN_CACHE: dict = {}


def golden(name: str) -> dict[str, torch.Tensor]:
    """fixtures/<name>/golden.safetensors as a dict (cached per session)."""
    if name not in _GOLDEN_CACHE:
        from safetensors.torch import load_file
        _GOLDEN_CACHE[name] = load_file(str(fixture_dir(name) / "golden.safetensors"))
    return _GOLDEN_CACHE[name]


def block_input(g: dict, cfg, L: int):
    """Teacher forcing: the golden input (h [b, s, hc, dim], pre [b, s, hc]) of backbone block L of a prefill
    golden file — the embedding broadcast over the streams for block 0, else block L-1's h / pre_mix, and the
    Engram output where block L starts with Engram."""
    P = int(g["prefill_len"])
    if L == 0:
        b = g["input_ids"].shape[0]
        h = g["prefill.embed"].unsqueeze(2).expand(b, P, cfg.hc_mult, cfg.dim).contiguous()
        pre = torch.zeros(b, P, cfg.hc_mult)
        pre[..., 0] = 1
    else:
        h, pre = g[f"prefill.layer.{L - 1}.h"], g[f"prefill.layer.{L - 1}.pre_mix"]
    if f"prefill.layer.{L}.engram_out" in g:
        h = g[f"prefill.layer.{L}.engram_out"]
    return h, pre


def cosine_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DESIGN.md metric: 1 - 2<x,y>/(|x|^2+|y|^2) in float64."""
    x, y = x.double().flatten(), y.double().flatten()
    den = (x * x).sum() + (y * y).sum()
    if den == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / den)


@pytest.fixture
def one_thread():
    """Run a test on one torch thread: multithreaded CPU matmuls sum in another order, and some tests
    compare against the reference bit for bit."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    # scripts/precompile_kernels.py's ``tests`` mode runs the GPU tests on CPU tensors (launches stubbed) to
    # compile their kernels; their results are meaningless there
    if torch.cuda.is_available() or os.environ.get("DSV41_TEST_DEVICE") == "cpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ------------------------------------------------------------------ golden trajectories and machine numerics
# The golden files were captured on one CPU. Another CPU's BLAS and SIMD kernels round some fp32 sums differently
# in the last ulp (seen 2026-12-04 on a Sapphire Rapids machine with AMX: MKL's sgemm takes other kernels), and in
# these tiny random models such an ulp can flip a near-tie expert or index choice, after which the run follows
# another trajectory (DESIGN.md: "an end-to-end mismatch that starts at a near-tie flip is a finding to report").
# The teacher-forced tests check every block whatever the machine; the end-to-end ones check the golden
# trajectory up to the first flip and, past it, skip with the figures instead of comparing another trajectory.
FLIP_KEYS = ("gate_idx", "sparse_idx", "topk_idxs")
MAX_FLIP_ROWS = 0.05            # a flip, not a systematic error: at most this share of a layer's rows differ


def golden_divergence(dbg: dict, g: dict, cfg) -> dict | None:
    """The first backbone layer whose discrete choices (experts ``gate_idx``, attended slots ``sparse_idx``, index
    top-k ``topk_idxs``) in an end-to-end prefill (``dbg`` from ``forward(debug=...)``) differ from the golden
    run's, as {layer, what, rows, of, before} (``before``: the worst cosine diff of ``h`` over the layers before
    it), or None when every choice matches."""
    worst = 0.0
    for L in cfg.layer_ids:
        for key in FLIP_KEYS:
            ref, ours = g.get(f"prefill.layer.{L}.{key}"), dbg.get(f"layer.{L}.{key}")
            if ref is None or ours is None:
                continue
            ours = ours.to(ref.dtype).reshape(ref.shape)
            rows = (ours != ref).reshape(-1, ref.shape[-1]).any(-1)
            if rows.any():
                return dict(layer=L, what=key, rows=int(rows.sum()), of=rows.numel(), before=worst)
        worst = max(worst, cosine_diff(dbg[f"layer.{L}.h"], g[f"prefill.layer.{L}.h"]))
    return None


def divergence_report(name: str, div: dict) -> str:
    return (f"{name}: on this machine the end-to-end prefill first chooses differently from the golden run at layer "
            f"{div['layer']} ({div['what']}: {div['rows']} of {div['of']} rows), every block before it within "
            f"{div['before']:.1e} cosine diff of the golden; the golden trajectory past that near-tie flip is not "
            f"this machine's (teacher-forced blocks are checked separately)")


def check_flip(name: str, div: dict, tol: float) -> None:
    """Assert that a divergence is a near-tie flip: the blocks before it agree within ``tol`` and only a few rows
    of the layer choose differently."""
    assert div["before"] < tol, divergence_report(name, div)
    assert div["rows"] <= MAX_FLIP_ROWS * div["of"] + 1, divergence_report(name, div)
    print(divergence_report(name, div))


_DIVERGENCE: dict = {}


def fixture_divergence(name: str):
    """golden_divergence of the text fixture ``name``'s golden prefill (cached)."""
    if name not in _DIVERGENCE:
        import functional_dsv41 as fd
        d = fixture_dir(name)
        cfg = fd.Config.from_json(d / "config.json")
        params = fd.load_params(d, cfg)
        g = golden(name)
        P, dbg = int(g["prefill_len"]), {}
        st = fd.init_state(cfg, g["input_ids"].shape[0], cfg.max_seq_len)
        fd.forward(params, {"input_ids": g["input_ids"][:, :P]}, cfg=cfg, state=st, debug=dbg)
        _DIVERGENCE[name] = golden_divergence(dbg, g, cfg)
    return _DIVERGENCE[name]


def skip_off_golden_trajectory(name: str, tol: float = 1e-4) -> None:
    """Skip an end-to-end golden comparison (logits, decode steps, generated tokens) when this machine's prefill
    leaves the golden trajectory at a near-tie flip; fail if the divergence is not one."""
    div = fixture_divergence(name)
    if div is not None:
        check_flip(name, div, tol if "fp8" not in name else 1e-3)
        pytest.skip(divergence_report(name, div))
