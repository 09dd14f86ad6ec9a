"""Functional AdamW vs torch.optim.AdamW, clipping vs clip_grad_norm_, and schedule values."""
import math

import pytest
import torch

from functional_dsv41.train import optim


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"layers.0.attn.wq_a.weight": torch.randn(8, 6, generator=g),
            "layers.0.attn_norm.weight": torch.randn(6, generator=g),
            "layers.0.hc_attn_base": torch.randn(3, 4, generator=g)}


def test_adamw_matches_torch_bitwise():
    cfg = optim.AdamWConfig(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    params = _tensors()
    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    decay = [ref[k] for k in ref if optim.decays(k, ref[k])]
    no_decay = [ref[k] for k in ref if not optim.decays(k, ref[k])]
    assert len(decay) == 1 and len(no_decay) == 2  # the norm weight and the hc base are not decayed
    topt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    state = optim.adamw_init(params)
    for i in range(5):
        lr = 1e-2 * (i + 1) / 5
        grads = {k: torch.randn_like(v, generator=torch.Generator().manual_seed(100 + i)) for k, v in params.items()}
        for group in topt.param_groups:
            group["lr"] = lr
        for k in ref:
            ref[k].grad = grads[k].clone()
        topt.step()
        params, state = optim.adamw_update(grads, state, params, lr=lr, cfg=cfg)
    for k in params:
        assert torch.equal(params[k], ref[k].detach()), k
        assert torch.equal(state["mu"][k], topt.state[ref[k]]["exp_avg"]), k
        assert torch.equal(state["nu"][k], topt.state[ref[k]]["exp_avg_sq"]), k
    assert state["count"] == 5


def test_adamw_does_not_modify_inputs():
    params = _tensors()
    before = {k: v.clone() for k, v in params.items()}
    state = optim.adamw_init(params)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    new, st = optim.adamw_update(grads, state, params, lr=0.1)
    assert all(torch.equal(params[k], before[k]) for k in params)
    assert all(not torch.equal(new[k], before[k]) for k in params)
    assert all(float(v.abs().sum()) == 0 for v in state["mu"].values())


def test_no_decay_rules():
    w = torch.zeros(4, 4)
    assert optim.decays("layers.3.ffn.experts.0.w1.weight", w)
    assert optim.decays("embed.weight", w)
    for p in ("layers.0.attn.q_norm.weight", "layers.0.hc_ffn_base", "layers.0.hc_attn_scale",
              "layers.0.attn.attn_sink", "vision.x.bias", "layers.2.attn.compressor.norm.weight"):
        assert not optim.decays(p, w), p
    assert not optim.decays("layers.0.ffn.gate.weight_1d", torch.zeros(4))
    # Engram per-channel gains [hc_mult, dim] (ones, SPEC 6.5) are like norm weights; its wkv projection decays
    for p in ("layers.1.engram.q_weight", "layers.14.engram.k_weight"):
        assert not optim.decays(p, torch.ones(4, 128)), p
    assert optim.decays("layers.1.engram.wkv.weight", w)


def test_clip_matches_torch():
    grads = {"a": torch.randn(5, 5) * 10, "b": torch.randn(7) * 10}
    clipped, norm = optim.clip_by_global_norm(grads, 1.0)
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for r, g in zip(ref, grads.values()):
        r.grad = g.clone()
    tnorm = torch.nn.utils.clip_grad_norm_(ref, 1.0, foreach=False)
    assert torch.allclose(norm, tnorm, rtol=1e-6)
    for r, g in zip(ref, clipped.values()):
        assert torch.allclose(r.grad, g, rtol=1e-6, atol=1e-7)
    assert abs(float(optim.global_norm(clipped)) - 1.0) < 1e-4
    small = {"a": torch.full((3,), 0.01)}
    same, _ = optim.clip_by_global_norm(small, 1.0)
    assert torch.equal(same["a"], small["a"])
    for off in (0.0, -1.0):                              # <= 0 turns clipping off (0 zeroed every gradient)
        kept, norm = optim.clip_by_global_norm(grads, off)
        assert all(torch.equal(kept[k], grads[k]) for k in grads) and float(norm) > 1.0


def test_schedule_values():
    f = lambda s: optim.lr_at(s, peak=1e-3, warmup=10, total=110, min_ratio=0.1)
    assert f(0) == pytest.approx(1e-4)
    assert f(9) == pytest.approx(1e-3)
    assert f(10) == pytest.approx(1e-3)
    assert f(60) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 50 / 99)))
    assert f(109) == pytest.approx(1e-4)
    assert f(500) == pytest.approx(1e-4)
    assert all(f(s) >= f(s + 1) for s in range(10, 120))


def test_non_finite_hyperparameters_are_refused():
    # clip=NaN passed `max_norm <= 0` and scaled every gradient by NaN; lr / weight_decay = inf passed through:
    # one update made every parameter non-finite, after the finiteness checks of the step had run
    params = _tensors()
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    with pytest.raises(ValueError, match="max_norm is NaN"):
        optim.clip_by_global_norm(grads, float("nan"))
    same, _ = optim.clip_by_global_norm(grads, float("inf"))
    assert all(torch.equal(same[k], grads[k]) for k in grads)
    st = optim.adamw_init(params)
    for lr, wd in ((float("inf"), 0.1), (1e-3, float("inf")), (float("nan"), 0.1)):
        with pytest.raises(ValueError, match="must be finite"):
            optim.adamw_update(grads, st, params, lr=lr, cfg=optim.AdamWConfig(weight_decay=wd))


def test_adamw_bf16_param_is_updated_in_fp32_and_rounded_back():
    """Module docstring: a bf16 parameter is updated in fp32 and rounded back, the moments are fp32 (bf16 gradients
    promoted). One step from bf16 values equals torch's AdamW on their fp32 copies, rounded to bf16."""
    g = torch.Generator().manual_seed(1)
    params = {"layers.0.attn.wq_a.weight": torch.randn(8, 6, generator=g).bfloat16(),
              "layers.0.attn_norm.weight": torch.randn(6, generator=g).bfloat16()}
    grads = {k: torch.randn(v.shape, generator=g).bfloat16() for k, v in params.items()}
    new, st = optim.adamw_update(grads, optim.adamw_init(params), params, lr=1e-2, cfg=optim.AdamWConfig())
    ref = {k: v.float().requires_grad_(True) for k, v in params.items()}
    topt = torch.optim.AdamW([{"params": [ref["layers.0.attn.wq_a.weight"]], "weight_decay": 0.1},
                              {"params": [ref["layers.0.attn_norm.weight"]], "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for k in ref:
        ref[k].grad = grads[k].float()
    topt.step()
    for k in params:
        assert new[k].dtype == torch.bfloat16, k
        assert torch.equal(new[k], ref[k].detach().bfloat16()), k
        assert st["mu"][k].dtype == st["nu"][k].dtype == torch.float32, k
        assert torch.equal(st["mu"][k], topt.state[ref[k]]["exp_avg"]), k
        assert torch.equal(st["nu"][k], topt.state[ref[k]]["exp_avg_sq"]), k


def test_adamw_refuses_grads_of_other_params():
    params = _tensors()
    st = optim.adamw_init(params)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    with pytest.raises(KeyError, match=r"keys differ \(missing \[\], extra \['extra.weight'\]\)"):
        optim.adamw_update({**grads, "extra.weight": torch.ones(2, 2)}, st, params, lr=1e-3)
    short = {k: v for k, v in grads.items() if k != "layers.0.hc_attn_base"}
    with pytest.raises(KeyError, match=r"keys differ \(missing \['layers.0.hc_attn_base'\]"):
        optim.adamw_update(short, st, params, lr=1e-3)


def test_clip_coefficient_near_a_tiny_norm_matches_torch():
    """clip_grad_norm_'s coefficient is max_norm / (norm + 1e-6): it matters where the norm is ~1e-6
    (norm 1e-6, max_norm 1e-7: coefficient 0.05, not 0.1)."""
    grads = {"a": torch.full((4,), 5e-7), "b": torch.zeros(3)}
    clipped, norm = optim.clip_by_global_norm(grads, 1e-7)
    assert float(norm) == pytest.approx(1e-6, rel=1e-6)
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for r, g in zip(ref, grads.values()):
        r.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(ref, 1e-7, foreach=False)
    for r, g in zip(ref, clipped.values()):
        assert torch.allclose(r.grad, g, rtol=1e-5, atol=0)
    assert torch.allclose(clipped["a"], torch.full((4,), 5e-7 * 0.05), rtol=1e-5, atol=0)


def test_schedule_without_room_to_decay():
    """lr_at's docstring: a run with total - 1 <= warmup ends in warmup or at its peak (step warmup) and never
    decays; the cosine then spans the one step after warmup (warmup 4: 0.25, 0.5, 0.75, 1 x peak, then peak)."""
    f = lambda s, total: optim.lr_at(s, peak=2.0, warmup=4, total=total, min_ratio=0.1)
    assert [f(s, 5) for s in range(5)] == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0])
    assert f(5, 5) == pytest.approx(0.2)                        # one step past warmup: the floor
    assert [f(s, 3) for s in range(3)] == pytest.approx([0.5, 1.0, 1.5])
    assert f(4, 4) == pytest.approx(2.0)
