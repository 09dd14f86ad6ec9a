"""``impl`` reaches every kernel call: ``forward``, speculative ``generate`` and ``dspark_forward`` with
``impl="torch"`` must never fall back to the process default (``DSV41_KERNELS``, "auto"), or a GPU run asked
for the torch reference would still run TileLang GEMMs in the projections and experts (as it did before this
test: ``linear()`` calls did not receive ``impl``)."""
import pytest
import torch

import functional_dsv41 as fd
from functional_dsv41 import kernels


@pytest.fixture
def calls(monkeypatch):
    """(op, impl) of every kernel call; a call without an explicit impl fails the test."""
    seen = []
    real = kernels.resolve

    def resolve(name, impl=None, *, on_cuda=True):
        seen.append((name, impl))
        return real(name, impl, on_cuda=on_cuda)

    def no_default():
        raise AssertionError("a kernel was called without impl= (it would use the process default)")

    monkeypatch.setattr(kernels, "resolve", resolve)
    monkeypatch.setattr(kernels, "default_impl", no_default)
    return seen


def _model():
    cfg = fd.Config.tiny(dtype="fp8", expert_dtype="fp4")        # quantised storage: linear() runs the GEMM ops
    params = fd.init_params(cfg, seed=0)
    params["engram_token_map"] = torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size
    return cfg, params


def test_forward_and_generate_pass_impl_to_every_kernel(calls):
    cfg, params = _model()
    ids = torch.tensor([[0, 17, 33, 5, 250, 7, 9, 11, 40, 41, 42, 43]])
    fd.forward(params, {"input_ids": ids}, cfg=cfg, state=fd.init_state(cfg, 1, 32), impl="torch")
    names = {n for n, _ in calls}
    assert {"act_quant", "fp8_gemm", "fp4_gemm_grouped", "sparse_attn", "hc_split_sinkhorn", "index_scores",
            "index_topk", "index_candidates"} <= names, names
    calls.clear()
    fd.generate(params, [[0, 17, 33, 5, 250]], cfg=cfg, max_new_tokens=4, speculative=True, impl="torch")
    assert {"fp8_gemm", "fp4_gemm_grouped", "sparse_attn"} <= {n for n, _ in calls}
    assert {i for _, i in calls} == {"torch"}


def test_dspark_forward_passes_impl(calls):
    from functional_dsv41.dspark import dspark_forward
    cfg, params = _model()
    ids = torch.tensor([[0, 17, 33, 5, 250, 7, 9, 11]])
    out = fd.forward(params, {"input_ids": ids}, cfg=cfg, impl="torch", mode="reference")
    calls.clear()
    dspark_forward(params, out.main_hidden, ids, cfg=cfg, anchors=torch.tensor([1, 4]), impl="torch")
    assert "fp8_gemm" in {n for n, _ in calls} and {i for _, i in calls} == {"torch"}
