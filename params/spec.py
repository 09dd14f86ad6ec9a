"""The parameter tree of a config: every released tensor's name, storage shape and dtype (SPEC §9, §11).

Tree convention (DESIGN.md "Conventions" 1): nested dicts; numbered components are Python lists, so
``params["layers"][5]["attn"]["wq_b"]["weight"]`` is the checkpoint tensor
``layers.5.attn.wq_b.weight``. Quantized weights keep their storage dtype and have a sibling
``"scale"``:

- dense fp8 (``cfg.dtype == "fp8"``): e4m3 ``[out, in]`` + e8m0 ``[ceil(out/32), ceil(in/32)]``;
- fp4 routed experts (``cfg.experts_dtype == "fp4"``): float4_e2m1fn_x2 ``[out, in/2]`` + e8m0
  ``[out, in/32]``;
- Engram tables (always, also in bf16 configs): e4m3 rows ``[rows, head_dim]`` + e8m0
  ``[rows, head_dim/32]``.

Everything else is stored bf16 or fp32 as the release stores it: hc_* (fp32), attn_sink (fp32),
gate.bias / gate.bias_vl (fp32; bias_vl only with vision), vision norms (fp32); wo_a, compressor,
indexer wk / weights_proj, gate.weight, norms, embed, head, Engram q/k weights, DSpark heads and the
vision tower in bf16, whatever ``cfg.dtype`` says.

``_entries(cfg)`` is the single source: an ordered list of :class:`Entry` (one per released tensor)
that ``param_spec``, ``init_params``, the count report and the checkpoint validation all read.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from functional_dsv41.config import Config
from functional_dsv41.pytree import unflatten_from_paths

BF16, F32 = torch.bfloat16, torch.float32
FP8, E8M0, FP4X2 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2
BLOCK = 32


@dataclasses.dataclass(frozen=True)
class Entry:
    """One released tensor.

    ``shape``/``dtype``: storage (what the checkpoint holds, fp4 packed two per byte).
    ``logical``: the logical shape (fp4: ``[out, in]``). ``fmt``: ``"fp8"`` (32x32 blocks), ``"fp4"``
    (1x32), ``"rows"`` (fp8 rows, 1x32) for a quantized weight, ``"scale"`` for its e8m0 scale,
    ``None`` for a plain bf16/fp32 tensor. ``init``: how :func:`init_params` draws it
    (``linear`` = normal fan-in scaled, ``ones``, ``zeros``, ``small`` = 0.02 normal).
    """
    name: str
    shape: tuple
    dtype: torch.dtype
    logical: tuple
    fmt: Optional[str] = None
    init: str = "linear"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.logical:
            n *= d
        return n


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Builder:
    def __init__(self):
        self.entries: list[Entry] = []

    def plain(self, name, shape, dtype=BF16, init="linear"):
        self.entries.append(Entry(name, tuple(shape), dtype, tuple(shape), None, init))

    def linear(self, name, out, inp, fmt: Optional[str]):
        """``name.weight`` (+ ``name.scale``) of a Linear ``inp -> out`` stored as ``fmt``."""
        w = f"{name}.weight"
        if fmt == "fp8":
            self.entries.append(Entry(w, (out, inp), FP8, (out, inp), "fp8"))
            self.entries.append(Entry(f"{name}.scale", (_cdiv(out, BLOCK), _cdiv(inp, BLOCK)), E8M0,
                                      (_cdiv(out, BLOCK), _cdiv(inp, BLOCK)), "scale", "none"))
        elif fmt == "fp4":
            self.entries.append(Entry(w, (out, inp // 2), FP4X2, (out, inp), "fp4"))
            self.entries.append(Entry(f"{name}.scale", (out, inp // BLOCK), E8M0, (out, inp // BLOCK),
                                      "scale", "none"))
        elif fmt in ("bf16", None):
            self.plain(w, (out, inp), BF16)
        else:
            raise ValueError(f"unknown storage format {fmt!r} for {w}")

    def rows(self, name, n_rows, width):
        self.entries.append(Entry(f"{name}.weight", (n_rows, width), FP8, (n_rows, width), "rows"))
        self.entries.append(Entry(f"{name}.scale", (n_rows, width // BLOCK), E8M0, (n_rows, width // BLOCK),
                                  "scale", "none"))


def _block(b: _Builder, cfg: Config, L: int) -> None:
    """One backbone block or DSpark stage (SPEC §2-§5, §6.5, §7, §8)."""
    p = cfg.param_prefix(L)
    dense, xfmt = cfg.dtype, cfg.experts_dtype
    for sub in ("attn", "ffn"):
        b.plain(f"{p}.hc_{sub}_fn", (cfg.n_hc_mix, cfg.hc_dim), F32, "small")
        b.plain(f"{p}.hc_{sub}_base", (cfg.n_hc_mix,), F32, "small")
        b.plain(f"{p}.hc_{sub}_scale", (3,), F32, "small")
    b.plain(f"{p}.attn_norm.weight", (cfg.dim,), init="ones")
    b.plain(f"{p}.ffn_norm.weight", (cfg.dim,), init="ones")
    # attention (SPEC §3)
    a = f"{p}.attn"
    b.plain(f"{a}.attn_sink", (cfg.n_heads,), F32, "zeros")
    b.linear(f"{a}.wq_a", cfg.q_lora_rank, cfg.dim, dense)
    b.plain(f"{a}.q_norm.weight", (cfg.q_lora_rank,), init="ones")
    b.linear(f"{a}.wq_b", cfg.n_heads * cfg.head_dim, cfg.q_lora_rank, dense)
    b.linear(f"{a}.wkv", cfg.head_dim, cfg.dim, dense)
    b.plain(f"{a}.kv_norm.weight", (cfg.head_dim,), init="ones")
    b.plain(f"{a}.wo_a.weight", (cfg.o_groups * cfg.o_lora_rank, cfg.n_heads * cfg.head_dim // cfg.o_groups))
    b.linear(f"{a}.wo_b", cfg.dim, cfg.o_groups * cfg.o_lora_rank, dense)
    if not cfg.is_dspark(L):
        if L in cfg.kv_source_layers:  # compressor (SPEC §4): bf16, no scale
            b.plain(f"{a}.compressor.wkv.weight", (cfg.head_dim, cfg.dim))
            if cfg.compress_ratio(L) > 1:
                b.plain(f"{a}.compressor.wgate.weight", (cfg.head_dim, cfg.dim))
            b.plain(f"{a}.compressor.norm.weight", (cfg.head_dim,), init="ones")
        if L in cfg.index_source_layers:  # indexer (SPEC §5)
            b.linear(f"{a}.indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, dense)
            b.plain(f"{a}.indexer.weights_proj.weight", (cfg.index_n_heads, cfg.dim))
            if L in cfg.kv_source_layers:
                b.plain(f"{a}.indexer.wk.weight", (cfg.index_head_dim, cfg.head_dim))
                b.plain(f"{a}.indexer.k_norm.weight", (cfg.index_head_dim,), init="ones")
    # MoE (SPEC §8)
    f = f"{p}.ffn"
    n_exp, _ = cfg.moe_experts(L)
    b.plain(f"{f}.gate.weight", (n_exp, cfg.dim))
    b.plain(f"{f}.gate.bias", (n_exp,), F32, "zeros")
    if cfg.vision_enabled:
        b.plain(f"{f}.gate.bias_vl", (n_exp,), F32, "zeros")
    for e in range(n_exp):
        b.linear(f"{f}.experts.{e}.w1", cfg.moe_inter_dim, cfg.dim, xfmt)
        b.linear(f"{f}.experts.{e}.w2", cfg.dim, cfg.moe_inter_dim, xfmt)
        b.linear(f"{f}.experts.{e}.w3", cfg.moe_inter_dim, cfg.dim, xfmt)
    if cfg.n_shared_experts:
        inter = cfg.moe_inter_dim * cfg.n_shared_experts
        b.linear(f"{f}.shared_experts.w1", inter, cfg.dim, dense)
        b.linear(f"{f}.shared_experts.w2", cfg.dim, inter, dense)
        b.linear(f"{f}.shared_experts.w3", inter, cfg.dim, dense)
    # Engram (SPEC §6.5)
    k = cfg.engram_index(L)
    if k is not None:
        e = f"{p}.engram"
        b.rows(f"{e}.embed", cfg.engram_num_embeddings[k], cfg.engram_head_dim)
        n_lookup = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        b.linear(f"{e}.wkv", (cfg.hc_mult + 1) * cfg.dim, n_lookup * cfg.engram_head_dim, dense)
        b.plain(f"{e}.q_weight", (cfg.hc_mult, cfg.dim), init="ones")
        b.plain(f"{e}.k_weight", (cfg.hc_mult, cfg.dim), init="ones")
    # DSpark extras (SPEC §7)
    if cfg.is_dspark(L):
        s = L - cfg.n_layers
        if s == 0:
            b.linear(f"{p}.main_proj", cfg.dim, len(cfg.dspark_target_layer_ids) * cfg.dim, dense)
            b.plain(f"{p}.main_norm.weight", (cfg.dim,), init="ones")
        if s == cfg.n_mtp_layers - 1:
            r = cfg.dspark_markov_rank
            b.plain(f"{p}.norm.weight", (cfg.dim,), init="ones")
            b.plain(f"{p}.markov_head.embed.weight", (cfg.vocab_size, r))
            b.plain(f"{p}.markov_head.head.weight", (cfg.vocab_size, r))
            b.plain(f"{p}.confidence_head.proj.weight", (1, cfg.dim + r))


def _vision(b: _Builder, cfg: Config) -> None:
    """ViT, aligner and image delimiters (SPEC §12): bf16, RMSNorm weights fp32."""
    vd, ps = cfg.vision_dim, cfg.vision_patch_size
    b.plain("vision.patch_embed.proj.weight", (vd, 3 * ps * ps))
    b.plain("vision.patch_embed.proj.bias", (vd,), init="zeros")
    for i in range(cfg.vision_n_layers):
        v = f"vision.blocks.{i}"
        b.plain(f"{v}.norm1.weight", (vd,), F32, "ones")
        b.plain(f"{v}.norm2.weight", (vd,), F32, "ones")
        b.plain(f"{v}.attn.wqkv.weight", (3 * vd, vd))
        b.plain(f"{v}.attn.wqkv.bias", (3 * vd,), init="zeros")
        b.plain(f"{v}.attn.wo.weight", (vd, vd))
        b.plain(f"{v}.attn.wo.bias", (vd,), init="zeros")
        b.plain(f"{v}.mlp.w1.weight", (2 * cfg.vision_inter_dim, vd))
        b.plain(f"{v}.mlp.w2.weight", (vd, cfg.vision_inter_dim))
    b.plain("vision.norm.weight", (vd,), F32, "ones")
    k = cfg.vision_downsample_ratio
    b.plain("aligner.w1.weight", (cfg.dim, vd * k * k))
    b.plain("aligner.w1.bias", (cfg.dim,), init="zeros")
    b.plain("aligner.w2.weight", (cfg.dim, cfg.dim))
    b.plain("aligner.w2.bias", (cfg.dim,), init="zeros")
    for n in ("image_start", "image_end", "image_newline"):
        b.plain(n, (cfg.dim,))


def _entries(cfg: Config) -> list[Entry]:
    """Every released tensor of ``cfg`` in a fixed order (embed, layers, norm, head, mtp, vision)."""
    b = _Builder()
    b.plain("embed.weight", (cfg.vocab_size, cfg.dim))
    for L in cfg.layer_ids:
        _block(b, cfg, L)
    b.plain("norm.weight", (cfg.dim,), init="ones")
    b.plain("head.weight", (cfg.vocab_size, cfg.dim))
    for L in cfg.dspark_layer_ids:
        _block(b, cfg, L)
    if cfg.vision_enabled:
        _vision(b, cfg)
    return b.entries


def master_dtype(e: Entry, dtype_master: Optional[torch.dtype]) -> torch.dtype:
    """dtype of an entry's FLOAT master weight: quantized storage -> ``dtype_master or fp32``;
    plain tensors keep their storage dtype unless ``dtype_master`` is given."""
    if e.fmt in ("fp8", "fp4", "rows"):
        return dtype_master or F32
    return dtype_master or e.dtype


def spec_entries(cfg: Config, *, master: bool = False, dtype_master: Optional[torch.dtype] = None) -> list[Entry]:
    """The entries of the storage tree, or with ``master=True`` of the float master tree: quantized
    weights at their logical shape in ``dtype_master`` (default fp32), no ``scale`` entries."""
    es = _entries(cfg)
    if not (master or dtype_master is not None):
        return es
    return [dataclasses.replace(e, shape=e.logical, dtype=master_dtype(e, dtype_master))
            for e in es if e.fmt != "scale"]


def param_spec(cfg: Config, *, master: bool = False, dtype_master: Optional[torch.dtype] = None):
    """The parameter tree of ``cfg`` with ``torch.empty(shape, dtype, device="meta")`` leaves.

    Nothing is allocated (works at ``Config.flash()``: ~96k tensors). ``master=True`` gives the tree
    that ``init_params(..., master=True)`` returns (float weights, no scales). Not listed: the
    Engram token map ``engram_token_map`` (built from the tokenizer, not a checkpoint tensor) and the
    reference's state_dict aliases ``mtp.{s}.embed/head`` (the file stores each tensor once).
    """
    from functional_dsv41.config import require_config
    require_config(cfg, "param_spec")
    flat = {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta")
            for e in spec_entries(cfg, master=master, dtype_master=dtype_master)}
    return unflatten_from_paths(flat)
