"""Sharding (DESIGN convention 8): DTensor placements for the parameter pytree; the model math is unchanged.

A mesh (``torch.distributed.device_mesh.init_device_mesh``) names one or both of two dims:

- ``"ep"``  expert parallelism: each MoE layer's routed experts (backbone and DSpark stages) are split into
  ``E / ep`` consecutive experts a rank; the rank stores only those;
- ``"emb"`` embedding parallelism: the vocabulary rows of ``embed.weight`` and ``head.weight`` and the rows of
  the Engram n-gram tables (``layers.L.engram.embed.{weight,scale}``) are split ``Shard(0)`` (torch.chunk's
  split: ceil(R / n) rows a rank, the last ones shorter where R does not divide).

Everything else is replicated (a plain tensor on every rank). ``shard_params`` applies the plan to a full tree
that every rank holds (``load_params`` / ``init_params`` with the same seed) and keeps only each rank's part, as
``DTensor``s built with ``from_local`` (no communication, so every storage dtype works: fp8, fp4 pairs, e8m0);
``full_params`` is its inverse (the released layout again, e.g. for ``save_params`` or ``tree_diff``).

Paths stay checkpoint names (convention 1) with one exception: a sharded MoE layer's ``experts`` is the stacked
form ``{"w1": {"weight": [E, ...], "scale": [E, ...]}, "w2": ..., "w3": ...}`` (the released
``layers.L.ffn.experts.e.w1.weight`` is row e of ``layers.L.ffn.experts.w1.weight``), each leaf a DTensor
``Shard(0)`` over ``ep`` - the layout expert-parallel frameworks use. ``moe`` accepts the list, the stacked form
and its sharded form alike (``local_experts``).

The same ``forward`` runs on a plain tree and on a sharded one. The model reads sharded leaves only through the
helpers below, at the places that touch them, and each returns a plain (replicated) tensor:

- ``embedding(ids, weight)``     token embedding (``model.forward``, DSpark stages): each rank looks up the rows it
  holds (zeros elsewhere), summed over ``emb``;
- ``take_rows(table, ids)``      Engram table rows in storage form (1-byte dtypes as bytes, summed over ``emb``);
- ``vocab_logits(x, weight)``    the LM head: each rank's vocabulary columns, gathered over ``emb``;
- ``local_experts(node)``, ``expert_inputs(tensors, node)``, ``sum_experts(t, node)``  the MoE: each rank runs its
  own experts on the slots routed to them; the slot outputs (zero where another rank's expert produced them) are
  summed over ``ep`` before the usual per-token sum, so each token's outputs are added in the same order as on one
  rank (``dispatch="dense"`` sums each rank's partial sums instead: the same values to rounding).

With the sorted dispatch each of these sums has exactly one nonzero term per element, so a sharded forward gives the
plain tree's values (tests/test_sharding.py asserts the logits equal). Gradients flow under ``torch.autograd``: the
split leaves are leaves of their own (``.grad`` a DTensor of the same split), and the replicated inputs of a split
computation (the tokens entering the experts or the head) have their gradient summed over the split dim in the
backward (``_enter``), so every rank holds the whole gradient of every replicated leaf. ``torch.func`` transforms
over DTensor trees are not supported (DTensor has no functorch rules; ``forward`` refuses them); ``save_params`` and
``tree_diff`` refuse a sharded tree and point to ``full_params``.
"""
from __future__ import annotations

import re
from typing import Any, Optional

import torch
import torch.nn.functional as F

MESH_DIMS = ("ep", "emb")


def _dtensor():
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    return DTensor, Partial, Replicate, Shard


def is_sharded(t: Any) -> bool:
    """True for a DTensor leaf (``shard_params``' output)."""
    if not isinstance(t, torch.Tensor) or type(t) is torch.Tensor:
        return False
    return type(t).__name__ == "DTensor" and isinstance(t, _dtensor()[0])


_STACKED_EXPERTS = re.compile(r"(.*\.experts)\.[^.\d][^.]*\.[^.]+")   # ...experts.w1.weight (no expert id)


def refusal(flat: dict, what: str, *, stacked: bool = True) -> Optional[str]:
    """The reason ``what`` (a function that needs whole tensors on one process: save_params, tree_diff) cannot
    take a flattened tree, or None: DTensor shards, or (``stacked``: it needs the released layout) experts in the
    stacked form."""
    shards = [k for k, v in flat.items() if is_sharded(v)]
    if shards:
        more = f" (and {len(shards) - 1} more)" if len(shards) > 1 else ""
        return (f"{what}: {shards[0]}{more} is a DTensor shard (sharding.shard_params): pass "
                f"sharding.full_params(tree) (a collective: every rank calls it) instead")
    forms = sorted({m[1] for k in flat if (m := _STACKED_EXPERTS.fullmatch(k))}) if stacked else []
    if forms:
        return (f"{what}: {forms[0]} holds its experts in the stacked form (sharding.stack_experts); the "
                f"released layout lists them one by one: pass sharding.full_params(tree) instead")
    return None


# ----------------------------------------------------------------------------- placements
def _mesh_dim(mesh, name: str) -> int:
    return list(mesh.mesh_dim_names).index(name)


def _check_mesh(mesh) -> tuple:
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        raise ValueError(f"shard_params: the mesh needs named dims (some of {MESH_DIMS}), e.g. "
                         f"init_device_mesh(device_type, (2,), mesh_dim_names=('ep',)); got {names}")
    unknown = [n for n in names if n not in MESH_DIMS]
    if unknown:
        raise ValueError(f"shard_params: unknown mesh dim(s) {unknown}; the plan shards over {MESH_DIMS} only")
    return tuple(names)


def _placements(mesh, name: str, placement):
    _, _, Replicate, _ = _dtensor()
    return [placement if n == name else Replicate() for n in mesh.mesh_dim_names]


def _chunk_range(rows: int, n: int, c: int) -> tuple[int, int]:
    """[start, stop) of chunk c of ``rows`` split n ways as torch.chunk / DTensor's Shard(0) split them."""
    size = -(-rows // n)
    start = min(c * size, rows)
    return start, min(start + size, rows)


def _my_rows(rows: int, mesh, md: int) -> tuple[int, int]:
    """[start, stop) of the rows this rank holds of ``rows`` split over mesh dim ``md``."""
    return _chunk_range(rows, mesh.size(md), mesh.get_local_rank(md))


def _shard_rows(t: torch.Tensor, mesh, name: str):
    """t (the full tensor, on every rank) -> DTensor Shard(0) over mesh dim ``name`` holding this rank's rows."""
    md = _mesh_dim(mesh, name)
    start, stop = _my_rows(t.shape[0], mesh, md)
    return _rows_from_local(t.narrow(0, start, stop - start), t.shape[0], mesh, name)


def _rows_from_local(local: torch.Tensor, rows: int, mesh, name: str):
    """This rank's rows ``local`` (already cut) of a [rows, ...] tensor -> the DTensor Shard(0) over ``name``:
    detached, a new leaf of its own with ``local``'s requires_grad (its .grad a DTensor of the same split)."""
    DTensor, _, _, Shard = _dtensor()
    shape = torch.Size((rows, *local.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local.detach().contiguous(), mesh, _placements(mesh, name, Shard(0)), run_check=False,
                              shape=shape, stride=stride).requires_grad_(local.requires_grad)


def _stack(ts: list) -> torch.Tensor:
    """torch.stack for any dtype (the 1-byte storage dtypes through uint8 views)."""
    if ts[0].element_size() == 1 and ts[0].dtype not in (torch.uint8, torch.int8, torch.bool):
        return torch.stack([t.view(torch.uint8) for t in ts]).view(ts[0].dtype)
    return torch.stack(ts)


def split_parts(params: dict):
    """(path, mesh dim, node) of every part ``shard_params`` may split, whatever the mesh: the vocabulary rows of
    ``embed.weight`` / ``head.weight`` and the Engram tables' rows (``emb``), each MoE layer's ``experts``
    (backbone and DSpark stages; the list, stacked or split form) (``ep``)."""
    for top in ("embed", "head"):
        if isinstance(params.get(top), dict) and "weight" in params[top]:
            yield f"{top}.weight", "emb", params[top]["weight"]
    for i, layer in enumerate(params.get("layers") or ()):
        table = layer.get("engram", {}).get("embed") if isinstance(layer, dict) else None
        for leaf in ("weight", "scale"):
            if isinstance(table, dict) and table.get(leaf) is not None:
                yield f"layers.{i}.engram.embed.{leaf}", "emb", table[leaf]
    for group in ("layers", "mtp"):
        for i, layer in enumerate(params.get(group) or ()):
            if isinstance(layer, dict) and isinstance(layer.get("ffn"), dict) and "experts" in layer["ffn"]:
                yield f"{group}.{i}.ffn.experts", "ep", layer["ffn"]["experts"]


def plan(params: dict, mesh_dims=MESH_DIMS) -> dict[str, str]:
    """{path or path prefix: mesh dim} of what ``shard_params`` splits for a mesh with ``mesh_dims``:
    ``"...experts"`` (a MoE layer's routed experts, stacked) over ``ep``; vocabulary and Engram table rows over
    ``emb``. Paths not listed are replicated."""
    return {path: dim for path, dim, _ in split_parts(params) if dim in mesh_dims}


def shard_params(params: dict, mesh) -> dict:
    """The tree with ``plan``'s leaves split over ``mesh`` (see the module docstring); replicated leaves are shared
    with ``params``, not copied. Every rank passes the same full tree; the result holds each rank's own part."""
    names = _check_mesh(mesh)
    if not isinstance(params, dict):
        raise TypeError(f"shard_params: params must be the parameter dict, got {type(params).__name__}")
    todo = plan(params, names)

    def experts(node, path):
        md = _mesh_dim(mesh, "ep")
        ep = mesh.size(md)
        if isinstance(node, dict):
            if any(is_sharded(t) for t in _leaves(node)):
                raise ValueError(f"shard_params: {path} is sharded already")
            n_exp = _n_experts(node, path)
        elif isinstance(node, list) and node and all(isinstance(e, dict) for e in node):
            n_exp = len(node)
        else:
            raise ValueError(f"shard_params: {path} must be a list of expert dicts, got {type(node).__name__}")
        if n_exp % ep:
            raise ValueError(f"shard_params: {path} has {n_exp} routed experts, not divisible over ep={ep}")
        if isinstance(node, dict):
            return {proj: {leaf: _shard_rows(t, mesh, "ep") for leaf, t in d.items()} for proj, d in node.items()}
        # the list: every expert checked, only this rank's stacked (not a transient copy of all E per layer)
        check_experts(node, path)
        start, stop = _my_rows(n_exp, mesh, md)
        mine = stack_experts(node[start:stop], path)
        return {proj: {leaf: _rows_from_local(t, n_exp, mesh, "ep") for leaf, t in d.items()}
                for proj, d in mine.items()}

    def walk(node, path):
        if path in todo and path.endswith("experts"):
            return experts(node, path)
        if isinstance(node, dict):
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(node)]
        if path in todo:
            if is_sharded(node):
                raise ValueError(f"shard_params: {path} is sharded already")
            return _shard_rows(node, mesh, todo[path])
        return node

    return walk(params, "")


def _leaves(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _leaves(v)
    elif isinstance(node, (list, tuple)):
        for v in node:
            yield from _leaves(v)
    else:
        yield node


def _n_experts(stacked: dict, path: str) -> int:
    sizes = {t.shape[0] for d in stacked.values() for t in d.values()}
    if len(sizes) != 1:
        raise ValueError(f"{path}: stacked experts disagree on the expert count: {sorted(sizes)}")
    return sizes.pop()


def stack_experts(experts: list, path: str = "experts") -> dict:
    """[{proj: {leaf: t}}] * E -> {proj: {leaf: [E, ...]}} (the stacked form); every expert must have the same
    projections, leaves, shapes and dtypes."""
    check_experts(experts, path)
    first = experts[0]
    return {p: {leaf: _stack([ex[p][leaf] for ex in experts]) for leaf in first[p]} for p in first}


def check_experts(experts: list, path: str = "experts") -> None:
    """Raise ValueError unless every expert has expert 0's projections, leaves, shapes and dtypes."""
    first = experts[0]
    for e, ex in enumerate(experts):
        if ex.keys() != first.keys() or any(ex[p].keys() != first[p].keys() for p in first):
            raise ValueError(f"{path}.{e}: its tensors {sorted(ex)} differ from expert 0's {sorted(first)}")
        for p in first:
            for leaf, t in first[p].items():
                o = ex[p][leaf]
                if o.shape != t.shape or o.dtype != t.dtype:
                    raise ValueError(f"{path}.{e}.{p}.{leaf}: {o.dtype} {tuple(o.shape)} differs from expert 0's "
                                     f"{t.dtype} {tuple(t.shape)}")


def unstack_experts(stacked: dict) -> list:
    """The inverse of ``stack_experts`` (views of the stacked tensors)."""
    n = _n_experts(stacked, "experts")
    return [{p: {leaf: t[e] for leaf, t in d.items()} for p, d in stacked.items()} for e in range(n)]


def _full(t):
    """A DTensor's full value on every rank (1-byte storage dtypes gathered as uint8, which every backend sums)."""
    DTensor = _dtensor()[0]
    if t.element_size() == 1 and t.dtype not in (torch.uint8, torch.int8, torch.bool):
        local = t.to_local()
        u = DTensor.from_local(local.view(torch.uint8), t.device_mesh, t.placements, run_check=False,
                               shape=t.shape, stride=t.stride())
        return u.full_tensor().view(t.dtype)
    return t.full_tensor()


def full_params(params: dict) -> dict:
    """A sharded tree back to the plain one in the released layout (every rank gets the whole tree): DTensor
    leaves gathered, stacked experts unstacked into the list of per-expert dicts. Collective: every rank calls it."""
    def walk(node, path):
        if isinstance(node, dict):
            if path.endswith(".experts") and node and all(isinstance(d, dict) for d in node.values()):
                return unstack_experts({p: {leaf: _full(t) if is_sharded(t) else t for leaf, t in d.items()}
                                        for p, d in node.items()})
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(node)]
        return _full(node) if is_sharded(node) else node
    return walk(params, "")


# ----------------------------------------------------------------------------- what the model calls
def sum_over_split(t: torch.Tensor, like) -> torch.Tensor:
    """t (this rank's part of a sum) summed over the mesh dim the DTensor ``like`` is split on: a plain tensor."""
    DTensor, Partial, _, _ = _dtensor()
    _, name = _split_dim(like, "a sum over a mesh dim")
    return DTensor.from_local(t, like.device_mesh, _placements(like.device_mesh, name, Partial()),
                              run_check=False).full_tensor()


def _enter(t: torch.Tensor, like) -> torch.Tensor:
    """t (replicated) as the input of this rank's part of a computation split over the mesh dim ``like`` is
    sharded on: the same values; in the backward its gradient (each rank's part) is summed over that dim."""
    if not t.requires_grad:
        return t
    _, Partial, _, _ = _dtensor()
    _, name = _split_dim(like, "a split computation's input")
    return replicated(t, like).to_local(grad_placements=_placements(like.device_mesh, name, Partial()))


def replicated(t: torch.Tensor, like) -> torch.Tensor:
    """The plain tensor ``t`` (the same on every rank) as a DTensor replicated over ``like``'s mesh: an operand
    that DTensor ops take beside ``like``."""
    DTensor, _, Replicate, _ = _dtensor()
    return DTensor.from_local(t, like.device_mesh, [Replicate()] * like.device_mesh.ndim, run_check=False)


def _split_dim(t, what: str) -> tuple[int, str]:
    """(mesh dim index, its name) of the one mesh dim a DTensor leaf is split over (Shard(0) along ``rows``)."""
    _, _, _, Shard = _dtensor()
    split = [i for i, p in enumerate(t.placements) if isinstance(p, Shard)]
    if len(split) != 1:
        raise ValueError(f"{what}: expected a DTensor split over one mesh dim (sharding.shard_params' placements), "
                         f"got placements {tuple(t.placements)}")
    return split[0], t.device_mesh.mesh_dim_names[split[0]]


def _local_rows(weight, ids: torch.Tensor):
    """(local table, local ids with the other ranks' rows sent to row 0, mask of the rows this rank holds)."""
    md, _ = _split_dim(weight, "a row-split table")
    mesh = weight.device_mesh
    start, stop = _my_rows(weight.shape[0], mesh, md)
    mine = (ids >= start) & (ids < stop)
    return weight.to_local(), torch.where(mine, ids - start, 0), mine


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding(ids, weight): ids [...] int64, weight [V, D] -> [..., D] in weight's dtype; weight may be a
    DTensor with vocabulary rows split over ``emb``."""
    if not is_sharded(weight):
        return F.embedding(ids, weight)
    local, lid, mine = _local_rows(weight, ids)
    if local.shape[0] == 0:           # a rank past the last row (more ranks than rows) holds none of them
        part = torch.zeros(*ids.shape, weight.shape[1], dtype=weight.dtype, device=ids.device)
    else:
        part = torch.where(mine[..., None], F.embedding(lid, local), 0)
    return sum_over_split(part, weight)


def take_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table[ids] for a 1-D int64 ``ids``, in the table's storage dtype (1-byte dtypes: fp8 / e8m0 through uint8
    views). A DTensor table (rows split over ``emb``): each rank's rows, zero elsewhere, summed - as floats for a
    float table (differentiable), as bytes for the 1-byte storage dtypes (which sum exactly)."""
    one_byte = table.element_size() == 1
    if not is_sharded(table):
        if one_byte:
            return table.view(torch.uint8).index_select(0, ids).view(table.dtype)
        return table.index_select(0, ids)
    local, lid, mine = _local_rows(table, ids)
    if one_byte:
        local = local.view(torch.uint8)
    if local.shape[0] == 0:           # a rank past the last row holds none of them
        part = local.new_zeros(ids.shape[0], *local.shape[1:])
    else:
        part = torch.where(mine.view(-1, *[1] * (local.ndim - 1)), local.index_select(0, lid), 0)
    whole = sum_over_split(part, table)
    return whole.view(table.dtype) if one_byte else whole


def vocab_logits(x: torch.Tensor, weight: torch.Tensor, linear=F.linear) -> torch.Tensor:
    """linear(x, weight.float()): x [..., D] fp32, weight [V, D] (a DTensor: vocabulary rows split over ``emb``)
    -> logits [..., V] fp32; each rank computes its own columns, gathered."""
    if not is_sharded(weight):
        return linear(x, weight.float())
    DTensor, _, _, Shard = _dtensor()
    _, name = _split_dim(weight, "the LM head")
    mesh = weight.device_mesh
    part = linear(_enter(x, weight), weight.to_local().float())
    shape = (*x.shape[:-1], weight.shape[0])
    stride = torch.empty(shape, device="meta").stride()
    d = DTensor.from_local(part, mesh, _placements(mesh, name, Shard(x.ndim - 1)),
                           run_check=False, shape=torch.Size(shape), stride=stride)
    return d.full_tensor()


def local_experts(node) -> tuple[list, int, int]:
    """A MoE layer's ``experts`` -> (this rank's experts as a list of per-expert dicts, the id of its first, the
    layer's expert count). The list form is itself; the stacked form (plain or split over ``ep``) gives views."""
    if isinstance(node, list):
        return node, 0, len(node)
    if not isinstance(node, dict) or not node:
        raise TypeError(f"moe: experts must be a list of expert dicts or the stacked form, got {type(node).__name__}")
    leaf = _first_leaf(node)
    if not is_sharded(leaf):
        return unstack_experts(node), 0, leaf.shape[0]
    md, _ = _split_dim(leaf, "the routed experts")
    mesh = leaf.device_mesh
    start, _ = _my_rows(leaf.shape[0], mesh, md)
    local = {p: {name: t.to_local() for name, t in d.items()} for p, d in node.items()}
    return unstack_experts(local), start, leaf.shape[0]


def _first_leaf(stacked: dict) -> torch.Tensor:
    """A tensor of the stacked experts form ({proj: {leaf: [E, ...]}}): all of them share its split."""
    return next(iter(next(iter(stacked.values())).values()))


def expert_inputs(tensors: tuple, node) -> tuple:
    """The MoE's replicated inputs to this rank's experts (the tokens, their routing weights): the same tensors;
    split over ``ep``, their gradients are summed over ``ep`` in the backward (each rank sees its experts' part)."""
    if isinstance(node, list):
        return tensors
    leaf = _first_leaf(node)
    return tuple(_enter(t, leaf) for t in tensors) if is_sharded(leaf) else tensors


def no_slots(node) -> torch.Tensor:
    """A 0 (fp32 scalar) tied to this rank's trainable expert leaves, for a rank no slot was routed to: its
    experts then get zero gradients, as on the ranks that ran theirs, instead of none (a DTensor .grad that
    exists on some ranks only breaks every collective over the gradients: clipping, full_tensor)."""
    zero = torch.zeros((), dtype=torch.float32)
    for t in _leaves(node):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            local = t.to_local() if is_sharded(t) else t
            zero = zero.to(local.device) + local.reshape(-1)[:0].float().sum()
    return zero


def sum_experts(t: torch.Tensor, node) -> torch.Tensor:
    """t (values from this rank's experts, zero where another rank's produced them) summed over ``ep``; the
    identity for a plain (list or stacked) ``experts``."""
    if isinstance(node, list):
        return t
    leaf = _first_leaf(node)
    return sum_over_split(t, leaf) if is_sharded(leaf) else t
