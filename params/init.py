"""Random parameters in the released storage formats, or float master weights for QAT (SPEC §9, §11).

Values are drawn in float32 from one ``torch.Generator`` seeded by ``seed``, entry by entry in the
fixed order of ``spec._entries`` (so a seed gives the same tree on every machine):

- Linear weights / embeddings / heads: ``N(0, 1) / sqrt(in_features)`` (fan-in scaled);
- norms and Engram ``q_weight``/``k_weight``: ones; ``attn_sink``, router biases, vision biases: zeros;
- mHC ``hc_*_fn/base/scale``: ``0.02 * N(0, 1)`` (small, so the mixes start near uniform);
- Engram tables: ``N(0, 1) / sqrt(head_dim)`` rows.

The storage tree is then quantized where the release stores quantized values:
``quant.quant_fp8_block`` (dense fp8, 32x32), ``quant.quant_fp4`` (routed experts, 1x32),
``quant.quant_fp8_rows`` (Engram tables, 1x32). With ``master=True`` the same float draws are
returned un-quantized (no ``scale`` entries): quantizing a master weight with the matching quantizer
gives exactly the storage tree of the same seed, so QAT training starts from the released format.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from functional_dsv41 import quant
from functional_dsv41.config import Config, require_config
from functional_dsv41.pytree import unflatten_from_paths

from .spec import Entry, _entries, master_dtype


def _draw(e: Entry, gen: torch.Generator) -> torch.Tensor:
    shape, dev = e.logical, gen.device
    if e.init == "ones":
        return torch.ones(shape, device=dev)
    if e.init == "zeros":
        return torch.zeros(shape, device=dev)
    x = torch.randn(shape, generator=gen, device=dev)
    if e.init == "small":
        return x.mul_(0.02)
    return x.mul_(1.0 / math.sqrt(shape[-1]))  # "linear": fan-in = last (input) dim


_QUANTIZERS = {"fp8": quant.quant_fp8_block, "fp4": quant.quant_fp4, "rows": quant.quant_fp8_rows}
_MASTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _seed(seed) -> int:
    """An integer seed torch.Generator takes; int(1.5) was seed 1 silently, 2**70 an OverflowError."""
    import operator
    try:
        n = operator.index(seed)
    except TypeError:
        raise TypeError(f"init_params: seed must be an integer, got {seed!r}") from None
    if not -2**63 <= n < 2**64:
        raise ValueError(f"init_params: seed must be in [-2**63, 2**64), got {n}")
    return n


def init_params(cfg: Config, seed: int = 0, *, master: bool = False,
                dtype_master: Optional[torch.dtype] = None, device: str | torch.device = "cpu",
                tokenizer=None, draw_on_device: bool = False):
    """A parameter tree of ``cfg`` with random values (same structure as ``param_spec(cfg)``).

    Default: storage dtypes of the release (fp8 e4m3 + e8m0 ``[ceil(out/32), ceil(in/32)]`` scales for
    dense Linears when ``cfg.dtype == "fp8"``; packed fp4 ``[out, in/2]`` + e8m0 ``[out, in/32]`` for
    routed experts when ``cfg.experts_dtype == "fp4"``; fp8 rows + e8m0 ``[rows, head_dim/32]`` for
    Engram tables; bf16/fp32 elsewhere).

    ``master=True`` (or any ``dtype_master``): FLOAT master weights for training with QAT
    (``linear(..., mode="qat")``): every quantized weight becomes a ``dtype_master`` (default fp32)
    tensor of its logical shape with no ``scale`` sibling; other tensors keep their storage dtype
    unless ``dtype_master`` is given. ``param_spec(cfg, master=True)`` describes this tree. ``dtype_master`` must be
    a float torch.dtype (fp32, bf16, fp16, fp64): TypeError / ValueError otherwise (torch.int64 gave all-zero weights).
    ValueError for ``cfg.engram_num_embeddings`` that do not fit the Engram hash layout (forward refused the tables).

    Deterministic for a seed (CPU generator; tensors are moved to ``device`` at the end).
    ``draw_on_device=True``: draw and quantize on ``device`` with its own generator instead (seconds
    instead of minutes for release-size layers on a GPU; deterministic per device type, but the
    values differ from the CPU draws).

    ``tokenizer``: path of a ``tokenizer.json``; with Engram layers, the Engram token map built from it
    is stored at ``params["engram_token_map"]`` (``forward`` needs it; ``load_params`` does the same
    from a checkpoint folder). Its class count must equal ``cfg.engram_compressed_vocab_size``.
    """
    require_config(cfg, "init_params")
    if torch.device(device).type == "meta":     # drew and quantised everything on the CPU to return shapes only
        raise ValueError("init_params: device='meta' would draw every tensor on the CPU to return shapes only; "
                         "fd.param_spec(cfg) gives the same tree of meta tensors without drawing anything")
    seed = _seed(seed)
    if dtype_master is not None and not isinstance(dtype_master, torch.dtype):
        raise TypeError(f"init_params: dtype_master must be a torch.dtype such as torch.float32, got "
                        f"{dtype_master!r} ({type(dtype_master).__name__})")
    if dtype_master is not None and dtype_master not in _MASTER_DTYPES:   # an integer one gave all-zero weights
        raise ValueError(f"init_params: dtype_master must be a float dtype ({', '.join(map(str, _MASTER_DTYPES))}) "
                         f"for float master weights, got {dtype_master} (master=False gives the storage formats)")
    from functional_dsv41.config_checks import engram_layout_error
    if (why := engram_layout_error(cfg)) is not None:     # forward would refuse the tables (SPEC §6.2)
        raise ValueError(f"init_params: {why}")
    as_master = master or dtype_master is not None
    gen = torch.Generator(device=device if draw_on_device else "cpu").manual_seed(seed)
    flat = {}
    for e in _entries(cfg):
        if e.fmt == "scale":
            continue  # produced together with its weight
        x = _draw(e, gen)
        if as_master:
            flat[e.name] = x.to(master_dtype(e, dtype_master))
        elif e.fmt in _QUANTIZERS:
            q, s = _QUANTIZERS[e.fmt](x)
            flat[e.name] = q
            flat[e.name[: -len("weight")] + "scale"] = s
        else:
            flat[e.name] = x.to(e.dtype)
    if torch.device(device).type != "cpu":
        flat = {k: v.to(device) for k, v in flat.items()}
    params = unflatten_from_paths(flat)
    del flat
    from functional_dsv41.moe import pack_experts
    pack_experts(params, inplace=True)          # the fp4 experts of a layer as views of one buffer (moe.py)
    if tokenizer is not None and cfg.engram_layer_ids:
        from functional_dsv41.engram import build_token_map
        params["engram_token_map"] = build_token_map(tokenizer, expected_size=cfg.engram_compressed_vocab_size).to(device)
    return params
