"""The settings of a training run (``train/run.py``): ``RunConfig`` (one field per command-line option), the model
presets (``tiny_model``, ``PRESETS``, ``preset_config``, ``model_config``) and ``validate``, the one-line refusals
of bad options before a model is built or a file written. ``run.py`` parses the command line into a RunConfig and
runs it; notebooks build one directly (``run.preset_config("tiny-dspark", steps=20)``).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

import functional_dsv41 as fd
from functional_dsv41.state import device_problem
from functional_dsv41.train import step as step_mod
from functional_dsv41.train.tokenizer import CORPUS_TXT, TOKENIZER_JSON, special_ids


@dataclass
class RunConfig:
    config: str = "tiny"           # model preset (PRESETS) or a path to an inference config.json
    steps: int = 150
    batch_size: int = 8
    seq_len: int = 128             # packed row length
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 10
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip: float = 1.0
    seed: int = 0
    log_every: int = 1             # metrics.jsonl gets every step; the console every N
    ckpt_every: int = 50           # 0: no checkpoints
    keep_last: int = 2             # checkpoints kept (>= 1)
    out: str = "runs/tiny"
    resume: bool = False
    overwrite: bool = False        # start afresh in an OUT that holds checkpoints or an export (deletes OUT/ckpt
    #                                and OUT/export)
    qat: bool = False              # mode="qat": linear() fake-quantises (fp8 / fp4 experts), STE gradients
    mode: str = "dequant"          # forward mode when qat is off
    loss_ce: float = 1.0
    loss_draft: float = 0.0        # DSpark draft loss (needs DSpark stages: n_mtp_layers > 0)
    draft_anchor_stride: int = 4   # draft after every k-th position (cost: anchors x block queries)
    loss_indexer_kl: float = 0.0   # lightning-indexer KL (needs forward(aux=True))
    frozen: str = ",".join(step_mod.FROZEN_DEFAULT)   # comma-separated globs of frozen param paths (and always
    #                                                   those no active loss reaches: step.unreached_patterns)
    remat: bool = False            # per-block activation checkpointing (needs the model hook)
    corpus: str = CORPUS_TXT
    tokenizer: str = TOKENIZER_JSON
    threads: int = 1               # torch intra-op threads (0: torch's default). 1: the tiny model's ops are
                                   # too small to gain from 2 threads, and 2 threads slow down 3-10x when
                                   # another process shares the cores (measured on the 2-core CI box)
    export: bool = True
    sample_prompt: str = "Once upon a time"
    sample_tokens: int = 48
    progress: str = "auto"         # progress bar: auto (when stderr is a terminal), on, off
    device: str = "cpu"            # where the step runs: cpu, cuda or cuda:N (the params, optimizer state and
    #                                batches live there; checkpoints and the export are written from host copies)

    @property
    def coefs(self) -> dict[str, float]:
        return {"ce": self.loss_ce, "draft": self.loss_draft, "indexer_kl": self.loss_indexer_kl}


# ----------------------------------------------------------------------------- presets
def engram_rows(cfg: fd.Config) -> tuple[int, ...]:
    """``engram_num_embeddings`` implied by the Engram prime layout of ``cfg`` (sum of primes per layer)."""
    from functional_dsv41.engram import _layout_ints
    ints = _layout_ints(tuple(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads,
                        cfg.engram_vocab_size, cfg.engram_compressed_vocab_size)
    return tuple(sum(sum(row) for row in primes) for primes, _ in ints)


def tiny_model(tokenizer: str = TOKENIZER_JSON, **overrides) -> fd.Config:
    """The README's training model: 6 layers that cover every attention role, sized for a 2-core CPU.

    Layers: 0 window, 1 window + Engram, 2 ratio-2 Full, 3 ratio-2 Reuse + Engram, 4 ratio-1 Full
    (candidate source), 5 Reindex. No DSpark stages. Vocabulary, special ids and the Engram class
    count come from the shipped tokenizer.
    """
    from functional_dsv41.engram import build_token_map
    sp = special_ids(tokenizer)
    n_cls = int(torch.as_tensor(build_token_map(tokenizer)).max()) + 1
    base = dict(max_seq_len=256, vocab_size=sp["vocab_size"], image_token_id=sp["image"],
                dspark_noise_token_id=sp["noise"], engram_pad_id=sp["pad"], engram_compressed_vocab_size=n_cls,
                n_layers=6, n_mtp_layers=0, compress_ratios=(0, 0, 2, 2, 1, 1), kv_source_layers=(2, 4),
                index_source_layers=(2, 4, 5), candidate_source_layer=4, engram_layer_ids=(1, 3),
                dspark_target_layer_ids=(3, 4, 5), window_size=16, index_topk=8, candidate_block_size=4,
                candidate_topk_blocks=4)
    base.update(overrides)
    probe = fd.Config.tiny(**{**base, "engram_num_embeddings": tuple(1 for _ in base["engram_layer_ids"])})
    return probe.replace(engram_num_embeddings=engram_rows(probe))


PRESETS: dict[str, tuple[Callable[..., fd.Config], dict]] = {
    # name: (model config builder, RunConfig overrides)
    "tiny": (tiny_model, {}),
    "tiny-dspark": (lambda tok: tiny_model(tok, n_mtp_layers=1, compress_ratios=(0, 0, 2, 2, 1, 1, 0),
                                           dspark_block_size=3), {"loss_draft": 0.5}),
    "tiny-qat": (lambda tok: tiny_model(tok, dtype="fp8", expert_dtype="fp4", dim=128, moe_inter_dim=32),
                 {"qat": True}),
}


def preset_config(name: str = "tiny", **overrides) -> RunConfig:
    """The RunConfig of preset ``name`` (its run settings, e.g. tiny-dspark's loss_draft=0.5, tiny-qat's qat=True)
    with ``overrides`` on top: what ``--config NAME --key value ...`` gives. ``RunConfig(config=NAME)`` alone
    takes the dataclass defaults for those settings (``_train`` says so when they differ from the preset's)."""
    if name not in PRESETS:
        raise KeyError(f"preset_config: {name!r} is no preset ({', '.join(PRESETS)})")
    return RunConfig(**{"config": name, **PRESETS[name][1], **overrides})


def model_config(rc: RunConfig) -> fd.Config:
    if rc.config in PRESETS:
        return PRESETS[rc.config][0](rc.tokenizer)
    if os.path.exists(rc.config):
        try:
            return fd.Config.from_json(rc.config)
        except (OSError, ValueError, TypeError) as e:   # ConfigError is a ValueError
            raise SystemExit(f"--config: {e}") from None   # e names the file
    raise SystemExit(f"--config: {rc.config!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json path")



# ----------------------------------------------------------------------------- checks before anything is written
def validate(rc: RunConfig) -> None:
    """Refuse bad options with a one-line message, before a model is built or a file written (a
    traceback after minutes of training, or a half-made OUT, is the failure this guards against)."""
    bad_float = [f"--{k} {v}" for k, v in (("lr", rc.lr), ("min_lr_ratio", rc.min_lr_ratio),
                                             ("weight_decay", rc.weight_decay), ("b1", rc.b1), ("b2", rc.b2),
                                             *((f"loss_{k}", v) for k, v in rc.coefs.items()))
                 if not math.isfinite(v)] + ([f"--clip {rc.clip}"] if math.isnan(rc.clip) else [])
    device_why = device_problem(rc.device)
    checks = [
        # a NaN fails every comparison below but one (a NaN loss coefficient would switch its part off silently),
        # an inf lr or weight decay passes them: either way the first update writes NaN into every parameter,
        # and the checkpoint of that step would be named "last good" when the next step notices
        (not bad_float, f"{', '.join(bad_float)}: must be a finite number (--clip may be inf: no clipping)"),
        (rc.steps >= 1, f"--steps must be >= 1, got {rc.steps}"),
        (0 <= rc.seed < 2**63, f"--seed must be an integer in [0, 2**63) (numpy's and torch's generators), "
                               f"got {rc.seed}"),
        (rc.batch_size >= 1, f"--batch_size must be >= 1, got {rc.batch_size}"),
        (rc.seq_len >= 2, f"--seq_len must be >= 2 (a row needs a token and its target), got {rc.seq_len}"),
        (rc.lr > 0, f"--lr must be > 0, got {rc.lr}"),
        (0 <= rc.min_lr_ratio <= 1, f"--min_lr_ratio must be in [0, 1], got {rc.min_lr_ratio}"),
        (rc.warmup >= 0, f"--warmup must be >= 0, got {rc.warmup}"),
        (rc.weight_decay >= 0, f"--weight_decay must be >= 0, got {rc.weight_decay}"),
        (0 <= rc.b1 < 1 and 0 <= rc.b2 < 1, f"--b1 and --b2 must be in [0, 1), got {rc.b1}, {rc.b2}"),
        (rc.log_every >= 1, f"--log_every must be >= 1, got {rc.log_every}"),
        (rc.ckpt_every >= 0, f"--ckpt_every must be >= 0 (0: no checkpoints), got {rc.ckpt_every}"),
        (rc.keep_last >= 1, f"--keep_last must be >= 1 (the checkpoints kept), got {rc.keep_last}"),
        (rc.draft_anchor_stride >= 1, f"--draft_anchor_stride must be >= 1, got {rc.draft_anchor_stride}"),
        (rc.threads >= 0, f"--threads must be >= 0 (0: torch's default), got {rc.threads}"),
        (rc.sample_tokens >= 0, f"--sample_tokens must be >= 0, got {rc.sample_tokens}"),
        (rc.progress in ("auto", "on", "off"), f"--progress must be auto, on or off, got {rc.progress!r}"),
        (rc.mode in ("reference", "dequant", "qat"), f"--mode must be reference, dequant or qat, got {rc.mode!r}"),
        (device_why is None, f"--device {rc.device!r}: {device_why}"),
        (not (rc.resume and rc.overwrite), "--resume and --overwrite contradict each other: pass one"),
        (max(rc.coefs.values()) > 0, "every loss coefficient is <= 0 ("
         + ", ".join(f"--loss_{k} {v}" for k, v in rc.coefs.items()) + "): nothing to train"),
        (os.path.isfile(rc.corpus), f"--corpus {rc.corpus}: no such file"),
        (os.path.isfile(rc.tokenizer), f"--tokenizer {rc.tokenizer}: no such file"),
        (not os.path.exists(rc.out) or os.path.isdir(rc.out), f"--out {rc.out}: exists and is not a folder"),
        (not (rc.qat and rc.mode not in ("dequant", "qat")), f"--qat trains in mode qat (the forward fake-quantises "
         f"the stored formats); --mode {rc.mode} would be ignored: pass one of them"),
    ]
    for ok, msg in checks:
        if not ok:
            raise SystemExit(msg)
    _check_out_creatable(rc.out)


def _check_out_creatable(out: str) -> None:
    """--out must be a folder this process can make or write in: its nearest existing ancestor must be a writable
    folder (a run that could not create OUT failed with a traceback after the model was built)."""
    if not out or not str(out).strip():
        raise SystemExit("--out must name a folder, got an empty string")
    path = os.path.abspath(out)
    anc = path
    while not os.path.exists(anc):
        anc = os.path.dirname(anc)
    if not os.path.isdir(anc):
        raise SystemExit(f"--out {out}: {anc} is a file, not a folder")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise SystemExit(f"--out {out}: {anc} is not writable by this user")
