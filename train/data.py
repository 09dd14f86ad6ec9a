"""Packed training rows from the shipped corpus, with an exactly resumable position.

Samples: one corpus line = one sample = ``[BOS] + tokens + [EOS]``; the line is text throughout (special-token
text in it is spelled in byte tokens, see ``load_samples``).

Packing (``pack``), per epoch, deterministic in (seed, epoch):
  1. the samples are shuffled (``numpy.random.default_rng([seed, epoch])``);
  2. a sample longer than the row is split into row-length pieces; every piece is a sample of its
     own (positions from 0, no target across the cut);
  3. rows are filled first-fit from a look-ahead buffer of the next ``lookahead`` samples: a sample
     goes into the row if it fits the space left; when none fits, the rest of the row is padding
     (``pad_id``, positions 0.. of its own, never a target). Nothing is dropped: the samples left at
     the end of the epoch fill the last rows, and the last row's padding is the only "tail".

Positions restart at 0 at every sample start; the model keeps samples isolated given them. Targets
(``labels``) never cross a sample boundary: ``labels[t] = ids[t+1]`` iff token t+1 continues the
same sample (``positions[t+1] == positions[t] + 1``) and is not padding, else ``IGNORE`` (-100). So
the last token of a sample (its EOS) has no target, and the first token of a sample is never one.

``PackedData`` walks the rows of epoch 0, 1, 2, ... in order; a batch that runs past the end of an
epoch continues with the next epoch's rows, so no row is skipped. ``state()`` = {"epoch", "offset"}
(offset = next row of that epoch) is part of the train state; ``set_state`` resumes exactly.
"""
from __future__ import annotations

from collections import deque
from functools import lru_cache

import numpy as np
import torch

IGNORE = -100


def load_samples(corpus: str, tokenizer_json: str, bos: int = 0, eos: int = 1) -> list[np.ndarray]:
    """Tokenize ``corpus`` (one sample per non-empty line) into int64 arrays ``[BOS] + ids + [EOS]``.

    A line is text: special-token text in it (``<｜end▁of▁sentence｜>``, the pad token's text...) becomes the
    byte tokens that spell it, not the control id (``tokenizer.corpus_tokenizer``), so the only control ids in
    a sample are the BOS/EOS added here - a document quoting ``<｜▁pad▁｜>`` must not turn into padding (no
    target) or an end of sample inside the row."""
    from .tokenizer import corpus_tokenizer
    tok = corpus_tokenizer(tokenizer_json)
    with open(corpus, encoding="utf-8-sig") as fh:      # -sig: a BOM at the start is not text of the first sample
        # iterate, not str.splitlines(): that also splits at U+2028/2029, U+0085, \f, \v and \x1c-\x1e, which web
        # text carries inside a line; a line ends at \n, \r\n or \r only (universal newlines)
        lines = [ln.rstrip("\n") for ln in fh]
        lines = [ln for ln in lines if ln.strip()]
    if not lines:
        raise ValueError(f"{corpus}: no samples (empty corpus)")
    return [np.asarray([bos] + e.ids + [eos], dtype=np.int64)
            for e in tok.encode_batch(lines, add_special_tokens=False)]


def pack(samples: list[np.ndarray], row_len: int, pad_id: int, lookahead: int = 64
         ) -> tuple[np.ndarray, np.ndarray]:
    """Pack samples (in the given order) into rows. Returns ``ids, positions`` int64 ``[n_rows, row_len]``.

    See the module docstring for the rules. Deterministic; every token of every sample is in exactly
    one row.
    """
    _check_sizes(row_len=row_len, lookahead=lookahead)
    if len(samples) == 0:
        raise ValueError("pack: no samples")
    pieces = (s[i:i + row_len] for s in samples for i in range(0, len(s), row_len))
    buf: deque = deque()
    rows_ids, rows_pos = [], []
    exhausted = False
    while True:
        while not exhausted and len(buf) < lookahead:
            nxt = next(pieces, None)
            if nxt is None:
                exhausted = True
            else:
                buf.append(nxt)
        if not buf:
            break
        ids = np.full(row_len, pad_id, dtype=np.int64)
        pos = np.zeros(row_len, dtype=np.int64)
        used = 0
        while True:
            fit = next((j for j, s in enumerate(buf) if len(s) <= row_len - used), None)
            if fit is None:
                break
            s = buf[fit]
            del buf[fit]
            ids[used:used + len(s)] = s
            pos[used:used + len(s)] = np.arange(len(s))
            used += len(s)
        pos[used:] = np.arange(row_len - used)  # padding: a segment of its own
        rows_ids.append(ids)
        rows_pos.append(pos)
    if not rows_ids:
        raise ValueError(f"pack: the {len(samples)} sample(s) hold no tokens (every one is empty)")
    return np.stack(rows_ids), np.stack(rows_pos)


def _check_sizes(**sizes: int) -> None:
    """Each of ``row_len`` (>= 2: a token and its target), ``lookahead``, ``batch_size`` (>= 1) is an int in range."""
    for name, v in sizes.items():
        lo = 2 if name == "row_len" else 1
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


def make_labels(ids: torch.Tensor, positions: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Next-token targets that never cross a sample boundary (module docstring). int64, same shape."""
    labels = torch.full_like(ids, IGNORE)
    cont = (positions[..., 1:] == positions[..., :-1] + 1) & (ids[..., 1:] != pad_id)
    labels[..., :-1] = torch.where(cont, ids[..., 1:], torch.full_like(ids[..., 1:], IGNORE))
    return labels


class PackedData:
    """Deterministic, resumable iterator over packed batches.

    ``next_batch()`` -> {"input_ids", "positions", "labels"} int64 ``[batch_size, row_len]``.
    """

    def __init__(self, samples: list[np.ndarray], *, row_len: int, batch_size: int, pad_id: int,
                 seed: int = 0, lookahead: int = 64):
        if len(samples) == 0:
            raise ValueError("PackedData: no samples")
        _check_sizes(row_len=row_len, batch_size=batch_size, lookahead=lookahead)
        self.samples, self.row_len, self.batch_size = samples, row_len, batch_size
        self.pad_id, self.seed, self.lookahead = pad_id, seed, lookahead
        self.epoch, self.offset = 0, 0
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def epoch_rows(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The packed (ids, positions) rows of ``epoch`` (cached for the current and next epoch)."""
        if epoch not in self._cache:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.samples))
            self._cache = {e: v for e, v in self._cache.items() if e >= epoch - 1}
            self._cache[epoch] = pack([self.samples[i] for i in order], self.row_len, self.pad_id,
                                      self.lookahead)
        return self._cache[epoch]

    def state(self) -> dict:
        return {"epoch": int(self.epoch), "offset": int(self.offset)}

    def set_state(self, state: dict) -> None:
        """Resume at ``state`` (what ``state()`` returned): ``epoch >= 0`` and ``0 <= offset < rows`` of that
        epoch - ``next_batch`` moves to (epoch + 1, 0) as soon as an epoch's last row is taken, so an offset at or
        past the end is no state this iterator reaches (e.g. a checkpoint from another --seq_len or corpus)."""
        vals = {}
        for k in ("epoch", "offset"):
            if k not in state:
                raise ValueError(f"PackedData.set_state: {k!r} missing from {state!r}")
            v = state[k]
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"PackedData.set_state: {k} must be an integer, got {v!r}")
            vals[k] = int(v)
        epoch, offset = vals["epoch"], vals["offset"]
        if epoch < 0:
            raise ValueError(f"PackedData.set_state: epoch must be >= 0, got {epoch}")
        n_rows = len(self.epoch_rows(epoch)[0])
        if not 0 <= offset < n_rows:
            raise ValueError(f"PackedData.set_state: offset {offset} out of range for epoch {epoch}, which has "
                             f"{n_rows} rows (0 <= offset < {n_rows}); is the state from another corpus, "
                             f"seq_len or seed?")
        self.epoch, self.offset = epoch, offset

    def next_batch(self) -> dict[str, torch.Tensor]:
        ids, pos = [], []
        while len(ids) < self.batch_size:
            rid, rpos = self.epoch_rows(self.epoch)
            take = min(self.batch_size - len(ids), len(rid) - self.offset)
            ids.extend(rid[self.offset:self.offset + take])
            pos.extend(rpos[self.offset:self.offset + take])
            self.offset += take
            if self.offset >= len(rid):
                self.epoch, self.offset = self.epoch + 1, 0
        t_ids = torch.from_numpy(np.stack(ids))
        t_pos = torch.from_numpy(np.stack(pos))
        return {"input_ids": t_ids, "positions": t_pos, "labels": make_labels(t_ids, t_pos, self.pad_id)}

    def stats(self) -> dict:
        """Rows per epoch, and the fraction of row slots that are padding (epoch 0)."""
        rid, _ = self.epoch_rows(0)
        return {"rows_per_epoch": len(rid), "pad_fraction": float((rid == self.pad_id).mean()),
                "tokens_per_epoch": int(sum(len(s) for s in self.samples))}


def shipped_samples(corpus: str, tokenizer_json: str) -> tuple:
    """``load_samples`` of the shipped corpus, cached (tests and run.py share it) while neither file changes:
    keyed by path, size and mtime, so a corpus or tokenizer rewritten under the same name is read again."""
    from .tokenizer import file_key
    return _samples(file_key(corpus), file_key(tokenizer_json))


@lru_cache(maxsize=2)
def _samples(corpus_key: tuple, tokenizer_key: tuple) -> tuple:
    return tuple(load_samples(corpus_key[0], tokenizer_key[0]))
