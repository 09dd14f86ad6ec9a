"""run.py end to end on a small budget: resume bit-identity, the non-finite guard, export round trip, CLI."""
import json
import os

import pytest
import torch

import functional_dsv41 as fd
from functional_dsv41.config import write_atomic
from functional_dsv41.params import train_state as C
from functional_dsv41.train import resume, run, step as S


def _rc(out, **kw):
    base = dict(config="tiny", steps=4, batch_size=2, seq_len=48, lr=3e-3, warmup=2, ckpt_every=2, keep_last=3,
                out=str(out), export=False, sample_tokens=0, progress="off")
    base.update(kw)
    return run.preset_config(**{"name": base.pop("config"), **base})


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
def test_export_then_load_params(tmp_path, preset, capsys, monkeypatch):
    """The export is the final train state re-quantised to the release's storage; load_params reads it back.
    The sample is what the export generates: a QAT run's is drawn from the exported fp8/fp4 tree in the
    release's numerics (mode 'reference', as `generate --ckpt OUT/export` runs it; the fake-quantised training
    function's greedy sample could differ), a bf16 run's from the trained params."""
    modes = []
    sample = run.greedy_sample
    monkeypatch.setattr(run, "greedy_sample", lambda *a, **k: modes.append(a[-1]) or sample(*a, **k))
    r = run.train(_rc(tmp_path, config=preset, steps=1, ckpt_every=1, export=True, sample_tokens=3))
    assert r["status"] == "ok" and "sample" in r and "sample (greedy" in capsys.readouterr().out
    assert modes == ["reference" if preset == "tiny-qat" else "dequant"]
    cfg = fd.Config.from_json(str(tmp_path / "export" / "config.json"))
    loaded = fd.load_params(str(tmp_path / "export"), cfg)          # strict: every tensor, shape, dtype
    res = fd.generate(loaded, [[0] + run.load_tokenizer(run.RunConfig().tokenizer).encode(run.RunConfig().sample_prompt).ids],
                      cfg=cfg, max_new_tokens=3, temperature=0.0, eos_id=1)
    tok = run.load_tokenizer(run.RunConfig().tokenizer)
    assert r["sample"].startswith(run.RunConfig().sample_prompt)
    assert tok.decode(tok.encode(run.RunConfig().sample_prompt).ids + res[0]) == r["sample"]   # the export's own
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


def test_failed_export_keeps_the_earlier_export_whole(tmp_path, monkeypatch, capsys):
    """A resumed run re-exports into OUT/export; a write that failed midway (disk full) tore the earlier export's
    tokenizer.json (copied in place) and config.json (written in place), so the folder no longer loaded."""
    assert run.train(_rc(tmp_path, steps=1, ckpt_every=1, export=True))["status"] == "ok"
    exp = tmp_path / "export"
    before = {n: (exp / n).read_bytes() for n in os.listdir(exp)}
    assert {"tokenizer.json", "config.json", "model.safetensors"} <= set(before)
    import shutil

    def torn_copy(src, dst, **kw):
        with open(dst, "wb") as fh:
            fh.write(b'{"version": "1.0", "trunc')
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(shutil, "copyfile", torn_copy)
    r = run.train(_rc(tmp_path, steps=2, ckpt_every=1, export=True, resume=True))
    assert r["status"] == "write_failed" and "simulated" in capsys.readouterr().err
    monkeypatch.undo()
    assert sorted(os.listdir(exp)) == sorted(before)                 # no temporary file left either
    assert (exp / "tokenizer.json").read_bytes() == before["tokenizer.json"]
    assert (exp / "config.json").read_bytes() == before["config.json"]
    cfg = fd.Config.from_json(str(exp / "config.json"))
    assert "engram_token_map" in fd.load_params(str(exp), cfg)      # the folder still loads, token map included


def test_cli_parsing():
    rc = run.parse_args(["--config", "tiny", "--steps=7", "--out", "x", "--resume", "--loss.indexer_kl=0.5",
                         "--qat=true", "--lr", "1e-3"])
    assert (rc.steps, rc.out, rc.resume, rc.loss_indexer_kl, rc.qat, rc.lr) == (7, "x", True, 0.5, True, 1e-3)
    assert run.parse_args(["--config=tiny-qat"]).qat is True
    with pytest.raises(SystemExit, match="unknown option"):
        run.parse_args(["--stepz=3"])
    with pytest.raises(SystemExit, match="cannot read"):
        run.parse_args(["--steps=many"])


# ----------------------------------------------------------------------------- resume checks, OUT records
def _records(out):
    """The bytes of OUT's record files and the names in OUT/ckpt: what a refused run must leave as it was."""
    snap = {n: open(os.path.join(out, n), "rb").read() for n in ("config.json", "run_config.json", "metrics.jsonl")
            if os.path.exists(os.path.join(out, n))}
    snap["ckpt/"] = sorted(os.listdir(os.path.join(out, "ckpt")))
    return snap


def _small_corpus(path, first_line="One short story."):
    lines = open(run.CORPUS_TXT, encoding="utf-8").read().splitlines()[:300]
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join([first_line] + lines) + "\n")
    return str(path)


@pytest.mark.parametrize("change, names", [
    (dict(config="tiny-qat", qat=True), ["config.dtype 'bf16' -> 'fp8'", "forward_mode 'dequant' -> 'qat'"]),
    (dict(seq_len=64, seed=5, lr=1.0), ["seq_len 48 -> 64", "seed 0 -> 5", "lr 0.003 -> 1.0"]),
    (dict(batch_size=3, warmup=1, weight_decay=0.0, loss_indexer_kl=0.1), ["batch_size", "warmup", "weight_decay",
                                                                           "loss_indexer_kl"]),
    (dict(corpus="CHANGED"), ["corpus_sha256"]),
    (dict(steps=1), ["at step 2, past --steps 1"]),
    (dict(resume=False, config="tiny-qat"), ["already holds checkpoints"]),
])
def test_resume_refuses_other_settings_and_keeps_records(tmp_path, change, names):
    corpus = _small_corpus(tmp_path / "corpus.txt")
    out = tmp_path / "run"
    assert run.train(_rc(out, steps=2, corpus=corpus))["status"] == "ok"
    before = _records(out)
    if change.get("corpus") == "CHANGED":            # same path, other content
        _small_corpus(tmp_path / "corpus.txt", first_line="Another short story.")
        change = {**change, "corpus": corpus}
    with pytest.raises(SystemExit) as e:
        run.train(_rc(out, **{"steps": 4, "resume": True, "corpus": corpus, **change}))
    for n in names:
        assert n in str(e.value), str(e.value)
    assert _records(out) == before                  # nothing of the run being resumed was rewritten


def test_resume_extends_steps_on_the_original_schedule(tmp_path):
    """--steps may grow on resume; the lr schedule keeps its first length and run_config.json its first record."""
    assert run.train(_rc(tmp_path, steps=4, warmup=1))["status"] == "ok"
    first = open(tmp_path / "run_config.json", "rb").read()
    r = run.train(_rc(tmp_path, steps=6, warmup=1, resume=True, log_every=3))
    assert r["status"] == "ok" and r["step"] == 6
    floor = 3e-3 * run.RunConfig.min_lr_ratio                 # the 4-step cosine has reached its floor
    assert [(s, lr) for s, _, _, lr in _losses(tmp_path)][3:] == [(4, pytest.approx(floor)), (5, pytest.approx(floor)),
                                                                   (6, pytest.approx(floor))]
    assert open(tmp_path / "run_config.json", "rb").read() == first
    res = [json.loads(ln) for ln in open(tmp_path / "resumes.jsonl")]
    assert [(x["from_step"], x["run_config"]["steps"], x["run_config"]["log_every"]) for x in res] == [(4, 6, 3)]
    ck = C.TrainCheckpointer(str(tmp_path / "ckpt"))
    assert ck.restore(6)["extra"]["run"]["schedule_steps"] == 4


def test_resume_without_checkpoint_starts_afresh(tmp_path, capsys):
    assert run.train(_rc(tmp_path, steps=2, ckpt_every=0))["status"] == "ok"
    assert run.train(_rc(tmp_path, steps=2, ckpt_every=0, resume=True))["status"] == "ok"
    assert "no finished checkpoint" in capsys.readouterr().out
    assert [s for s, *_ in _losses(tmp_path)] == [1, 2]     # not 1, 2, 1, 2


def test_resume_drops_a_truncated_metrics_line(tmp_path):
    """A run killed while writing metrics.jsonl leaves a partial last line; resume drops it."""
    assert run.train(_rc(tmp_path, steps=2))["status"] == "ok"
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 3, "loss/ce": 4.')
    assert run.train(_rc(tmp_path, steps=3, resume=True))["status"] == "ok"
    assert [s for s, *_ in _losses(tmp_path)] == [1, 2, 3]


def test_trim_metrics_refuses_a_damaged_middle_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n{"ste\n{"step": 2}\n')
    with pytest.raises(SystemExit, match="line 2 is not a metrics record"):
        resume.trim_metrics(str(p), 1)


def test_write_atomic_leaves_the_old_file_when_interrupted(tmp_path, monkeypatch):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n')

    def fail(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(str(p), '{"step": 1}\n')
    assert p.read_text() == '{"step": 1}\n{"step": 2}\n' and os.listdir(tmp_path) == ["metrics.jsonl"]


def test_disk_full_stops_with_a_message_naming_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    """A checkpoint or export that cannot be written (disk full) ends the run with one line naming the last good
    checkpoint and status write_failed (exit 2), not a traceback per array from orbax's writer threads."""
    import collections
    import shutil
    du = collections.namedtuple("du", "total used free")
    calls = []

    def fake_usage(path):        # room for the step-2 checkpoint, not for the step-4 one
        calls.append(path)
        return du(1 << 40, 0, (1 << 40) if len(calls) == 1 else 1 << 20)

    monkeypatch.setattr(shutil, "disk_usage", fake_usage)
    r = run.train(_rc(tmp_path / "a"))
    assert r["status"] == "write_failed" and r["step"] == 4
    err = capsys.readouterr().err
    assert "STOPPED before the checkpoint of step 4: it needs" in err and "1.0 MiB free" in err, err
    assert f"Last good checkpoint: {tmp_path / 'a' / 'ckpt' / '2'}" in err, err
    assert C.TrainCheckpointer(str(tmp_path / "a" / "ckpt")).latest_step() == 2
    monkeypatch.undo()

    # orbax reports a failed asynchronous save at the next save (or at close) as a ValueError
    orig_save, orig_close = C.TrainCheckpointer.save, C.TrainCheckpointer.close
    enospc = ValueError('RESOURCE_EXHAUSTED: Error writing "params/x": No space left on device [os_error_code=\'28\']')

    def save(self, step, **kw):
        if step == 4:
            raise enospc
        return orig_save(self, step, **kw)

    monkeypatch.setattr(C.TrainCheckpointer, "save", save)
    r = run.train(_rc(tmp_path / "b"))
    assert r["status"] == "write_failed"
    err = capsys.readouterr().err
    assert "STOPPED: writing a checkpoint failed (RESOURCE_EXHAUSTED" in err and "ckpt/2;" in err, err
    monkeypatch.undo()

    closed = []

    def close(self):             # the run's own checkpointer, the first to close
        orig_close(self)
        if not closed:
            closed.append(self)
            raise enospc

    monkeypatch.setattr(C.TrainCheckpointer, "close", close)
    r = run.train(_rc(tmp_path / "c", steps=2))
    assert r["status"] == "write_failed"
    assert "STOPPED: writing the last checkpoint failed" in capsys.readouterr().err
    monkeypatch.undo()

    def no_space(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fd, "save_params", no_space)
    r = run.train(_rc(tmp_path / "d", steps=2, export=True))
    assert r["status"] == "write_failed"
    err = capsys.readouterr().err
    assert "STOPPED: the export to" in err and "No space left on device" in err and "ckpt/2;" in err, err
    monkeypatch.setattr(run, "train", lambda rc: {"status": "write_failed"})
    assert run.main(["--steps=1"]) == 2


def test_an_earlier_export_is_not_overwritten_without_overwrite(tmp_path):
    """A run without checkpoints leaves only its export; a second run in that OUT used to truncate its metrics
    and replace its export without --overwrite (the guard looked at checkpoints only)."""
    out = tmp_path / "o"
    assert run.train(_rc(out, steps=1, ckpt_every=0, export=True))["status"] == "ok"
    model = (out / "export" / "model.safetensors").read_bytes()
    metrics = (out / "metrics.jsonl").read_text()
    for kw in ({}, {"resume": True}):
        with pytest.raises(SystemExit, match="holds the export of an earlier run"):
            run.train(_rc(out, steps=1, ckpt_every=0, seed=3, **kw))
    assert (out / "export" / "model.safetensors").read_bytes() == model
    assert (out / "metrics.jsonl").read_text() == metrics
    assert run.train(_rc(out, steps=1, ckpt_every=0, seed=3, overwrite=True))["status"] == "ok"
    assert not (out / "export").exists()    # export=False: no stale model beside the new run's records


def test_a_preset_in_a_notebook_gets_its_run_settings(tmp_path, capsys):
    """RunConfig(config='tiny-dspark') trained with loss_draft=0 (DSpark stages frozen, never trained) and
    RunConfig(config='tiny-qat') without QAT, silently: the presets' run settings applied on the command line only."""
    assert run.preset_config("tiny-dspark").loss_draft == 0.5 and run.preset_config("tiny-qat").qat is True
    assert run.preset_config("tiny-qat", qat=False, steps=3).qat is False
    assert run.preset_config("tiny-dspark") == run.parse_args(["--config", "tiny-dspark"])
    r = run.train(run.RunConfig(config="tiny-qat", steps=1, batch_size=2, seq_len=48, ckpt_every=0, export=False,
                                sample_tokens=0, progress="off", out=str(tmp_path / "o")))
    assert r["status"] == "ok"
    assert "note: preset tiny-qat sets qat=True; this run has qat=False" in capsys.readouterr().out


def test_an_earlier_runs_records_are_not_replaced_without_overwrite(tmp_path):
    """A run with neither checkpoints nor an export (--ckpt_every 0 --export false) leaves only metrics.jsonl and
    run_config.json; a second run in that OUT replaced them silently (a helper's probe)."""
    out = tmp_path / "o"
    assert run.train(_rc(out, steps=2, ckpt_every=0))["status"] == "ok"
    metrics = (out / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit, match="holds an earlier run's metrics.jsonl and run_config.json and no checkpoint"):
        run.train(_rc(out, steps=1, ckpt_every=0))
    assert (out / "metrics.jsonl").read_text() == metrics
    assert run.train(_rc(out, steps=1, ckpt_every=0, overwrite=True))["status"] == "ok"
    assert [s for s, *_ in _losses(out)] == [1]


def test_a_signal_during_the_last_step_skips_export_and_sample(tmp_path, capsys):
    """SIGINT while the last step runs: the loop had no next step to stop before, so the run went on to export and
    sample (slow on a big model) and reported success; now it stops there, names the checkpoint, status interrupted."""
    import signal

    def fault(s, tr):
        if s == 1:                              # the second (last) step: the handler only records the signal
            os.kill(os.getpid(), signal.SIGINT)
        return tr

    out = tmp_path / "o"
    r = run.train(_rc(out, steps=2, ckpt_every=2, export=True, sample_tokens=4), fault=fault)
    assert r["status"] == "interrupted" and r["signal"] == signal.SIGINT and r["step"] == 2
    err = capsys.readouterr().err
    assert err.startswith("STOPPED by SIGINT after the last step (2): the export and the sample were skipped. "
                          f"Last good checkpoint: {os.path.join(os.path.abspath(out), 'ckpt', '2')}; run the same "
                          "command with --resume to export"), err
    assert not (out / "export").exists()
    r = run.train(_rc(out, steps=2, ckpt_every=2, export=True, resume=True))
    assert r["status"] == "ok" and (out / "export" / "model.safetensors").exists()


def test_resume_names_a_damaged_newest_checkpoint(tmp_path):
    """A newest checkpoint whose files are damaged: --resume printed pages of orbax tracebacks; now one line naming
    it and the step before it, and the run resumes from that one once the damaged one is moved away."""
    import shutil
    out = tmp_path / "o"
    assert run.train(_rc(out, steps=4, ckpt_every=2))["status"] == "ok"
    meta = out / "ckpt" / "4" / "meta"
    for f in meta.rglob("*"):
        if f.is_file():
            f.write_text("{")
    with pytest.raises(SystemExit) as e:
        run.train(_rc(out, steps=4, ckpt_every=2, resume=True))
    msg = str(e.value)
    assert msg.startswith(f"--resume: the newest checkpoint {out / 'ckpt' / '4'} cannot be read (") and \
        msg.endswith("it is damaged. Move it out of " + str(out / "ckpt") + " to resume from the one before it (step 2)"), msg
    shutil.move(str(out / "ckpt" / "4"), str(tmp_path / "damaged"))
    r = run.train(_rc(out, steps=4, ckpt_every=2, resume=True))
    assert r["status"] == "ok" and r["step"] == 4


@pytest.mark.parametrize("kw,msg", [
    (dict(qat=True), "--qat fake-quantises the formats the model stores, and model tiny stores none"),
    (dict(config="tiny-qat", mode="reference"), "--qat trains in mode qat .* --mode reference would be ignored"),
    (dict(out=""), "--out must name a folder, got an empty string"),
])
def test_refused_before_anything_is_built(tmp_path, kw, msg):
    with pytest.raises(SystemExit, match=msg):
        run.train(_rc(kw.pop("out", tmp_path / "o"), **kw))
    assert not (tmp_path / "o").exists()


def test_a_config_off_the_engram_layout_is_refused_before_out_is_written(tmp_path, monkeypatch):
    """A model config built in code with Engram tables of other rows than the hash layout's (the presets and
    Config.from_json never give one) is refused by init_params, before the run writes its records or a checkpoint
    records the config (TrainCheckpointer takes no config: the run is its only way in)."""
    real = run.model_config
    monkeypatch.setattr(run, "model_config", lambda rc: real(rc).replace(engram_num_embeddings=(100, 100)))
    with pytest.raises(ValueError, match=r"init_params: engram layout: layer 1 needs \d+ table rows \(sum of its "
                                         r"primes\), config engram_num_embeddings\[0\] = 100"):
        run.train(_rc(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_out_that_cannot_be_created(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit, match=f"--out {tmp_path / 'afile' / 'sub'}: {tmp_path / 'afile'} is a file, not a folder"):
        run.train(_rc(tmp_path / "afile" / "sub"))
    if os.path.isdir("/proc/self") and os.name == "posix":      # writable by its mode bits for root, not in fact
        out = "/proc/dsv41-cannot-exist/run"
        try:
            run.train(_rc(out))
        except SystemExit as e:
            assert str(e).startswith(f"--out {out}: "), e
        else:
            raise AssertionError("a run under /proc was not refused")


def test_resume_from_a_truncated_array_file_prints_one_line_and_no_traceback(tmp_path):
    """The newest checkpoint with one array file cut short (a full disk, a killed copy): `run.py --resume` named it
    in one line, but around that line orbax's reads printed hundreds of 'RuntimeError: Event loop is closed'
    tracebacks (params/train_state.py's docstring says why); now stderr is that line alone."""
    import subprocess
    import sys
    out = tmp_path / "o"
    assert run.train(_rc(out, steps=4, ckpt_every=2))["status"] == "ok"
    state = out / "ckpt" / "4" / "state"
    biggest = max((f for f in state.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    with open(biggest, "r+b") as fh:
        fh.truncate(10)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["--config", "tiny", "--steps", "4", "--batch_size", "2", "--seq_len", "48", "--lr", "3e-3", "--warmup",
            "2", "--ckpt_every", "2", "--keep_last", "3", "--out", str(out), "--export", "false", "--sample_tokens",
            "0", "--progress", "off", "--resume"]
    res = subprocess.run([sys.executable, "train/run.py", *args], cwd=repo, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"--resume: the newest checkpoint {out / 'ckpt' / '4'} cannot be "
                                                   f"read (ValueError: ") and \
        lines[0].endswith(f"it is damaged. Move it out of {out / 'ckpt'} to resume from the one before it (step 2)"), \
        res.stderr[-3000:]


def test_resume_of_a_record_without_corpus_encoding(tmp_path):
    """Since 2026-12-05 corpus text quoting a special token is tokenized as text (it was the control id). A
    checkpoint recorded before (no corpus_encoding) resumes where that changes no id (a corpus quoting no special
    token: the shipped one) and is refused, naming the field, where it would read other ids."""
    plain = _small_corpus(tmp_path / "plain.txt")
    quoting = _small_corpus(tmp_path / "quoting.txt", first_line="It ended. <｜end▁of▁sentence｜> Then more.")
    for corpus, ok in ((plain, True), (quoting, False)):
        rc = _rc(tmp_path / "run", corpus=corpus)
        cfg = run.model_config(rc)
        rec = resume.run_record(rc, cfg, 4)
        assert rec["run"]["corpus_encoding"] == resume.CORPUS_ENCODING
        assert resume.check_resume(rc, cfg, {"step": 2, "extra": rec}) == 4
        old = {**rec, "run": {k: v for k, v in rec["run"].items() if k != "corpus_encoding"}}
        if ok:
            assert resume.check_resume(rc, cfg, {"step": 2, "extra": old}) == 4
        else:
            with pytest.raises(SystemExit, match=r"corpus_encoding None -> 2"):
                resume.check_resume(rc, cfg, {"step": 2, "extra": old})


_OOM = {"allocator": (torch.OutOfMemoryError, "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
                                             "capacity of 79.19 GiB of which 1.2 GiB is free. Including non-PyTorch "
                                             "memory, this process has 78.0 GiB memory in use.",
                      "CUDA out of memory. Tried to allocate 20.00 GiB"),
        "cublas": (RuntimeError, "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
                   "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        "cpu": (RuntimeError, None, "DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                                    "4611686018427387904 bytes. Error code 12 (Cannot allocate memory)")}     # None: torch's own message, raised below


def _cpu_alloc_error() -> str:
    """What torch's CPU allocator raises when malloc refuses (4 EiB: refused on any machine)."""
    try:
        torch.empty(1 << 62, dtype=torch.uint8)
    except RuntimeError as e:
        return str(e)
    raise AssertionError("a 4 EiB CPU allocation succeeded")


@pytest.mark.parametrize("kind", list(_OOM))
def test_out_of_memory_stops_with_message_and_resumes(tmp_path, monkeypatch, capsys, kind):
    """A step that runs out of device memory (here a stand-in raising what CUDA's allocator or cuBLAS raises) stops
    the run with one line naming the step, the allocation and the last good checkpoint, exit status 2; a resume
    goes on. Another RuntimeError still propagates."""
    real = S.make_step
    exc, text, shown = _OOM[kind]
    text = text or _cpu_alloc_error()

    def make_step(*a, **k):
        step = real(*a, **k)

        def oom_at_3(tr, opt, batch, *, lr, step_no):
            if step_no == 3:
                raise exc(text)
            return step(tr, opt, batch, lr=lr, step_no=step_no)
        return oom_at_3

    monkeypatch.setattr(S, "make_step", make_step)
    out = tmp_path / "o"
    argv = ["--steps", "4", "--batch_size", "2", "--seq_len", "48", "--warmup", "2", "--ckpt_every", "2",
            "--export", "false", "--sample_tokens", "0", "--progress", "off", "--out", str(out)]
    assert run.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"STOPPED: out of memory in step 3 on cpu ({shown}). No update was applied. Last good checkpoint: "
                   f"{out / 'ckpt' / '2'}; a smaller --batch_size or --seq_len, or --remat, needs less"), err
    assert [s for s, *_ in _losses(out)] == [1, 2]
    monkeypatch.setattr(S, "make_step", real)
    assert run.main(argv + ["--resume"]) == 0
    assert [s for s, *_ in _losses(out)] == [1, 2, 3, 4]


def test_a_runtime_error_that_is_not_out_of_memory_propagates(tmp_path, monkeypatch):
    def make_step(*a, **k):
        def boom(tr, opt, batch, *, lr, step_no):
            raise RuntimeError("shape mismatch in some op")
        return boom

    monkeypatch.setattr(S, "make_step", make_step)
    with pytest.raises(RuntimeError, match="shape mismatch in some op"):
        run.train(_rc(tmp_path / "o"))


@pytest.mark.parametrize("edit, says", [
    (lambda m: m.update(opt_count="x"), "meta: 'opt_count' must be an integer, got 'x'"),
    (lambda m: m["data"].update(offset=10 ** 6), "PackedData.set_state: offset 1000000 out of range for epoch 0"),
    (lambda m: m["dtypes"].update({"params/layers.2.attn.indexer.wk.weight": "float64"}),
     "meta: dtypes['params/layers.2.attn.indexer.wk.weight'] = 'float64', but the stored array holds uint16, not "
     "float64"),
    (lambda m: m["dtypes"].update({"params/layers.2.attn.indexer.wk.weight": "uint16"}),      # the same bits
     "params/layers.2.attn.indexer.wk.weight is torch.uint16 [32, 64]; this run's model has torch.bfloat16 [32, 64]"),
    (lambda m: m["dtypes"].update({"params/layers.1.engram.embed.weight": "float8_e5m2"}),
     "params/layers.1.engram.embed.weight is torch.float8_e5m2 [2514, 32]; this run's model has torch.float8_e4m3fn"),
    (lambda m: m["extra"]["run"].pop("schedule_steps"), "extra['run']['schedule_steps'] is not a step count (KeyError"),
    (lambda m: m["extra"]["run"].update(schedule_steps="x"), "extra['run']['schedule_steps'] is not a step count"),
])
def test_resume_refuses_a_hand_edited_meta_in_one_line(tmp_path, edit, says):
    """A checkpoint whose meta was edited by hand: "opt_count": "x" failed with the optimizer's TypeError after
    resumes.jsonl had been appended; an offset past the corpus gave a traceback; a dtype float64 recorded for a bf16
    param read its bits as other values. Now the damaged-checkpoint refusal, and nothing of OUT written."""
    out = tmp_path / "o"
    assert run.train(_rc(out, steps=4, ckpt_every=2))["status"] == "ok"
    path = out / "ckpt" / "4" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    assert meta["dtypes"]["params/layers.2.attn.indexer.wk.weight"] == "bfloat16"
    edit(meta)
    path.write_text(json.dumps(meta))
    before = _records(out)
    with pytest.raises(SystemExit) as e:
        run.train(_rc(out, steps=6, ckpt_every=2, resume=True))
    msg = str(e.value)
    assert msg.startswith(f"--resume: the newest checkpoint {out / 'ckpt' / '4'} cannot be read (ValueError: ") and \
        msg.endswith(f"it is damaged. Move it out of {out / 'ckpt'} to resume from the one before it (step 2)"), msg
    assert says in msg and "\n" not in msg, msg
    assert _records(out) == before and not (out / "resumes.jsonl").exists()


# ----------------------------------------------------------------------------- mutation-audit additions
