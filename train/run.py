"""The scripted training loop: ``python train/run.py --config tiny --out runs/tiny``.

Trains a model preset on the shipped corpus (data/), logging one line per step (loss parts, lr,
grad norm, non-padding tokens/s, step time) under a progress bar and one JSON object per step to
``OUT/metrics.jsonl``; saves orbax train-state checkpoints to ``OUT/ckpt`` (asynchronous, last
``keep_last``); at the end exports the params to ``OUT/export`` in the released layout (re-quantised
where the config stores fp8/fp4) and prints a greedy sample.

Command line: ``--config NAME`` (model + run preset), ``--steps N``, ``--out DIR``, ``--resume``, ``--device
cuda`` (default cpu), and ``--key=value`` (or ``--key value``) for any ``RunConfig`` field; ``--loss.ce=1`` is
``--loss_ce=1``. On a GPU the params, optimizer state and batches live there, and the kernels follow ``impl="auto"``
(TileLang where its tiles cover the shapes, torch elsewhere); checkpoints, the export and the sample are the same.
Bad options or inputs (a missing or non-UTF-8 corpus, --out naming a file, a count < 1 ...) are refused
with a one-line message before anything is written.

``--resume`` continues from the newest checkpoint in ``OUT/ckpt`` bit-identically to a run that was
never interrupted (same params, optimizer state, data position, RNG; metrics lines after the
checkpoint are dropped and recomputed). On CUDA that holds under ``torch.use_deterministic_algorithms(True)`` with
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (tests/test_gpu_train_run.py); without them two runs of the tiny preset also
agreed bit for bit (BENCHMARKS.md run 127), but CUDA does not promise that of every kernel. Every checkpoint
records the model config and the settings that decide the data order or the optimisation
(``resume.RESUME_FIXED``, the corpus and tokenizer contents, the length of the lr schedule); a resume that differs
in any of them is refused up front, naming them. Free to change on resume: ``--steps`` (to extend a run; not
below the checkpoint's step; the warmup + cosine schedule keeps the length of the run's first start, so steps past
it run at ``lr * min_lr_ratio``), log_every, ckpt_every, keep_last, threads, remat and device (execution only,
though the result may then differ from an uninterrupted run by rounding), export, sample_*, progress.
``OUT/config.json`` and ``OUT/run_config.json`` record the run as first started and a resume leaves
them alone; each resume appends its own settings to ``OUT/resumes.jsonl``. ``--resume`` with no
finished checkpoint says so and starts afresh.

The first SIGINT (Ctrl-C) or SIGTERM stops the run before the next step (after the last step: before the
export and the sample, which a --resume of the finished run then does), waits for pending checkpoint saves and
prints where the last good checkpoint is; a second one aborts at once. A newest checkpoint that cannot be read, or
does not fit the run (a hand-edited meta: a value of the wrong type, a data position past the corpus, a param of
another dtype), is named, with the step before it, instead of resumed from; nothing is written first.

Exit status: 0 on success; 2 when a loss part or gradient goes non-finite (the message names the step
and the part/leaves; the last good checkpoint is left complete and loadable), a step runs out of device memory
(the message names the step, what it tried to allocate and the last good checkpoint) or a checkpoint or the export
cannot be written (e.g. the disk is full: the message names the last good checkpoint to resume from);
130 / 143 when stopped by SIGINT / SIGTERM. Params and optimizer state that do not fit ``--device`` are refused
before anything is written.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from typing import Callable, Optional

if __package__ in (None, ""):  # `python train/run.py` from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import functional_dsv41 as fd
from functional_dsv41.config import write_atomic
from functional_dsv41.linear import qat_format
from functional_dsv41.pytree import tree_nbytes
from functional_dsv41.params import train_state as ckpt_mod
from functional_dsv41.train import data as data_mod
from functional_dsv41.train import optim, resume, step as step_mod
# the run's settings (train/settings.py); notebooks and tests reach them here too: run.RunConfig, run.preset_config,
# run.tiny_model, run.PRESETS, run.CORPUS_TXT
from functional_dsv41.train.settings import PRESETS, RunConfig, model_config, preset_config, tiny_model, validate
from functional_dsv41.train.tokenizer import CORPUS_TXT, load_tokenizer, special_ids


# ----------------------------------------------------------------------------- command line
def parse_args(argv: list[str]) -> RunConfig:
    """RunConfig from ``argv`` (module docstring); preset overrides apply before explicit flags."""
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    kv: dict[str, str] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            print(__doc__)
            print("fields: " + ", ".join(f"{n}={f.default!r}" for n, f in fields.items()))
            raise SystemExit(0)
        if not a.startswith("--"):
            raise SystemExit(f"unexpected argument {a!r} (use --key=value)")
        key, eq, val = a[2:].partition("=")
        key = key.replace(".", "_").replace("-", "_")
        if key not in fields:
            raise SystemExit(f"unknown option --{key}; known: {', '.join(fields)}")
        if not eq:
            if fields[key].type in ("bool", bool) and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
                val = "true"
            else:
                i += 1
                if i >= len(argv):
                    raise SystemExit(f"--{key} needs a value")
                val = argv[i]
        kv[key] = val
        i += 1
    preset = kv.get("config", RunConfig.config)
    merged = {**{k: str(v) for k, v in PRESETS.get(preset, (None, {}))[1].items()}, **kv}
    out = {}
    for k, v in merged.items():
        t = fields[k].type
        try:
            if t in ("bool", bool):
                if v.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(v)
                out[k] = v.lower() in ("1", "true", "yes")
            elif t in ("int", int):
                out[k] = int(v)
            elif t in ("float", float):
                out[k] = float(v)
            else:
                out[k] = v
        except ValueError:
            raise SystemExit(f"--{k}: cannot read {v!r} as {t}") from None
    return RunConfig(**out)


# ----------------------------------------------------------------------------- helpers
def init_train_params(cfg: fd.Config, rc: RunConfig, token_map: torch.Tensor):
    """fp32 master params + frozen leaves in storage form (Engram tables fp8 + scale, token map)."""
    master = fd.flatten_with_paths(fd.init_params(cfg, seed=rc.seed, dtype_master=torch.float32))
    master["engram_token_map"] = token_map
    pats = [p for p in rc.frozen.split(",") if p] + list(step_mod.unreached_patterns(rc.coefs))
    storage = ckpt_mod.to_storage(master, cfg)
    import fnmatch
    # a misspelt glob froze nothing, silently (and replaced the default, so the Engram tables trained too)
    unused = [p for p in rc.frozen.split(",") if p and p not in step_mod.FROZEN_DEFAULT
              and not any(fnmatch.fnmatchcase(k, p) for k in storage)]
    if unused:
        raise SystemExit(f"--frozen {','.join(unused)}: matches no parameter of model {rc.config} (globs over "
                         f"dotted paths such as layers.0.attn.wq_a.weight)")
    flat = {}
    for k, v in storage.items():  # frozen entries (and their scales) in storage form, the rest as masters
        base = k[: -len("scale")] + "weight" if k.endswith(".scale") else k
        if any(fnmatch.fnmatchcase(base, p) or fnmatch.fnmatchcase(k, p) for p in pats):
            flat[k] = v
        elif k in master:
            flat[k] = master[k]
    return step_mod.split_params(fd.unflatten_from_paths(flat), pats)


def greedy_sample(params, cfg: fd.Config, prompt_ids: list[int], n: int, eos: int, mode: str,
                  device: Optional[torch.device] = None) -> list[int]:
    """Greedy continuation with the decode path: prefill the prompt, then one token per call (on ``device``, where
    ``params`` are; default the CPU)."""
    state = fd.init_state(cfg, batch_size=1, max_seq_len=min(cfg.max_seq_len, len(prompt_ids) + n), device=device)
    out = fd.forward(params, {"input_ids": torch.tensor([prompt_ids], device=device)}, cfg=cfg, state=state,
                     mode=mode)
    new: list[int] = []
    while len(new) < n:
        nxt = int(out.logits[0, -1].argmax())
        new.append(nxt)
        if nxt == eos or len(prompt_ids) + len(new) >= state.max_seq_len:
            break
        out = fd.forward(params, {"input_ids": torch.tensor([[nxt]], device=device)}, cfg=cfg, state=out.state,
                         mode=mode)
    return new


def _out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says the device ran out of memory: torch's CUDA allocator raises ``torch.OutOfMemoryError``; a
    library that allocates for itself raises a RuntimeError naming it (cuBLAS: "CUBLAS_STATUS_ALLOC_FAILED"), and so
    does torch's CPU allocator when malloc refuses ("DefaultCPUAllocator: can't allocate memory"). (A CPU process
    that the kernel's out-of-memory killer ends gets no chance to say anything.)"""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and any(m in str(e) for m in ("CUBLAS_STATUS_ALLOC_FAILED", "CUDA out of memory",
                                                                   "cudaErrorMemoryAllocation",
                                                                   "DefaultCPUAllocator: can't allocate memory")))


def _first_sentences(e: BaseException, n: int = 2, width: int = 160) -> str:
    """The first ``n`` sentences of an exception's message, for a one-line report (CUDA's out-of-memory text runs on:
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of ...")."""
    text = " ".join(str(e).split()) or type(e).__name__
    text = re.sub(r"^\[enforce fail at [^\]]*\] [^.]*\. ", "", text)   # c10's prefix: "[enforce fail at f.cpp:1] err == 0. "
    head = ". ".join(text.split(". ")[:n])
    return head if len(head) <= width else head[:width - 3] + "..."


def _to_device(tree: dict, dev: torch.device) -> dict:
    """A flat {path: leaf} dict with its tensors on ``dev`` (other leaves as they are)."""
    return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in tree.items()}


def _draft_forward():
    try:
        from functional_dsv41.dspark import dspark_forward
    except ImportError as e:
        raise SystemExit(f"--loss_draft > 0 needs functional_dsv41.dspark.dspark_forward ({e})") from None
    return dspark_forward


def _fmt(step: int, total: int, m: dict) -> str:
    parts = " ".join(f"{k[5:]}={v:.4f}" for k, v in m.items() if k.startswith("loss/"))
    return (f"step {step:>5}/{total} | {parts} | lr {m['lr']:.2e} | gnorm {m['grad_norm']:.3f} | "
            f"{m['tokens_per_s']:.0f} non-pad tok/s | {m['step_time']:.2f}s")


# ----------------------------------------------------------------------------- checks before anything is written
def _special_ids(rc: RunConfig) -> dict[str, int]:
    """``special_ids`` of --tokenizer, a file that is no tokenizer being a one-line refusal."""
    try:
        return special_ids(rc.tokenizer)
    except Exception as e:   # tokenizers raises a bare Exception for a file it cannot parse
        raise SystemExit(f"--tokenizer {rc.tokenizer}: cannot load it ({e})") from None


def check_model(rc: RunConfig, cfg: fd.Config, sp: dict[str, int]) -> None:
    """Refuse options the model config cannot serve (before building it: these used to fail mid-run)."""
    if sp["vocab_size"] != cfg.vocab_size:
        raise SystemExit(f"tokenizer has {sp['vocab_size']} ids but the model config has vocab_size {cfg.vocab_size}")
    if rc.seq_len > cfg.max_seq_len:
        raise SystemExit(f"--seq_len {rc.seq_len} > the model's max_seq_len {cfg.max_seq_len}")
    if (rc.qat or rc.mode == "qat") and qat_format(cfg, "dense") is None \
            and qat_format(cfg, "expert") is None:
        raise SystemExit(f"--qat fake-quantises the formats the model stores, and model {rc.config} stores none "
                         f"(dtype {cfg.dtype!r}, experts {cfg.experts_dtype!r}): --qat would train as without it; "
                         f"use --config tiny-qat (fp8 dense, fp4 experts)")
    if rc.loss_draft > 0 and cfg.n_mtp_layers == 0:
        raise SystemExit(f"--loss_draft {rc.loss_draft} needs DSpark stages but model {rc.config} has n_mtp_layers=0; "
                         f"use --config tiny-dspark or --loss_draft 0")
    if rc.sample_tokens > 0:
        n = 1 + len(load_tokenizer(rc.tokenizer).encode(rc.sample_prompt).ids)
        if n > cfg.max_seq_len:
            raise SystemExit(f"--sample_prompt is {n} tokens (with BOS), more than the model's max_seq_len "
                             f"{cfg.max_seq_len}; shorten it or pass --sample_tokens 0")


def _load_corpus(rc: RunConfig) -> tuple:
    try:
        return data_mod.shipped_samples(rc.corpus, rc.tokenizer)
    except UnicodeDecodeError as e:
        raise SystemExit(f"--corpus {rc.corpus}: not UTF-8 text (byte offset {e.start}: {e.reason})") from None
    except ValueError as e:   # an empty corpus
        raise SystemExit(f"--corpus {e}") from None


class _StopOnSignal:
    """Within ``with``: the first SIGINT / SIGTERM only sets ``signum``, and the loop stops before its next
    step. Why not stop at once: the signal could land inside ``ck.save`` or leave an async save unfinished,
    i.e. a half-written checkpoint; between steps the pending saves can be waited for. A second signal
    aborts at once (the handler that was there before). Only the main thread can install handlers; elsewhere
    (a caller's thread) this does nothing."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._prev: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._prev[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:
            prev = self._prev[signum]
            signal.signal(signum, signal.SIG_DFL if prev is None else prev)
            signal.raise_signal(signum)
            return
        self.signum = signum

    def __exit__(self, *exc):
        for s, h in self._prev.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)
        return False


# ----------------------------------------------------------------------------- the loop
def train(rc: RunConfig, *, fault: Optional[Callable] = None) -> dict:
    """Run training per ``rc`` (see ``_train``); restores torch's thread count and current CUDA device afterwards."""
    prev = torch.get_num_threads()
    prev_dev = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    try:
        return _train(rc, fault=fault)
    finally:
        torch.set_num_threads(prev)
        if prev_dev is not None:
            torch.cuda.set_device(prev_dev)


def _train(rc: RunConfig, *, fault: Optional[Callable] = None) -> dict:
    """Run training per ``rc``. Returns {"status", "step", "metrics": last metrics, "out"}; status is "ok",
    "non_finite", "out_of_memory", "write_failed" or "interrupted" (then "signal" holds the signal number).

    Every check (options, inputs, the OUT folder, a resume's settings) runs before the first write to OUT,
    so a refused run leaves OUT as it was. ``fault(step_no, trainable) -> trainable`` is a test hook applied
    before each step (e.g. to put a NaN into a leaf); it is not reachable from the command line.
    """
    t_start = time.perf_counter()
    validate(rc)
    if rc.threads > 0:
        torch.set_num_threads(rc.threads)
    sp = _special_ids(rc)
    cfg = model_config(rc)
    check_model(rc, cfg, sp)
    if rc.config in PRESETS:
        # RunConfig(config="tiny-dspark") trained without the draft loss (the DSpark stages frozen, untrained) and
        # RunConfig(config="tiny-qat") without QAT, without a word: the preset's run settings were the CLI's only
        off = {k: v for k, v in PRESETS[rc.config][1].items() if getattr(rc, k) != v}
        if off:
            print(f"note: preset {rc.config} sets " + ", ".join(f"{k}={v!r}" for k, v in off.items()) + "; this run has "
                  + ", ".join(f"{k}={getattr(rc, k)!r}" for k in off) + f" (build the RunConfig with "
                  f"run.preset_config({rc.config!r}, ...) to start from the preset's settings)", flush=True)
    samples = list(_load_corpus(rc))
    ckpt_dir = os.path.join(rc.out, "ckpt")
    metrics_path = os.path.join(rc.out, "metrics.jsonl")
    latest, restored = resume.newest_checkpoint(ckpt_dir, restore=rc.resume)
    if latest is not None and not rc.resume and not rc.overwrite:
        raise SystemExit(f"{os.path.abspath(ckpt_dir)} already holds checkpoints (step {latest}): pass --resume "
                         f"to continue, --overwrite to start afresh, or another --out")
    exp_dir = os.path.join(rc.out, "export")
    earlier_export = os.path.isdir(exp_dir) and any(f.endswith(".safetensors") for f in os.listdir(exp_dir))
    earlier_records = [f for f in ("metrics.jsonl", "run_config.json")
                       if os.path.isfile(os.path.join(rc.out, f)) and os.path.getsize(os.path.join(rc.out, f)) > 0]
    if latest is None and not earlier_export and earlier_records and not rc.overwrite and not rc.resume:
        # a run with neither checkpoints nor an export (--ckpt_every 0 --export false) leaves only its records
        # (--resume there starts afresh, saying so, as documented)
        raise SystemExit(f"{os.path.abspath(rc.out)} holds an earlier run's {' and '.join(earlier_records)} and no "
                         f"checkpoint or export: pass --overwrite to replace them, or another --out")
    if restored is None and earlier_export and not rc.overwrite:
        # a run without checkpoints (--ckpt_every 0) leaves only its export: a fresh start here would truncate
        # its metrics at once and replace the export at its end (or leave it beside the new run's records)
        raise SystemExit(f"{os.path.abspath(exp_dir)} holds the export of an earlier run and {os.path.abspath(ckpt_dir)} "
                         f"no checkpoint to resume from: pass --overwrite to start afresh, or another --out")
    try:
        schedule_steps = rc.steps if restored is None else resume.check_resume(rc, cfg, restored)
    except ValueError as e:                     # its recorded run settings damaged (a hand-edited extra)
        raise resume.damaged(ckpt_dir, restored["step"], e) from None
    record = resume.run_record(rc, cfg, schedule_steps)
    if restored is not None:
        metrics_kept = resume.trim_metrics(metrics_path, restored["step"])

    from functional_dsv41.engram import build_token_map
    token_map = torch.as_tensor(build_token_map(rc.tokenizer), dtype=torch.int64)
    torch.manual_seed(rc.seed)
    data = data_mod.PackedData(samples, row_len=rc.seq_len, batch_size=rc.batch_size, pad_id=sp["pad"],
                               seed=rc.seed)
    trainable, frozen = init_train_params(cfg, rc, token_map)
    opt_state = optim.adamw_init(trainable)
    start = 0
    if restored is not None:
        r = restored
        start = r["step"]
        missing = sorted(set(trainable) - set(r["params"]))
        if missing:
            raise SystemExit(f"--resume: checkpoint lacks trainable params {missing[:5]}")
        try:   # (restore checked the meta's types against the stored arrays; these against this run's model)
            resume.check_restored(r, trainable, frozen)
            data.set_state(r["data_state"])
        except ValueError as e:
            raise resume.damaged(ckpt_dir, start, e) from None
        trainable = {k: r["params"][k] for k in trainable}
        frozen = {k: r["params"].get(k, v) for k, v in frozen.items()}
        opt_state = r["opt_state"]
        if r["rng_state"] is not None:
            torch.set_rng_state(r["rng_state"])
    dev = torch.device(rc.device)
    if dev.type == "cuda":     # params, optimizer state and batches live on the device (restored ones come as host
        #                        copies); checkpoints and the export read them back (to_numpy, save_params)
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
        try:
            trainable, frozen = _to_device(trainable, dev), _to_device(frozen, dev)
            opt_state = {**opt_state, "mu": _to_device(opt_state["mu"], dev), "nu": _to_device(opt_state["nu"], dev)}
        except torch.OutOfMemoryError as e:
            need = tree_nbytes(trainable, frozen, opt_state["mu"], opt_state["nu"])
            raise SystemExit(f"--device {dev}: the params and optimizer state ({need / 2**30:.2f} GiB) do not fit "
                             f"({_first_sentences(e)})") from None
    mode = "qat" if rc.qat else rc.mode
    try:
        fkw = step_mod.remat_forward_kwargs(fd.forward) if rc.remat else None
    except NotImplementedError as e:
        raise SystemExit(f"--remat: {e}") from None
    step_fn = step_mod.make_step(
        cfg, frozen=frozen, dtypes=step_mod.compute_dtypes(cfg, trainable), forward=fd.forward, coefs=rc.coefs,
        mode=mode, adamw=optim.AdamWConfig(rc.b1, rc.b2, 1e-8, rc.weight_decay), clip=rc.clip, pad_id=sp["pad"],
        forward_kwargs=fkw, draft_forward=_draft_forward() if rc.loss_draft > 0 else None,
        draft_anchor_stride=rc.draft_anchor_stride)

    # ---- every check passed: from here on the run writes into OUT
    try:
        os.makedirs(rc.out, exist_ok=True)
    except OSError as e:                         # e.g. under /sys or /proc: writable by mode bits, not in fact
        raise SystemExit(f"--out {rc.out}: cannot create the folder ({e.strerror or e})") from None
    if restored is None:
        if rc.resume:
            print(f"--resume: no finished checkpoint in {os.path.abspath(ckpt_dir)}; starting afresh", flush=True)
        if latest is not None:   # --overwrite
            shutil.rmtree(ckpt_dir)
        if earlier_export:       # --overwrite: the replaced run's model must not pass for this run's
            shutil.rmtree(exp_dir)
        cfg.to_json(os.path.join(rc.out, "config.json"))
        write_atomic(os.path.join(rc.out, "run_config.json"), json.dumps(dataclasses.asdict(rc), indent=2))
        write_atomic(metrics_path, "")
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(rc.out, "resumes.jsonl"))   # a stale one of the run this replaces
    else:
        write_atomic(metrics_path, metrics_kept)
        with open(os.path.join(rc.out, "resumes.jsonl"), "a") as fh:
            fh.write(json.dumps({"from_step": start, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                 "run_config": dataclasses.asdict(rc)}) + "\n")
    ck = ckpt_mod.TrainCheckpointer(ckpt_dir, max_to_keep=rc.keep_last)
    if restored is not None:
        print(f"resumed from {ck.directory}/{start} (data epoch {data.epoch}, row {data.offset})", flush=True)
    n_tr = sum(v.numel() for v in trainable.values())
    where = f"{dev} ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "cpu"
    print(f"model {rc.config}: {cfg.n_layers} layers, dim {cfg.dim}, vocab {cfg.vocab_size}; {n_tr / 1e6:.2f}M "
          f"trainable params in {len(trainable)} tensors, {len(frozen)} frozen leaves; data "
          f"{data.stats()['rows_per_epoch']} rows/epoch of {rc.seq_len}; on {where}", flush=True)

    bar = None
    if rc.progress == "on" or (rc.progress == "auto" and sys.stderr.isatty()):
        try:
            from tqdm import tqdm
            bar = tqdm(total=rc.steps, initial=start, desc="train", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            bar = None
    log = bar.write if bar is not None else (lambda s: print(s, flush=True))

    def stop(msg: str) -> None:   # on the console and on stderr, after the pending saves are on disk
        log(msg)
        print(msg, file=sys.stderr, flush=True)

    def last_good() -> str:
        with contextlib.suppress(Exception):   # a pending save that failed (disk full) is not a good one: skip it
            ck.wait()
        last = resume.newest_checkpoint(ckpt_dir, restore=False)[0]
        return "none" if last is None else os.path.join(ck.directory, str(last))

    def write_failed(what: str, e: BaseException) -> None:
        # orbax reports a failed asynchronous save (e.g. disk full) at the next save or at close, as a
        # ValueError / OSError from its writer thread: one line naming it and the checkpoint to resume from
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        last = last_good()
        stop(f"STOPPED: {what} failed ({first}). Last good checkpoint: {last}; free some space, then "
             + ("run the same command with --resume" if last != "none" else "run again (no checkpoint to resume from)"))

    def save_checkpoint(step: int) -> bool:
        """Start the asynchronous save of ``step``; False (after the message) when it cannot be written."""
        state = {**trainable, **{k: v for k, v in frozen.items() if isinstance(v, torch.Tensor)}}
        need = tree_nbytes(state, opt_state["mu"], opt_state["nu"])
        free = shutil.disk_usage(ck.directory).free
        if free < need:   # else orbax's writer threads fail midway, with a traceback per array
            stop(f"STOPPED before the checkpoint of step {step}: it needs {need / 2**20:.1f} MiB and "
                 f"{ck.directory} has {free / 2**20:.1f} MiB free. Last good checkpoint: {last_good()}; "
                 f"free some space, then run the same command with --resume")
            return False
        try:
            ck.save(step, params=state, opt_state=opt_state, data_state=data.state(),
                    rng_state=torch.get_rng_state(), extra={"config": rc.config, **record})
        except (OSError, ValueError) as e:   # the previous save's failure, raised here
            write_failed("writing a checkpoint", e)
            return False
        return True

    m: dict = {}
    status, signum = "ok", None
    try:  # on any exit (also Ctrl-C or an exception) let pending async saves finish: they are good states
        with open(metrics_path, "a") as mf, _StopOnSignal() as sig:
            for s in range(start, rc.steps):
                if sig.signum is not None:
                    name = signal.Signals(sig.signum).name
                    stop(f"STOPPED by {name} after step {s}. Last good checkpoint: {last_good()}; to continue, "
                         f"run the same command with --resume")
                    status, signum = "interrupted", sig.signum
                    break
                batch = _to_device(data.next_batch(), dev)
                if fault is not None:
                    trainable = fault(s, trainable)
                lr = optim.lr_at(s, peak=rc.lr, warmup=rc.warmup, total=schedule_steps, min_ratio=rc.min_lr_ratio)
                try:
                    trainable, opt_state, m = step_fn(trainable, opt_state, batch, lr=lr, step_no=s + 1)
                except step_mod.NonFiniteError as e:
                    stop(f"STOPPED: {e}. No update was applied. Last good checkpoint: {last_good()}")
                    status = "non_finite"
                    break
                except RuntimeError as e:   # (OutOfMemoryError is one) a traceback said less than this
                    if not _out_of_memory(e):
                        raise
                    stop(f"STOPPED: out of memory in step {s + 1} on {dev} ({_first_sentences(e)}). No update was "
                         f"applied. Last good checkpoint: {last_good()}; a smaller --batch_size or --seq_len, or "
                         f"--remat, needs less")
                    status = "out_of_memory"
                    break
                m = {"step": s + 1, **m, "epoch": data.epoch, "wall": time.perf_counter() - t_start}
                mf.write(json.dumps(m) + "\n")
                mf.flush()
                if (s + 1) % rc.log_every == 0 or s == start:
                    log(_fmt(s + 1, rc.steps, m))
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{m['loss/total']:.3f}")
                if rc.ckpt_every > 0 and ((s + 1) % rc.ckpt_every == 0 or s + 1 == rc.steps):
                    if not save_checkpoint(s + 1):
                        status = "write_failed"
                        break
            else:   # every step ran; a signal during the last one still stops the run before the export
                if sig.signum is not None:
                    name = signal.Signals(sig.signum).name
                    last = last_good()
                    stop(f"STOPPED by {name} after the last step ({rc.steps}): the export and the sample were "
                         f"skipped. Last good checkpoint: {last}; "
                         + ("run the same command with --resume to export" if last != "none" else
                            "no checkpoint holds the trained state (--ckpt_every 0)"))
                    status, signum = "interrupted", sig.signum
    finally:
        if bar is not None:
            bar.close()
        try:
            ck.close()
        except (OSError, ValueError) as e:   # the last save failed (an exception already on its way wins)
            close_error = e
        else:
            close_error = None
    if close_error is not None and status == "ok":
        write_failed("writing the last checkpoint", close_error)
        status = "write_failed"
    result = {"status": status, "step": m.get("step", start), "metrics": m, "out": rc.out}
    if signum is not None:
        result["signal"] = signum
    if status != "ok":
        return result

    params = step_mod.assemble(trainable, frozen, step_mod.compute_dtypes(cfg, trainable))
    if rc.export:
        exp = os.path.join(rc.out, "export")
        flat = ckpt_mod.to_storage(fd.flatten_with_paths(step_mod.assemble(trainable, frozen)), cfg)
        try:
            fd.save_params(fd.unflatten_from_paths(flat), exp, cfg)
            cfg.to_json(os.path.join(exp, "config.json"))
            # through a temporary name: a copy that fails midway must not tear a resumed run's earlier export
            tmp = os.path.join(exp, f".tokenizer.json.tmp-{os.getpid()}")
            try:
                shutil.copyfile(rc.tokenizer, tmp)
                os.replace(tmp, os.path.join(exp, "tokenizer.json"))
            finally:
                if os.path.lexists(tmp):
                    os.remove(tmp)
        except OSError as e:   # e.g. disk full: the trained state is in the last checkpoint, say so
            write_failed(f"the export to {exp}", e)
            return {**result, "status": "write_failed"}
        print(f"exported params (release layout, storage dtypes) to {exp}", flush=True)
    if rc.sample_tokens > 0:
        tok = load_tokenizer(rc.tokenizer)
        prompt = [sp["bos"]] + tok.encode(rc.sample_prompt).ids
        if rc.export and mode == "qat":
            # a QAT run: the exported model in the release's numerics (what `generate --ckpt OUT/export` runs); the
            # fake-quantised training function computes the same QDQ'd values with other roundings (float matmuls,
            # not block-scaled GEMMs) and its greedy sample could differ from the export's (a helper's probe)
            s_params, s_mode = fd.unflatten_from_paths(flat), "reference"
        else:
            # the function that was trained (a QAT run's float masters in "dequant" are another model)
            s_params, s_mode = params, mode
        with torch.no_grad():
            new = greedy_sample(s_params, cfg, prompt, rc.sample_tokens, sp["eos"], s_mode, device=dev)
        text = tok.decode(prompt[1:] + new)
        result["sample"] = text
        print(f"sample (greedy, {len(new)} new tokens): {text}", flush=True)
    print(f"done: {result['step']} steps in {time.perf_counter() - t_start:.1f}s", flush=True)
    return result


def main(argv: Optional[list[str]] = None) -> int:
    """Exit status per the module docstring."""
    rc = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        res = train(rc)
    except KeyboardInterrupt:   # a second Ctrl-C, or one before the loop started: no traceback for it
        print(f"interrupted; finished checkpoints in {os.path.join(rc.out, 'ckpt')} are kept (continue with "
              f"--resume)", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    if res["status"] == "interrupted":
        return 128 + res["signal"]
    return 0 if res["status"] == "ok" else 2


if __name__ == "__main__":
    sys.exit(main())
