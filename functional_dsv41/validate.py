"""``forward``'s input checks (model.py), kept out of the model's file so that it reads as the model.

Each refuses bad input by name before the model runs (DESIGN.md: a clear error that names the problem):
the batch's keys and types (``_check_batch``, ``_check_ids``, ``_check_token_types``), the ids against the
vocabulary and the parameter tree against the config (``_check_inputs``, ``_check_params``: shapes, dtypes,
scales, leaves the config does not have), a decode state against the config and the chunk (``_check_state``,
``_check_state_fits``). ``dspark.py`` reuses them for its own entry points.
"""
from __future__ import annotations

import functools
import re
import weakref
from typing import Optional

import optree
import torch

from . import transforms
from .config import Config
from .pytree import OPTREE_NAMESPACE, _logical_shape, flatten_with_paths
from .state import DecodeState, check_current, config_mismatch


def _check_state(state) -> None:
    """Checks that cost no device work, run even with ``validate=False``: a wrong object in ``state=``
    (e.g. the ForwardOutput instead of its ``.state``), a stale state (state.py, "Branching") and a state of
    inference tensors outside ``torch.inference_mode()``."""
    if state is None:
        return
    if not isinstance(state, DecodeState):
        from .model import ForwardOutput                  # (model imports this module)
        hint = " (pass out.state, not the ForwardOutput)" if isinstance(state, ForwardOutput) else ""
        raise TypeError(f"forward: state must be a DecodeState (fd.init_state) or None, got "
                        f"{type(state).__name__}{hint}")
    check_current(state, "forward")
    if not torch.is_inference_mode_enabled() and any(
            c.compress_kv is not None and c.compress_kv.is_inference() for c in state.layers):
        # else torch's "Inplace update to inference tensor outside InferenceMode" from inside attention
        raise ValueError("forward: this DecodeState was built under torch.inference_mode() and forward appends to "
                         "its histories in place, which torch allows only inside inference_mode: run this forward "
                         "under torch.inference_mode() too, or continue from fd.clone_state(state)")


def _not_int_tensor(t) -> Optional[str]:
    """What ``t`` is (its dtype, or its type's name) when it is not an integer tensor; None when it is one."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        return str(t.dtype)
    return None


def _check_token_types(batch: dict, data: bool) -> None:
    """token_types: an integer tensor shaped like input_ids. ``data`` (a device sync): image positions
    (>= 0) need images, as images need token_types (vision.merge_image_embeddings) - spans without
    images would silently run as text tokens with the image routing bias and Engram gating."""
    tt, ids = batch.get("token_types"), batch["input_ids"]
    if tt is None:
        return
    got = _not_int_tensor(tt)
    if got:
        raise TypeError(f"forward: token_types must be an integer tensor [b, s] (-1 text, 0..3 image span), "
                        f"got {got}")
    if tuple(tt.shape) != tuple(ids.shape):
        raise ValueError(f"forward: token_types {tuple(tt.shape)} must match input_ids {tuple(ids.shape)}")
    if data:
        lo, hi = int(tt.min()), int(tt.max())
        if lo < -1 or hi > 3:                   # -5 ran as text silently
            raise ValueError(f"forward: token_types holds {lo if lo < -1 else hi}; the types are -1 (text), "
                             f"0 IMAGE_START, 1 IMAGE, 2 IMAGE_NEW_LINE, 3 IMAGE_END")
    if data and batch.get("images") is None and bool((tt >= 0).any()):
        raise ValueError("forward: token_types marks image positions (>= 0) but batch has no 'images' "
                         "(one entry per row, image_processor.load_image); text positions are -1")


BATCH_KEYS = ("input_ids", "positions", "token_types", "images")
LOSS_KEYS = ("labels",)         # the training batch's (train.data.make_labels): the loss reads it, forward need not


def _check_batch(batch) -> None:
    """Host-only checks of the batch dict, run even with ``validate=False``: ``input_ids`` present and no key
    forward does not read (but the training batch's ``labels``). A misspelt or foreign key (``position_ids``,
    ``image``) would otherwise be ignored silently, running packed samples unisolated or images as text."""
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise ValueError("forward: batch must be a dict with 'input_ids' (int64 [b, s])")
    unknown = [k for k in batch if k not in BATCH_KEYS + LOSS_KEYS]
    if unknown:
        raise ValueError(f"forward: batch has keys that forward does not read: {unknown} (known: {list(BATCH_KEYS)}, "
                         f"and {list(LOSS_KEYS)}, which the training loss reads)")


def _check_ids(batch: dict, where: str = "forward") -> None:
    """input_ids' type, dtype and rank: host-only, so run even with ``validate=False`` (a float id was
    truncated to an integer silently there, 1-D ids failed with "not enough values to unpack")."""
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{where}: input_ids must be a tensor, got {type(ids).__name__}")
    if _not_int_tensor(ids):
        raise TypeError(f"{where}: input_ids must be an integer tensor, got {ids.dtype}")
    if ids.dim() != 2:
        hint = (" (under torch.func.vmap an example's ids are [seq]: pass x[None])"
                if ids.dim() == 1 and transforms.vmapped(ids) else "")
        raise ValueError(f"{where}: input_ids must be [batch, seq], got shape {tuple(ids.shape)}{hint}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"{where}: empty input_ids of shape {tuple(ids.shape)}")


def _outside_vocab(ids: torch.Tensor, cfg: Config) -> Optional[int]:
    """A token id of ``ids`` outside [0, vocab_size) (the lowest if one is negative, else the highest), or None
    (empty ids included). Reads the ids back: a device sync."""
    if ids.numel() == 0:
        return None
    lo, hi = int(ids.min()), int(ids.max())
    return lo if lo < 0 else hi if hi >= cfg.vocab_size else None


def _check_inputs(params: dict, batch: dict, cfg: Config, state: Optional[DecodeState], where: str = "forward"):
    ids = batch["input_ids"]
    b, s = ids.shape
    bad = _outside_vocab(ids, cfg)
    if bad is not None:
        raise ValueError(f"{where}: token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")
    if state is None and s > cfg.max_seq_len:
        raise ValueError(f"{where}: chunk of {s} tokens at position 0 runs past max_seq_len {cfg.max_seq_len}")
    _check_params(params, cfg, where)


# the stages and the vision tower are read only by dspark_forward / with images: absent is fine for forward
_OPTIONAL_PARAMS = ("mtp.", "vision.", "aligner.", "image_start", "image_end", "image_newline")


@functools.lru_cache(maxsize=8)
def _param_entries(cfg: Config) -> dict:
    """{path: Entry} of every tensor of ``param_spec(cfg)``, scales included (storage shapes and dtypes)."""
    from .params.spec import spec_entries
    return {e.name: e for e in spec_entries(cfg)}


_STACKED = re.compile(r"(.*\.experts)\.(\d+)(\..*)")   # layers.L.ffn.experts.E.w1.weight -> ...experts / E / .w1.weight
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)     # a plain tensor or a float master weight
_EXTRA_LEAVES = ("engram_token_map",)          # built by load_params from the tokenizer, not a released tensor


def _spec_name(path: str, entries: dict) -> str | None:
    """The spec entry a tree path stands for: itself, or expert 0's for the stacked experts form
    (``...experts.w1.weight`` [E, ...], sharding.py)."""
    if path in entries:
        return path
    head, dot, rest = path.partition(".experts.")
    if dot and f"{head}.experts.0.{rest}" in entries:
        return f"{head}.experts.0.{rest}"
    return None


class _Passed:
    """A tree that passed ``_check_params`` for a config: its structure and the ids of its leaves, each leaf
    watched by a weak reference whose death drops the record (so while it stands every id is a live object's,
    never a reused address)."""
    __slots__ = ("spec", "ids", "refs")

    def __init__(self, spec, leaves, forget):
        self.spec, self.ids = spec, list(map(id, leaves))
        self.refs = [weakref.ref(t, forget) for t in leaves]


_PASSED: dict = {}          # (cfg, id(params)) -> _Passed; the latest _PASSED_MAX trees that passed
_PASSED_MAX = 4


def _passed_before(params, cfg: Config):
    """(True, None) when ``params`` is, leaf for leaf, a tree that passed for ``cfg`` (same structure, same
    tensor objects); else (False, its (leaves, spec)) for ``_remember_passed``. One optree flatten: a decode
    loop over one tree pays the spec walk once (0.6-0.9 s a call at the release's 96k leaves, 0.15 s stacked)."""
    leaves, spec = optree.tree_flatten(params, namespace=OPTREE_NAMESPACE)
    rec = _PASSED.get((cfg, id(params)))
    if rec is not None and rec.spec == spec and rec.ids == list(map(id, leaves)):
        return True, None
    return False, (leaves, spec)


def _remember_passed(params, cfg: Config, flat) -> None:
    leaves, spec = flat
    key = (cfg, id(params))

    def forget(_ref, key=key, passed=_PASSED):   # a leaf died: its address may be reused by another tensor
        if passed.get(key) is rec:                  # (the dict bound here: at exit the module's globals are None)
            del passed[key]
    try:
        rec = _Passed(spec, leaves, forget)
    except TypeError:                        # a leaf without weak references (not a tensor): not remembered
        return
    _PASSED.pop(key, None)
    _PASSED[key] = rec
    while len(_PASSED) > _PASSED_MAX:
        del _PASSED[next(iter(_PASSED))]


def _check_params(params, cfg: Config, where: str = "forward") -> None:
    """The params against the config (host-only): every weight's shape (``param_spec``'s logical shapes, fp4
    unpacked) and dtype (a quantized weight in its storage dtype with its ``scale``, or a float master weight;
    every other tensor a float), and no leaf the config does not have. Without it a config changed in a notebook
    without new params failed deep inside torch ("shape '[1, 6, 8, 64]' is invalid"), with a KeyError, or ran on
    the params' own sizes; an integer weight was cast and run; a misspelt override was ignored.

    A tree that passed is remembered (the latest four, per config): called again with the same structure and
    the same tensor objects, only the flatten runs. A leaf replaced, added or removed anywhere re-runs the whole
    check; a tensor changed in place (``t.data = other``, ``t.resize_``) is not seen."""
    if isinstance(params, dict):
        seen, flat_leaves = _passed_before(params, cfg)
        if seen:
            return
    else:
        flat_leaves = None
    _check_params_walk(params, cfg, where)
    if flat_leaves is not None:
        _remember_passed(params, cfg, flat_leaves)


def _check_params_walk(params, cfg: Config, where: str) -> None:
    if not isinstance(params, dict):
        raise TypeError(f"{where}: params must be the parameter tree (a dict, fd.init_params / fd.load_params), "
                        f"got {type(params).__name__}")
    for key in ("layers", "mtp"):       # a dict of "0", "1", ... has the same paths, then fails with KeyError 0
        if key in params and not isinstance(params[key], (list, tuple)):
            raise TypeError(f"{where}: params[{key!r}] must be a list (one subtree a "
                            f"{'layer' if key == 'layers' else 'DSpark stage'}, as fd.init_params and "
                            f"fd.load_params build it), got {type(params[key]).__name__}")
    n = len(params.get("layers", ()))
    if n != cfg.n_layers:
        raise ValueError(f"{where}: params have {n} layers, config has {cfg.n_layers}")
    flat = flatten_with_paths(params)
    entries = _param_entries(cfg)
    problems = []
    for name, e in entries.items():
        if e.fmt == "scale":
            continue                            # checked beside its weight (master trees have none)
        want = tuple(e.logical)
        t = flat.get(name)
        stacked = None if t is not None else _STACKED.fullmatch(name)
        if stacked is not None and isinstance(flat.get(stacked[1] + stacked[3]), torch.Tensor):
            # the stacked experts form (sharding.py): ...experts.w1.weight [E, ...] holds expert e in row e
            t = flat[stacked[1] + stacked[3]]
            if t.dim() == 0 or t.shape[0] <= int(stacked[2]):
                problems.append(f"{stacked[1] + stacked[3]} has no expert {stacked[2]} (shape {tuple(t.shape)})")
                continue
            got = _logical_shape(t)[1:]
            if got != want:
                problems.append(f"{name} (row {stacked[2]} of {stacked[1] + stacked[3]}) is {got}, expected {want}")
            if stacked[2] == "0":
                problems += _dtype_problems(stacked[1] + stacked[3], t, e, flat)
            continue
        if t is None:
            if not name.startswith(_OPTIONAL_PARAMS):
                problems.append(f"{name} is missing (expected {want})")
            continue
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name} is a {type(t).__name__}, not a tensor")
            continue
        got = _logical_shape(t)                 # packed fp4 [N, K/2] is [N, K]
        if got != want:
            problems.append(f"{name} is {got}, expected {want}")
        problems += _dtype_problems(name, t, e, flat)
    extra = [p for p in flat if p not in _EXTRA_LEAVES and _spec_name(p, entries) is None]
    problems += [f"{p} is not a parameter of this config" for p in extra]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"{where}: params do not match the config ({len(problems)} problem(s)): "
                         + "; ".join(problems[:3]) + more + " - params built for another config, or edited?")


def _dtype_problems(path: str, t: torch.Tensor, e, flat: dict) -> list:
    """What is wrong with the dtype of weight ``t`` at ``path`` (spec entry ``e``): [] or one message."""
    if e.fmt in ("fp8", "fp4", "rows") and t.dtype == e.dtype:
        scale = path[:-len("weight")] + "scale"
        if not isinstance(flat.get(scale), torch.Tensor):
            return [f"{path} is stored as {t.dtype} but {scale} is missing"]
        return []
    if t.dtype in _FLOATS:
        return []
    want = f"{e.dtype} with its .scale, or a float master weight" if e.fmt in ("fp8", "fp4", "rows") else "a float"
    return [f"{path} is {t.dtype}, expected {want}"]


def _check_state_fits(batch: dict, cfg: Config, state: Optional[DecodeState]) -> None:
    """The state against the chunk and the config: host-only, so run even with ``validate=False`` (the decode
    loops' setting), where a state of another batch size failed deep inside torch and one of another config
    (same shapes, e.g. another index_topk) ran silently."""
    ids = batch["input_ids"]
    if state is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return
    b, s = ids.shape
    if state.pos + s > state.max_seq_len:
        raise ValueError(f"forward: chunk of {s} tokens at position {state.pos} runs past max_seq_len "
                         f"{state.max_seq_len}")
    if (why := config_mismatch(state.config_id, cfg)) is not None:
        raise ValueError(f"forward: {why}")
    if state.batch_size != b:
        raise ValueError(f"forward: the state holds {state.batch_size} rows, the batch has {b}")
    sdev = state.layers[0].window_kv.device if state.layers else ids.device
    if sdev != ids.device:
        raise ValueError(f"forward: the state is on {sdev} but input_ids are on {ids.device}: build it with "
                         f"fd.init_state(cfg, ..., device={str(ids.device)!r}) (forward computes on input_ids' device)")
    if "positions" in batch:
        raise ValueError("forward: packed 'positions' are for stateless (training) calls only")
