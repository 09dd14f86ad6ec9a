"""What a training checkpoint records about its run, and what ``train/run.py --resume`` checks against it.

Every checkpoint's ``extra`` holds ``run_record``: the model config and the settings that decide the data order
or the optimisation (``RESUME_FIXED``, the corpus and tokenizer contents and how the corpus is tokenized
(``CORPUS_ENCODING``), the length of the lr schedule); a
resume whose record differs is refused up front, naming what changed (``check_resume``). The run's
``metrics.jsonl`` is carried across resumes by ``trim_metrics`` (the lines up to the checkpoint's step) and
rewritten, like the run's record files, through ``functional_dsv41.config.write_atomic``.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Optional

import torch

import functional_dsv41 as fd
from functional_dsv41.config import short_repr
from functional_dsv41.params import train_state as ckpt_mod

if TYPE_CHECKING:
    from functional_dsv41.train.run import RunConfig


# Settings a resume must share with the checkpoint it continues: they decide the data order (batch_size,
# seq_len, seed; with the corpus and tokenizer contents) or the optimisation (the rest). See the module docstring.
RESUME_FIXED = ("batch_size", "seq_len", "seed", "lr", "min_lr_ratio", "warmup", "weight_decay", "b1", "b2",
                "clip", "loss_ce", "loss_draft", "draft_anchor_stride", "loss_indexer_kl", "frozen")


# How load_samples turns corpus text into ids, beyond the corpus and tokenizer bytes: 2 = special-token text in
# a line is tokenized as text (before 2026-12-05 it became the control id). Records without it are version 1,
# which matches 2 exactly on a corpus that quotes no special token.
CORPUS_ENCODING = 2


def _quotes_special_tokens(corpus: str, tokenizer: str) -> bool:
    from functional_dsv41.train.tokenizer import load_tokenizer
    specials = [t.content for t in load_tokenizer(tokenizer).get_added_tokens_decoder().values() if t.special]
    with open(corpus, encoding="utf-8-sig") as fh:
        text = fh.read()
    return any(sp and sp in text for sp in specials)


def _sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def run_record(rc: RunConfig, cfg: fd.Config, schedule_steps: int) -> dict:
    """What every checkpoint records and a resume must match: the model config and the run settings,
    as JSON values (the form they come back from a checkpoint in, so the two compare equal)."""
    run = {k: getattr(rc, k) for k in RESUME_FIXED}
    run.update(forward_mode="qat" if rc.qat else rc.mode, schedule_steps=schedule_steps,
               corpus_sha256=_sha256(rc.corpus), tokenizer_sha256=_sha256(rc.tokenizer),
               corpus_encoding=CORPUS_ENCODING)
    return json.loads(json.dumps({"model": cfg.to_dict(), "run": run}))


def record_diff(saved: dict, now: dict) -> list[str]:
    """``"name old -> new"`` for every recorded setting that differs (schedule_steps is the resume's to keep)."""
    out = []
    for part, prefix in (("model", "config."), ("run", "")):
        a, b = saved.get(part, {}), now[part]
        out += [f"{prefix}{k} {short_repr(a.get(k), 24)} -> {short_repr(b.get(k), 24)}"
                for k in sorted(set(a) | set(b))
                if k != "schedule_steps" and a.get(k) != b.get(k)]
    return out


def check_resume(rc: RunConfig, cfg: fd.Config, restored: dict) -> int:
    """Refuse a resume whose settings differ from those the checkpoint records (train/run.py's docstring); returns
    the lr schedule length to continue with (the one the run first started with). ValueError for recorded settings
    that are not what run.py writes (a hand-edited meta)."""
    where = os.path.join(os.path.abspath(rc.out), "ckpt", str(restored["step"]))
    saved = restored["extra"]
    if "run" not in saved or "model" not in saved:
        raise SystemExit(f"--resume: {where} records no run settings (saved by an older run.py), so it cannot be "
                         f"checked against this run; start afresh with --overwrite or another --out")
    try:
        schedule_steps = int(saved["run"]["schedule_steps"])
        if isinstance(saved["run"]["schedule_steps"], bool) or schedule_steps < 1:
            raise ValueError(schedule_steps)
    except (KeyError, TypeError, ValueError) as e:      # train/run.py turns it into the damaged-checkpoint refusal
        raise ValueError(f"{where}/meta: extra['run']['schedule_steps'] is not a step count "
                         f"({type(e).__name__}: {e})") from None
    if "corpus_encoding" not in saved["run"] and not _quotes_special_tokens(rc.corpus, rc.tokenizer):
        saved = {**saved, "run": {**saved["run"], "corpus_encoding": CORPUS_ENCODING}}   # the same ids either way
    diff = record_diff(saved, run_record(rc, cfg, schedule_steps))
    if diff:
        raise SystemExit(f"--resume: {where} was trained with other settings ({'; '.join(diff[:8])}"
                         f"{'; ...' if len(diff) > 8 else ''}); resume with the original ones, or start afresh "
                         f"with --overwrite or another --out")
    if rc.steps < restored["step"]:
        raise SystemExit(f"--resume: {where} is at step {restored['step']}, past --steps {rc.steps}; pass "
                         f"--steps >= {restored['step']}")
    return schedule_steps


def newest_checkpoint(ckpt_dir: str, restore: bool) -> tuple[Optional[int], Optional[dict]]:
    """(step, restored state or None) of the newest finished checkpoint in ``ckpt_dir``, (None, None) when
    there is none. Only reads: a run refused after this must not have created the folder."""
    if not os.path.isdir(ckpt_dir):
        return None, None
    ck = ckpt_mod.TrainCheckpointer(ckpt_dir, cleanup_tmp=False)
    try:
        step = ck.latest_step()
        if not restore or step is None:
            return step, None
        try:
            return step, ck.restore(step)
        except Exception as e:                   # a damaged checkpoint: orbax's own error is pages of tracebacks
            raise damaged(ck.directory, step, e, [s for s in ck.all_steps() if s < step]) from None
    finally:
        ck.close()


def damaged(directory: str, step: int, e: BaseException, older: Optional[list] = None) -> SystemExit:
    """The one-line refusal of a newest checkpoint (``directory``/``step``) that cannot be resumed from: unreadable
    (``newest_checkpoint``), or readable but not fitting the run (train/run.py: a hand-edited meta). ``older``: the
    finished steps before it, ascending (default: the step folders before it in ``directory``)."""
    directory = os.path.abspath(directory)
    if older is None:
        older = sorted(int(n) for n in os.listdir(directory) if n.isdigit() and int(n) < step)
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return SystemExit(f"--resume: the newest checkpoint {os.path.join(directory, str(step))} cannot be read "
                      f"({type(e).__name__}: {first}); it is damaged. "
                      + (f"Move it out of {directory} to resume from the one before it (step {older[-1]})" if older
                         else "There is no older checkpoint: start afresh with --overwrite"))


def check_restored(r: dict, trainable: dict, frozen: dict) -> None:
    """ValueError unless the restored params, moments and RNG state have this run's dtypes and shapes: a ``meta``
    edited to another dtype of the same bits (uint16 for bf16) restores, and trained on other values silently."""
    mu, nu = r["opt_state"]["mu"], r["opt_state"]["nu"]
    if set(mu) != set(trainable) or set(nu) != set(trainable):
        raise ValueError(f"its optimizer moments are for other params (they differ at "
                         f"{sorted(set(mu) ^ set(trainable) | set(nu) ^ set(trainable))[:3]})")
    want = [(f"params/{k}", r["params"][k], v.dtype, v.shape) for k, v in {**frozen, **trainable}.items()
            if k in r["params"] and isinstance(v, torch.Tensor)]
    want += [(f"opt/{m}/{k}", t[k], torch.float32, v.shape) for m, t in (("mu", mu), ("nu", nu))
             for k, v in trainable.items()]                               # (optim.adamw_init's fp32 moments)
    if r["rng_state"] is not None:
        rng = torch.get_rng_state()
        want.append(("rng/torch", r["rng_state"], rng.dtype, rng.shape))
    for name, got, dtype, shape in want:
        if got.dtype != dtype or got.shape != shape:
            raise ValueError(f"{name} is {got.dtype} {list(got.shape)}; this run's model has {dtype} {list(shape)}")


def trim_metrics(path: str, upto: int) -> str:
    """The text of ``path`` (metrics.jsonl) that a resume from step ``upto`` keeps: lines with step <= upto
    (the resumed run recomputes the rest). A malformed last line is a run killed mid-write and is dropped; a
    malformed earlier one means the file was damaged or edited, and is refused rather than guessed at."""
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = fh.read().splitlines()
    keep = []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            step = int(json.loads(ln)["step"])
        except (ValueError, KeyError, TypeError):
            if i == len(lines) - 1:
                break
            raise SystemExit(f"--resume: {path} line {i + 1} is not a metrics record; repair or remove it") from None
        if step <= upto:
            keep.append(ln + "\n")
    return "".join(keep)
