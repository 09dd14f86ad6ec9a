"""Sharding (DESIGN convention 8, functional_dsv41/sharding.py): the same forward on a plain and a DTensor tree.

The distributed checks run two CPU processes over gloo (tests/_sharding_worker.py, one per rank) for each mesh:
1-D ep, 1-D emb, and the 2-D (ep, emb) mesh with each dim the split one. Each rank asserts, on the tiny fp8 / fp4
model: its local shards' sizes; logits, main_hidden, chunked prefill + decode and the DSpark stages bit-equal to
the plain tree's; the dense dispatch within rounding; full_params giving back the released tree bit for bit;
uneven row splits of every storage dtype; the refusals; and the QAT gradients of the sharded leaves (and of the
replicated ones upstream of the split computations) against the plain tree's.

The same checks run over NCCL on two GPUs (marked gpu; skipped with fewer than two), rank r on cuda:r, with the
torch kernels (DSV41_KERNELS=torch: what is under test is the placements and the collectives, not the TileLang
kernels) and deterministic algorithms; there the plain tree runs on the same GPU, and values are checked within
fp32 rounding (the ranks' GEMMs on half the vocabulary may be other cuBLAS kernels), the worker printing how many
were bit-equal anyway.
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import functional_dsv41 as fd
from functional_dsv41 import sharding
from functional_dsv41.params import CheckpointError

from conftest import fixture_dir

WORKER = Path(__file__).with_name("_sharding_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NO_GLOO = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                             reason="torch.distributed with gloo is not available in this build")
TWO_GPUS = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
                                   and torch.distributed.is_available() and torch.distributed.is_nccl_available()),
                              reason="needs two CUDA GPUs and NCCL")


@NO_GLOO
@pytest.mark.parametrize("scenario", ["ep", "emb", "ep2_emb1", "ep1_emb2"])
def test_sharded_tree_runs_like_the_plain_one(scenario):
    _run_ranks(scenario)


@NO_GLOO
def test_sharded_release_layout_checkpoint_generates_like_the_plain_one():
    """tiny-fp8 as load_params gives it, over (ep 2, emb 1) and (ep 1, emb 2): logits, generate, speculative."""
    _run_ranks("checkpoint", str(fixture_dir("tiny-fp8")))


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("scenario", ["ep", "emb", "ep2_emb1", "ep1_emb2"])
def test_sharded_tree_runs_like_the_plain_one_over_nccl(scenario):
    print(_run_ranks(scenario, "--device", "cuda"))


@pytest.mark.gpu
@TWO_GPUS
def test_sharded_release_layout_checkpoint_generates_like_the_plain_one_over_nccl():
    print(_run_ranks("checkpoint", str(fixture_dir("tiny-fp8")), "--device", "cuda"))


def _run_ranks(scenario, *extra):
    """Two worker processes (rank 0, 1) of the scenario; asserts both printed "ok SCENARIO"; rank 0's output."""
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if "cuda" in extra:
        env.update(DSV41_KERNELS="torch", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", port, scenario, *extra], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"ok {scenario}" in out, f"rank {r} (exit {p.returncode}):\n{out[-4000:]}"
    return outs[0]


def _tiny(**kw):
    cfg = fd.Config.tiny(dtype="fp8", expert_dtype="fp4", **kw)
    params = fd.init_params(cfg, seed=0)
    params["engram_token_map"] = torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size
    return cfg, params


def _stacked(params):
    """params with every MoE layer's experts in the stacked form (plain tensors)."""
    out = dict(params)
    for group in ("layers", "mtp"):
        out[group] = [{**layer, "ffn": {**layer["ffn"], "experts": sharding.stack_experts(layer["ffn"]["experts"])}}
                      for layer in params[group]]
    return out


def test_plan_lists_what_each_mesh_dim_splits():
    cfg, params = _tiny()
    both = sharding.plan(params, ("ep", "emb"))
    experts = {f"layers.{i}.ffn.experts" for i in range(cfg.n_layers)} | \
              {f"mtp.{i}.ffn.experts" for i in range(cfg.n_mtp_layers)}
    rows = {"embed.weight", "head.weight"} | {f"layers.{L}.engram.embed.{leaf}" for L in cfg.engram_layer_ids
                                               for leaf in ("weight", "scale")}
    assert both == {**{p: "ep" for p in experts}, **{p: "emb" for p in rows}}
    assert sharding.plan(params, ("ep",)) == {p: "ep" for p in experts}
    assert sharding.plan(params, ("emb",)) == {p: "emb" for p in rows}


def test_stacked_experts_run_like_the_list():
    """The stacked form (what an ep-sharded tree holds) on one process: same logits, and back to the list."""
    cfg, params = _tiny()
    st = _stacked(params)
    w1 = st["layers"][3]["ffn"]["experts"]["w1"]
    assert w1["weight"].shape[0] == cfg.n_routed_experts and w1["weight"].dtype == torch.float4_e2m1fn_x2
    ids = torch.randint(0, cfg.vocab_size - 2, (2, 10), generator=torch.Generator().manual_seed(0))
    want = fd.forward(params, {"input_ids": ids}, cfg=cfg).logits
    assert torch.equal(fd.forward(st, {"input_ids": ids}, cfg=cfg).logits, want)
    back = sharding.unstack_experts(st["layers"][3]["ffn"]["experts"])
    for e, ex in enumerate(params["layers"][3]["ffn"]["experts"]):
        for proj in ex:
            for leaf, t in ex[proj].items():
                assert torch.equal(back[e][proj][leaf].view(torch.uint8), t.view(torch.uint8))


def test_params_check_reads_the_stacked_form():
    """forward's params check names a stack with too few experts or the wrong row shape."""
    cfg, params = _tiny()
    st = _stacked(params)
    ex = st["layers"][2]["ffn"]["experts"]
    ex["w2"] = {k: v[:5] for k, v in ex["w2"].items()}
    with pytest.raises(ValueError, match=r"layers\.2\.ffn\.experts\.w2\.weight has no expert 5"):
        fd.forward(st, {"input_ids": torch.zeros(1, 4, dtype=torch.long)}, cfg=cfg)
    st = _stacked(params)
    st["layers"][4]["ffn"]["experts"]["w1"]["weight"] = torch.zeros(cfg.n_routed_experts, 3, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"layers\.4\.ffn\.experts\.0\.w1\.weight \(row 0 of "
                                         r"layers\.4\.ffn\.experts\.w1\.weight\) is \(3, 4\)"):
        fd.forward(st, {"input_ids": torch.zeros(1, 4, dtype=torch.long)}, cfg=cfg)


def test_stack_experts_refuses_experts_that_differ():
    cfg, params = _tiny()
    experts = list(params["layers"][3]["ffn"]["experts"])
    experts[2] = {**experts[2], "w1": {**experts[2]["w1"], "weight": experts[2]["w1"]["weight"][:-1]}}
    with pytest.raises(ValueError, match=r"experts\.2\.w1\.weight: .* differs from expert 0's"):
        sharding.stack_experts(experts)
    experts[2] = {k: v for k, v in params["layers"][3]["ffn"]["experts"][2].items() if k != "w3"}
    with pytest.raises(ValueError, match=r"experts\.2: its tensors"):
        sharding.stack_experts(experts)


def test_plain_helpers_are_the_plain_ops():
    """Without a mesh the helpers are F.embedding / index_select / linear: nothing changes for a plain tree."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(9, 32, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[3, 0, 8]])
    assert torch.equal(sharding.embedding(ids, w), torch.nn.functional.embedding(ids, w))
    q = (torch.randn(9, 32, generator=g) * 8).to(torch.float8_e4m3fn)
    assert torch.equal(sharding.take_rows(q, ids[0]).view(torch.uint8), q.view(torch.uint8)[ids[0]])
    x = torch.randn(4, 32, generator=g)
    assert torch.equal(sharding.vocab_logits(x, w), torch.nn.functional.linear(x, w.float()))
    assert not sharding.is_sharded(w)


def test_save_and_tree_diff_name_the_stacked_form(tmp_path):
    """save_params writes the released layout: experts in the stacked form are refused by name, nothing written."""
    cfg, params = _tiny()
    st = _stacked(params)
    with pytest.raises(CheckpointError, match=r"layers\.0\.ffn\.experts holds its experts in the stacked form"):
        fd.save_params(st, tmp_path / "out", cfg)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    report = fd.tree_diff(params, st)          # a plain stacked tree compares (other paths), it does not raise
    assert not report.ok
