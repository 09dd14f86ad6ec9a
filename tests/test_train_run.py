"""run.py end to end on a small budget: resume bit-identity, the non-finite guard, export round trip, CLI."""
import json
import os

import pytest
import torch

import functional_dsv41 as fd
from functional_dsv41.train import checkpoint as C
from functional_dsv41.train import run, step as S


def _rc(out, **kw):
    base = dict(config="tiny", steps=4, batch_size=2, seq_len=48, lr=3e-3, warmup=2, ckpt_every=2, keep_last=3,
                out=str(out), export=False, sample_tokens=0, progress="off")
    base.update(kw)
    return run.RunConfig(**base)


def _losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [(m["step"], m["loss/ce"], m["grad_norm"], m["lr"]) for m in map(json.loads, fh)]


class _Crash(RuntimeError):
    pass


def test_resume_is_bit_identical(tmp_path):
    a = run.train(_rc(tmp_path / "a"))
    assert a["status"] == "ok" and a["step"] == 4

    def crash(s, tr):
        if s == 2:
            raise _Crash("simulated kill after the step-2 checkpoint")
        return tr

    with pytest.raises(_Crash):
        run.train(_rc(tmp_path / "b"), fault=crash)
    assert C.TrainCheckpointer(str(tmp_path / "b" / "ckpt")).latest_step() == 2
    b = run.train(_rc(tmp_path / "b", resume=True))
    assert b["status"] == "ok" and b["step"] == 4
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    ra = C.TrainCheckpointer(str(tmp_path / "a" / "ckpt")).restore(4)
    rb = C.TrainCheckpointer(str(tmp_path / "b" / "ckpt")).restore(4)
    assert ra["data_state"] == rb["data_state"] and ra["opt_state"]["count"] == rb["opt_state"]["count"] == 4
    for k in ra["params"]:
        assert torch.equal(ra["params"][k].view(torch.uint8), rb["params"][k].view(torch.uint8)), k
    for k in ra["opt_state"]["mu"]:
        assert torch.equal(ra["opt_state"]["mu"][k], rb["opt_state"]["mu"][k])
        assert torch.equal(ra["opt_state"]["nu"][k], rb["opt_state"]["nu"][k])
    assert ra["params"]["layers.1.engram.embed.weight"].dtype == torch.float8_e4m3fn


def test_non_finite_stops_with_message_and_last_checkpoint_loads(tmp_path, capsys):
    leaf = "layers.2.attn.wq_b.weight"

    def poison(s, tr):
        if s == 2:                       # the 3rd step (step_no 3) sees a NaN weight
            tr = dict(tr)
            tr[leaf] = tr[leaf].clone()
            tr[leaf][0, 0] = float("nan")
        return tr

    r = run.train(_rc(tmp_path, steps=6), fault=poison)
    assert r["status"] == "non_finite" and r["step"] == 2
    err = capsys.readouterr().err
    assert "STOPPED: step 3: non-finite" in err and leaf in err, err
    assert "ce=nan" in err or "forward raised" in err, err
    ck = C.TrainCheckpointer(str(tmp_path / "ckpt"))
    assert ck.latest_step() == 2
    st = ck.restore()
    assert all(bool(torch.isfinite(v).all()) for k, v in st["params"].items() if v.is_floating_point()
               and v.element_size() > 1)


def test_main_exit_status(monkeypatch):
    monkeypatch.setattr(run, "train", lambda rc: {"status": "non_finite"})
    assert run.main(["--steps=1"]) == 2
    monkeypatch.setattr(run, "train", lambda rc: {"status": "ok"})
    assert run.main(["--steps=1"]) == 0


def test_non_finite_gradient_names_the_leaf():
    grads = {"a.weight": torch.ones(2), "b.weight": torch.tensor([1.0, float("inf")])}
    with pytest.raises(S.NonFiniteError, match=r"step 7: non-finite gradient .* b\.weight"):
        S._check_finite(7, {"ce": torch.tensor(1.0)}, grads, torch.tensor(float("inf")))


@pytest.mark.parametrize("preset", ["tiny", "tiny-qat"])
def test_export_then_load_params(tmp_path, preset, capsys):
    """The export is the final train state re-quantised to the release's storage; load_params reads it back."""
    r = run.train(_rc(tmp_path, config=preset, steps=1, ckpt_every=1, export=True, sample_tokens=3))
    assert r["status"] == "ok" and "sample" in r and "sample (greedy" in capsys.readouterr().out
    cfg = fd.Config.from_json(str(tmp_path / "export" / "config.json"))
    loaded = fd.load_params(str(tmp_path / "export"), cfg)          # strict: every tensor, shape, dtype
    flat = fd.flatten_with_paths(loaded)
    if preset == "tiny-qat":
        assert cfg.dtype == "fp8" and cfg.experts_dtype == "fp4"
        assert flat["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
        assert flat["layers.0.ffn.experts.0.w1.weight"].dtype == torch.float4_e2m1fn_x2
    assert flat["layers.1.engram.embed.weight"].dtype == torch.float8_e4m3fn
    assert "engram_token_map" in flat                                # built from the exported tokenizer.json
    want = C.to_storage(C.TrainCheckpointer(str(tmp_path / "ckpt")).restore(1)["params"], cfg)
    for k, v in flat.items():
        if k != "engram_token_map":
            assert v.dtype == want[k].dtype and torch.equal(v.contiguous().view(torch.uint8),
                                                            want[k].contiguous().view(torch.uint8)), k


def test_cli_parsing():
    rc = run.parse_args(["--config", "tiny", "--steps=7", "--out", "x", "--resume", "--loss.indexer_kl=0.5",
                         "--qat=true", "--lr", "1e-3"])
    assert (rc.steps, rc.out, rc.resume, rc.loss_indexer_kl, rc.qat, rc.lr) == (7, "x", True, 0.5, True, 1e-3)
    assert run.parse_args(["--config=tiny-qat"]).qat is True
    with pytest.raises(SystemExit, match="unknown option"):
        run.parse_args(["--stepz=3"])
    with pytest.raises(SystemExit, match="cannot read"):
        run.parse_args(["--steps=many"])
