"""The indexer's kernel ops (kernels.index_scores / index_topk / index_candidates, torch reference) on CPU:
bit-identical to the model code they replaced (kept below as ``_old_*``), visibility as a [lo, hi) range
equal to the old boolean mask on plain, chunked (history) and packed rows, ties and empty rows."""
import pytest
import torch

from functional_dsv41 import kernels as K
from functional_dsv41.state import BIG
from functional_dsv41.config import Config
from functional_dsv41.indexer import entry_blocks, visible_range
from functional_dsv41.kernels import reference_indexer as R


# ----------------------------------------------------------------------------- the replaced model code
def _old_scores(q, keys, w, visible):
    score = torch.einsum("bshd,bnd->bshn", q, keys)
    score = (score.relu() * w.unsqueeze(-1)).sum(2)
    return score.masked_fill(~visible, float("-inf"))


def _old_select_topk(score, k):
    n = score.shape[-1]
    k = min(k, n)
    if k == 0:
        return score.new_zeros(score.shape[:-1] + (0,), dtype=torch.int64)
    top = R.topk_first(score, k)
    idx = torch.where(torch.isneginf(top.values), n, top.indices)
    idx = idx.sort(-1).values
    return torch.where(idx == n, -1, idx)


def _old_candidate_mask(score, visible, blocks, topk_blocks, nb):
    b, s, n = score.shape
    idx = blocks[:, None, :].expand(b, s, n)
    block = torch.full((b, s, nb), float("-inf"))
    block = block.scatter_reduce(-1, idx, score.float(), reduce="amax", include_self=True)
    ar = torch.arange(n)
    newest = torch.where(visible, ar, -1).amax(-1)
    has = newest >= 0
    forced_block = blocks.gather(1, newest.clamp_min(0))
    forced = torch.nn.functional.one_hot(forced_block, nb).bool() & has[..., None]
    block = block.masked_fill(forced, float("inf"))
    kb = min(topk_blocks, nb)
    top = R.topk_first(block, kb)
    keep = torch.zeros(b, s, nb, dtype=torch.bool)
    keep = keep.scatter(-1, top.indices, ~torch.isneginf(top.values))
    return keep.gather(-1, idx)


def _old_visible(end, seg, pos_abs, seg_start):
    return (end[:, None, :] <= pos_abs[None, :, None]) & (seg[:, None, :] == seg_start[:, :, None])


# ----------------------------------------------------------------------------- entry layouts
def _packed_layout(lengths_per_row, r, start=0, hist=0):
    """end/seg/group of the entries and pos_abs/seg_start of the queries, as compressor.compress and
    attention._compress_and_publish build them (history of ``hist`` entries before a chunk at ``start``)."""
    b = len(lengths_per_row)
    s = sum(lengths_per_row[0])
    ends, segs, groups, seg_start = [], [], [], []
    for lens in lengths_per_row:
        assert sum(lens) == s
        e, sg, gr, ss, p0 = [], [], [], [], start
        for L in lens:
            for i in range(L):
                ss.append(p0 if start == 0 else 0)
                if (i + (start if start else 0)) % r == r - 1 if start else i % r == r - 1:
                    e.append(p0 + i)
                    sg.append(p0 if start == 0 else 0)
                    gr.append((i + start) // r if start else i // r)
            p0 += L
        ends.append(e), segs.append(sg), groups.append(gr), seg_start.append(ss)
    n = max(len(e) for e in ends)
    end = torch.full((b, n), BIG, dtype=torch.int64)
    seg = torch.zeros(b, n, dtype=torch.int64)
    group = torch.zeros(b, n, dtype=torch.int64)
    for i in range(b):
        m = len(ends[i])
        end[i, :m], seg[i, :m], group[i, :m] = torch.tensor(ends[i]), torch.tensor(segs[i]), torch.tensor(groups[i])
        if m < n:
            seg[i, m:] = torch.tensor(segs[i][-1:] * (n - m))
    if hist:
        h = torch.arange(hist)
        end = torch.cat([(h * r + r - 1).expand(b, hist), end], 1)
        seg = torch.cat([torch.zeros(b, hist, dtype=torch.int64), seg], 1)
        group = torch.cat([h.expand(b, hist), group], 1)
    pos_abs = start + torch.arange(s)
    return end, seg, group, pos_abs, torch.tensor(seg_start)


LAYOUTS = {
    "plain_r2": ([[37]], 2, 0, 0),
    "plain_r1_b2": ([[20], [20]], 1, 0, 0),
    "packed_r2": ([[9, 14, 6], [3, 20, 6]], 2, 0, 0),
    "packed_r1": ([[5, 1, 10], [16]], 1, 0, 0),
    "chunk_with_history": ([[11]], 2, 24, 12),
    "decode_step": ([[1]], 2, 31, 15),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_visible_range_equals_old_mask(name):
    lens, r, start, hist = LAYOUTS[name]
    end, seg, _, pos_abs, seg_start = _packed_layout(lens, r, start, hist)
    lo, hi = visible_range(end, pos_abs, seg_start)
    old = _old_visible(end, seg, pos_abs, seg_start)
    assert torch.equal(R.range_mask(lo, hi, end.shape[1]), old)


def _qkw(b, s, n, Hi=8, Di=32, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, Hi, Di, generator=g).bfloat16()
    k = torch.randn(b, n, Di, generator=g).bfloat16()
    w = (torch.randn(b, s, Hi, generator=g) / 16).bfloat16()
    if ties:   # coarse values: many exactly equal scores (and zeros from the ReLU)
        q = (q * 2).round().clamp(-2, 2) / 2
        k = (k * 2).round().clamp(-2, 2) / 2
        w = (w.float().sign() / 8).bfloat16()
    return q, k, w


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("ties", [False, True])
def test_ops_equal_old_model_code(name, ties):
    lens, r, start, hist = LAYOUTS[name]
    end, seg, group, pos_abs, seg_start = _packed_layout(lens, r, start, hist)
    b, n = end.shape
    s = pos_abs.shape[0]
    cfg = Config.tiny()
    lo, hi = visible_range(end, pos_abs, seg_start)
    visible = _old_visible(end, seg, pos_abs, seg_start)
    q, k, w = _qkw(b, s, n, seed=len(name), ties=ties)

    score = K.index_scores(q, k, w, lo, hi, impl="torch")
    old = _old_scores(q, k, w, visible)
    assert torch.equal(score.view(torch.int16), old.view(torch.int16))

    for kk in (1, 4, 7, 512):
        assert torch.equal(K.index_topk(score, kk, impl="torch"), _old_select_topk(old, kk))

    blocks = entry_blocks(group, seg, cfg=cfg)
    nb = int(blocks.max()) + 1
    for tb in (1, 2, 3, 100):
        cand = K.index_candidates(score, lo, hi, blocks, nb, tb, impl="torch")
        assert torch.equal(cand, _old_candidate_mask(old, visible, blocks, tb, nb))
        # level 2: candidates folded into the scoring op = masking the scores afterwards
        s2 = K.index_scores(q, k, w, lo, hi, cand, impl="torch")
        assert torch.equal(s2.view(torch.int16), old.masked_fill(~cand, float("-inf")).view(torch.int16))


def test_topk_ties_empty_rows_and_short_rows():
    x = torch.tensor([[1.0, 2.0, 2.0, -0.0, 0.0, 2.0, float("-inf"), 1.0]]).bfloat16()[None]
    assert K.index_topk(x, 3, impl="torch").tolist() == [[[1, 2, 5]]]
    # ties across the k boundary: the lower index wins (at k = 3, 5, 7 no tie straddles it)
    assert K.index_topk(x, 2, impl="torch").tolist() == [[[1, 2]]]                 # three 2.0s, two places
    assert K.index_topk(x, 4, impl="torch").tolist() == [[[0, 1, 2, 5]]]           # two 1.0s, one place
    assert K.index_topk(x, 6, impl="torch").tolist() == [[[0, 1, 2, 3, 5, 7]]]     # -0 and +0, one place
    assert K.index_topk(x, 5, impl="torch").tolist() == [[[0, 1, 2, 5, 7]]]
    assert K.index_topk(x, 7, impl="torch").tolist() == [[[0, 1, 2, 3, 4, 5, 7]]]       # -0 and +0 tie
    assert K.index_topk(x, 16, impl="torch").tolist() == [[[0, 1, 2, 3, 4, 5, 7, -1]]]  # n < k, -inf -> -1
    empty = torch.full((1, 2, 5), float("-inf")).bfloat16()
    assert (K.index_topk(empty, 3, impl="torch") == -1).all()
    assert K.index_topk(empty[..., :0], 3, impl="torch").shape == (1, 2, 0)


def test_scores_gradient_matches_old_code():
    """The op is differentiable like the code it replaced (fp32 model for gradient checks)."""
    end, seg, _, pos_abs, seg_start = _packed_layout([[9, 14, 6]], 2)
    lo, hi = visible_range(end, pos_abs, seg_start)
    visible = _old_visible(end, seg, pos_abs, seg_start)
    q, k, w = (t.float().requires_grad_() for t in _qkw(1, 29, end.shape[1]))
    g = torch.randn(1, 29, end.shape[1])
    new = K.index_scores(q, k, w, lo, hi, impl="torch")
    old = _old_scores(q, k, w, visible)
    g1 = torch.autograd.grad(new, (q, k, w), g.masked_fill(~visible, 0))
    g2 = torch.autograd.grad(old, (q, k, w), g.masked_fill(~visible, 0))
    for a, c in zip(g1, g2):
        assert torch.equal(a, c)


def test_candidates_int_block_size_is_plain_rows():
    """blocks as an int block size (plain rows, what the model passes) = entry_blocks' tensor there."""
    cfg = Config.tiny(candidate_block_size=4)
    end, seg, group, pos_abs, seg_start = _packed_layout([[41], [41]], 1)
    lo, hi = visible_range(end, pos_abs, seg_start)
    q, k, w = _qkw(2, 41, end.shape[1], seed=9, ties=True)
    score = K.index_scores(q, k, w, lo, hi, impl="torch")
    blocks = entry_blocks(group, seg, cfg=cfg)
    assert torch.equal(blocks, (torch.arange(end.shape[1]) // 4).expand_as(blocks))
    nb = -(-end.shape[1] // 4)
    for tb in (1, 3, 16):
        assert torch.equal(K.index_candidates(score, lo, hi, 4, nb, tb, impl="torch"),
                           K.index_candidates(score, lo, hi, blocks, nb, tb, impl="torch"))
