"""Released-layout checkpoints: read and write ``*.safetensors`` with storage dtypes kept (SPEC §9, §11).

Layouts read: one ``*.safetensors`` file; a folder holding ``model.safetensors``; a sharded folder with
``model.safetensors.index.json`` (``{"weight_map": {name: shard file}}``). Files are parsed here
(8-byte little-endian header length, JSON header, raw data) and memory-mapped copy-on-write with
numpy, so a tensor is a view into the mapping until it is materialised: the checkpoint is never held
twice, and with ``mmap_engram=True`` the Engram tables are never read into anonymous memory at all.

Writing is atomic per folder: every shard goes to a temporary name in the target folder, is
fsync'ed, and only once all are written are they renamed (``os.replace``) to their final names,
the index last. An exception while writing leaves the previous checkpoint untouched and removes
the temporary files.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from functional_dsv41 import quant
from functional_dsv41.config import Config
from functional_dsv41.pytree import flatten_with_paths, unflatten_from_paths

from .spec import Entry, spec_entries

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKEN_MAP = "engram_token_map"  # params key of the Engram token map (not a checkpoint tensor)
_MAX_HEADER = 1 << 30

_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint or a params tree that does not match ``param_spec(cfg)``; lists every problem."""

    def __init__(self, msg: str, problems: Optional[list[str]] = None):
        self.problems = list(problems or [])
        super().__init__(msg + ("".join(f"\n  {p}" for p in self.problems)))


# ----------------------------------------------------------------------------- reading
def _read_header(path: Path) -> tuple[dict, int]:
    """(header dict without __metadata__, byte offset of the data section)."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
        hdr = json.loads(fh.read(n))
    hdr.pop("__metadata__", None)
    return hdr, 8 + n


def _storage_shape(dtype_name: str, shape: list) -> tuple:
    """safetensors headers give fp4 tensors their logical shape; torch stores ``[..., K/2]``."""
    shape = tuple(shape)
    if dtype_name == "F4":
        return shape[:-1] + (shape[-1] // 2,)
    return shape


def _resolve(path: Path) -> dict[str, Path]:
    """tensor name -> file that holds it, for a file, a single-file folder or a sharded folder."""
    if path.is_file():
        return {k: path for k in _read_header(path)[0]}
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if (path / INDEX).exists():
        with open(path / INDEX) as fh:
            wmap = json.load(fh).get("weight_map")
        if not isinstance(wmap, dict):
            raise CheckpointError(f"{path / INDEX}: no 'weight_map' object")
        root = path.resolve()
        files, bad = {}, []
        for shard in sorted(set(wmap.values())):
            p = Path(shard)
            full = (root / p).resolve()
            if p.is_absolute() or ".." in p.parts or root not in full.parents:
                bad.append(f"shard path {shard!r} leaves the checkpoint folder")
            files[shard] = full
        if bad:
            raise CheckpointError(f"{path / INDEX}: refused", bad)
        return {name: files[shard] for name, shard in wmap.items()}
    if (path / SINGLE).exists():
        return _resolve(path / SINGLE)
    found = sorted(path.glob("*.safetensors"))
    if len(found) != 1:
        raise FileNotFoundError(f"{path}: expected {INDEX}, {SINGLE} or one *.safetensors, found {len(found)}")
    return _resolve(found[0])


class _File:
    """A safetensors file mapped copy-on-write; ``tensor(name)`` is a zero-copy view."""

    def __init__(self, path: Path):
        self.path = path
        self.header, self.start = _read_header(path)
        size = os.path.getsize(path)
        self.map = np.memmap(path, dtype=np.uint8, mode="c") if size > self.start else None
        self.bytes = torch.from_numpy(self.map) if self.map is not None else torch.empty(0, dtype=torch.uint8)

    def tensor(self, name: str) -> torch.Tensor:
        h = self.header[name]
        dtype, shape = _DTYPES[h["dtype"]], _storage_shape(h["dtype"], h["shape"])
        a, b = h["data_offsets"]
        raw = self.bytes[self.start + a: self.start + b]
        if (self.start + a) % dtype.itemsize:  # misaligned: copy (never happens for safetensors-written files)
            raw = raw.clone()
        return raw.view(dtype).view(shape)


def _is_engram_table(name: str) -> bool:
    return ".engram.embed." in name


def _check(entries: list[Entry], found: dict[str, tuple[tuple, torch.dtype]], what: str):
    """All mismatches between the spec and ``found`` (name -> (shape, dtype)), raised at once."""
    want = {e.name: e for e in entries}
    problems = [f"missing: {n} ({_NAMES.get(e.dtype, e.dtype)} {list(e.shape)})"
                for n, e in want.items() if n not in found]
    problems += [f"unexpected: {n}" for n in found if n not in want]
    for n, (shape, dtype) in found.items():
        e = want.get(n)
        if e is None:
            continue
        if tuple(shape) != e.shape:
            problems.append(f"wrong shape: {n} is {list(shape)}, expected {list(e.shape)}")
        if dtype != e.dtype:
            problems.append(f"wrong dtype: {n} is {dtype}, expected {e.dtype}")
    if problems:
        raise CheckpointError(f"{what} does not match the config ({len(problems)} problem(s)):", problems)


def _fp8_wo_a(where: dict, files: dict, cfg: Config) -> set[str]:
    """Prefixes ``layers.L.attn.wo_a`` / ``mtp.S.attn.wo_a`` stored as fp8 + ``scale`` (the Hugging Face
    release's form, SPEC §3/§16: its convert.py dequantises ``wo_a`` to bf16, the layout we keep)."""
    out = set()
    for name in where:
        if name.endswith(".attn.wo_a.scale"):
            w = name[: -len("scale")] + "weight"
            if w in where and files[where[w]].header[w]["dtype"] == "F8_E4M3":
                out.add(name[: -len(".scale")])
    return out


def load_params(path, cfg: Config, *, strict: bool = True, mmap_engram: bool = False,
                tokenizer=None):
    """Read a released-layout checkpoint into the params tree of ``cfg`` (storage dtypes kept).

    ``path``: a ``*.safetensors`` file, a folder with ``model.safetensors``, or a sharded folder with
    ``model.safetensors.index.json`` (shard paths that leave the folder are refused).
    ``strict``: every tensor of ``param_spec(cfg)`` must be present with its shape and dtype and
    nothing else may be; all problems are raised together as one :class:`CheckpointError`.
    With ``strict=False`` whatever the files hold is returned, unchecked.
    Tensors are materialised one at a time from the memory mapping; with ``mmap_engram=True`` the
    Engram tables (``layers.L.engram.embed.weight/scale``) stay views of the mapped file (read-only
    use; writes are copy-on-write and never reach the file).
    ``attn.wo_a`` stored as fp8 + ``scale`` (the Hugging Face release) is dequantised to bf16 on load,
    as the release's convert.py does; the returned tree has the released bf16 ``wo_a``.
    If ``cfg`` has Engram layers and ``tokenizer`` (a tokenizer.json path) is given or the folder
    holds ``tokenizer.json``, ``params["engram_token_map"]`` (int64 ``[vocab]``, SPEC §6.1) is built
    with ``functional_dsv41.engram.build_token_map`` (skipped when that module is unavailable).
    """
    path = Path(path)
    where = _resolve(path)
    files = {p: _File(p) for p in sorted(set(where.values()))}
    for name, p in where.items():
        if name not in files[p].header:
            raise CheckpointError(f"{path}: index lists {name} in {p.name}, which does not hold it")
    fp8_wo_a = _fp8_wo_a(where, files, cfg)
    if strict:
        found = {}
        for name, p in where.items():
            h = files[p].header[name]
            found[name] = (_storage_shape(h["dtype"], h["shape"]), _DTYPES.get(h["dtype"], h["dtype"]))
        for pre in fp8_wo_a:                     # checked as the bf16 tensor it becomes
            found[pre + ".weight"] = (found[pre + ".weight"][0], torch.bfloat16)
            del found[pre + ".scale"]
        _check(spec_entries(cfg), found, f"checkpoint {path}")
        order = [e.name for e in spec_entries(cfg)]
    else:
        order = [n for n in where if n[: -len(".scale")] not in fp8_wo_a]
    flat = {}
    for name in order:
        t = files[where[name]].tensor(name)
        pre = name[: -len(".weight")]
        if pre in fp8_wo_a:
            t = quant.dequant_fp8_block(t, files[where[pre + ".scale"]].tensor(pre + ".scale"), torch.bfloat16)
        flat[name] = t if (mmap_engram and _is_engram_table(name)) else t.clone()
    params = unflatten_from_paths(flat)
    del flat
    from functional_dsv41.moe import pack_experts
    pack_experts(params, inplace=True)          # the fp4 experts of a layer as views of one buffer (moe.py)
    _add_token_map(params, path, cfg, tokenizer)
    return params


def _add_token_map(params: dict, path: Path, cfg: Config, tokenizer) -> None:
    if not cfg.engram_layer_ids:
        return
    tok = Path(tokenizer) if tokenizer is not None else (path if path.is_dir() else path.parent) / "tokenizer.json"
    if not tok.exists():
        return
    try:
        from functional_dsv41.engram import build_token_map
    except ImportError:
        return
    params[TOKEN_MAP] = torch.as_tensor(build_token_map(str(tok)), dtype=torch.int64)


# ----------------------------------------------------------------------------- writing
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


def save_params(params, path, cfg: Config, *, max_shard_bytes: float = 5e9) -> list[str]:
    """Write ``params`` to folder ``path`` in the released layout; returns the files written.

    The tree is first checked against ``param_spec(cfg)`` (all problems at once, nothing written on
    failure; ``engram_token_map`` is ignored). Storage dtypes are kept, metadata ``{"format": "pt"}``.
    One ``model.safetensors`` when the tensors fit in ``max_shard_bytes``, else
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``. Atomic: temp
    files in ``path``, fsync, ``os.replace`` into place, index last; files of a previous checkpoint
    in that folder that the new one does not use are removed after the switch.
    """
    path = Path(path)
    flat = {k: v for k, v in flatten_with_paths(params).items() if k != TOKEN_MAP}
    entries = spec_entries(cfg)
    bad = [k for k, v in flat.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError("params tree has non-tensor leaves:", bad)
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

    path.mkdir(parents=True, exist_ok=True)
    old = _previous_files(path)
    tmps: list[str] = []
    try:
        for shard, name in zip(shards, names):
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=path)
            os.close(fd)
            tmps.append(tmp)
            _write_shard(shard, tmp)
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.numel() * t.dtype.itemsize for t in flat.values())},
                     "weight_map": {n: name for shard, name in zip(shards, names) for n in shard}}
            fd, tmp = tempfile.mkstemp(prefix=f".{INDEX}.", suffix=".tmp", dir=path)
            tmps.append(tmp)
            with os.fdopen(fd, "w") as fh:
                json.dump(index, fh, indent=2)
                fh.flush()
                os.fsync(fh.fileno())
    except BaseException:
        for tmp in tmps:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise
    # commit: shards first, index last; a single-file save drops an old index first so the new file wins
    finals = names + ([INDEX] if len(shards) > 1 else [])
    if len(shards) == 1 and (path / INDEX).exists():
        os.replace(tmps[0], path / SINGLE)
        os.unlink(path / INDEX)
    else:
        for tmp, name in zip(tmps, finals):
            os.replace(tmp, path / name)
    _fsync_dir(path)
    for f in old - set(finals):
        try:
            os.unlink(path / f)
        except FileNotFoundError:
            pass
    return [str(path / f) for f in finals]


def _previous_files(path: Path) -> set[str]:
    """Checkpoint files of an existing checkpoint in ``path`` (index, its shards, model.safetensors)."""
    old = set()
    if (path / SINGLE).exists():
        old.add(SINGLE)
    if (path / INDEX).exists():
        old.add(INDEX)
        try:
            with open(path / INDEX) as fh:
                wmap = json.load(fh).get("weight_map", {})
            old |= {s for s in set(wmap.values()) if Path(s).name == s}
        except (OSError, ValueError):
            pass
    return old
