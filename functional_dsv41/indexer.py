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

from . import kernels, quant
from .config import Config
from .linear import fp4_qdq, linear, qat_format
from .norm import rms_norm
from .rope import apply_rope, rope_angles


def index_keys(p: dict, latent: torch.Tensor, rope_pos: torch.Tensor, *, cfg: Config, layer_id: int,
               qdq: bool = True) -> torch.Tensor:
    """latent [b, n, D] bf16 -> index keys [b, n, Di] bf16. p = ...["attn"]["indexer"]."""
    k = rms_norm(linear(latent, p["wk"]), p["k_norm"]["weight"], cfg.norm_eps)
    k = apply_rope(k, rope_angles(cfg, layer_id, rope_pos))
    return fp4_qdq(k, 32, quant.E8M0, qdq)


def visible_range(end: torch.Tensor, pos_abs: torch.Tensor, seg_start: torch.Tensor):
    """The entries a query sees, as a half-open range [lo, hi) per query ([b, s] int64 each).

    end [b, n]: end position of each entry, entries in position order along the row (history first,
    padding entries last with end = BIG); pos_abs [s] (or [b, s]) and seg_start [b, s]: each query's
    position and its sample's start. Entry j is visible iff it is complete (end_j <= pos) and in the
    query's own sample (its sample start seg_j == seg_start); an entry's end lies inside its sample,
    samples are contiguous in position and ends ascend along the row, so the visible entries are exactly
    those with seg_start <= end_j <= pos: lo = #(end < seg_start), hi = #(end <= pos), and the entries'
    own sample starts are not needed.
    """
    b = end.shape[0]
    pos = pos_abs.expand(b, -1) if pos_abs.dim() == 1 else pos_abs
    end = end.contiguous()
    lo = torch.searchsorted(end, seg_start.contiguous(), side="left")
    hi = torch.searchsorted(end, pos.contiguous(), side="right")
    return lo, hi


def index_scores(p: dict, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, visible, *,
                 cfg: Config, layer_id: int, pos: torch.Tensor, mode: str = "reference",
                 qdq: bool = True, cand: torch.Tensor | None = None, impl: str | None = None) -> torch.Tensor:
    """Scores I [b, s, n] (bf16, -inf where not visible or, given ``cand`` [b, s, n] bool, not a candidate).

    x [b, s, dim] attention input, qr [b, s, q_lora_rank], keys [b, n, Di], visible = (lo, hi) [b, s]
    each (``visible_range``), pos [b, s] query RoPE positions. The scoring itself is the kernel op
    ``kernels.index_scores`` (reference: ``kernels/reference_indexer.py``).
    """
    b, s, _ = x.shape
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim
    q = linear(qr, p["wq_b"], mode=mode, fake=qat_format(cfg), impl=impl).view(b, s, Hi, Di)
    q = apply_rope(q, rope_angles(cfg, layer_id, pos)[:, :, None, :])
    q = fp4_qdq(q, 32, quant.E8M0, qdq)
    w = linear(x, p["weights_proj"], mode=mode) * (Di ** -0.5 * Hi ** -0.5)     # [b, s, Hi]
    lo, hi = visible
    return kernels.index_scores(q, keys, w, lo, hi, cand, impl=impl)


def select_topk(score: torch.Tensor, k: int, impl: str | None = None) -> torch.Tensor:
    """[b, s, n] -> [b, s, min(k, n)] int64 entry indices ascending, -1 where the score is -inf
    (``kernels.index_topk``: exact ties to the lower index)."""
    return kernels.index_topk(score, k, impl=impl)


def entry_blocks(group: torch.Tensor, seg: torch.Tensor, *, cfg: Config) -> torch.Tensor:
    """group, seg [b, n] int64 (each entry's index inside its sample, its sample's start) -> the candidate block
    id of every compressed entry [b, n] int64: ``candidate_block_size`` consecutive groups
    of one sample (group = entry index inside its sample), numbered along the row. For a plain row
    this is ``j // candidate_block_size``; in packed rows blocks never straddle two samples."""
    B = cfg.candidate_block_size
    new = (group % B == 0)
    new[:, 1:] |= seg[:, 1:] != seg[:, :-1]
    new[:, :1] = True
    return new.long().cumsum(1) - 1


def candidate_mask(score: torch.Tensor, visible, blocks: torch.Tensor, *, cfg: Config,
                   n_blocks: int | None = None, impl: str | None = None) -> torch.Tensor:
    """Level-1 selection: [b, s, n] scores -> [b, s, n] bool mask of entries in the chosen blocks
    (``kernels.index_candidates``).

    visible = (lo, hi) [b, s]; blocks [b, n]: block id of each entry (``entry_blocks``), or the int block
    size on plain rows (block of entry j = j // size: what ``entry_blocks`` gives there); ``n_blocks``:
    how many there are, when the caller knows it without reading the tensor (plain rows:
    ceil(n / block size); no host sync). Block score = max of its entries' scores (-inf where none is
    visible); the block of the query's newest visible entry is forced in; the top
    ``candidate_topk_blocks`` blocks with a finite score are kept.
    """
    n = score.shape[-1]
    lo, hi = visible
    if n == 0:
        return torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    if n_blocks is not None:
        nb = n_blocks
    else:
        nb = -(-n // blocks) if isinstance(blocks, int) else int(blocks.max()) + 1
    return kernels.index_candidates(score, lo, hi, blocks, nb, cfg.candidate_topk_blocks, impl=impl)
