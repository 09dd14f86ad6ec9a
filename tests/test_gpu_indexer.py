"""TileLang lightning indexer (scoring + mask, top-k, candidates, score gradients) against the torch reference
(SPEC §5, §10; issue #7 item 2). GPU only. Scores: cosine diff < 1e-4, almost all within 1 bf16 ulp, -inf exactly
where the reference has -inf. Top-k and candidate masks: EXACT (integer outputs) on the reference's own scores.
"""
import pytest
import torch

from functional_dsv41 import kernels as K

from conftest import cosine_diff
from gpu_common import DEV, close_bf16, need_tilelang

pytestmark = pytest.mark.gpu


def _inputs(b, s, n, H, D, ratio=4, seed=0, packed=False):
    """q, k, w as the model builds them (bf16; w ~ 1/64 scale) and causal [lo, hi) ranges: query t sees
    entries [0, (t+1)//ratio) (packed: the second half of each row is a new sample)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, s, H, D, device=DEV, generator=g).bfloat16()
    k = torch.randn(b, n, D, device=DEV, generator=g).bfloat16()
    w = (torch.randn(b, s, H, device=DEV, generator=g) / 64).bfloat16()
    t = torch.arange(s, device=DEV)
    hi = ((t + 1) // ratio).clamp(max=n).expand(b, s).clone()
    lo = torch.zeros_like(hi)
    if packed:
        half = s // 2
        lo[:, half:] = (half + 1) // ratio
        hi[:, half:] = ((t[half:] + 1) // ratio).clamp(max=n)
    return q, k, w, lo, hi


SCORE_SHAPES = [  # b, s, n, H, D
    (1, 64, 16, 32, 128),
    (2, 37, 300, 32, 128),          # query tail (not a multiple of BQ), entry tail (not of BN)
    (1, 4096, 1024, 32, 128),       # release: 4096 queries, ratio 4
    (2, 50, 200, 16, 64),
    (2, 128, 128, 16, 32),          # tests/test_gpu_train.py's model: 16 heads of 32
]


def _check_scores(out, ref):
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref)), "-inf pattern differs"
    fin = torch.isfinite(ref)
    assert torch.isfinite(out[fin]).all()
    if fin.any():
        o, r = out[fin].float(), ref[fin].float()
        assert cosine_diff(o, r) < 1e-4
        nbad, mx = close_bf16(o, r, ulps=2)          # ~1 bf16 ulp (2^-8 relative per unit)
        print(f"scores: {nbad} of {o.numel()} beyond ~1 ulp, max abs diff {mx:.3g}, cosine diff {cosine_diff(o, r):.2e}")
        assert nbad <= max(2, o.numel() * 1e-2), (nbad, o.numel(), mx)


@pytest.mark.parametrize("shape", SCORE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_index_scores(shape):
    need_tilelang()
    b, s, n, H, D = shape
    q, k, w, lo, hi = _inputs(b, s, n, H, D, packed=b > 1)
    lo[0, 0], hi[0, 0] = 5, 3                                  # an empty row (nothing visible)
    out = K.index_scores(q, k, w, lo, hi, impl="tilelang")
    ref = K.index_scores(q, k, w, lo, hi, impl="torch")
    _check_scores(out, ref)
    assert torch.isneginf(out[0, 0]).all()


def _long_inputs(b, s, n, H, D, seed=1):
    """Few queries on a long row (decode / chunked prefill at 16K-64K entries): ranges that start and end
    inside entry blocks and inside entry chunks, one query seeing everything, one an empty range."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, s, H, D, device=DEV, generator=g).bfloat16()
    k = torch.randn(b, n, D, device=DEV, generator=g).bfloat16()
    w = (torch.randn(b, s, H, device=DEV, generator=g) / 64).bfloat16()
    t = torch.arange(s, device=DEV)
    lo = ((t * 977) % (n // 3)).expand(b, s).clone()
    hi = (n - (t * 331) % (n // 4)).expand(b, s).clone()
    lo[:, 0], hi[:, 0] = 0, n
    if s > 1:
        lo[:, 1], hi[:, 1] = 7, 7
    return q, k, w, lo, hi


@pytest.mark.parametrize("bsn", [(1, 64, 16384), (1, 16, 65536), (2, 5, 3000)], ids=lambda s: "x".join(map(str, s)))
def test_index_scores_long_rows(bsn):
    """Few queries x many entries: the entry-chunked grid (chunks > 1) with the pipelined K loads."""
    need_tilelang()
    b, s, n = bsn
    q, k, w, lo, hi = _long_inputs(b, s, n, 32, 128)
    out = K.index_scores(q, k, w, lo, hi, impl="tilelang")
    ref = K.index_scores(q, k, w, lo, hi, impl="torch")
    _check_scores(out, ref)


# the configurations kernels/bench.py sweeps (plus forced entry chunks), each checked against the reference
SCORE_CFGS = [dict(BQ=4, BN=128, stages=0), dict(BQ=4, BN=64, stages=2), dict(BQ=2, BN=128, stages=2),
              dict(BQ=8, BN=64, stages=2), dict(BQ=4, BN=128, stages=3), dict(chunks=3), dict(chunks=1),
              dict(hsum="gemm"), dict(hsum="gemm", BQ=8, BN=64), dict(hsum="gemm", chunks=3)]


@pytest.mark.parametrize("cfg", SCORE_CFGS, ids=lambda c: ",".join(f"{a}={v}" for a, v in c.items()))
def test_index_scores_cfgs(cfg):
    need_tilelang()
    from functional_dsv41.kernels.tilelang import indexer_tl
    for (b, s, n, long) in ((2, 37, 300, False), (1, 16, 8192, True)):
        q, k, w, lo, hi = (_long_inputs(b, s, n, 32, 128) if long else _inputs(b, s, n, 32, 128, packed=True))
        out = indexer_tl._score_fwd(q, k, w, lo, hi, cfg=cfg)
        _check_scores(out, K.index_scores(q, k, w, lo, hi, impl="torch"))
    cand = torch.rand(b, s, n, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3)) < 0.5
    _check_scores(indexer_tl._score_fwd(q, k, w, lo, hi, cand, cfg=cfg), K.index_scores(q, k, w, lo, hi, cand, impl="torch"))


def test_index_scores_candidates():
    need_tilelang()
    b, s, n, H, D = 2, 70, 260, 32, 128
    q, k, w, lo, hi = _inputs(b, s, n, H, D, ratio=1)
    cand = torch.rand(b, s, n, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3)) < 0.5
    out = K.index_scores(q, k, w, lo, hi, cand, impl="tilelang")
    ref = K.index_scores(q, k, w, lo, hi, cand, impl="torch")
    _check_scores(out, ref)


def _tied_scores(b, s, n, seed=0):
    """Scores with many exact ties, -0/+0, -inf holes, an all--inf row and a short visible prefix."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = (torch.randn(b, s, n, device=DEV, generator=g) * 4).round() / 4
    x = x.bfloat16()
    x[..., ::7] = -0.0
    x[..., 3::7] = 0.0
    x = x.masked_fill(torch.rand(b, s, n, device=DEV, generator=g) < 0.2, float("-inf"))
    x[0, 0] = float("-inf")
    x[0, 1, 10:] = float("-inf")
    return x


@pytest.mark.parametrize("bsn", [(1, 64, 1024), (2, 33, 300), (1, 8, 5000), (1, 3, 65536), (1, 16, 100),
                                 (1, 300, 6000)],     # threads by rows and n: 256, 256, 1024, 1024, 256, 512
                         ids=lambda s: "x".join(map(str, s)))
def test_index_topk_exact(bsn):
    need_tilelang()
    from functional_dsv41.kernels.tilelang import index_topk_tl
    x = _tied_scores(*bsn)
    for k in (512, 64):
        out = K.index_topk(x, k, impl="tilelang")
        ref = K.index_topk(x, k, impl="torch")
        assert out.dtype == torch.int64 and out.shape == ref.shape
        assert torch.equal(out, ref)
        for agg in (False, True):           # both histogram variants, whatever TOPK_AGG says
            assert torch.equal(index_topk_tl.index_topk(x, k, agg=agg), ref), agg


def test_index_topk_on_reference_scores_release():
    """Top-k of the release shape's own scores (bf16 ties between near-equal scores)."""
    need_tilelang()
    q, k, w, lo, hi = _inputs(1, 4096, 1024, 32, 128, seed=5)
    from functional_dsv41.kernels.tilelang import index_topk_tl
    ref_scores = K.index_scores(q, k, w, lo, hi, impl="torch")
    ref = K.index_topk(ref_scores, 512, impl="torch")
    assert torch.equal(K.index_topk(ref_scores, 512, impl="tilelang"), ref)
    for agg in (False, True):
        for th in (256, 512, 1024):             # every count the bench sweeps
            assert torch.equal(index_topk_tl.index_topk(ref_scores, 512, threads=th, agg=agg), ref), (agg, th)


@pytest.mark.parametrize("bsn", [(2, 40, 333), (1, 16, 20000)], ids=lambda s: "x".join(map(str, s)))
def test_index_candidates_exact(bsn):
    """Plain rows (int block size, the kernel path) against the reference with entry_blocks' tensor:
    ties, -0/+0, -inf holes, empty rows; n = 20000 has 2500 blocks, so 2048 is a real selection."""
    need_tilelang()
    b, s, n = bsn
    x = _tied_scores(b, s, n, seed=7)
    t = torch.arange(s, device=DEV)
    hi = (t * n // s).expand(b, s).contiguous()
    lo = (hi // 3).contiguous()
    blocks = (torch.arange(n, device=DEV) // 8).expand(b, n).contiguous()
    nb = -(-n // 8)
    for tb in (3, 16, 2048):
        out = K.index_candidates(x, lo, hi, 8, nb, tb, impl="tilelang")
        ref = K.index_candidates(x, lo, hi, blocks, nb, tb, impl="torch")
        assert torch.equal(out, ref), tb


def _packed_blocks(b, n, B, cuts):
    """Block ids as ``indexer.entry_blocks`` numbers them on packed rows: B entries of one sample per block,
    a new block at every sample start (cuts: sample starts inside the row)."""
    j = torch.arange(n, device=DEV)
    seg = sum((j >= c).long() for c in cuts)
    start = torch.zeros_like(j)
    for c in cuts:
        start = torch.where(j >= c, c, start)
    group = j - start
    new = group % B == 0
    new[1:] |= seg[1:] != seg[:-1]
    new[0] = True
    return (new.long().cumsum(0) - 1).expand(b, n).contiguous()


@pytest.mark.parametrize("bsn", [(2, 40, 333), (1, 16, 20000)], ids=lambda s: "x".join(map(str, s)))
def test_index_candidates_packed_exact(bsn):
    """Packed rows (a [b, n] block-id tensor, blocks restart at each sample): scatter block maxima + the
    top-k kernel, exactly the reference (ties, -0/+0, -inf holes, empty rows, a real 2048-of-many pick)."""
    need_tilelang()
    b, s, n = bsn
    x = _tied_scores(b, s, n, seed=8)
    blocks = _packed_blocks(b, n, 8, (n // 3 + 5, n // 2 + 1))
    nb = int(blocks.max()) + 1
    t = torch.arange(s, device=DEV)
    hi = (t * n // s).expand(b, s).contiguous()
    lo = torch.where(hi > n // 3 + 5, n // 3 + 5, 0).expand(b, s).contiguous()
    for tb in (3, 16, 2048):
        out = K.index_candidates(x, lo, hi, blocks, nb, tb, impl="tilelang")
        ref = K.index_candidates(x, lo, hi, blocks, nb, tb, impl="torch")
        assert torch.equal(out, ref), tb


@pytest.mark.parametrize("shape", [(2, 37, 300, 32, 128), (1, 512, 128, 32, 128), (2, 128, 128, 16, 32)],
                         ids=lambda s: "x".join(map(str, s)))
def test_index_scores_backward(shape):
    """dq, dk, dw vs autograd of the reference (the upstream gradient is zero where the scores are -inf)."""
    need_tilelang()
    b, s, n, H, D = shape
    q, k, w, lo, hi = _inputs(b, s, n, H, D, ratio=2)
    dI = torch.randn(b, s, n, device=DEV).bfloat16()
    grads = []
    for impl in ("tilelang", "torch"):
        qq, kk, ww = (t.clone().requires_grad_(True) for t in (q, k, w))
        out = K.index_scores(qq, kk, ww, lo, hi, impl=impl)
        grads.append(torch.autograd.grad(out, (qq, kk, ww), dI.masked_fill(torch.isneginf(out), 0)))
    for a, r in zip(*grads):
        print(f"grad cosine diff {cosine_diff(a, r):.2e}")
        assert cosine_diff(a, r) < 1e-4


def _grads(q, k, w, lo, hi, cand, dI, impl, cfg=None):
    from functional_dsv41.kernels.tilelang import indexer_tl
    qq, kk, ww = (t.clone().requires_grad_(True) for t in (q, k, w))
    if impl == "cfg":
        old = dict(indexer_tl.BWD_CFG)
        indexer_tl.BWD_CFG.update(cfg)
        try:
            out = K.index_scores(qq, kk, ww, lo, hi, cand, impl="tilelang")
            return torch.autograd.grad(out, (qq, kk, ww), dI)
        finally:
            indexer_tl.BWD_CFG.clear()
            indexer_tl.BWD_CFG.update(old)
    out = K.index_scores(qq, kk, ww, lo, hi, cand, impl=impl)
    return torch.autograd.grad(out, (qq, kk, ww), dI)


@pytest.mark.parametrize("bsn", [(1, 64, 16384), (1, 16, 65536)], ids=lambda s: "x".join(map(str, s)))
def test_index_scores_backward_long_rows(bsn):
    """Few queries x many entries: the dq / dw kernel split over entry chunks (fp32 atomics)."""
    need_tilelang()
    b, s, n = bsn
    q, k, w, lo, hi = _long_inputs(b, s, n, 32, 128)
    dI = torch.randn(b, s, n, device=DEV).bfloat16()
    got, ref = (_grads(q, k, w, lo, hi, None, dI, impl) for impl in ("tilelang", "torch"))
    for a, r in zip(got, ref):
        print(f"grad cosine diff {cosine_diff(a, r):.2e}")
        assert torch.isfinite(a.float()).all()
        assert cosine_diff(a, r) < 1e-4


BWD_CFGS = [dict(stages=0), dict(stages=2, chunks=3), dict(stages=0, chunks=5), dict(chunks=1), dict(BNk=64)]


@pytest.mark.parametrize("cfg", BWD_CFGS, ids=lambda c: ",".join(f"{a}={v}" for a, v in c.items()))
def test_index_scores_backward_cfgs(cfg):
    """The backward variants the bench sweeps, with and without candidates (forced chunks on short rows
    too: query tails, entry tails and chunks that miss every range)."""
    need_tilelang()
    for (b, s, n, long) in ((2, 37, 300, False), (1, 16, 8192, True)):
        q, k, w, lo, hi = (_long_inputs(b, s, n, 32, 128) if long else _inputs(b, s, n, 32, 128, ratio=2, packed=True))
        dI = torch.randn(b, s, n, device=DEV).bfloat16()
        for cand in (None, torch.rand(b, s, n, device=DEV) < 0.5):
            got, ref = (_grads(q, k, w, lo, hi, cand, dI, impl, cfg) for impl in ("cfg", "torch"))
            for a, r in zip(got, ref):
                assert torch.isfinite(a.float()).all()
                assert cosine_diff(a, r) < 1e-4, (cfg, long, cand is None)


def test_index_scores_backward_candidates():
    need_tilelang()
    b, s, n, H, D = 2, 70, 260, 32, 128
    q, k, w, lo, hi = _inputs(b, s, n, H, D, ratio=1)
    cand = torch.rand(b, s, n, device=DEV, generator=torch.Generator(device=DEV).manual_seed(4)) < 0.5
    dI = torch.randn(b, s, n, device=DEV).bfloat16()
    grads = []
    for impl in ("tilelang", "torch"):
        qq, kk, ww = (t.clone().requires_grad_(True) for t in (q, k, w))
        out = K.index_scores(qq, kk, ww, lo, hi, cand, impl=impl)
        grads.append(torch.autograd.grad(out, (qq, kk, ww), dI))      # dI where -inf: must be ignored
    for a, r in zip(*grads):
        assert torch.isfinite(a.float()).all()
        assert cosine_diff(a, r) < 1e-4


def test_index_scores_func_grad():
    need_tilelang()
    q, k, w, lo, hi = _inputs(1, 40, 64, 32, 128, ratio=1)
    dI = torch.randn(1, 40, 64, device=DEV)

    def loss(q_, impl):
        out = K.index_scores(q_, k, w, lo, hi, impl=impl).float()
        return torch.where(torch.isfinite(out), out * dI, 0).sum()
    g1 = torch.func.grad(lambda x: loss(x, "tilelang"))(q)
    g2 = torch.func.grad(lambda x: loss(x, "torch"))(q)
    assert cosine_diff(g1, g2) < 1e-4


def test_auto_picks_tilelang():
    need_tilelang()
    from functional_dsv41.kernels.tilelang import index_topk_tl, indexer_tl
    assert K.resolve("index_scores", "auto", on_cuda=True) is indexer_tl.index_scores
    for op in ("index_topk", "index_candidates"):
        assert K.resolve(op, "auto", on_cuda=True) is getattr(index_topk_tl, op)
