"""``Config``'s validation (config.py): every refusal of a malformed config, each a ConfigError naming the field.

Field kinds (JSON types, int64 range), sizes and divisibility (heads, ranks, the fp8 / fp4 blocks), the layer roles
of SPEC §0.1 (compress ratios, kv / index / candidate sources), the Engram and DSpark and vision settings, and the
sizes past which building the parameter tree would fail inside torch or never finish (``_check_sizes``).
``Config.__post_init__`` runs ``validate``; config.py holds the fields, the constructors and the per-layer roles.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from .config import ConfigError, short_repr

if TYPE_CHECKING:
    from .config import Config

_FP8_BLOCK = 32  # dense fp8 weights: 32x32 blocks; activations: 1x32 (SPEC §9)
_FP4_BLOCK = 32  # fp4 experts: 1x32 blocks
_INT64_MAX = (1 << 63) - 1
# _check_sizes: the largest parameter shapes of params/spec.py by the part that has them ("" always); a factor
# hc_mult + 2, hc_mult + 1 or engram_max_ngram_size - 1 counts as 3 * hc_mult, 2 * hc_mult or engram_max_ngram_size
_BIG_SHAPES = {
    "": "vocab_size*dim 3*hc_mult*hc_mult*hc_mult*dim q_lora_rank*dim n_heads*head_dim*q_lora_rank head_dim*dim "
        "n_heads*head_dim*o_lora_rank o_groups*o_lora_rank*dim index_n_heads*index_head_dim*q_lora_rank "
        "index_n_heads*dim index_head_dim*head_dim n_routed_experts*dim moe_inter_dim*dim "
        "n_shared_experts*moe_inter_dim*dim",
    "engram": "engram_num_embeddings*engram_head_dim "
              "2*hc_mult*dim*engram_max_ngram_size*engram_n_heads*engram_head_dim",
    "dspark": "dspark_target_layer_ids*dim*dim vocab_size*dspark_markov_rank dspark_n_routed_experts*dim",
    "vision": "3*vision_dim*vision_dim 2*vision_inter_dim*vision_dim 3*vision_patch_size*vision_patch_size*vision_dim "
              "vision_downsample_ratio*vision_downsample_ratio*vision_dim*dim"}


def engram_layout_error(cfg: "Config") -> str | None:
    """Why the Engram tables (``engram_num_embeddings``) do not fit the hash layout (SPEC §6.2), or None: forward
    refuses such tables, after init_params / load_params made them. Not part of ``validate``: code builds configs
    whose tables it fills itself (train/settings.py's ``tiny_model`` probes the layout with 1-row tables), so
    ``Config.from_dict`` and ``init_params`` ask. (Lazy import: engram.py imports torch; the layout is memoised.)"""
    if not cfg.engram_layer_ids:
        return None
    from .engram import layout
    try:
        layout(cfg)
    except ValueError as e:
        return str(e)
    return None


def validate(cfg: "Config") -> None:
    """Refuse a malformed config (``Config.__post_init__`` calls it): ConfigError naming the field and the problem."""
    def bad(name: str, msg: str):
        raise ConfigError(f"{name}: {msg}")

    # field types: every JSON value must have the annotated kind
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        t = f.type if isinstance(f.type, str) else str(f.type)
        if t.startswith("tuple"):
            if not isinstance(v, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
                bad(f.name, f"expected a list of integers, got {v!r}")
        elif t == "int":
            if not isinstance(v, int) or isinstance(v, bool):
                bad(f.name, f"expected an integer, got {v!r}")
        elif t in ("float", "Optional[float]"):
            if t == "Optional[float]" and v is None:
                continue
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            try:
                ok = ok and math.isfinite(v)
            except OverflowError:                   # a huge JSON integer: no float holds it
                ok = False
            if not ok:
                bad(f.name, f"expected a finite number{' or null' if t != 'float' else ''}, "
                            f"got {short_repr(v)}")
        elif t == "bool":
            if not isinstance(v, bool):
                bad(f.name, f"expected true/false, got {v!r}")
        if t == "int" or t.startswith("tuple"):      # torch takes every size and id as an int64
            big = [i for i in (v if isinstance(v, tuple) else (v,)) if abs(i) > _INT64_MAX]
            if big:
                bad(f.name, f"{short_repr(big[0])} does not fit in int64 (torch takes sizes and ids as int64)")
    for name in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "q_lora_rank", "o_groups",
                 "o_lora_rank", "window_size", "n_routed_experts", "n_activated_experts", "moe_inter_dim",
                 "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters",
                 "candidate_topk_blocks", "candidate_block_size", "max_batch_size", "max_seq_len"):
        if getattr(cfg, name) < 1:
            bad(name, f"must be >= 1, got {getattr(cfg, name)}")
    # sizes of optional parts: a 0 there would build empty weights and compute nothing, silently
    groups = (((bool(cfg.engram_layer_ids)), ("engram_n_heads", "engram_head_dim", "engram_vocab_size")),
              (cfg.n_mtp_layers > 0, ("dspark_n_routed_experts", "dspark_n_activated_experts",
                                       "dspark_markov_rank")),
              (cfg.vision_n_layers > 0, ("vision_dim", "vision_n_heads", "vision_inter_dim",
                                          "vision_patch_size", "vision_downsample_ratio")))
    for enabled, names in groups:
        for name in names:
            if enabled and getattr(cfg, name) < 1:
                bad(name, f"must be >= 1, got {getattr(cfg, name)}")
    if cfg.n_mtp_layers and not cfg.dspark_target_layer_ids:
        bad("dspark_target_layer_ids", "is empty, but DSpark stages need main-model hidden states")
    if any(n < 1 for n in cfg.engram_num_embeddings):
        bad("engram_num_embeddings", f"every table needs >= 1 row, got {list(cfg.engram_num_embeddings)}")
    for name in ("n_mtp_layers", "n_shared_experts", "vision_n_layers"):
        if getattr(cfg, name) < 0:
            bad(name, f"must be >= 0, got {getattr(cfg, name)}")
    if cfg.dtype not in ("fp8", "bf16", None):
        bad("dtype", f"must be 'fp8' or 'bf16', got {cfg.dtype!r}")
    if cfg.expert_dtype not in ("fp4", "fp8", "bf16", None):
        bad("expert_dtype", f"must be 'fp4', 'fp8', 'bf16' or null, got {cfg.expert_dtype!r}")
    if cfg.score_func not in ("softmax", "sigmoid", "sqrtsoftplus"):
        bad("score_func", f"must be softmax, sigmoid or sqrtsoftplus, got {cfg.score_func!r}")
    if cfg.temperature < 0:
        bad("temperature", f"must be >= 0, got {cfg.temperature}")
    if cfg.route_scale < 0:      # (0 is an ablation: the routed experts off; a negative one flips their sign)
        bad("route_scale", f"must be >= 0 (it multiplies the routing weights), got {cfg.route_scale}")
    # numbers the model divides by or takes the log of: outside these ranges forward returns NaN / inf
    for name in ("rope_theta", "compress_rope_theta", "vision_rope_theta"):
        if getattr(cfg, name) <= 1:
            bad(name, f"must be > 1 (a RoPE base: frequencies base^(-2i/d) fall with i, YaRN divides by "
                      f"log(base)), got {getattr(cfg, name)}")
    for name, why in (("rope_factor", "YaRN divides the low frequencies by it"),
                      ("beta_fast", "YaRN takes log(original_seq_len / (2 pi beta_fast))"),
                      ("beta_slow", "YaRN takes log(original_seq_len / (2 pi beta_slow))"),
                      ("norm_eps", "RMSNorm takes rsqrt(mean(x^2) + norm_eps)"),
                      ("gate_temp", "the router logits are divided by it")):
        if getattr(cfg, name) <= 0:
            bad(name, f"must be > 0 ({why}), got {getattr(cfg, name)}")
    if cfg.original_seq_len < 1:
        bad("original_seq_len", f"must be >= 1 (YaRN takes log(original_seq_len / ...)), "
                                f"got {cfg.original_seq_len}")
    if cfg.hc_eps < 0:
        bad("hc_eps", f"must be >= 0 (added to the hyper-connection mixes before they are normalised), "
                      f"got {cfg.hc_eps}")
    if cfg.vision_max_wh_ratio is not None:     # the release's null; SPEC §12 leaves the stretch branch unused
        bad("vision_max_wh_ratio", f"must be null (the release's value: images keep their aspect ratio; the "
                                   f"stretch branch a ratio would select is not implemented), got "
                                   f"{cfg.vision_max_wh_ratio}")
    if cfg.n_activated_experts > cfg.n_routed_experts:
        bad("n_activated_experts", f"{cfg.n_activated_experts} > n_routed_experts {cfg.n_routed_experts}")
    if cfg.n_mtp_layers and cfg.dspark_n_activated_experts > cfg.dspark_n_routed_experts:
        bad("dspark_n_activated_experts",
            f"{cfg.dspark_n_activated_experts} > dspark_n_routed_experts {cfg.dspark_n_routed_experts}")

    # attention geometry
    if cfg.rope_head_dim % 2 or not 0 < cfg.rope_head_dim <= min(cfg.head_dim, cfg.index_head_dim):
        bad("rope_head_dim", f"must be even and <= head_dim and index_head_dim, got {cfg.rope_head_dim}")
    if cfg.n_heads % cfg.o_groups:
        bad("o_groups", f"n_heads {cfg.n_heads} is not divisible by o_groups {cfg.o_groups}")
    if cfg.head_dim % _FP8_BLOCK:
        bad("head_dim", f"{cfg.head_dim} is not a multiple of 32 (the KV latent is fp8-QDQ'd in 1x32 blocks)")
    if cfg.index_head_dim % 32:
        bad("index_head_dim", f"{cfg.index_head_dim} is not a multiple of 32 (fp4 QDQ blocks of 32)")

    # quantized storage: every fp8 GEMM input dim is split into 32-wide activation blocks
    if cfg.dtype == "fp8":
        for name, v in (("dim", cfg.dim), ("q_lora_rank", cfg.q_lora_rank),
                        ("moe_inter_dim", cfg.moe_inter_dim),
                        ("o_lora_rank*o_groups", cfg.o_lora_rank * cfg.o_groups),
                        ("engram_head_dim", cfg.engram_head_dim)):
            if v % _FP8_BLOCK:
                bad(name.split("*")[0], f"{name} = {v} is not a multiple of the 32-wide fp8 block")
    if cfg.expert_dtype in ("fp4", "fp8"):     # fp8 experts of a bf16 model: same 1x32 activation blocks
        for name, v in (("dim", cfg.dim), ("moe_inter_dim", cfg.moe_inter_dim)):
            if v % _FP4_BLOCK:
                bad(name, f"{v} is not a multiple of the 32-wide {cfg.expert_dtype} expert block")

    # per-layer compression roles (SPEC §0.1)
    nt = cfg.n_layers + cfg.n_mtp_layers
    if len(cfg.compress_ratios) != nt:
        bad("compress_ratios", f"has {len(cfg.compress_ratios)} entries, expected n_layers + n_mtp_layers = {nt}")
    if any(r < 0 for r in cfg.compress_ratios):
        bad("compress_ratios", f"entries must be >= 0, got {list(cfg.compress_ratios)}")
    if any(cfg.compress_ratios[cfg.n_layers:]):
        bad("compress_ratios", "DSpark stages (the last n_mtp_layers entries) are window-only: ratio must be 0")
    for name in ("kv_source_layers", "index_source_layers"):
        ls = getattr(cfg, name)
        if list(ls) != sorted(set(ls)):
            bad(name, f"must be strictly increasing, got {list(ls)}")
        for L in ls:
            if not 0 <= L < cfg.n_layers:
                bad(name, f"layer {L} is not a backbone layer (0..{cfg.n_layers - 1})")
            if cfg.compress_ratios[L] == 0:
                bad(name, f"layer {L} has compress ratio 0, so it has no compressed KV to share")
    for L in cfg.kv_source_layers:
        if L not in cfg.index_source_layers:
            bad("kv_source_layers", f"layer {L} owns index keys, so it must also be in index_source_layers")
    for L in range(cfg.n_layers):
        r = cfg.compress_ratios[L]
        if r == 0:
            continue
        src = cfg._last_at_or_before(cfg.kv_source_layers, L)
        if src is None:
            bad("kv_source_layers", f"layer {L} has compress ratio {r} but no kv source layer at or before it")
        if cfg.compress_ratios[src] != r:
            bad("compress_ratios", f"layer {L} has ratio {r} but its kv source layer {src} has ratio "
                                   f"{cfg.compress_ratios[src]}")
    c = cfg.candidate_source_layer
    if c >= 0:
        if c not in cfg.index_source_layers:
            bad("candidate_source_layer", f"layer {c} is not in index_source_layers")
        for L in cfg.index_source_layers:
            if L > c and cfg.kv_source(L) != cfg.kv_source(c):
                bad("candidate_source_layer", f"reindex layer {L} reads the kv of layer {cfg.kv_source(L)} "
                                              f"but its candidates come from layer {c} over the kv of "
                                              f"layer {cfg.kv_source(c)}")

    # Engram
    if len(cfg.engram_num_embeddings) != len(cfg.engram_layer_ids):
        bad("engram_num_embeddings", f"has {len(cfg.engram_num_embeddings)} entries for "
                                     f"{len(cfg.engram_layer_ids)} engram_layer_ids")
    if list(cfg.engram_layer_ids) != sorted(set(cfg.engram_layer_ids)):
        bad("engram_layer_ids", f"must be strictly increasing, got {list(cfg.engram_layer_ids)}")
    for L in cfg.engram_layer_ids:
        if not 0 <= L < cfg.n_layers:
            bad("engram_layer_ids", f"layer {L} is not a backbone layer (0..{cfg.n_layers - 1})")
    if cfg.engram_layer_ids and cfg.engram_max_ngram_size < 2:
        bad("engram_max_ngram_size", f"must be >= 2, got {cfg.engram_max_ngram_size}")
    if cfg.engram_layer_ids and cfg.engram_head_dim % 32:
        bad("engram_head_dim", f"{cfg.engram_head_dim} is not a multiple of the 32-column table scale block")
    if cfg.engram_layer_ids and not 1 <= cfg.engram_compressed_vocab_size <= cfg.vocab_size:
        # SPEC §6.1/§6.3: the number of classes the token map folds the vocabulary into (asserted), and
        # the multiplier bound divides int64_max by it
        bad("engram_compressed_vocab_size", f"must be in [1, vocab_size {cfg.vocab_size}] (the classes the "
                                            f"engram token map folds the vocabulary into), got "
                                            f"{cfg.engram_compressed_vocab_size}")

    # DSpark
    if cfg.n_mtp_layers:
        for L in cfg.dspark_target_layer_ids:
            if not 0 <= L < cfg.n_layers:
                bad("dspark_target_layer_ids", f"layer {L} is not a backbone layer")
        if list(cfg.dspark_target_layer_ids) != sorted(set(cfg.dspark_target_layer_ids)):
            # forward collects the inputs in layer order, once per layer: a repeat or another order would
            # give the drafter fewer or other-ordered hidden states than the config promises
            bad("dspark_target_layer_ids", f"must be strictly increasing, got {list(cfg.dspark_target_layer_ids)}")
        if cfg.dspark_block_size < 1:
            bad("dspark_block_size", f"must be >= 1, got {cfg.dspark_block_size}")
    for name in ("image_token_id", "dspark_noise_token_id", "engram_pad_id"):
        if not 0 <= getattr(cfg, name) < cfg.vocab_size:
            bad(name, f"token id {getattr(cfg, name)} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    if cfg.vision_n_layers:
        if cfg.vision_dim % cfg.vision_n_heads:
            bad("vision_n_heads", f"vision_dim {cfg.vision_dim} not divisible by {cfg.vision_n_heads}")
        hd = cfg.vision_dim // cfg.vision_n_heads
        if hd % 4:      # SPEC §12: rotate-half over two halves of hd/2 angles = hd/4 row + hd/4 column freqs
            bad("vision_n_heads", f"vision head dim vision_dim / vision_n_heads = {cfg.vision_dim} / "
                                  f"{cfg.vision_n_heads} = {hd} is not a multiple of 4 (the 2D RoPE splits "
                                  f"each head into halves of hd/2 angles, half of them per axis)")
    _check_sizes(cfg, bad)

def _check_sizes(cfg: "Config", bad) -> None:
    """Sizes past which init_params / param_spec / load_params failed inside torch ("Overflow when unpacking long
    long", "Storage size calculation overflowed") or ran for days: a parameter's bytes, even at 8 an element (an
    fp64 master), must fit int64; the tree lists <= 2**22 tensors (one per expert and layer, each handled in Python:
    the release has ~96k); the Engram layout's primes (one per layer, n-gram order and head, found by trial division
    above engram_vocab_size) are <= 2**10, above <= 2**32 (~2 s; the release's 48 above 16e6 take ~0.02 s)."""
    on = {"": True, "engram": bool(cfg.engram_layer_ids), "dspark": cfg.n_mtp_layers > 0,
          "vision": cfg.vision_n_layers > 0}
    v = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    v.update(engram_num_embeddings=max(cfg.engram_num_embeddings, default=0),
             dspark_target_layer_ids=len(cfg.dspark_target_layer_ids))
    for shape in (sh for part, shapes in _BIG_SHAPES.items() if on[part] for sh in shapes.split()):
        fs = shape.split("*")
        n = math.prod(int(x) if x.isdigit() else v[x] for x in fs)
        if n * 8 > _INT64_MAX:
            bad(max((x for x in fs if not x.isdigit()), key=v.get),
                f"a parameter of {shape} = {short_repr(n)} elements is too large (its bytes do not fit in int64)")
    counts = {"n_layers": cfg.n_total_layers, "n_routed_experts": cfg.n_routed_experts,
              "dspark_n_routed_experts": cfg.dspark_n_routed_experts * on["dspark"],
              "vision_n_layers": cfg.vision_n_layers}
    tensors = cfg.n_total_layers * (6 * max(cfg.n_routed_experts, counts["dspark_n_routed_experts"]) + 64) \
        + 16 * cfg.vision_n_layers
    if tensors > 1 << 22:
        bad(max(counts, key=counts.get), f"the parameter tree would list ~{short_repr(tensors)} tensors ((n_layers "
                                         f"+ n_mtp_layers) * (6 * experts + 64) + 16 * vision_n_layers), more than "
                                         f"2**22 (the release lists ~96k)")
    if on["engram"]:
        primes = len(cfg.engram_layer_ids) * (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        if primes > 1 << 10:
            bad("engram_n_heads", f"the Engram layout needs a prime per layer, n-gram order and head: {primes}, "
                                  f"more than 2**10 (the release needs 48)")
        if cfg.engram_vocab_size > 1 << 32:
            bad("engram_vocab_size", f"{cfg.engram_vocab_size} > 2**32 (the Engram layout's primes are found by "
                                     f"trial division above it; the release's is 16000000)")
