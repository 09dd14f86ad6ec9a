"""Released-layout checkpoints: the ``*.safetensors`` format and reading it, ``load_params`` (SPEC §9, §11).

Layouts read: one ``*.safetensors`` file; a folder holding ``model.safetensors``; a sharded folder with
``model.safetensors.index.json`` (``{"weight_map": {name: shard file}}``). Files are parsed here
(8-byte little-endian header length, JSON header, raw data) and memory-mapped copy-on-write with
numpy, so a tensor is a view into the mapping until it is materialised: the checkpoint is never held
twice, and with ``mmap_engram=True`` the Engram tables are never read into anonymous memory at all.

Also here, as writing uses them too: the file names, the dtype names, :class:`CheckpointError`, the index
reader and the spec check. Writing (``save_params``, atomic) is in ``save``.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from functional_dsv41 import quant
from functional_dsv41.config import Config, require_config
from functional_dsv41.pytree import unflatten_from_paths

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


def _first(problems: list[str], n: int = 8) -> list[str]:
    """At most ``n`` problems, then a count of the rest (a truncated file lists every tensor past the cut)."""
    return problems[:n] + ([f"... and {len(problems) - n} more"] if len(problems) > n else [])


class CheckpointError(ValueError):
    """A checkpoint or a params tree that does not match ``param_spec(cfg)``; lists every problem."""

    def __init__(self, msg: str, problems: Optional[list[str]] = None):
        self.problems = list(problems or [])
        super().__init__(msg + ("".join(f"\n  {p}" for p in self.problems)))


# ----------------------------------------------------------------------------- reading
def _read_header(path: Path) -> tuple[dict, int]:
    """(header dict without __metadata__, byte offset of the data section), every entry checked against the file:
    a known dtype, a list shape (fp4: an even last dimension), data offsets inside the file whose length is the
    shape's, the data section covered exactly (as safetensors itself requires). Any problem is a
    :class:`CheckpointError` naming the file and the tensor: a truncated or corrupt file never loads."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
        text = fh.read(n)
    size = os.path.getsize(path)
    if len(text) != n:
        raise CheckpointError(f"{path}: truncated: the header needs {n} bytes, the file has {size - 8}")
    try:
        hdr = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(hdr, dict):
        raise CheckpointError(f"{path}: the safetensors header is a JSON {type(hdr).__name__}, not an object")
    hdr.pop("__metadata__", None)
    start, problems, spans = 8 + n, [], []
    for name, h in hdr.items():
        if not isinstance(h, dict) or not {"dtype", "shape", "data_offsets"} <= set(h):
            problems.append(f"{name}: entry {h!r} lacks dtype / shape / data_offsets")
            continue
        dt, shape, offs = h["dtype"], h["shape"], h["data_offsets"]
        if dt not in _DTYPES:
            problems.append(f"{name}: unknown dtype {dt!r} (known: {', '.join(_DTYPES)})")
            continue
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            problems.append(f"{name}: shape {shape!r} is not a list of sizes")
            continue
        if dt == "F4" and (not shape or shape[-1] % 2):
            problems.append(f"{name}: F4 shape {shape} needs an even last dimension (two values a byte)")
            continue
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            problems.append(f"{name}: data_offsets {offs!r} are not [begin, end]")
            continue
        want = _DTYPES[dt].itemsize             # Python ints: an int64 product of a crafted shape wraps around
        for d in _storage_shape(dt, shape):
            want *= int(d)
        if offs[1] - offs[0] != want:
            problems.append(f"{name}: data_offsets {offs} hold {offs[1] - offs[0]} bytes, {dt} {shape} needs {want}")
        elif start + offs[1] > size:
            problems.append(f"{name}: data ends at byte {start + offs[1]}, past the end of the file ({size} bytes): "
                            f"truncated")
        else:
            spans.append((offs[0], offs[1]))
    if not problems:
        end = 0
        for a, b in sorted(spans):
            if a != end:
                problems.append(f"data bytes [{end}, {a}) belong to no tensor" if a > end else
                                f"data bytes [{a}, {end}) belong to two tensors (they overlap)")
                break
            end = b
        else:
            if start + end != size:
                problems.append(f"{size - start - end} bytes after the last tensor's data")
    if problems:
        raise CheckpointError(f"{path}: corrupt safetensors file", _first(problems))
    return hdr, start


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
        wmap = _read_index(path / INDEX)
        # shard names are checked lexically, not resolved: a Hugging Face hub snapshot's shards are symlinks
        # into its blobs folder, which is fine; a name with a folder part ("..", absolute) is not
        files, bad = {}, []
        for shard in sorted(set(wmap.values())):
            p = Path(shard)
            if p.is_absolute() or ".." in p.parts:
                bad.append(f"shard path {shard!r} leaves the checkpoint folder")
            files[shard] = path / p
        if bad:
            raise CheckpointError(f"{path / INDEX}: refused", bad)
        return {name: files[shard] for name, shard in wmap.items()}
    if (path / SINGLE).exists():
        return _resolve(path / SINGLE)
    found = sorted(path.glob("*.safetensors"))
    if len(found) != 1:
        raise FileNotFoundError(f"{path}: expected {INDEX}, {SINGLE} or one *.safetensors, found {len(found)}")
    return _resolve(found[0])


def _read_index(index: Path) -> dict[str, str]:
    """An index's weight_map (tensor name -> shard file name), checked: a JSON object whose ``weight_map`` maps
    names to file names."""
    try:
        with open(index) as fh:
            doc = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index}: not valid JSON ({e})") from None
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict):
        raise CheckpointError(f"{index}: no 'weight_map' object")
    bad = [f"{k!r}: {v!r}" for k, v in wmap.items() if not isinstance(v, str) or not v]
    if bad:
        raise CheckpointError(f"{index}: weight_map values must be shard file names", bad)
    return wmap


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


def _check_engram_layout(cfg: Config, who: str, note: str = "") -> None:
    """A :class:`CheckpointError` when ``cfg``'s Engram tables (``engram_num_embeddings``) do not fit the hash
    layout (SPEC §6.2; ``config_checks.engram_layout_error``). ``_check`` cannot see it: the spec takes the tables'
    rows from ``cfg`` itself, so a config built in code (``Config(...)``, ``cfg.replace(...)``: only
    ``Config.from_dict`` asks) and tables of its rows agreed, were saved and loaded, and only forward refused them."""
    from functional_dsv41.config_checks import engram_layout_error
    why = engram_layout_error(cfg)
    if why is not None:
        raise CheckpointError(f"{who}: the config's Engram tables do not fit the hash layout (SPEC §6.2: forward "
                              f"refuses them){note}:", [why])


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


def _int8_fp4(where: dict, files: dict) -> set[str]:
    """Routed-expert weights stored as I8 / U8 bytes ``[N, K/2]`` beside an e8m0 ``scale`` ``[N, K/32]``: packed fp4
    under an integer dtype, as the Hugging Face release stores them (SPEC §9). Their bytes are the fp4 pairs of our
    layout, so they are viewed as float4_e2m1fn_x2 on load (nothing is converted)."""
    out = set()
    for name in where:
        if ".ffn.experts." in name and name.endswith(".weight"):
            w, s = files[where[name]].header[name], name[: -len("weight")] + "scale"
            if w["dtype"] in ("I8", "U8") and len(w["shape"]) == 2 and s in where:
                h = files[where[s]].header[s]
                if h["dtype"] == "F8_E8M0" and (2 * w["shape"][1]) % 32 == 0 \
                        and h["shape"] == [w["shape"][0], 2 * w["shape"][1] // 32]:
                    out.add(name)
    return out


def _check_wo_a_scales(fp8_wo_a: set, where: dict, files: dict) -> None:
    """The fp8 ``wo_a``'s scale must be what ``quant.dequant_fp8_block`` reads: e8m0, one per 32 x 32 block."""
    problems = []
    for pre in sorted(fp8_wo_a):
        w, s = files[where[pre + ".weight"]].header[pre + ".weight"], files[where[pre + ".scale"]].header[pre + ".scale"]
        want = [-(-w["shape"][0] // 32), -(-w["shape"][1] // 32)] if len(w["shape"]) == 2 else None
        if s["dtype"] != "F8_E8M0" or s["shape"] != want:
            problems.append(f"{pre}.scale is {s['dtype']} {s['shape']}, expected F8_E8M0 {want} "
                            f"(one e8m0 scale per 32 x 32 block of the fp8 weight {w['shape']})")
    if problems:
        raise CheckpointError("fp8 attn.wo_a scales that cannot be dequantised:", problems)


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
    as the release's convert.py does; the returned tree has the released bf16 ``wo_a``. Routed-expert weights stored
    as I8 / U8 packed bytes (with their e8m0 ``[N, K/32]`` scale) are read as the packed fp4 they hold.
    If ``cfg`` has Engram layers and ``tokenizer`` (a tokenizer.json path) is given or the folder
    holds ``tokenizer.json``, ``params["engram_token_map"]`` (int64 ``[vocab]``, SPEC §6.1) is built
    with ``functional_dsv41.engram.build_token_map`` and checked against ``cfg.engram_compressed_vocab_size``; a
    ``tokenizer`` path that is a folder or does not exist is an error, raised before any tensor is read. A ``cfg``
    whose ``engram_num_embeddings`` do not fit the Engram hash layout (a config built in code) is a
    :class:`CheckpointError`, strict or not: forward refuses such tables.
    """
    require_config(cfg, "load_params")       # a path or a dict failed deep inside the spec walk
    _check_engram_layout(cfg, "load_params")   # (strict or not: the tables would be unusable)
    path = Path(path)
    tok = _token_map_source(path, cfg, tokenizer)   # before any tensor is read: a wrong path fails at once
    where = _resolve(path)
    shards = sorted(set(where.values()))
    missing = [p for p in shards if not p.is_file()]
    if missing:
        raise CheckpointError(f"{path}: the index names shard files that are not there:",
                              _first([f"{p.name} (holds {sum(1 for q in where.values() if q == p)} tensors, e.g. "
                                      f"{min(n for n, q in where.items() if q == p)})" for p in missing]))
    files = {p: _File(p) for p in shards}
    absent = [f"{name} in {p.name}" for name, p in where.items() if name not in files[p].header]
    if absent:
        raise CheckpointError(f"{path}: the index lists tensors in shards that do not hold them:", _first(absent))
    fp8_wo_a = _fp8_wo_a(where, files, cfg)
    _check_wo_a_scales(fp8_wo_a, where, files)
    int8_fp4 = _int8_fp4(where, files)
    if strict:
        found = {}
        for name, p in where.items():
            h = files[p].header[name]
            found[name] = (_storage_shape(h["dtype"], h["shape"]), _DTYPES.get(h["dtype"], h["dtype"]))
        for p in sorted(set(where.values())):    # a shard's tensors that the index does not list are extras too
            for name in files[p].header:
                if where.get(name) != p:
                    found[f"{name} (in {p.name}, not in the index)"] = (None, None)
        for pre in fp8_wo_a:                     # checked as the bf16 tensor it becomes
            found[pre + ".weight"] = (found[pre + ".weight"][0], torch.bfloat16)
            del found[pre + ".scale"]
        for name in int8_fp4:                    # and as the packed fp4 it is
            found[name] = (found[name][0], torch.float4_e2m1fn_x2)
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
        elif name in int8_fp4:
            t = t.view(torch.float4_e2m1fn_x2)
        flat[name] = t if (mmap_engram and _is_engram_table(name)) else _clone(t)
    params = unflatten_from_paths(flat)
    del flat
    from functional_dsv41.moe import pack_experts
    pack_experts(params, inplace=True)          # the fp4 experts of a layer as views of one buffer (moe.py)
    if tok is not None:
        from functional_dsv41.engram import build_token_map
        params[TOKEN_MAP] = torch.as_tensor(build_token_map(str(tok), expected_size=cfg.engram_compressed_vocab_size),
                                            dtype=torch.int64)
    return params


def _clone(t: torch.Tensor) -> torch.Tensor:
    """t copied out of the file's mapping. A packed fp4 tensor is copied as its bytes: under
    ``torch.use_deterministic_algorithms(True)`` a clone first fills its new storage, which torch does not implement
    for float4_e2m1fn_x2 (it raised NotImplementedError)."""
    if t.dtype == torch.float4_e2m1fn_x2:
        return t.view(torch.uint8).clone().view(t.dtype)
    return t.clone()


def _token_map_source(path: Path, cfg: Config, tokenizer) -> Path | None:
    """The tokenizer.json the Engram token map is built from: ``tokenizer`` if given (refused if it is a folder or
    is not there, even where no Engram layer reads it: a wrong path is a mistake), else the checkpoint folder's own
    if it has one; None without Engram layers or without a tokenizer."""
    if tokenizer is not None:
        tok = Path(tokenizer)
        if tok.is_dir():
            raise IsADirectoryError(f"load_params: tokenizer {tok} is a folder: pass its tokenizer.json")
        if not tok.is_file():
            raise FileNotFoundError(f"load_params: tokenizer {tok} does not exist"
                                    + (" (the Engram token map needs it)" if cfg.engram_layer_ids else ""))
    if not cfg.engram_layer_ids:
        return None
    if tokenizer is None:
        tok = (path if path.is_dir() else path.parent) / "tokenizer.json"
        if not tok.is_file():
            return None
    return tok
