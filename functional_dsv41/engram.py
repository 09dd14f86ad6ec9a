"""Engram: hashed n-gram memory written into the hyper-connection streams (SPEC §6).

Pipeline, as ``forward`` uses it (SPEC §1): ``hash_ids`` once per chunk for every Engram layer, then at
the input of each Engram block ``engram_write`` (which calls ``lookup``) on the streams.

- ``build_token_map``  tokenizer.json -> compressed class per token id (§6.1)
- ``layout``           primes, row offsets, odd multipliers, table rows per Engram layer (§6.2-6.3)
- ``hash_ids``         row ids per position for a chunk starting anywhere, ``NgramCache`` carried (§6.4)
- ``lookup``           gather rows from a table in storage form (fp8 rows + e8m0, or bf16/fp32) (§6.5)
- ``engram_write``     the gated residual write over the hc streams (§6.5)

Shape suffixes: B batch, S chunk length, E Engram layers, G look-backs (= max_ngram_size - 1),
H hash heads, C = G*H row ids per position and layer, R table rows, D row width (engram_head_dim),
N hc streams (hc_mult), M model dim.

Why a compressed vocabulary: case/accent/whitespace variants of a token share n-gram rows; the hash
multipliers are sized from the class count (§6.3), so a map from another tokenizer revision silently
reads other rows. The map therefore has to be built from the exact tokenizer and checked by size.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Optional

import numpy as np
import torch

from functional_dsv41 import invariant, quant, sharding
from functional_dsv41.linear import linear, qat_format
from functional_dsv41.pytree import register_carrier

DEAD = -1          # compressed id of an image token: breaks every n-gram through it
BEFORE_START = -2  # history slot before the sequence start (empty cache)
_INT64_MAX = (1 << 63) - 1


# ----------------------------------------------------------------------------- §6.1 token map
def _key_normalizer():
    """NFKC -> NFD -> StripAccents -> Lowercase -> whitespace runs to " " -> a lone " " survives Strip."""
    from tokenizers import Regex, normalizers as N
    return N.Sequence([
        N.NFKC(), N.NFD(), N.StripAccents(), N.Lowercase(),
        N.Replace(Regex(r"[ \t\r\n]+"), " "),
        N.Replace(Regex(r"^ $"), "\uE000"),   # protect a whitespace-only token from Strip
        N.Strip(),
        N.Replace("\uE000", " "),
    ])


def build_token_map(tokenizer_json_path: str | os.PathLike, *,
                    expected_size: Optional[int] = None) -> torch.Tensor:
    """Compressed token classes of a Hugging Face ``tokenizer.json`` (SPEC §6.1).

    Every id is decoded alone (raw backend, special tokens kept). A text containing U+FFFD (a partial
    UTF-8 byte token) keys on the raw token string (``id_to_token``) so distinct byte pieces stay
    distinct; any other text keys on its normalised form (empty -> the decoded text). Classes are
    numbered in first-seen order of keys.

    Returns int64 ``[vocab]`` (vocab = size with added tokens). ``expected_size`` is the number of
    classes the config asserts (``cfg.engram_compressed_vocab_size``); a mismatch is a ValueError.
    """
    from tokenizers import Tokenizer
    path = os.fspath(tokenizer_json_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"build_token_map: no tokenizer file at {path}"
                                + (" (a folder: pass its tokenizer.json)" if os.path.isdir(path) else ""))
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:                       # the tokenizers library raises a bare Exception
        with open(path, "rb") as fh:
            lfs = fh.read(40).startswith(b"version https://git-lfs")
        raise ValueError(f"build_token_map: {path}: cannot read it as a tokenizer.json ({e})"
                         + ("; it is a git-lfs pointer (cloned without git-lfs: run git lfs pull)" if lfs else "")
                         ) from None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    texts = tok.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    norm = _key_normalizer()
    keys: dict[str, int] = {}
    out = np.empty(vocab, dtype=np.int64)
    for i, text in enumerate(texts):
        if "\ufffd" in text:
            raw = tok.id_to_token(i)
            key = raw if raw is not None else text
        else:
            key = norm.normalize_str(text) or text
        out[i] = keys.setdefault(key, len(keys))
    if expected_size is not None and len(keys) != expected_size:
        raise ValueError(f"build_token_map: {tokenizer_json_path} gives {len(keys)} compressed classes, "
                         f"the config expects {expected_size} (engram_compressed_vocab_size): "
                         "wrong tokenizer revision?")
    return torch.from_numpy(out)


# ----------------------------------------------------------------------------- §6.2-6.3 layout
@dataclasses.dataclass(frozen=True)
class EngramLayerLayout:
    """Hash layout of one Engram layer: ``primes`` int64 [G, H] (bucket modulus per n-gram order and
    head), ``offsets`` int64 [G*H] (exclusive cumsum of the primes = first row of each bucket range),
    ``multipliers`` int64 [G+1] (odd, one per look-back), ``rows`` = sum of primes (table rows)."""
    primes: torch.Tensor
    offsets: torch.Tensor
    multipliers: torch.Tensor
    rows: int


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    for d in range(3, math.isqrt(n) + 1, 2):
        if n % d == 0:
            return False
    return True


@functools.lru_cache(maxsize=16)
def _layout_ints(layer_ids: tuple[int, ...], max_ngram: int, n_heads: int, vocab: int,
                 n_classes: int) -> tuple:
    """Pure-int layout, memoised in memory (trial division near 16M takes ~0.1 s)."""
    used: set[int] = set()
    bound = max(1, (_INT64_MAX // n_classes) // 2)
    out = []
    for L in layer_ids:
        primes = []
        for _n in range(2, max_ngram + 1):
            current, row = vocab - 1, []     # restarts per (layer, order); never reuses a prime
            for _h in range(n_heads):
                current += 1
                while current in used or not _is_prime(current):
                    current += 1
                used.add(current)
                row.append(current)
            primes.append(tuple(row))
        rng = np.random.default_rng(10007 * L)
        mult = rng.integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1
        out.append((tuple(primes), tuple(int(m) for m in mult)))
    return tuple(out)


def layout(cfg) -> list[EngramLayerLayout]:
    """One ``EngramLayerLayout`` per Engram layer, in ``cfg.engram_layer_ids`` order (SPEC §6.2-6.3).

    Primes: for every (layer, order) a search restarting above ``engram_vocab_size - 1``, head by head,
    skipping primes used anywhere before. Multipliers: ``2*default_rng(10007*L).integers(0, bound, G+1)+1``
    with ``bound = max(1, (int64_max // engram_compressed_vocab_size) // 2)``, so a class id times a
    multiplier never overflows int64. Raises ValueError if the rows differ from
    ``cfg.engram_num_embeddings``.
    """
    ints = _layout_ints(tuple(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads,
                        cfg.engram_vocab_size, cfg.engram_compressed_vocab_size)
    res = []
    for i, (primes, mult) in enumerate(ints):
        p = torch.tensor(primes, dtype=torch.int64)
        flat = p.flatten()
        rows = sum(int(q) for row in primes for q in row)     # from the Python ints: no tensor read
        want = cfg.engram_num_embeddings[i]
        if rows != want:
            raise ValueError(f"engram layout: layer {cfg.engram_layer_ids[i]} needs {rows} table rows "
                             f"(sum of its primes), config engram_num_embeddings[{i}] = {want}")
        offsets = torch.cumsum(flat, 0) - flat
        res.append(EngramLayerLayout(p, offsets, torch.tensor(mult, dtype=torch.int64), rows))
    return res


# ----------------------------------------------------------------------------- §6.4 hashing
@register_carrier
@dataclasses.dataclass(frozen=True)
class NgramCache:
    """The n-gram history a chunk needs from before it: ``tail`` int64 [B, G], the compressed ids of the
    last G = max_ngram_size-1 tokens (oldest first), ``DEAD`` (-1) for image tokens, ``BEFORE_START``
    (-2) for slots before the sequence start. Both markers block the look-back through them."""
    tail: torch.Tensor


def init_ngram_cache(cfg, batch_size: int, device=None) -> NgramCache:
    """Empty history (sequence start): ``tail`` int64 [batch_size, G] filled with BEFORE_START."""
    g = cfg.engram_max_ngram_size - 1
    return NgramCache(torch.full((batch_size, g), BEFORE_START, dtype=torch.int64, device=device))


def _check_token_map(token_map: torch.Tensor, cfg) -> None:
    if token_map.ndim != 1 or token_map.shape[0] != cfg.vocab_size:
        raise ValueError(f"engram token_map has shape {tuple(token_map.shape)}, expected [{cfg.vocab_size}] "
                         "(cfg.vocab_size): built from another tokenizer?")
    if token_map.is_floating_point() or token_map.dtype == torch.bool:
        raise TypeError(f"engram token_map must be an integer tensor, got {token_map.dtype}")
    lo, hi = int(token_map.min()), int(token_map.max())
    if lo < 0 or hi >= cfg.engram_compressed_vocab_size:
        raise ValueError(f"engram token_map has classes in [{lo}, {hi}], expected [0, "
                         f"{cfg.engram_compressed_vocab_size}) (engram_compressed_vocab_size): "
                         "built from another tokenizer?")


def hash_ids(input_ids: torch.Tensor, *, cfg, token_map: torch.Tensor,
             image_mask: Optional[torch.Tensor] = None, cache: Optional[NgramCache] = None,
             positions: Optional[torch.Tensor] = None, check: bool = True
             ) -> tuple[torch.Tensor, NgramCache]:
    """Engram row ids of a chunk (SPEC §6.4): ``(ids int64 [B, S, E, G*H], new_cache)``.

    input_ids int64 [B, S]; token_map int [vocab] (``build_token_map``); image_mask bool [B, S]
    (True = image token, DEAD); cache = history before the chunk (None = the chunk starts a sequence);
    positions int64 [B, S] = each token's position within its own sample (packed training rows
    restart at 0): look-back s is blocked where ``positions < s``. Look-back s at position p is also
    blocked once any of p, p-1, .., p-s is DEAD or before the start; a blocked slot hashes as
    ``token_map[engram_pad_id]``. Column ``(n-2)*H + h`` of layer e is
    ``(XOR_{s<n} tok_s * mult[e][s]) mod primes[e][n-2][h] + offsets[e][(n-2)*H + h]``, all int64
    (products < 2^63 by the multiplier bound, XOR of non-negatives stays non-negative).
    ``check=False`` skips the value checks (they synchronise with the device).
    Raises ValueError for a config without Engram layers (``forward`` skips the hashing then).
    """
    if not cfg.engram_layer_ids:
        raise ValueError("hash_ids: the config has no Engram layers (engram_layer_ids is empty), so there are no "
                         "row ids to hash; forward skips hash_ids for such a config")
    if input_ids.ndim != 2:
        raise ValueError(f"hash_ids: input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    B, S = input_ids.shape
    G = cfg.engram_max_ngram_size - 1
    dev = input_ids.device
    ids_BS = input_ids.long()
    if check:
        _check_token_map(token_map, cfg)
        bad = (ids_BS < 0) | (ids_BS >= cfg.vocab_size)
        if bool(bad.any()):
            raise ValueError(f"hash_ids: token id {int(ids_BS[bad][0])} is outside the vocabulary "
                             f"[0, {cfg.vocab_size})")
    if cache is None:
        cache = init_ngram_cache(cfg, B, dev)
    if cache.tail.shape != (B, G):
        raise ValueError(f"hash_ids: NgramCache.tail has shape {tuple(cache.tail.shape)}, expected {(B, G)}")
    tmap = token_map.to(device=dev, dtype=torch.int64)
    c_BS = tmap[ids_BS]
    if image_mask is not None:
        if image_mask.shape != (B, S):
            raise ValueError(f"hash_ids: image_mask shape {tuple(image_mask.shape)} != input_ids {(B, S)}")
        c_BS = torch.where(image_mask.to(dev, torch.bool), DEAD, c_BS)
    if positions is not None and positions.shape != (B, S):
        raise ValueError(f"hash_ids: positions shape {tuple(positions.shape)} != input_ids {(B, S)}")
    hist = torch.cat([cache.tail.to(dev, torch.int64), c_BS], dim=1)       # [B, G+S]
    pad = tmap[cfg.engram_pad_id]

    lays = layout(cfg)
    mult_EK = torch.stack([l.multipliers for l in lays]).to(dev)          # [E, G+1]
    primes_EGH = torch.stack([l.primes for l in lays]).to(dev)            # [E, G, H]
    offsets_EC = torch.stack([l.offsets for l in lays]).to(dev)           # [E, G*H]

    blocked = torch.zeros(B, S, dtype=torch.bool, device=dev)
    acc = None
    rs = []
    for s in range(G + 1):
        tok = hist[:, G - s:G - s + S]                                      # c(p - s)
        blocked = blocked | (tok < 0)
        if positions is not None:
            blocked = blocked | (positions.to(dev) < s)
        tok = torch.where(blocked, pad, tok)
        P_BSE = tok[..., None] * mult_EK[:, s]
        acc = P_BSE if acc is None else torch.bitwise_xor(acc, P_BSE)
        if s >= 1:
            rs.append(acc)                                                 # hashes the (s+1)-gram
    R_BSEG = torch.stack(rs, dim=-1)
    ids = torch.remainder(R_BSEG[..., None], primes_EGH).flatten(-2) + offsets_EC
    return ids, NgramCache(hist[:, -G:] if G else hist[:, :0])


# ----------------------------------------------------------------------------- §6.5 lookup
def lookup(weight: torch.Tensor, scale: Optional[torch.Tensor], ids: torch.Tensor, *,
           check: bool = True) -> torch.Tensor:
    """Rows ``ids`` of one table, concatenated: bf16 ``[..., n*D]`` for ids int [..., n].

    weight: fp8 e4m3 [R, D] with scale e8m0 [R, D/32] (``row = q * 2^(e-127)`` -> bf16, dequantised on
    the gathered rows only), or a bf16/fp32 table with scale None. Only the gathered rows are read,
    so a memory-mapped table (``torch.from_file`` / ``numpy.memmap``) stays on disk.
    """
    if weight.ndim != 2:
        raise ValueError(f"engram lookup: table must be [rows, dim], got shape {tuple(weight.shape)}")
    R, D = weight.shape
    flat = ids.reshape(-1).long()
    if check and flat.numel():
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= R:
            raise ValueError(f"engram lookup: row id {hi if hi >= R else lo} is outside the table's "
                             f"{R} rows")
    if weight.dtype == quant.FP8:
        if scale is None or scale.shape != (R, D // quant.BLOCK):
            raise ValueError(f"engram lookup: fp8 table [{R}, {D}] needs an e8m0 scale [{R}, {D // quant.BLOCK}], "
                             f"got {None if scale is None else tuple(scale.shape)}")
        q = sharding.take_rows(weight, flat)        # (rows may be split over a mesh: sharding.py)
        s = sharding.take_rows(scale, flat).view(torch.uint8)
        rows = quant.dequant_fp8_rows(q, s, torch.bfloat16)
    elif weight.is_floating_point():
        if scale is not None:
            raise ValueError(f"engram lookup: a {weight.dtype} table takes no scale")
        rows = sharding.take_rows(weight, flat).to(torch.bfloat16)
    else:
        raise TypeError(f"engram lookup: unsupported table dtype {weight.dtype}")
    return rows.reshape(*ids.shape[:-1], ids.shape[-1] * D)


def validate_table(embed: dict, *, cfg, layer_id: int) -> None:
    """Raise ValueError unless ``embed`` ({"weight", "scale"?}) has the layout's rows and D columns."""
    e = cfg.engram_index(layer_id)
    if e is None:
        raise ValueError(f"engram: layer {layer_id} is not an Engram layer {list(cfg.engram_layer_ids)}")
    rows = layout(cfg)[e].rows
    w = embed["weight"]
    if tuple(w.shape) != (rows, cfg.engram_head_dim):
        raise ValueError(f"engram table of layer {layer_id} has shape {tuple(w.shape)}, the hash layout "
                         f"needs [{rows}, {cfg.engram_head_dim}]")
    s = embed.get("scale")
    if s is not None and s.shape[0] != rows:
        raise ValueError(f"engram table scale of layer {layer_id} has {s.shape[0]} rows, expected {rows}")


# ----------------------------------------------------------------------------- §6.5 gated write
def engram_write(p: dict, h: torch.Tensor, ids: torch.Tensor, *, cfg,
                 image_mask: Optional[torch.Tensor] = None, mode: str = "reference",
                 layer_id: Optional[int] = None, check: bool = True, impl: Optional[str] = None) -> torch.Tensor:
    """Engram write into the hc streams (SPEC §6.5): bf16 [B, S, N, M] -> bf16 [B, S, N, M].

    p = params["layers"][L]["engram"]: {"embed": {"weight", "scale"}, "wkv": {"weight", "scale"?},
    "q_weight": [N, M], "k_weight": [N, M]}; ids int64 [B, S, C] of this layer (``hash_ids(..)[:, :, e]``);
    image_mask bool [B, S] (True = image token: gate 0). ``layer_id`` given: the table is checked
    against the layout first; ``check=False`` skips the row-id range check (a device sync).

    Dtype flow (the reference's): e = gathered rows bf16 [B, S, C*D]; kv = linear(e, wkv) bf16
    [B, S, (N+1)*M]; key = kv[:N*M] -> fp32, h -> fp32, qk = fp32(q_weight) * fp32(k_weight);
    dot = sum(h*qk*key) * rsqrt(mean h^2 + eps) * rsqrt(mean key^2 + eps) * M^-0.5 (fp32);
    g = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))); h + g*value in fp32, cast to bf16.
    """
    B, S, N, M = h.shape
    if layer_id is not None:
        validate_table(p["embed"], cfg=cfg, layer_id=layer_id)
    e = lookup(p["embed"]["weight"], p["embed"].get("scale"), ids, check=check)  # [B, S, C*D] bf16
    kv = linear(e, p["wkv"], mode=mode, fake=qat_format(cfg), impl=impl).to(torch.bfloat16)                 # [B, S, (N+1)*M]
    key_BSNM = kv[..., :N * M].unflatten(-1, (N, M)).float()
    value_BSM = kv[..., N * M:]
    h32 = h.float()
    qk_NM = p["q_weight"].float() * p["k_weight"].float()   # fp32 product: a bf16 one is off by ulps
    eps = cfg.norm_eps
    dot = (h32 * qk_NM * key_BSNM).sum(-1)                    # norms as scalars AFTER the sum
    dot = dot * torch.rsqrt(h32.square().mean(-1) + eps) * torch.rsqrt(key_BSNM.square().mean(-1) + eps)
    dot = dot * M ** -0.5
    g_BSN = invariant.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
    if image_mask is not None:
        g_BSN = torch.where(image_mask[..., None], 0.0, g_BSN)
    return (h32 + g_BSN[..., None] * value_BSM[:, :, None, :].float()).to(h.dtype)
