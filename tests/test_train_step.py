"""Step plumbing without the model: remat under torch.func, the trainable/frozen split."""
import pytest
import torch
from torch.func import grad_and_value

from functional_dsv41.train import step as S


def _blk(p, h, pre, *, k):
    y = torch.tanh(h @ p["w"]) * k
    return {"h": y, "idx": y.argmax(-1), "none": None}, pre + y.sum(-1)


def test_remat_matches_plain_gradients_under_torch_func():
    g = torch.Generator().manual_seed(0)
    W = [{"w": torch.randn(4, 4, dtype=torch.float64, generator=g)} for _ in range(3)]
    x = torch.randn(3, 4, dtype=torch.float64, generator=g)

    def f(W, wrap):
        h, pre = x, torch.zeros(3, dtype=torch.float64)
        for p in W:
            o, pre = (S.remat(_blk) if wrap else _blk)(p, h, pre, k=2.0)
            assert o["none"] is None and o["idx"].dtype == torch.long
            h = o["h"]
        return h.sum() + pre.sum()

    (g1, v1), (g0, v0) = grad_and_value(f)(W, True), grad_and_value(f)(W, False)
    assert torch.equal(v1, v0)
    assert all(torch.equal(a["w"], b["w"]) for a, b in zip(g1, g0))


def test_remat_needs_a_model_hook():
    def forward(params, batch, *, cfg, state=None, mode="dequant"):
        return None
    with pytest.raises(NotImplementedError, match="block_wrapper"):
        S.remat_forward_kwargs(forward)

    def forward2(params, batch, *, cfg, block_wrapper=None):
        return None
    assert S.remat_forward_kwargs(forward2)["block_wrapper"] is S.remat


def test_split_params_trainable_and_frozen():
    params = {"embed": {"weight": torch.ones(3, 2, dtype=torch.bfloat16)},
              "layers": [{"engram": {"embed": {"weight": torch.ones(5, 32).to(torch.float8_e4m3fn),
                                               "scale": torch.ones(5, 1).to(torch.float8_e8m0fnu)},
                                     "wkv": {"weight": torch.ones(2, 2)}},
                          "attn": {"wq_a": {"weight": torch.ones(2, 2).to(torch.float8_e4m3fn)}},
                          "table": {"weight": torch.ones(2, 2)}}],
              "engram_token_map": torch.arange(4)}
    tr, fr = S.split_params(params, frozen=("layers.*.table.*",))
    assert set(tr) == {"embed.weight", "layers.0.engram.wkv.weight"}
    assert all(v.dtype == torch.float32 for v in tr.values())
    assert {"engram_token_map", "layers.0.table.weight", "layers.0.attn.wq_a.weight",
            "layers.0.engram.embed.weight", "layers.0.engram.embed.scale"} == set(fr)
    tree = S.assemble(tr, fr, {k: torch.bfloat16 for k in tr})
    assert tree["embed"]["weight"].dtype == torch.bfloat16 and tree["engram_token_map"] is fr["engram_token_map"]
