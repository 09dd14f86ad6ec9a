"""Torch reference of the lightning indexer's kernels (SPEC §5, §10): scoring, level-1 candidate
blocks, top-k. The executable spec that ``kernels/tilelang/indexer_tl.py`` (scores) and
``index_topk_tl.py`` (top-k, candidates) are tested against; the model (``functional_dsv41.indexer``)
calls these through ``kernels.<op>``.

Visibility is a per-query half-open range of entries ``[lo, hi)``: entries are stored in position
order along the row and a query sees exactly the completed entries of its own sample, i.e. every
entry whose end position lies in ``[sample start, query position]`` — a contiguous run (prefill,
chunked prefill with history, decode, packed rows alike; ``indexer.visible_range``).

Shape legend: b batch, s queries, n compressed entries, Hi index heads, Di index head dim,
nb candidate blocks, k top-k.
"""
from __future__ import annotations

import torch


def range_mask(lo: torch.Tensor, hi: torch.Tensor, n: int) -> torch.Tensor:
    """[b, s] lo, hi -> [b, s, n] bool: lo <= j < hi."""
    j = torch.arange(n, device=lo.device)
    return (j >= lo[..., None]) & (j < hi[..., None])


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 cand: torch.Tensor | None = None) -> torch.Tensor:
    """I[b, t, j] = sum_h w[b, t, h] * ReLU(q[b, t, h] . k[b, j]), -inf outside [lo, hi) and outside cand.

    q [b, s, Hi, Di], k [b, n, Di], w [b, s, Hi] (bf16 in the model; fp32 for gradient checks),
    lo, hi [b, s] int, cand [b, s, n] bool or None. Returns [b, s, n] in the promoted dtype of q and w (bf16 in
    the model, where both are bf16).

    Numerics are the release's bf16 einsum chain, op for op: each per-head dot product (fp32
    accumulate) rounded to bf16, ReLU, the product with w rounded to bf16, then the sum over heads
    (torch's bf16 sum: fp32 accumulate, one rounding). Differentiable (masked entries get no gradient).
    """
    score = torch.einsum("bshd,bnd->bshn", q, k)
    score = (score.relu() * w.unsqueeze(-1)).sum(2)                              # [b, s, n]
    vis = range_mask(lo, hi, k.shape[1])
    if cand is not None:
        vis = vis & cand
    return score.masked_fill(~vis, float("-inf"))


def topk_first(x: torch.Tensor, k: int):
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


def index_topk(score: torch.Tensor, k: int) -> torch.Tensor:
    """[b, s, n] scores -> [b, s, min(k, n)] int64 entry ids ascending, -1 (at the end) for entries
    whose score is -inf. The set is the k largest with exact ties broken towards the lower index
    (``topk_first``), so the result does not depend on padding or on the row length."""
    n = score.shape[-1]
    k = min(k, n)
    if k == 0:
        return score.new_zeros(score.shape[:-1] + (0,), dtype=torch.int64)
    top = topk_first(score, k)
    idx = torch.where(torch.isneginf(top.values), n, top.indices)
    idx = idx.sort(-1).values
    return torch.where(idx == n, -1, idx)


def index_candidates(score: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, blocks: torch.Tensor,
                     n_blocks: int, topk_blocks: int) -> torch.Tensor:
    """Level-1 selection: [b, s, n] scores -> [b, s, n] bool mask of the entries in the chosen blocks.

    blocks [b, n] int64: block id of each entry (``indexer.entry_blocks``), or an int block size for
    plain rows (block of entry j = j // size); n_blocks: how many ids there are. Block score = max of its entries' scores (fp32; -inf
    where none is visible); the block of the query's newest visible entry (hi - 1, when hi > lo) is
    forced in (+inf); the top ``topk_blocks`` blocks with a finite score are kept (ties to the lower
    block id, ``topk_first``).
    """
    b, s, n = score.shape
    if n == 0:
        return torch.zeros(b, s, 0, dtype=torch.bool, device=score.device)
    if isinstance(blocks, int):
        blocks = (torch.arange(n, device=score.device) // blocks).expand(b, n)
    nb = n_blocks
    idx = blocks[:, None, :].expand(b, s, n)
    block = torch.full((b, s, nb), float("-inf"), device=score.device)
    block = block.scatter_reduce(-1, idx, score.float(), reduce="amax", include_self=True)   # [b, s, nb]
    has = hi > lo
    newest = torch.where(has, hi - 1, 0)                                          # [b, s] newest visible entry
    forced_block = blocks.gather(1, newest)                                       # [b, s]
    forced = torch.nn.functional.one_hot(forced_block, nb).bool() & has[..., None]
    block = block.masked_fill(forced, float("inf"))
    kb = min(topk_blocks, nb)
    top = topk_first(block, kb)
    keep = torch.zeros(b, s, nb, dtype=torch.bool, device=score.device)
    keep = keep.scatter(-1, top.indices, ~torch.isneginf(top.values))
    return keep.gather(-1, idx)
