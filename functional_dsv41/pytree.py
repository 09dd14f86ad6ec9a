"""Pytree helpers over parameter trees and state carriers.

Parameter trees are nested ``dict``/``list`` containers of tensors; a leaf's path joined with "."
is its checkpoint name (``layers.5.attn.wq_b.weight``).

State carriers (``AttnCache``, ``SharedAttention``, ``NgramCache``, ``DecodeState``...) are frozen
dataclasses registered ONCE, here, with both ``torch.utils._pytree`` (what ``torch.func`` uses) and
``optree``, with the same child order (the dataclass field order), so a flatten by one and an
unflatten by the other agree.
"""
from __future__ import annotations

import dataclasses

import optree
import torch.utils._pytree as torch_pytree

OPTREE_NAMESPACE = "functional_dsv41"


def register_carrier(cls):
    """Class decorator: register a frozen dataclass as a pytree node with torch and optree.

    Children are the dataclass fields in declaration order; ``None`` fields are no children at all (optree's
    "empty" None; for torch the field names that are present are the node's context), so both libraries see
    the same leaves and ``torch.func.vmap`` / ``jvp`` can return a carrier with unset fields (a
    ``ForwardOutput`` without state or hidden streams): torch's own None would be a leaf they refuse.
    Use it on every state carrier, once.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"register_carrier: {cls.__name__} is not a dataclass")
    names = tuple(f.name for f in dataclasses.fields(cls))

    def flatten(obj):
        ctx = tuple(n for n in names if getattr(obj, n) is not None)
        return [getattr(obj, n) for n in ctx], ctx

    def flatten_with_keys(obj):
        children, ctx = flatten(obj)
        return [(torch_pytree.GetAttrKey(n), c) for n, c in zip(ctx, children)], ctx

    def unflatten(children, ctx=names):
        return cls(**{n: None for n in names if n not in ctx}, **dict(zip(ctx, children)))

    torch_pytree.register_pytree_node(
        cls, flatten, lambda children, ctx: unflatten(children, ctx),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )
    optree.register_pytree_node(
        cls, lambda obj: ([getattr(obj, n) for n in names], names, names),
        lambda ctx, children: unflatten(children, ctx), namespace=OPTREE_NAMESPACE,
    )
    return cls


# ----------------------------------------------------------------------------- path-keyed views
from typing import Any, Callable, Optional  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402


def tree_nbytes(*trees) -> int:
    """Bytes held by the tensors of ``trees`` (any pytrees: params, flat {path: leaf} dicts, carriers); other
    leaves count nothing."""
    return sum(t.numel() * t.element_size() for t in torch_pytree.tree_leaves(trees) if isinstance(t, torch.Tensor))


def _path_str(path: tuple, who: str) -> str:
    """The entries of ``path`` joined with ".". An entry that holds "." or is empty is refused: its path would
    read back as other nesting (``{"a.b": x}`` as ``{"a": {"b": x}}``), and two trees would share one path set."""
    for i, p in enumerate(path):
        s = str(p)
        if s == "" or "." in s:
            where = f"under {'.'.join(str(q) for q in path[:i])!r}" if i else "at the top level"
            why = "is empty (its path would have an empty part)" if s == "" else \
                "contains '.' (its path would read back as nested keys)"
            raise ValueError(f"{who}: the key {p!r} {where} {why}; a leaf's path is its keys joined with '.', "
                             f"the checkpoint name (layers.3.attn.wq.weight) - rename the key")
    return ".".join(str(p) for p in path)


def _flatten(tree, who: str) -> dict[str, Any]:
    paths, leaves, _ = optree.tree_flatten_with_path(tree, namespace=OPTREE_NAMESPACE)
    out = {}
    for p, leaf in zip(paths, leaves):
        key = _path_str(p, who)
        if key in out:
            raise ValueError(f"{who}: two leaves share the path {key!r}")
        out[key] = leaf
    return out


def flatten_with_paths(tree) -> dict[str, Any]:
    """``{"layers.5.attn.wq_b.weight": tensor, ...}``: every leaf under its "."-joined path.

    List indices appear as numbers, dataclass carriers by field name. The order is optree's (dict
    keys sorted at each level, lists in index order, carriers in field order), so two trees with the
    same structure flatten in the same order however they were built. ``None`` is an empty node, not
    a leaf (it does not appear). A dict key that contains "." or is empty is a ValueError naming the key
    and where it is: its path could not be told from a deeper one (``{"a.b": x}`` and ``{"a": {"b": x}}``).
    """
    return _flatten(tree, "flatten_with_paths")


def unflatten_from_paths(flat: dict[str, Any]):
    """Inverse of :func:`flatten_with_paths` for dict/list trees.

    Paths are split on "."; a level becomes a Python list when its keys are exactly ``0..n-1``
    (in any order), else a dict (in first-seen key order). ``{"layers.0.w": a, "layers.1.w": b}``
    -> ``{"layers": [{"w": a}, {"w": b}]}``. A path that is both a leaf and a prefix is refused, and so is
    one with an empty part (``""``, ``"a..b"``, ``"a."``): no dict/list tree flattens to one.
    """
    root: dict = {}
    for key, leaf in flat.items():
        parts = key.split(".")
        if "" in parts:
            raise ValueError(f"unflatten_from_paths: the path {key!r} has an empty part (a path is keys joined "
                             f"with '.', none of them empty)")
        node = root
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ValueError(f"unflatten_from_paths: {key!r} extends the leaf path of another entry")
            node = nxt
        if parts[-1] in node:
            raise ValueError(f"unflatten_from_paths: {key!r} collides with another entry's subtree")
        node[parts[-1]] = leaf

    def listify(node):
        if not isinstance(node, dict):
            return node
        node = {k: listify(v) for k, v in node.items()}
        if node and all(k.isdigit() and (k == "0" or not k.startswith("0")) for k in node):
            idx = sorted(int(k) for k in node)
            if idx == list(range(len(idx))):
                return [node[str(i)] for i in idx]
        return node

    return listify(root)


def tree_map_with_path(fn: Callable[[str, Any], Any], tree, *rest):
    """``fn(path, leaf, *rest_leaves)`` over every leaf; returns a tree of the same structure.

    ``path`` is the "."-joined checkpoint name (see :func:`flatten_with_paths`; the same keys are refused).
    """
    return optree.tree_map_with_path(lambda p, x, *r: fn(_path_str(p, "tree_map_with_path"), x, *r), tree, *rest,
                                     namespace=OPTREE_NAMESPACE)


# ----------------------------------------------------------------------------- tree_diff
_QUANT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2)


@dataclasses.dataclass
class DiffRow:
    """One path of a :class:`TreeDiff`. ``status``: ok | missing (in b) | extra (in b) | shape |
    dtype | value (beyond ``atol``, or bytes differ where no value comparison exists) | type."""
    path: str
    status: str
    shape_a: Optional[tuple] = None
    shape_b: Optional[tuple] = None
    dtype_a: Optional[str] = None
    dtype_b: Optional[str] = None
    max_abs: Optional[float] = None
    cos_diff: Optional[float] = None
    note: str = ""


@dataclasses.dataclass
class TreeDiff:
    """Per-path comparison of two trees (from :func:`tree_diff`).

    ``ok``: every path present in both with equal shape and dtype, and (with ``atol``) max-abs
    error <= atol. ``rows``: one :class:`DiffRow` per path of a or b. ``str(diff)`` is a table;
    ``worst(n)`` the n rows that differ most (structural problems first, then cosine diff, max-abs).
    """
    rows: list
    atol: Optional[float] = None

    @property
    def ok(self) -> bool:
        return all(r.status == "ok" for r in self.rows)

    def problems(self) -> list:
        return [r for r in self.rows if r.status != "ok"]

    def worst(self, n: int = 10) -> list:
        rank = {"missing": 0, "extra": 0, "type": 0, "shape": 1, "dtype": 2, "value": 3, "ok": 4}

        def desc(v):    # a NaN (inf or NaN against a number) is the largest difference, not an unordered key
            return float("-inf") if v is not None and v != v else -(v or 0.0)
        return sorted(self.rows, key=lambda r: (rank.get(r.status, 0), desc(r.cos_diff), desc(r.max_abs)))[:n]

    def format(self, rows=None) -> str:
        rows = self.rows if rows is None else rows
        def f(v):
            return "-" if v is None else f"{v:.3e}"
        def both(a, b, show=str):
            if a is None and b is None:
                return "-"
            if a is None or b is None or a == b:
                return show(a if a is not None else b)
            return f"{show(a)} vs {show(b)}"
        def shp(a, b):
            return both(a, b, lambda v: str(list(v)))
        def dt(a, b):
            return both(a, b)
        table = [("path", "status", "shape", "dtype", "max_abs", "cos_diff", "note")]
        table += [(r.path, r.status, shp(r.shape_a, r.shape_b), dt(r.dtype_a, r.dtype_b), f(r.max_abs),
                   f(r.cos_diff), r.note) for r in rows]
        w = [max(len(str(row[i])) for row in table) for i in range(len(table[0]))]
        lines = ["  ".join(str(c).ljust(w[i]) for i, c in enumerate(row)).rstrip() for row in table]
        lines.insert(1, "  ".join("-" * x for x in w))
        n_bad = sum(r.status != "ok" for r in rows)
        lines.append(f"{len(rows)} paths, {n_bad} not ok" + (f" (atol={self.atol})" if self.atol is not None else ""))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _as_float(x: torch.Tensor, scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Values of x in float64; quantized storage decoded via its sibling scale (SPEC §9), else None."""
    from functional_dsv41 import quant
    if x.dtype == torch.float4_e2m1fn_x2:
        if (scale is None or scale.dtype != quant.E8M0 or (x.shape[-1] * 2) % quant.BLOCK
                or scale.shape != (*x.shape[:-1], x.shape[-1] * 2 // quant.BLOCK)):
            return None
        return quant.dequant_fp4(x, scale, torch.float64)
    if x.dtype == torch.float8_e4m3fn and scale is not None and scale.dtype == torch.float8_e8m0fnu:
        if x.dim() == 2 and scale.shape == (-(-x.shape[0] // 32), -(-x.shape[1] // 32)):
            return quant.dequant_fp8_block(x, scale, torch.float64)
        if x.shape[-1] % 32 == 0 and scale.shape == (*x.shape[:-1], x.shape[-1] // 32):
            return quant.dequant_fp8_rows(x, scale, torch.float64)
        return None
    if x.dtype in _QUANT_DTYPES:
        return x.double() if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else None
    if x.dtype == torch.bool:
        return x.double()
    if x.is_complex():
        return torch.view_as_real(x).double()
    return x.double()


def _is_int(t: torch.Tensor) -> bool:
    return t.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
                       torch.uint64)


def _scale_of(flat: dict, path: str):
    if path.endswith(".weight"):
        s = flat.get(path[: -len("weight")] + "scale")
        return s if isinstance(s, torch.Tensor) else None
    return None


def tree_diff(a, b, *, atol: Optional[float] = None) -> TreeDiff:
    """Compare tree ``b`` against tree ``a`` path by path (DESIGN "Tolerances").

    For each path of a or b: ``missing`` (only in a), ``extra`` (only in b), ``shape``/``dtype``
    mismatch, and for tensors whose values can be compared the max-abs error and the cosine diff
    ``1 - 2<x,y>/(|x|^2+|y|^2)`` in float64. Quantized weights (fp8 e4m3 / packed fp4) are compared
    by their dequantized value when a sibling ``scale`` is present in the same tree (32x32 fp8 blocks,
    fp8 rows with 1x32 scales, fp4 1x32); fp8 without a scale by its own value (so +0/-0 and NaN encodings
    compare equal), e8m0 scales and packed fp4 without a scale bytewise. Equal non-finite values (NaN against
    NaN, inf against the same inf) count as equal: max-abs 0, left out of the cosine; a NaN or inf against
    anything else makes both NaN (ranked first by ``worst``). A dtype
    mismatch is still reported with the value error when both sides decode. Without ``atol`` values
    are reported, not judged (``ok`` = same structure, shapes and dtypes); with ``atol`` a max-abs
    error above it, or any differing byte of a bytewise-compared tensor, marks the row ``value``.
    Non-tensor leaves are compared with ``==``.
    """
    if atol is not None and (isinstance(atol, bool) or not isinstance(atol, (int, float)) or not atol >= 0):
        raise TypeError(f"tree_diff: atol must be None or a number >= 0, got {atol!r}")
    fa, fb = _flatten(a, "tree_diff (a)"), _flatten(b, "tree_diff (b)")
    from . import sharding
    for side, flat in (("a", fa), ("b", fb)):
        why = sharding.refusal(flat, f"tree_diff ({side})", stacked=False)   # (stacked experts compare: other paths)
        if why:
            raise ValueError(why)
    rows = []
    for path in list(fa) + [p for p in fb if p not in fa]:
        if path not in fb:
            x = fa[path]
            rows.append(DiffRow(path, "missing", shape_a=tuple(x.shape) if isinstance(x, torch.Tensor) else None,
                                dtype_a=str(x.dtype).replace("torch.", "") if isinstance(x, torch.Tensor) else None))
            continue
        if path not in fa:
            y = fb[path]
            rows.append(DiffRow(path, "extra", shape_b=tuple(y.shape) if isinstance(y, torch.Tensor) else None,
                                dtype_b=str(y.dtype).replace("torch.", "") if isinstance(y, torch.Tensor) else None))
            continue
        rows.append(_diff_leaf(path, fa[path], fb[path], _scale_of(fa, path), _scale_of(fb, path), atol))
    ka, kb = _node_kinds(a), _node_kinds(b)     # same leaf paths, other containers: [x] vs {"0": x}
    rows += [DiffRow(p or "<root>", "type", note=f"{ka[p]} vs {kb[p]}") for p in ka if p in kb and ka[p] != kb[p]]
    return TreeDiff(rows, atol)


def _node_kinds(tree, prefix: str = "") -> dict[str, str]:
    """{path: container type name} of the dict / list / tuple / dataclass nodes of ``tree``."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        items = ((f.name, getattr(tree, f.name)) for f in dataclasses.fields(tree))
    else:
        return {}
    out = {prefix: type(tree).__name__}
    for k, v in items:
        out.update(_node_kinds(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _logical_shape(t: torch.Tensor) -> tuple:
    if t.dtype == torch.float4_e2m1fn_x2 and t.dim():
        return (*t.shape[:-1], 2 * t.shape[-1])
    return tuple(t.shape)


def _same(x, y) -> bool:
    """``x == y`` for non-tensor leaves, also where ``==`` gives an array (numpy) or raises."""
    try:
        r = x == y
        return bool(r.all()) if hasattr(r, "all") else bool(r)
    except Exception:
        return repr(x) == repr(y)


def _diff_leaf(path, x, y, sx, sy, atol) -> DiffRow:
    if isinstance(x, np.ndarray) and isinstance(y, np.ndarray):     # numpy leaves: compared as tensors
        x, y = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor) or type(x) is not type(y):
            return DiffRow(path, "type", note=f"{type(x).__name__} vs {type(y).__name__}")
        same = _same(x, y)
        return DiffRow(path, "ok" if same else "value", note="" if same else f"{x!r} vs {y!r}")
    row = DiffRow(path, "ok", tuple(x.shape), tuple(y.shape), str(x.dtype).replace("torch.", ""),
                  str(y.dtype).replace("torch.", ""))
    if _logical_shape(x) != _logical_shape(y):  # packed fp4 [N, K/2] matches a float [N, K]
        row.status = "shape"
        return row
    if x.dtype != y.dtype:
        row.status = "dtype"
    if x.is_meta or y.is_meta:
        row.note = "meta: structure only"
        return row
    maxes, xy, xx, yy, nbad, bytewise, nonfinite_differs = [], 0.0, 0.0, 0.0, 0, False, False
    for xc, yc, sxc, syc in _chunks(x.detach().cpu(), y.detach().cpu(), sx, sy):
        xf, yf = _as_float(xc, sxc), _as_float(yc, syc)
        if xf is None or yf is None:
            if x.dtype != y.dtype:
                return row
            nbad += int((xc.contiguous().view(torch.uint8) != yc.contiguous().view(torch.uint8)).sum())
            bytewise = True
            continue
        if xf.shape != yf.shape:
            row.status = "shape"
            return row
        same = (xf == yf) | (torch.isnan(xf) & torch.isnan(yf))
        d = torch.where(same, 0.0, (xf - yf).abs())  # equal values (also equal infinities), NaN against NaN: 0
        if _is_int(x) and _is_int(y):           # exactly: float64 would merge integers above 2^53 (and an int64
            ne = xc != yc if xc.dtype == yc.dtype else xc.long() != yc.long()   # difference can overflow): any
            d = torch.where(ne, d.clamp_min(1.0), torch.zeros_like(d))          # differing pair >= 1
        if d.numel():
            maxes.append(d.max())
        xv, yv = xf.flatten(), yf.flatten()
        fin = torch.isfinite(xv) & torch.isfinite(yv)
        if not bool(fin.all()):                 # equal NaN / inf pairs leave the cosine; any other one spoils it
            nonfinite_differs = nonfinite_differs or bool((~fin & ~same.flatten()).any())
            xv, yv = xv[fin], yv[fin]
        xy, xx, yy = xy + float((xv * yv).sum()), xx + float((xv * xv).sum()), yy + float((yv * yv).sum())
    if bytewise:
        row.note = "bytewise" + (f": {nbad} bytes differ" if nbad else "")
        if nbad and atol is not None:
            row.status = "value"
        return row
    row.max_abs = float(torch.stack(maxes).max()) if maxes else 0.0    # torch's max: a NaN chunk stays NaN
    den = xx + yy
    row.cos_diff = float("nan") if nonfinite_differs else 0.0 if den == 0 else 1 - 2 * xy / den
    if row.status == "ok" and atol is not None and not row.max_abs <= atol:
        row.status = "value"
    return row


_CHUNK = 1 << 22    # elements decoded at a time: a release Engram table (98e9 fp8 values) in float64 is ~800 GB


def _chunks(x, y, sx, sy):
    """(x, y, sx, sy) in pieces of about ``_CHUNK`` elements along dim 0, each with its rows of the scales (1x32
    rows / fp4: the same rows; 32x32 blocks: whole 32-row blocks); small tensors in one piece. Keeps the float64
    copies that :func:`_diff_leaf` makes bounded, whatever the tensor's size."""
    n = x.shape[0] if x.dim() >= 2 and x.shape[0] == y.shape[0] else 0     # 1-D: packed fp4 vs float differ
    if x.numel() <= _CHUNK or n < 2:
        yield x, y, sx, sy
        return
    step = max(32, _CHUNK // (x.numel() // n) // 32 * 32)

    def rows(s, t, i, j):
        if not isinstance(s, torch.Tensor) or s.dim() == 0:
            return s
        if s.shape[0] == t.shape[0]:
            return s[i:j]
        if s.shape[0] == -(-t.shape[0] // 32):
            return s[i // 32: -(-j // 32)]
        return s
    for i in range(0, n, step):
        j = min(n, i + step)
        yield x[i:j], y[i:j], rows(sx, x, i, j), rows(sy, y, i, j)
