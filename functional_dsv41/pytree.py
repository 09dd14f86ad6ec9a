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

    Children are the dataclass fields in declaration order; ``None`` fields stay ``None`` leaves of
    both libraries' "empty" kind. Use it on every state carrier, once.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"register_carrier: {cls.__name__} is not a dataclass")
    names = tuple(f.name for f in dataclasses.fields(cls))

    def flatten(obj):
        return [getattr(obj, n) for n in names], names

    def unflatten(children, ctx=names):
        return cls(**dict(zip(ctx, children)))

    torch_pytree.register_pytree_node(
        cls, flatten, lambda children, ctx: unflatten(children, ctx),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=lambda obj: ([(torch_pytree.GetAttrKey(n), getattr(obj, n)) for n in names], names),
    )
    optree.register_pytree_node(
        cls, lambda obj: ([getattr(obj, n) for n in names], names, names),
        lambda ctx, children: unflatten(children, ctx), namespace=OPTREE_NAMESPACE,
    )
    return cls
