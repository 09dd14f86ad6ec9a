"""Writing a released-layout checkpoint: ``save_params`` (SPEC §9, §11); the format and reading are in ``checkpoint``.

Writing is atomic per folder: every shard goes to a temporary name in the target folder, is
fsync'ed, and only once all are written are they moved into place (``_commit``) so that the folder
always holds one whole checkpoint, the previous or the new one, whatever step is interrupted; the
temporary files are removed on failure. A save killed outright (SIGKILL, the OOM killer, a node lost) cannot
remove its own: their names carry the writer's pid and host, and the next save into the folder removes those
whose writer, on this host, is gone (``_remove_stale_tmps``), so a killed release-size save does not leave
hundreds of GB of hidden files behind.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import tempfile
from pathlib import Path

import torch

from functional_dsv41 import sharding
from functional_dsv41.config import Config, require_config
from functional_dsv41.pytree import flatten_with_paths

from .checkpoint import (INDEX, SINGLE, TOKEN_MAP, CheckpointError, _NAMES, _check, _check_engram_layout, _first,
                         _read_index)
from .spec import spec_entries


def save_params(params, path, cfg: Config, *, max_shard_bytes: float = 5e9) -> list[str]:
    """Write ``params`` to folder ``path`` in the released layout; returns the files written.

    The tree is first checked against ``param_spec(cfg)`` (all problems at once, nothing written on
    failure; ``engram_token_map`` is ignored), and before that ``cfg`` against the Engram hash layout (a config
    built in code can give the tables other rows; ``param_spec`` takes them from ``cfg``). Storage dtypes are
    kept, metadata ``{"format": "pt"}``.
    One ``model.safetensors`` when the tensors fit in ``max_shard_bytes``, else
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``. Atomic: temp
    files in ``path``, fsync, ``os.replace`` into place, index last; files of a previous checkpoint
    in that folder that the new one does not use are removed after the switch. A folder whose index cannot be
    read is refused before anything is written: which files the old checkpoint has is then unknown.
    """
    require_config(cfg, "save_params")
    _check_engram_layout(cfg, "save_params", "; nothing was written")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"save_params: {path} is a file; save_params writes a folder (config.json, "
                              f"*.safetensors): pass a folder path", [])
    above = next((a for a in path.parents if a.exists()), None)     # the nearest existing folder above it
    if above is not None and not above.is_dir():
        raise CheckpointError(f"save_params: cannot make the folder {path}: {above} is a file, not a folder", [])
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, (int, float)) or \
            not max_shard_bytes > 0:
        raise CheckpointError(f"save_params: max_shard_bytes must be a number > 0, got {max_shard_bytes!r}", [])
    flat = {k: v for k, v in flatten_with_paths(params).items() if k != TOKEN_MAP}
    why = sharding.refusal(flat, "save_params")
    if why:
        raise CheckpointError(why, [])
    entries = spec_entries(cfg)
    bad = [k for k, v in flat.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError("params tree has non-tensor leaves:", bad)
    bad = [k for k, v in flat.items() if v.is_meta]
    if bad:
        raise CheckpointError("params tree has meta tensors (shapes without data: nothing to write):", _first(bad))
    _check(entries, {k: (tuple(v.shape), v.dtype) for k, v in flat.items()}, "params tree")

    shards, cur, cur_bytes = [], {}, 0
    for e in entries:
        t = flat[e.name]
        nb = t.numel() * t.dtype.itemsize
        if cur and cur_bytes + nb > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = {}, 0
        cur[e.name] = t
        cur_bytes += nb
    shards.append(cur)
    names = [SINGLE] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]

    old = _previous_files(path)
    path.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmps(path)
    mode = _file_mode()
    tmps: list[str] = []
    try:
        for shard, name in zip(shards, names):
            fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(name), suffix=".tmp", dir=path)
            os.close(fd)
            tmps.append(tmp)
            _write_shard(shard, tmp)
            os.chmod(tmp, mode)                 # mkstemp's 0600 would stay on the final file
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.numel() * t.dtype.itemsize for t in flat.values())},
                     "weight_map": {n: name for shard, name in zip(shards, names) for n in shard}}
            tmps.append(_write_json_tmp(index, INDEX, path, mode))
        finals = names + ([INDEX] if len(shards) > 1 else [])
        old |= _commit(path, tmps, finals, mode)
    except BaseException:
        for tmp in tmps:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise
    for f in old - set(finals):                 # after the switch: the previous checkpoint's files
        try:
            os.unlink(path / f)
        except FileNotFoundError:
            pass
    _fsync_dir(path)
    return [str(path / f) for f in finals]


def _previous_files(path: Path) -> set[str]:
    """Checkpoint files of an existing checkpoint in ``path`` (index, its shards, model.safetensors). An index that
    cannot be read is a :class:`CheckpointError`: its shards are unknown, and removing the index alone would leave
    them beside the new checkpoint (deleting ``model-*-of-*`` files by name could remove files it does not own)."""
    old = set()
    if (path / SINGLE).exists():
        old.add(SINGLE)
    if (path / INDEX).exists():
        old.add(INDEX)
        try:
            old |= {s for s in set(_read_index(path / INDEX).values()) if Path(s).name == s}
        except (OSError, CheckpointError) as e:
            raise CheckpointError(f"save_params: {path / INDEX} cannot be read, so the shard files of the checkpoint "
                                  f"in {path} are unknown; nothing was written. Repair or remove that index (and the "
                                  f"shards it listed), or save to another folder:", [str(e)]) from e
    return old


def _commit(path: Path, tmps: list[str], finals: list[str], mode: int) -> set[str]:
    """Move the written files into place so that at every instant the folder holds one whole checkpoint, the
    previous or the new one; returns the backup names it made (below), which the caller removes with the
    previous checkpoint's other files. The commit point is a single ``os.replace``: of ``model.safetensors``
    for a single-file save, of the index for a sharded one (the loader prefers the index). A new shard can only be moved onto a name
    the previous index uses once that index no longer needs it: such shards are first hard-linked (copied
    where links are unsupported) under backup names and the previous index rewritten to them, so a crash
    anywhere leaves a loadable previous checkpoint. Moved files leave ``tmps``, so a failure removes only
    what has not been moved."""
    if len(finals) == 1:                        # single file: replace it; a previous index must go (it wins)
        os.replace(tmps[0], path / SINGLE)
        tmps.pop(0)
        if (path / INDEX).exists():
            os.unlink(path / INDEX)
        return set()
    wmap = _read_index(path / INDEX) if (path / INDEX).exists() else {}    # readable: _previous_files checked it
    backup = {}
    clash = sorted({s for s in wmap.values() if s in finals})
    if clash:
        for s in clash:
            fd, bak = tempfile.mkstemp(prefix=f".{s}.", suffix=".prev", dir=path)
            os.close(fd)
            os.unlink(bak)
            try:
                os.link(path / s, bak)
            except OSError:
                shutil.copy2(path / s, bak)
            backup[s] = Path(bak).name
        doc = {"metadata": {"note": "the previous checkpoint, while a new one is moved into place"},
               "weight_map": {n: backup.get(s, s) for n, s in wmap.items()}}
        tmp = None
        try:
            tmp = _write_json_tmp(doc, INDEX, path, mode)
            os.replace(tmp, path / INDEX)
        except BaseException:                   # the previous index still names the originals: drop the links
            for f in [tmp, *[path / b for b in backup.values()]]:
                if f is not None and os.path.lexists(f):
                    os.unlink(f)
            raise
    for name in finals:                         # the shards, then the index (finals[-1]): the commit
        os.replace(tmps[0], path / name)
        tmps.pop(0)
    return set(backup.values())


def _header_for(tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[str]]:
    """safetensors header (padded to 8 bytes) and the data order: by alignment then name, as
    safetensors orders it, so every tensor's offset is aligned to its element size."""
    order = sorted(tensors, key=lambda n: (-tensors[n].dtype.itemsize, n))
    hdr, off = {"__metadata__": {"format": "pt"}}, 0
    for n in order:
        t = tensors[n]
        shape = list(t.shape)
        if t.dtype == torch.float4_e2m1fn_x2:
            shape[-1] *= 2  # header holds the logical shape (dtype F4)
        nb = t.numel() * t.dtype.itemsize
        hdr[n] = {"dtype": _NAMES[t.dtype], "shape": shape, "data_offsets": [off, off + nb]}
        off += nb
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return raw, order


def _write_shard(tensors: dict[str, torch.Tensor], fname: str) -> None:
    """Write one safetensors file and fsync it (module-level so tests can interrupt it)."""
    raw, order = _header_for(tensors)
    with open(fname, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for n in order:
            t = tensors[n].detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            fh.write(memoryview(t.numpy()))
        fh.flush()
        os.fsync(fh.fileno())


def _write_json_tmp(doc: dict, name: str, path: Path, mode: int) -> str:
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(name), suffix=".tmp", dir=path)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _file_mode() -> int:
    """0666 less the process umask: the mode ``open`` would give a new file."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _host() -> str:
    """This host's name reduced to [A-Za-z0-9_-] (it goes between dots in a file name)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64]


def _tmp_prefix(name: str) -> str:
    """Temporary-file prefix for ``name``: hidden, and naming the writer (pid, host) for ``_remove_stale_tmps``."""
    return f".{name}.pid{os.getpid()}@{_host()}."


_STALE = re.compile(r"^\.(?:model\.safetensors(?:\.index\.json)?|model-\d+-of-\d+\.safetensors)"
                    r"\.pid(\d+)@([A-Za-z0-9_-]*)\.[^./]+\.tmp$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):   # another user's process: alive
        return True
    return True


def _remove_stale_tmps(path: Path) -> list[str]:
    """Remove temporary files in ``path`` left by a save that was killed before it could clean up: named by
    ``_tmp_prefix``, written on this host, by a pid that no longer runs. A live writer's files (a concurrent
    save) and another host's are kept (a pid means nothing across hosts). Says what it removed (a warning
    naming the files and the bytes freed); returns their names."""
    import warnings
    me = _host()
    gone, freed = [], 0
    for f in sorted(os.listdir(path)):
        m = _STALE.match(f)
        if m is None or m.group(2) != me or _alive(int(m.group(1))):
            continue
        try:
            size = os.lstat(path / f).st_size
            os.unlink(path / f)
        except FileNotFoundError:
            continue
        gone.append(f)
        freed += size
    if gone:
        warnings.warn(f"save_params: removed {len(gone)} temporary file(s) ({freed / 1e9:.3g} GB) that an interrupted "
                      f"save left in {path}: {', '.join(gone[:4])}{' ...' if len(gone) > 4 else ''}", stacklevel=3)
    return gone
