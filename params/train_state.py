"""Train-state checkpoints with orbax-checkpoint: params, optimizer state, step, data position, RNG.

Layout of one checkpoint ``DIR/<step>/``: an orbax ``state`` item (a tree of numpy arrays:
``params/<path>``, ``opt/mu/<path>``, ``opt/nu/<path>``, ``rng/torch``) and a JSON ``meta`` item (step,
optimizer count, data position, the torch dtype of every array, anything else the caller adds).

Lossless torch <-> numpy: orbax stores numpy arrays, and numpy has no bfloat16 / float8 / float4, so
those tensors are stored as their raw bits (bf16 -> uint16, fp8 e4m3 / e8m0 / packed fp4 -> uint8,
``Tensor.view``) and the torch dtype is recorded in ``meta["dtypes"]``; restore views the bits back.
Every other dtype (fp32, int64, bool ...) round-trips through ``Tensor.numpy()`` unchanged. Restore
reads into a numpy template of the recorded shapes/dtypes, so no int64 is narrowed on the way; it first checks the
meta (its fields' types, and its dtypes and shapes against the arrays orbax stored), so that a hand-edited one is
refused, naming the field, instead of casting the stored bits to another dtype.

Saving is asynchronous (``CheckpointManager`` with ``enable_async_checkpointing``): ``save`` copies the
tensors to numpy on the caller's thread (the arrays it hands over never change afterwards), orbax
writes them in the background. Orbax writes into a temporary folder and renames it to ``<step>`` only
after every file is written (its atomic finalize), so a save interrupted midway leaves a
``<step>.orbax-checkpoint-tmp-*`` folder that ``latest_step``/``restore`` ignore: it never replaces
the last good checkpoint (tests/test_train_checkpoint.py kills a process inside the finalize), and the next
``TrainCheckpointer`` on the folder (a resumed run) removes it before its first save.
``max_to_keep`` keeps the newest N. Steps must grow: ``save`` refuses a step that is already saved or older than
the newest one (orbax would skip it without a word).

A restore that fails (a damaged checkpoint) raises orbax's error and prints nothing else. Orbax reads every array
concurrently on an event loop of its own and closes that loop as soon as the first read fails, while the other reads
still run in tensorstore's threads; unless the loop is retired (``_quiet_failed_restore``), each of them reports
``RuntimeError: Event loop is closed`` through ``sys.unraisablehook`` when it finishes, and the asyncio logger "Task
exception was never retrieved" when its task is collected: hundreds of tracebacks, up to ~0.2 s after the error,
interleaved with the caller's message (``train/run.py --resume`` on a checkpoint with one truncated array file).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import sys
from typing import Any, Optional

import numpy as np
import torch

from functional_dsv41 import sharding
from functional_dsv41.config import short_repr

# torch dtypes numpy lacks -> the unsigned int type of the same width holding their bits
_BITS = {torch.bfloat16: torch.uint16, torch.float16: None, torch.float8_e4m3fn: torch.uint8,
         torch.float8_e5m2: torch.uint8, torch.float8_e8m0fnu: torch.uint8}
if hasattr(torch, "float4_e2m1fn_x2"):
    _BITS[torch.float4_e2m1fn_x2] = torch.uint8


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


@functools.lru_cache(maxsize=None)
def _numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype ``to_numpy`` gives a tensor of the torch dtype ``name`` (no tensor of that dtype is made:
    under ``torch.use_deterministic_algorithms(True)`` torch fills new storage, and has no fill for fp4)."""
    dt = getattr(torch, name)
    return to_numpy(torch.zeros((), dtype=_BITS.get(dt) or dt)).dtype


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy copy of ``t`` holding its exact bits (see module docstring for non-numpy dtypes)."""
    t = t.detach().cpu().contiguous()
    bits = _BITS.get(t.dtype)
    if bits is not None:
        t = t.view(bits)
    return t.numpy().copy()


def from_numpy(a: np.ndarray, dtype: str) -> torch.Tensor:
    """Inverse of ``to_numpy`` given the recorded torch dtype name."""
    dt = getattr(torch, dtype)
    t = torch.from_numpy(np.ascontiguousarray(a))
    if _BITS.get(dt) is not None:
        return t.view(dt)
    if t.dtype != dt:
        raise TypeError(f"checkpoint array stored as {t.dtype}, recorded as {dt}")
    return t


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def _is_orphaned_read_report(u) -> bool:
    """Whether a ``sys.unraisablehook`` report is a read that a failed restore left running: tensorstore, from one of
    its own threads, calls ``call_soon_threadsafe`` of the (closed) loop that awaited it, and reports the error as
    unraisable. The traceback starts in ``call_soon_threadsafe`` itself: no Python code called it."""
    exc, tb = u.exc_value, u.exc_traceback
    return (type(exc) is RuntimeError and str(exc) == "Event loop is closed" and u.object is None
            and tb is not None and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"
            and isinstance(tb.tb_frame.f_locals.get("self"), asyncio.AbstractEventLoop))


def _retire_closed_loops(exc: BaseException) -> None:
    """Retire the closed event loops that the frames of ``exc``'s traceback (and of the exceptions it chains) hold:
    orbax's, whose reads may still be running. Their late callbacks are dropped (``call_soon_threadsafe`` of a closed
    loop could only raise) and their exception reports (the other failed reads' "Task exception was never
    retrieved", logged when the task is collected, maybe long after) go nowhere: the caller has the first read's
    error. The loop is orbax's own, made for this one restore and closed: nothing else calls it."""
    def drop(*args, **kwargs):
        return None

    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        todo += [e.__cause__, e.__context__]
        tb = e.__traceback__
        while tb is not None:
            for v in list(tb.tb_frame.f_locals.values()):
                if isinstance(v, asyncio.AbstractEventLoop) and v.is_closed():
                    v.set_exception_handler(drop)
                    try:
                        v.call_soon_threadsafe = drop
                    except (AttributeError, TypeError):       # a loop type without instance attributes (uvloop)
                        pass
            tb = tb.tb_next


@contextlib.contextmanager
def _quiet_failed_restore():
    """Around an orbax restore: when it raises, retire the closed event loop whose reads are still running
    (``_retire_closed_loops``) before the error leaves, so they finish silently. While it runs, unraisable reports of
    exactly that kind (``_is_orphaned_read_report``: a read finishing between the loop's closing and its retiring)
    are dropped; every other one goes to the previous ``sys.unraisablehook``, restored on the way out."""
    prev = sys.unraisablehook

    def hook(u):
        if not _is_orphaned_read_report(u):
            prev(u)

    sys.unraisablehook = hook
    try:
        yield
    except BaseException as e:
        _retire_closed_loops(e)
        raise
    finally:
        if sys.unraisablehook is hook:          # (replaced meanwhile by someone else: leave theirs)
            sys.unraisablehook = prev


class TrainCheckpointer:
    """Save/restore train states under ``directory`` (one sub-folder per step), keeping the last N. ``cleanup_tmp``:
    remove a killed save's temporary folders (before the first save; off for a look that must only read)."""

    def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True, cleanup_tmp: bool = True):
        import orbax.checkpoint as ocp
        self._ocp = ocp
        self.directory = os.path.abspath(directory)
        # cleanup_tmp_directories: a save killed mid-write leaves a ``<step>.orbax-checkpoint-tmp-*`` folder (a
        # whole train state's size) that nothing reads; opening the folder again (a resumed run) removes it (in
        # the background; orbax awaits it before the first save)
        opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                            create=True, cleanup_tmp_directories=cleanup_tmp)
        self.manager = ocp.CheckpointManager(self.directory, options=opts)

    # ---------------------------------------------------------------- save
    def save(self, step: int, *, params: dict[str, torch.Tensor], opt_state: dict,
             data_state: dict, rng_state: Optional[torch.Tensor] = None, extra: Optional[dict] = None) -> None:
        """Start saving the train state of ``step`` (returns once the arrays are copied to numpy)."""
        ocp = self._ocp
        # (no manager.reload() here: it would drop the pending saves that max_to_keep counts)
        if int(step) in self.manager.all_steps() or os.path.isdir(os.path.join(self.directory, str(int(step)))):
            raise ValueError(f"TrainCheckpointer.save: step {int(step)} is already saved in {self.directory} "
                             f"(orbax would skip it silently); restore it or save under another step")
        # orbax also skips, without a word, every step at or below its newest one (a loop restarted from step 0
        # in a folder that holds step 100 would save nothing)
        newest = max([*self.manager.all_steps(),
                      *(int(n) for n in os.listdir(self.directory)   # (a stray file named "100" is no step)
                        if n.isdigit() and os.path.isdir(os.path.join(self.directory, n)))], default=None)
        if newest is not None and int(step) < newest:
            raise ValueError(f"TrainCheckpointer.save: step {int(step)} is older than step {newest}, already saved "
                             f"in {self.directory} (orbax would skip it silently); save under a later step or "
                             f"into another folder")
        for what, tree in (("params", params), ("opt_state['mu']", opt_state["mu"]), ("opt_state['nu']", opt_state["nu"])):
            leaves = _flatten(tree)
            bad = [k for k, v in leaves.items() if not isinstance(v, torch.Tensor)]
            if bad:
                raise TypeError(f"TrainCheckpointer.save: {what} must be a (nested) dict of tensors; not tensors: "
                                f"{bad[:5]}")
            why = sharding.refusal(leaves, f"TrainCheckpointer.save {what}", stacked=False)
            if why:                                     # (it writes one process's whole tensors; stacked is fine)
                raise TypeError(why + ", and save on one rank")
        tensors = {"params": params, "opt": {"mu": opt_state["mu"], "nu": opt_state["nu"]}}
        if rng_state is not None:
            tensors["rng"] = {"torch": rng_state}
        flat = _flatten(tensors)
        meta = {"step": int(step), "opt_count": int(opt_state["count"]), "data": dict(data_state),
                "dtypes": {k: _dtype_name(v.dtype) for k, v in flat.items()},
                "shapes": {k: list(v.shape) for k, v in flat.items()}, "extra": extra or {}}
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise TypeError(f"TrainCheckpointer.save: data_state and extra must be JSON values (numbers, strings, "
                            f"lists, dicts): {e}") from None
        arrays = {k: to_numpy(v) for k, v in flat.items()}
        self.manager.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(arrays),
                                                             meta=ocp.args.JsonSave(meta)))

    def wait(self) -> None:
        """Block until every pending asynchronous save is on disk (finalized)."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    # ---------------------------------------------------------------- restore
    def latest_step(self) -> Optional[int]:
        """Newest finalized step, or None (unfinished temporary folders are ignored)."""
        self.manager.reload()
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def _check_meta(self, step: int, meta) -> None:
        """ValueError unless ``meta`` is one ``save`` could have written for the arrays the checkpoint holds: a
        hand-edited or damaged one ("opt_count": "x", a dtype "float64" recorded for bf16 bits) was restored as it
        was, and failed later (the optimizer's TypeError mid-run) or reinterpreted the stored bits silently."""
        where = os.path.join(self.directory, str(step), "meta")

        def bad(msg):
            raise ValueError(f"{where}: {msg}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not isinstance(meta, dict):
            bad(f"expected a JSON object, got {type(meta).__name__}")
        for k, ok, what in (("step", is_int, "an integer"), ("opt_count", is_int, "an integer"),
                            ("data", lambda v: isinstance(v, dict), "an object"),
                            ("dtypes", lambda v: isinstance(v, dict), "an object"),
                            ("shapes", lambda v: isinstance(v, dict), "an object"),
                            ("extra", lambda v: isinstance(v, dict), "an object")):
            if k not in meta and k != "extra":
                bad(f"{k!r} is missing")
            if k in meta and not ok(meta[k]):
                bad(f"{k!r} must be {what}, got {short_repr(meta[k], 60)}")
        if meta["step"] != step:
            bad(f"records step {meta['step']} but is the checkpoint of step {step}")
        if meta["opt_count"] < 0:
            bad(f"'opt_count' must be >= 0, got {meta['opt_count']}")
        handler = self._ocp.StandardCheckpointHandler()
        try:                                    # the stored arrays' dtypes and shapes (orbax's own metadata)
            from etils import epath
            stored = dict(handler.metadata(epath.Path(self.directory) / str(step) / "state").tree)
        finally:
            handler.close()
        dtypes, shapes = meta["dtypes"], meta["shapes"]
        if set(dtypes) != set(stored) or set(shapes) != set(stored):
            bad(f"dtypes / shapes do not list the stored arrays (they differ at "
                f"{sorted(set(dtypes) ^ set(stored) | set(shapes) ^ set(stored))[:5]})")
        for k, a in stored.items():
            name, shape = dtypes[k], shapes[k]
            try:
                want = _numpy_dtype(name) if isinstance(getattr(torch, str(name), None), torch.dtype) else None
            except (TypeError, RuntimeError, NotImplementedError):      # a torch dtype numpy cannot hold (complex32)
                want = None
            if want is None:
                bad(f"dtypes[{k!r}] = {short_repr(name, 40)} is not a torch dtype a checkpoint holds")
            if want != np.dtype(a.dtype):
                bad(f"dtypes[{k!r}] = {name!r}, but the stored array holds {np.dtype(a.dtype)}, not {want}")
            if not (isinstance(shape, list) and all(is_int(d) and d >= 0 for d in shape)
                    and tuple(shape) == tuple(a.shape)):
                bad(f"shapes[{k!r}] = {short_repr(shape, 40)}, but the array is stored as {list(a.shape)}")

    def restore(self, step: Optional[int] = None) -> dict:
        """Restore a train state. Returns {"step", "params", "opt_state", "data_state", "rng_state", "extra"}
        with params/moments as flat ``{path: tensor}`` dicts in their saved dtypes. ValueError (naming the field) for a
        ``meta`` that does not fit the stored arrays or has a value of the wrong type (``_check_meta``)."""
        ocp = self._ocp
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint in {self.directory}")
        with _quiet_failed_restore():           # a damaged checkpoint: orbax's error, without its reads' tracebacks
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            self._check_meta(step, meta)
            template = {k: np.zeros(meta["shapes"][k], dtype=_numpy_dtype(d)) for k, d in meta["dtypes"].items()}
            arrays = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(template))).state
        # reshape: np.ascontiguousarray makes a 0-dim array 1-dim
        t = {k: from_numpy(np.asarray(arrays[k]), d).reshape(meta["shapes"][k]) for k, d in meta["dtypes"].items()}

        def sub(prefix):
            return {k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix)}

        return {"step": meta["step"], "params": sub("params/"),
                "opt_state": {"count": meta["opt_count"], "mu": sub("opt/mu/"), "nu": sub("opt/nu/")},
                "data_state": meta["data"], "rng_state": t.get("rng/torch"), "extra": meta.get("extra", {})}


# ----------------------------------------------------------------------------- export
def to_storage(flat: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Flat float master params -> the release's storage dtypes, per ``params.spec_entries(cfg)``.

    A float leaf the release stores quantized (``fmt`` fp8 32x32 / fp4 1x32 / Engram fp8 rows) is
    re-quantised with the same quantizer ``init_params`` uses, producing ``weight`` + ``scale``; a
    leaf already in storage form (e.g. a frozen fp8 table with its scale) is kept; plain tensors are
    cast to their storage dtype. Leaves outside the spec (``engram_token_map``) pass through.
    """
    from functional_dsv41 import quant
    from functional_dsv41.params import spec_entries
    qz = {"fp8": quant.quant_fp8_block, "fp4": quant.quant_fp4, "rows": quant.quant_fp8_rows}
    out = {k: v for k, v in flat.items()}
    for e in spec_entries(cfg):
        if e.fmt == "scale":
            continue
        if e.name not in flat:
            raise KeyError(f"to_storage: params lack {e.name}")
        t = flat[e.name]
        if e.fmt in qz and t.is_floating_point() and t.element_size() >= 2:
            q, s = qz[e.fmt](t.detach().float())
            out[e.name], out[e.name[: -len("weight")] + "scale"] = q, s
        else:
            out[e.name] = t.detach().to(e.dtype) if t.dtype != e.dtype else t.detach()
    return out
