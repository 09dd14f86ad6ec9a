"""State carriers (DESIGN convention 4): frozen dataclasses registered as pytree nodes; and ``Chunk``, the
positions of one forward call's tokens, which every layer reads.

- ``AttnCache`` (one per layer that attends): the sliding-window ring, and for kv-source layers the
  append-only compressed history, its index keys and the partial compression group still filling.
- ``SharedAttention``: what source layers hand to the layers that reuse them *within one forward*
  (compressed KV, index keys, top-k, candidate mask), keyed by the source layer id.
- ``DecodeState``: every layer's ``AttnCache``, the n-gram tail, the DSpark draft windows and the
  positions (main model, DSpark windows); the one value ``forward`` takes and returns.

Ownership rule for the append-only histories (``compress_kv``, ``index_k``): a forward writes its new
entries into the preallocated buffer at rows ``>= n_compressed`` of the state it was given and returns
a state with a larger count; rows below the old count are never touched, so the old state stays a
valid (shorter) state. Rolling back (speculative decoding) is taking an older state: histories are
cut back by length, never cloned. Bounded pieces (window ring, partial group, n-gram tail) are new
tensors in every returned state.

Branching. Growing a state S again (a second continuation, a regenerated answer, a speculative
re-run) overwrites the history rows that the earlier continuations of S wrote, so every state of
that history that has gone past ``S.pos`` is then stale. Copying the buffers on every step would
make decode slower, so instead staleness is tracked on the host (``_Stamp``, no device work) and a
stale state is refused with an error by ``forward``; states at or before ``S.pos`` (S itself, its
ancestors) stay valid. To keep two futures alive, branch with ``clone_state`` (copies the buffers
once). The bookkeeping follows the buffer tensors, so it also covers the states that
``speculative.rollback`` assembles from another state's buffers.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from .config import Config, require_config, short_repr
from .pytree import register_carrier, tree_nbytes

BIG = 1 << 40  # "never": end position of padding entries


@dataclass
class Chunk:
    """Positions of the tokens of one forward call (``model.make_chunk``), read by every layer.

    start      absolute position of the chunk's first token (the state's position; 0 without state)
    pos_abs    [s] int64 absolute positions (index into the row)
    pos        [b, s] int64 positions inside each token's own sample (RoPE, grouping); = pos_abs
               unless the batch is packed
    seg_start  [b, s] int64 absolute position where each token's sample starts (0 unless packed)
    """
    start: int
    pos_abs: torch.Tensor
    pos: torch.Tensor
    seg_start: torch.Tensor
    packed: bool = False

    @property
    def s(self) -> int:
        return self.pos_abs.shape[0]


@register_carrier
@dataclass(frozen=True)
class AttnCache:
    """Per-layer inference cache.

    window_kv     [b, window, head_dim] bf16: ring buffer, row = position % window
    compress_kv   [b, max_seq_len // ratio, head_dim] bf16 (kv-source layers): RoPE'd, fp4-QDQ'd latents
    index_k       [b, max_seq_len // ratio, index_head_dim] bf16 (kv-source layers): indexer keys
    partial_kv    [b, ratio, head_dim] fp32 (ratio > 1 sources): compressor projections of the group
                  still filling, row = position % ratio (zeros where unused)
    partial_score [b, ratio, head_dim] fp32: their gate scores (-inf where unused)
    """
    window_kv: torch.Tensor
    compress_kv: Optional[torch.Tensor] = None
    index_k: Optional[torch.Tensor] = None
    partial_kv: Optional[torch.Tensor] = None
    partial_score: Optional[torch.Tensor] = None


@register_carrier
@dataclass(frozen=True)
class SharedAttention:
    """Within-forward hand-over from source layers (SPEC §0.1), keyed by source layer id.

    kv[L]         [b, n_compressed, head_dim]: all compressed KV rows visible to this chunk
    index_k[L]    [b, n_compressed, index_head_dim]
    topk[L]       [b, s, k] int64 compressed-entry indices (no window offset), -1 = none
    visible[L]    (lo, hi) [b, s] int64 each: the query sees entries lo <= j < hi (complete, own sample)
    blocks[L]     [b, n_compressed] int64: candidate block of each entry (never spanning two samples)
    candidates    [b, s, n_compressed] bool, published by the candidate source layer
    """
    kv: dict = dataclasses.field(default_factory=dict)
    index_k: dict = dataclasses.field(default_factory=dict)
    topk: dict = dataclasses.field(default_factory=dict)
    visible: dict = dataclasses.field(default_factory=dict)
    blocks: dict = dataclasses.field(default_factory=dict)
    candidates: Optional[torch.Tensor] = None

    def replace(self, **kw) -> "SharedAttention":
        return dataclasses.replace(self, **kw)


@register_carrier
@dataclass(frozen=True)
class DecodeState:
    """Everything a chunk needs from the past. ``pos`` = tokens already processed (same for all rows).

    layers[L]   AttnCache of backbone layer L
    dspark[s]   AttnCache (window only) of DSpark stage s: the main-model KV ring (SPEC §7)
    ngram       the Engram n-gram tail (engram.NgramCache) or None
    config_id   fingerprint of the config the state was built for (``config_id``; ``config_mismatch``)
    dspark_pos  the DSpark rings hold the main KV of positions < dspark_pos (a host int, like ``pos``;
                <= pos). ``forward`` leaves it (and the rings) as they are; ``dspark.dspark_prefill``
                extends it to ``pos``, and ``dspark_draft`` refuses rings that lag behind the state.
    """
    pos: int
    batch_size: int
    max_seq_len: int
    layers: tuple
    dspark: tuple = ()
    ngram: object = None
    config_id: str = ""
    dspark_pos: int = 0

    def replace(self, **kw) -> "DecodeState":
        return dataclasses.replace(self, **kw)

    def clone(self) -> "DecodeState":
        """``clone_state(self)``: an independent copy to grow a second future from."""
        return clone_state(self)


# Config fields that change neither what a state holds (its shapes come from init_state's arguments and
# the model fields) nor how the model computes: the sampling temperature (generate's default only),
# max_batch_size (never read) and max_seq_len (the default capacity of init_state and the limit of a
# stateless forward; a state keeps its own max_seq_len, and RoPE/YaRN read original_seq_len, not it).
STATE_NEUTRAL_FIELDS = ("temperature", "max_batch_size", "max_seq_len")

# fingerprint -> the fields it was computed from, so that a refusal can name the fields that differ
# (a state that comes from another process falls back to the plain message).
_CONFIG_FIELDS: dict = {}


def _state_fields(cfg: Config) -> dict:
    return {k: v for k, v in cfg.to_dict().items() if k not in STATE_NEUTRAL_FIELDS}


@functools.lru_cache(maxsize=64)
def config_id(cfg: Config) -> str:
    """A short fingerprint of the config a state was built for (refuse a state from another model).
    Hashes every field except ``STATE_NEUTRAL_FIELDS`` (so a state carries over to a config that differs
    in sampling temperature or max_seq_len only). Cached per config: ``forward`` asks on every call."""
    import hashlib
    import json
    fields = _state_fields(cfg)
    cid = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    _CONFIG_FIELDS[cid] = fields
    return cid


def config_mismatch(state_config_id: str, cfg: Config, what: str = "the state") -> Optional[str]:
    """None when ``state_config_id`` (a ``DecodeState.config_id``) is ``cfg``'s fingerprint; otherwise the
    text of the refusal, naming the fields that differ where the fingerprint is known in this process:
    "the state was built for another config (window_size 8 in it, 16 in cfg)". ``what`` names the holder."""
    want = config_id(cfg)
    if state_config_id == want:
        return None
    old = _CONFIG_FIELDS.get(state_config_id)
    if old is None:
        return f"{what} was built for another config"
    new = _CONFIG_FIELDS[want]
    diff = [f"{k} {short_repr(old.get(k), 40)} in it, {short_repr(new.get(k), 40)} in cfg"
            for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)]
    more = f"; and {len(diff) - 4} more field(s)" if len(diff) > 4 else ""
    return f"{what} was built for another config ({'; '.join(diff[:4])}{more})"


def state_nbytes(cfg: Config, batch_size: int, max_seq_len: Optional[int] = None) -> int:
    """Bytes ``init_state(cfg, batch_size, max_seq_len)`` allocates, computed without allocating
    (``state_bytes`` of that state): windows and compressed histories bf16, partial groups fp32, n-gram tail int64."""
    require_config(cfg, "state_nbytes")
    b = positive_int("state_nbytes", "batch_size", batch_size)
    n_tok = cfg.max_seq_len if max_seq_len is None else positive_int("state_nbytes", "max_seq_len", max_seq_len)
    ring = b * cfg.window_size * cfg.head_dim * 2
    total = ring * (len(cfg.layer_ids) + len(cfg.dspark_layer_ids))
    for L in cfg.layer_ids:
        if L in cfg.kv_source_layers:
            r = cfg.compress_ratio(L)
            total += b * (n_tok // r) * (cfg.head_dim + cfg.index_head_dim) * 2
            if r > 1:
                total += 2 * b * r * cfg.head_dim * 4
    if cfg.engram_layer_ids:
        total += b * (cfg.engram_max_ngram_size - 1) * 8
    return total


def free_bytes(device=None) -> Optional[int]:
    """Memory a new allocation on ``device`` can still get: CUDA free memory plus what torch's caching
    allocator holds unused; on the CPU, Linux's MemAvailable. None where it cannot be read (no check then)."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        free, _ = torch.cuda.mem_get_info(idx)
        return free + torch.cuda.memory_reserved(idx) - torch.cuda.memory_allocated(idx)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def check_state_fits(cfg: Config, batch_size: int, max_seq_len: Optional[int] = None, *, device=None,
                     who: str = "init_state") -> None:
    """Refuse a state larger than the memory ``device`` has free, before anything is allocated: a huge
    ``max_seq_len`` (a typo, ``--max-new-tokens 10**9``) would otherwise fail deep inside torch or, on a
    Linux host, get the process (a notebook's kernel) killed by the OOM killer while the zeros are written."""
    need = state_nbytes(cfg, batch_size, max_seq_len)
    free = free_bytes(device)
    if free is not None and need > free:
        n_tok = cfg.max_seq_len if max_seq_len is None else max_seq_len
        raise ValueError(f"{who}: a decode state for {batch_size} row(s) of {n_tok} tokens needs "
                         f"{need / 2**30:.2f} GiB, more than the {free / 2**30:.2f} GiB free on "
                         f"{torch.device('cpu' if device is None else device)}; ask for fewer tokens "
                         f"(max_seq_len / max_new_tokens) or rows")


def init_state(cfg: Config, batch_size: int, max_seq_len: Optional[int] = None, *, device=None) -> DecodeState:
    """An empty state for ``batch_size`` rows of up to ``max_seq_len`` tokens (default cfg.max_seq_len).
    Raises ValueError when it would not fit the memory ``device`` has free (``check_state_fits``).

    ``max_seq_len`` may exceed ``cfg.max_seq_len``: RoPE is computed per position and YaRN reads
    ``original_seq_len`` (SPEC §3), so a state's own capacity is the only limit of a stateful run. (The
    reference's generate caps a run at ``cfg.max_seq_len``, the length of its precomputed RoPE table.)"""
    require_config(cfg, "init_state")
    batch_size = positive_int("init_state", "batch_size", batch_size)
    max_seq_len = cfg.max_seq_len if max_seq_len is None else positive_int("init_state", "max_seq_len", max_seq_len)
    check_state_fits(cfg, batch_size, max_seq_len, device=device)
    b, W, D = batch_size, cfg.window_size, cfg.head_dim
    bf16 = torch.bfloat16

    def cache(L: int) -> AttnCache:
        ring = torch.zeros(b, W, D, dtype=bf16, device=device)
        if L not in cfg.kv_source_layers:
            return AttnCache(ring)
        r = cfg.compress_ratio(L)
        n = max_seq_len // r
        part_kv = part_s = None
        if r > 1:
            part_kv = torch.zeros(b, r, D, dtype=torch.float32, device=device)
            part_s = torch.full((b, r, D), float("-inf"), dtype=torch.float32, device=device)
        return AttnCache(ring, torch.zeros(b, n, D, dtype=bf16, device=device),
                         torch.zeros(b, n, cfg.index_head_dim, dtype=bf16, device=device), part_kv, part_s)

    ngram = None
    if cfg.engram_layer_ids:
        from . import engram
        ngram = engram.init_ngram_cache(cfg, b, device=device)
    return DecodeState(
        pos=0, batch_size=b, max_seq_len=max_seq_len,
        layers=tuple(cache(L) for L in cfg.layer_ids),
        dspark=tuple(AttnCache(torch.zeros(b, W, D, dtype=bf16, device=device)) for _ in cfg.dspark_layer_ids),
        ngram=ngram, config_id=config_id(cfg),
    )


def state_bytes(state: DecodeState) -> int:
    """Bytes held by a state's tensors."""
    return tree_nbytes(state)


def positive_int(who: str, name: str, v) -> int:
    """``v`` as an int >= 1 (Python, numpy or 0-d torch integers); refuses bools, floats and 0 (which
    would otherwise mean "the default" or fail deep inside torch), naming ``who`` (the caller) and ``name``."""
    try:
        n = operator.index(v)
    except TypeError:
        n = None
    if n is None or isinstance(v, bool) or n < 1:
        raise ValueError(f"{who}: {name} must be an integer >= 1, got {v!r}")
    return n


def device_problem(device: str) -> Optional[str]:
    """What is wrong with ``device`` as the device to run on (a command line's ``--device``: cpu, cuda or cuda:N), or
    None. A typo, or cuda on a machine without one, otherwise failed at the first tensor moved, after a model was
    built or loaded."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        return "not a device (cpu, cuda or cuda:N)"
    if d.type not in ("cpu", "cuda"):
        return f"runs on cpu or cuda, not {d.type}"
    if d.type == "cpu":
        return None if d.index in (None, 0) else "the CPU is one device (cpu)"
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return f"no CUDA device here (torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'})"
    if d.index is not None and d.index >= n:
        return f"this machine has {n} CUDA device(s) (cuda:0 .. cuda:{n - 1})"
    return None


def clone_state(state: DecodeState) -> DecodeState:
    """An independent copy of ``state`` (every tensor cloned): the way to grow two futures from one
    state (see the module docstring, "Branching"). Costs one copy of the state's buffers."""
    import torch.utils._pytree as tp
    if not isinstance(state, DecodeState):
        raise TypeError(f"clone_state: expected a DecodeState, got {type(state).__name__}")
    check_current(state, "clone_state")
    return tp.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)


# ----------------------------------------------------------------------------- staleness bookkeeping
class _Stamp:
    """Host-side record of the forward that returned a history buffer view.

    ``family``: the stamps over one set of history buffers (a WeakSet: a dropped state stops counting);
    ``end``: the position that forward reached; ``limit``: rows of positions >= limit may since have
    been overwritten by a forward from an earlier state of the same family. A state whose buffer
    carries this stamp is valid while ``state.pos <= limit`` (``rollback`` builds states at positions
    below ``end`` from the same views; those stay valid until something overwrites them).
    """
    __slots__ = ("family", "end", "limit", "__weakref__")

    def __init__(self, family: weakref.WeakSet, end: int):
        self.family, self.end, self.limit = family, end, float("inf")
        family.add(self)


# id(buffer view) -> (weakref to it, stamp). A side table rather than a tensor attribute, so states
# still pickle / torch.load (weights_only) as plain tensors; entries leave with their tensors.
_STAMPS: dict = {}


def _stamp_of(t: torch.Tensor) -> Optional[_Stamp]:
    e = _STAMPS.get(id(t))
    return e[1] if e is not None and e[0]() is t else None


def _set_stamp(t: torch.Tensor, stamp: _Stamp) -> None:
    key = id(t)

    def drop(ref, key=key):
        e = _STAMPS.get(key)
        if e is not None and e[0] is ref:
            del _STAMPS[key]
    _STAMPS[key] = (weakref.ref(t, drop), stamp)


def check_current(state: DecodeState, where: str) -> None:
    """Refuse a stale state (module docstring, "Branching")."""
    for c in state.layers:
        st = _stamp_of(c.compress_kv) if c.compress_kv is not None else None
        if st is not None and state.pos > st.limit:
            raise ValueError(
                f"{where}: this DecodeState (position {state.pos}) is stale: a forward from an earlier state of "
                f"the same history (position {st.limit}) has since overwritten the compressed KV it reads. "
                "Only one future can be grown from a state; to keep several, branch first with "
                "fd.clone_state(state) and grow each copy")


def begin_append(state: DecodeState, end: int) -> list:
    """Called by ``forward`` before it appends history rows from ``state.pos`` up to ``end``: marks
    every state of the same history past ``state.pos`` stale (before any write, so a forward that
    fails half-way still leaves them marked). Returns one new stamp per layer (None: no history)."""
    start, out = state.pos, []
    for c in state.layers:
        if c.compress_kv is None:
            out.append(None)
            continue
        old = _stamp_of(c.compress_kv)
        if old is None:                 # fresh buffers (init_state, clone_state, a copied state): adopt them
            old = _Stamp(weakref.WeakSet(), start)     # a new family: the stamps over one set of buffers
            _set_stamp(c.compress_kv, old)
        for st in list(old.family):
            if st.end > start:
                st.limit = min(st.limit, start)
        out.append(_Stamp(old.family, end))
    return out


def finish_append(layers: tuple, stamps: list) -> tuple:
    """The returned state's caches, each history buffer a fresh view (shared storage, no copy)
    carrying its stamp: the stamp then travels with every state built from these caches."""
    out = []
    for c, st in zip(layers, stamps):
        if st is not None:
            view = c.compress_kv.view_as(c.compress_kv)
            _set_stamp(view, st)
            c = dataclasses.replace(c, compress_kv=view)
        out.append(c)
    return tuple(out)
