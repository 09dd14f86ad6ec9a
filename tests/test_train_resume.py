"""train/resume.py's checks on their own: a resume's settings against the checkpoint's run record
(``check_resume``), the restored optimizer state and RNG (``check_restored``) and the metrics trim. The runs that
resume end to end are in test_train_run.py."""
import dataclasses

import pytest
import torch

from functional_dsv41.train import resume, run

from test_train_run import _rc, _small_corpus


def _record(tmp_path):
    """(rc, cfg, run_record) of a tiny run on a small corpus, without training."""
    rc = _rc(tmp_path / "run", corpus=_small_corpus(tmp_path / "corpus.txt"))
    cfg = run.model_config(rc)
    return rc, cfg, resume.run_record(rc, cfg, 4)


@pytest.mark.parametrize("field, value", [("min_lr_ratio", 0.2), ("b1", 0.8), ("b2", 0.9), ("clip", 0.5),
                                          ("loss_ce", 0.5), ("loss_draft", 0.1), ("draft_anchor_stride", 2),
                                          ("frozen", "")])
def test_check_resume_refuses_each_optimisation_setting(tmp_path, field, value):
    """run.py's docstring: a resume differing in a setting that decides the optimisation is refused, naming it. The
    run-level test above covers seq_len, seed, lr, batch_size, warmup, weight_decay and loss_indexer_kl; these are
    the others (none of them is free to change: run.py's list of free settings)."""
    rc, cfg, rec = _record(tmp_path)
    assert getattr(rc, field) != value
    with pytest.raises(SystemExit, match=rf"was trained with other settings \({field} "):
        resume.check_resume(dataclasses.replace(rc, **{field: value}), cfg, {"step": 2, "extra": rec})


@pytest.mark.parametrize("bad", [0, -3, True])
def test_check_resume_refuses_a_schedule_length_that_is_no_step_count(tmp_path, bad):
    """extra['run']['schedule_steps'] is the lr schedule's length: < 1 or a JSON boolean is a damaged record."""
    rc, cfg, rec = _record(tmp_path)
    rec["run"]["schedule_steps"] = bad
    with pytest.raises(ValueError, match=r"extra\['run'\]\['schedule_steps'\] is not a step count"):
        resume.check_resume(rc, cfg, {"step": 2, "extra": rec})


def test_check_resume_names_a_checkpoint_without_run_record(tmp_path):
    """A checkpoint saved by an older run.py records no run settings: said so (SystemExit), not reported as a
    damaged step count."""
    rc, cfg, rec = _record(tmp_path)
    for extra in ({}, {"model": rec["model"]}, {"run": rec["run"]}):
        with pytest.raises(SystemExit, match="records no run settings"):
            resume.check_resume(rc, cfg, {"step": 2, "extra": extra})


def test_check_restored_moments_and_rng_state():
    """check_restored: the moments are fp32 for every trainable (what adamw_init makes, whatever the param dtype),
    both moments cover exactly the trainables, and the RNG state has the shape and dtype of torch's."""
    from functional_dsv41.train import optim
    trainable = {"a.weight": torch.zeros(2, 3), "b.weight": torch.zeros(4, dtype=torch.bfloat16)}

    def restored():
        return {"params": {k: v.clone() for k, v in trainable.items()}, "opt_state": optim.adamw_init(trainable),
                "rng_state": torch.get_rng_state()}

    resume.check_restored(restored(), trainable, {})
    r = restored()
    del r["opt_state"]["nu"]["b.weight"]
    with pytest.raises(ValueError, match=r"optimizer moments are for other params .*b\.weight"):
        resume.check_restored(r, trainable, {})
    r = restored()
    r["opt_state"]["mu"]["b.weight"] = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"opt/mu/b\.weight is torch\.bfloat16 \[4\]; this run's model has "
                                         r"torch\.float32 \[4\]"):
        resume.check_restored(r, trainable, {})
    r = restored()
    r["rng_state"] = r["rng_state"][:-8]
    with pytest.raises(ValueError, match=r"rng/torch is torch\.uint8"):
        resume.check_restored(r, trainable, {})


def test_trim_metrics_skips_blank_lines(tmp_path):
    """Blank lines carry no record: skipped wherever they are, not refused as a damaged middle line."""
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n\n{"step": 2}\n   \n{"step": 3}\n')
    assert resume.trim_metrics(str(p), 2) == '{"step": 1}\n{"step": 2}\n'
