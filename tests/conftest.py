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
