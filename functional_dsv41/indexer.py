"""Lightning indexer and two-level candidate selection (SPEC §5).

Keys (kv-source layers, per new compressed entry j, from the RoPE-free latent):
    k_j = fp4_QDQ_32(RoPE(RMSNorm_k(W_k latent_j), pos_j))              [Di]
Queries (every index-source layer, from the attention's ``qr``):
    q_th = fp4_QDQ_32(RoPE((W_qb qr_t).view(Hi, Di)[h], t))
    w_th = (W_wp x_t)_h * Di^-0.5 * Hi^-0.5
Score, in bf16:  I_tj = sum_h w_th * ReLU(q_th . k_j), -inf where entry j is not visible to t.

Level 1 (the candidate source layer): blocks of ``candidate_block_size`` entries scored by their max,
the block of the query's newest visible entry forced in, the top ``candidate_topk_blocks`` blocks with
a finite score kept -> candidate mask [b, s, n]. Level 2 (reindex layers after it): their own scores
with non-candidates set to -inf. Top-k: the k = min(index_topk, n) best entries, sorted ascending by
position, -1 for entries whose score is -inf (not visible / not a candidate).

Shape legend: b batch, s queries, n compressed entries, Hi index heads, Di index head dim.
"""
from __future__ import annotations

import torch

from . import quant
from .config import Config
from .linear import linear, qat_format, ste
from .norm import rms_norm
from .rope import apply_rope, rope_angles


def fp4_qdq(x: torch.Tensor, block: int, scale_dtype, enabled: bool = True) -> torch.Tensor:
    """E2M1 QDQ with a straight-through gradient (the release quantises these in place)."""
    if not enabled:
        return x
    with torch.no_grad():
        y = quant.fp4_act_quant_dequant(x.detach(), block, scale_dtype)
    return ste(x, y)


def index_keys(p: dict, latent: torch.Tensor, rope_pos: torch.Tensor, *, cfg: Config, layer_id: int,
               qdq: bool = True) -> torch.Tensor:
    """latent [b, n, D] bf16 -> index keys [b, n, Di] bf16. p = ...["attn"]["indexer"]."""
    k = rms_norm(linear(latent, p["wk"]), p["k_norm"]["weight"], cfg.norm_eps)
    k = apply_rope(k, rope_angles(cfg, layer_id, rope_pos))
    return fp4_qdq(k, 32, quant.E8M0, qdq)


def index_scores(p: dict, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, *,
                 cfg: Config, layer_id: int, pos: torch.Tensor, mode: str = "reference",
                 qdq: bool = True) -> torch.Tensor:
    """Scores I [b, s, n] (bf16, -inf where not visible).

    x [b, s, dim] attention input, qr [b, s, q_lora_rank], keys [b, n, Di], visible [b, s, n] bool,
    pos [b, s] query RoPE positions.
    """
    b, s, _ = x.shape
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    q = linear(qr, p["wq_b"], mode=mode, fake=qat_format(cfg)).view(b, s, Hi, Di)
    q = apply_rope(q, rope_angles(cfg, layer_id, pos)[:, :, None, :])
    q = fp4_qdq(q, 32, quant.E8M0, qdq)
    w = linear(x, p["weights_proj"], mode=mode) * (Di ** -0.5 * Hi ** -0.5)     # [b, s, Hi]
    score = torch.einsum("bshd,bnd->bshn", q, keys)
    score = (score.relu() * w.unsqueeze(-1)).sum(2)                              # [b, s, n] bf16
    return score.masked_fill(~visible, float("-inf"))


def _topk_first(x: torch.Tensor, k: int):
    """The k largest along the last dim, exact ties resolved towards the LOWER index. torch.topk's tie
    order depends on the row length, and bf16 index scores tie often, so a decode step (n entries) and
    the same query inside a chunk (n + padding entries) could pick different entries (SPEC §16).

    One exact top-k over an int64 key (order-preserving bits of the fp32 value, then the reversed
    index) gives the same result as a stable descending sort in O(n log k)."""
    n = x.shape[-1]
    bits = (x.float() + 0.0).contiguous().view(torch.int32)                   # + 0.0: -0 ties with +0
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)     # monotone in the value
    key = (order << 32) | (n - 1 - torch.arange(n, device=x.device))
    i = key.topk(k, dim=-1).indices
    return torch.return_types.topk((x.gather(-1, i), i))


def select_topk(score: torch.Tensor, k: int) -> torch.Tensor:
    """[b, s, n] -> [b, s, min(k, n)] int64 entry indices ascending, -1 where the score is -inf."""
    n = score.shape[-1]
    k = min(k, n)
    if k == 0:
        return score.new_zeros(score.shape[:-1] + (0,), dtype=torch.int64)
    top = _topk_first(score, k)
    idx = torch.where(torch.isneginf(top.values), n, top.indices)
    idx = idx.sort(-1).values
    return torch.where(idx == n, -1, idx)


def entry_blocks(group: torch.Tensor, seg: torch.Tensor, *, cfg: Config) -> torch.Tensor:
    """Candidate block id of every compressed entry [b, n]: ``candidate_block_size`` consecutive groups
    of one sample (group = entry index inside its sample), numbered along the row. For a plain row
    this is ``j // candidate_block_size``; in packed rows blocks never straddle two samples."""
    B = cfg.candidate_block_size
    new = (group % B == 0)
    new[:, 1:] |= seg[:, 1:] != seg[:, :-1]
    new[:, :1] = True
    return new.long().cumsum(1) - 1


def candidate_mask(score: torch.Tensor, visible: torch.Tensor, blocks: torch.Tensor, *, cfg: Config,
                   n_blocks: int | None = None) -> torch.Tensor:
    """Level-1 selection: [b, s, n] scores -> [b, s, n] bool mask of entries in the chosen blocks.

    blocks [b, n]: block id of each entry (``entry_blocks``); ``n_blocks``: how many there are, when the
    caller knows it without reading the tensor (plain rows: ceil(n / block size); no host sync).
    Block score = max of its entries' scores (-inf where none is visible); the block of the query's
    newest visible entry is forced in; the top ``candidate_topk_blocks`` blocks with a finite score
    are kept.
    """
    b, s, n = score.shape
    if n == 0:
        return torch.zeros_like(visible)
    nb = n_blocks if n_blocks is not None else int(blocks.max()) + 1
    idx = blocks[:, None, :].expand(b, s, n)
    block = torch.full((b, s, nb), float("-inf"), device=score.device)
    block = block.scatter_reduce(-1, idx, score.float(), reduce="amax", include_self=True)   # [b, s, nb]
    ar = torch.arange(n, device=score.device)
    newest = torch.where(visible, ar, -1).amax(-1)                               # [b, s] newest visible entry
    has = newest >= 0
    forced_block = blocks.gather(1, newest.clamp_min(0))                         # [b, s]
    forced = torch.nn.functional.one_hot(forced_block, nb).bool() & has[..., None]
    block = block.masked_fill(forced, float("inf"))
    kb = min(cfg.candidate_topk_blocks, nb)
    top = _topk_first(block, kb)
    keep = torch.zeros(b, s, nb, dtype=torch.bool, device=score.device)
    keep = keep.scatter(-1, top.indices, ~torch.isneginf(top.values))
    return keep.gather(-1, idx)
