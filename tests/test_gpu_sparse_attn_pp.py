"""The ping-pong sparse-attention forward (``sparse_attn_pp_tl.fwd_kernel_pp``, the default's kernel) beyond the
impl tests of test_gpu_sparse_attn.py: its options on one CTA a query and the persistent grid (each the same bits
as the plain kernel), the lazy max, the trace and ablation variants, its option checks; and its 2-CTA cluster
variant (``sparse_attn_cl_tl``). GPU only: tests/conftest.py skips them without CUDA.
"""
import pytest
import torch

from conftest import cosine_diff
from gpu_common import DEV, attn_inputs as _attn_inputs, check_fwd_out as _check_fwd_out, lse_ref as _lse_ref
from gpu_common import need_tilelang as _need_tilelang

pytestmark = pytest.mark.gpu


# fwd_kernel_pp (the ping-pong forward) beyond the impl tests: one pair of blocks, many pairs, D = 256 with odd M,
# and hole patterns that empty a consumer's whole block (its max stays at the previous one) or a whole pair
PP_SHAPES = [(2, 64, 64, 512, 700, 128), (1, 48, 64, 512, 3000, 1280), (3, 37, 64, 256, 333, 256)]


def _pp_inputs(shape, seed=14):
    """test_sparse_attn_fwd_pp's operands: random, with hole patterns that empty a consumer's whole block (its max
    stays at the previous one) or a whole pair."""
    B, M, H, D, N, T = shape
    q, kv, sink, idx = _attn_inputs(*shape, seed=seed)
    idx[-1, 1, :100] = -1                              # a leading run of holes (max from -1e30)
    idx[0, 3, 64:128] = -1                             # consumer 1's block of the first pair all holes
    idx[0, 5, :64] = -1                                # consumer 0's first block all holes
    if T >= 256:
        idx[-1, 7, 128:256] = -1                       # a whole pair of holes mid-row
    return q, kv, sink, idx


@pytest.mark.parametrize("shape", PP_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sparse_attn_fwd_pp(shape):
    _need_tilelang()
    from functional_dsv41.kernels.tilelang.sparse_attn_pp_tl import fwd_kernel_pp
    B, M, H, D, N, T = shape
    q, kv, sink, idx = _pp_inputs(shape)
    scale = D ** -0.5
    o, lse = fwd_kernel_pp(H, D, T, scale)(q, kv, sink.float(), idx)
    _check_fwd_out(o, lse, q, kv, sink, idx, scale, 64, "pp")
    for _ in range(3):                                 # repeated launches: the same bits (no race between roles)
        o2, lse2 = fwd_kernel_pp(H, D, T, scale)(q, kv, sink.float(), idx)
        assert torch.equal(o2, o) and torch.equal(lse2, lse)


@pytest.mark.parametrize("boundary", ["default", "on"])
@pytest.mark.parametrize("T", [640, 1280])
def test_sparse_attn_fwd_default_persistent(T, boundary, monkeypatch):
    """The default forward takes pp's persistent grid (one CTA per SM) where there are more queries than SMs, with
    FWD_PP_BOUNDARY's options (as set, and with FWD_PP_BOUNDARY_ON: late_s0, and o_in_p where it fits: not beside
    two 1280-slot index rows), and gives the bits of one CTA a query."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import sparse_attn_pp_tl as pp
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    if boundary == "on":
        monkeypatch.setattr(sa, "FWD_PP_BOUNDARY", sa.FWD_PP_BOUNDARY_ON)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else sa.PP_SMS
    B, M, H, D, N = 1, sms + 9, 64, 512, 1500
    q, kv, sink, idx = _attn_inputs(B, M, H, D, N, T, seed=17)
    idx[0, 3, 64:128] = -1
    scale = D ** -0.5
    seen, real = [], pp.fwd_kernel_pp
    monkeypatch.setattr(pp, "fwd_kernel_pp", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    o, lse = sa._fwd(q, kv, sink, idx, scale)
    assert pp.pp_fits(H, D, T, ctas=sms, o_in_p=True) == (T == 640)
    want = dict(ctas=sms, **sa.FWD_PP_BOUNDARY)
    if want.get("o_in_p"):
        want["o_in_p"] = T == 640
    assert seen == [want]
    o0, lse0 = real(H, D, T, scale)(q, kv, sink.float(), idx)
    assert torch.equal(o, o0) and torch.equal(lse, lse0)
    seen.clear()
    sa._fwd(q[:, :sms], kv, sink, idx[:, :sms], scale)            # no more queries than SMs: one CTA a query
    assert seen == [dict(ctas=0)]


@pytest.mark.parametrize("opts", [{}, dict(late_s0=True), dict(late_s0=True, o_in_p=True),
                                  dict(late_s0=True, o_in_p=True, q_tma=True),
                                  dict(late_s0=True, o_in_p=True, s0_first=True),
                                  dict(late_s0=True, o_in_p=True, q_prefetch=True),
                                  dict(late_s0=True, o_in_p=True, q_late=True, q_prefetch=True)],
                         ids=["", "late_s0", "o_in_p", "q_tma", "s0_first", "q_prefetch", "q_late"])
@pytest.mark.parametrize("ctas", [7, 132])
@pytest.mark.parametrize("shape", PP_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sparse_attn_fwd_pp_persistent(shape, ctas, opts):
    """ctas > 0, a persistent grid: CTA c takes queries c, c + ctas, ... (rows of several batches in one CTA's run;
    132 CTAs outnumber the first shape's 128 queries, so some CTAs have none). The next query's Q and index row load
    during the current one's last pair, O is staged in a KV stage and consumer 0 issues the next query's first QK
    before its epilogue (``late_s0``: after issuing the O store, under its reads; ``o_in_p``: with most of O_L
    staged in the P buffers; ``q_tma``: Q by one TMA load, the index row still by cp.async, both behind bar_q;
    ``s0_first``: the next QK issued before stage 1's O piece is read; ``q_prefetch``: the next Q and index row
    prefetched into L2 a query ahead; ``q_late``: each Q loaded behind its query's first gathers); the
    arithmetic is the same, so the bits must be one-CTA-a-query's, launch after launch."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang.sparse_attn_pp_tl import fwd_kernel_pp
    from functional_dsv41.kernels.tilelang.sparse_attn_pp_tl import pp_fits
    B, M, H, D, N, T = shape
    if not pp_fits(H, D, T, ctas=ctas, **opts):
        with pytest.raises(ValueError, match="shared memory"):     # (o_in_p's extra piece beside two 1280-slot rows)
            fwd_kernel_pp(H, D, T, D ** -0.5, ctas=ctas, **opts)
        return
    q, kv, sink, idx = _pp_inputs(shape)
    scale = D ** -0.5
    o, lse = fwd_kernel_pp(H, D, T, scale)(q, kv, sink.float(), idx)
    for _ in range(3):
        o2, lse2 = fwd_kernel_pp(H, D, T, scale, ctas=ctas, **opts)(q, kv, sink.float(), idx)
        assert torch.equal(o2, o) and torch.equal(lse2, lse)


def _attn_fp64(q, kv, sink, idx, scale):
    """The exact forward in fp64: softmax over the valid slots and the sink (denominator only), all-hole rows 0."""
    B = q.shape[0]
    ix = idx.long()
    kv_t = kv[torch.arange(B, device=q.device)[:, None, None], ix.clamp_min(0)].double()      # [B, M, T, D]
    s = torch.einsum("bmhd,bmtd->bmht", q.double(), kv_t) * scale
    s = s.masked_fill((ix < 0)[:, :, None, :], float("-inf"))
    m = torch.maximum(s.amax(-1), sink.double())                                             # [B, M, H]
    p = torch.exp(s - m[..., None])
    return torch.einsum("bmht,bmtd->bmhd", p, kv_t) / (p.sum(-1) + torch.exp(sink.double() - m))[..., None]


@pytest.mark.parametrize("ramp", [False, True], ids=["random", "ramp"])
@pytest.mark.parametrize("shape", PP_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sparse_attn_fwd_pp_lazy(shape, ramp):
    """lazy = 8: a warp keeps its rows' running max until one would move by more than 8 (log2 units), so most O
    rescales are skipped. P is then rounded to bf16 under a stale max (<= 2^8), so even the largest probability,
    exactly 1 under the release's numerics, carries a rounding: the bits differ from the release's (not the 2-ulp
    match _check_fwd_out asks of the release numerics) but not the accuracy. Checked: cosine diff to the bf16
    reference < 1e-4 (DESIGN's bf16 bound), LSE within 1e-3, all-hole rows 0, and the error against the fp64
    softmax no worse than the release-numerics kernel's (mean within 1.25x, max within 2x). "ramp" scales the KV
    rows up along each (sorted) index row, so the maxima keep moving by more than 8 and the update path runs too.
    Persistent + lazy: the same bits as lazy alone."""
    _need_tilelang()
    from functional_dsv41.kernels import reference
    from functional_dsv41.kernels.tilelang.sparse_attn_pp_tl import fwd_kernel_pp
    B, M, H, D, N, T = shape
    q, kv, sink, idx = _pp_inputs(shape, seed=16)
    if ramp:
        kv = (kv.float() * (1 + 7 * torch.arange(N, device=DEV) / N)[:, None]).bfloat16()
        idx = torch.where(idx < 0, N, idx).sort(-1).values
        idx = torch.where(idx == N, -1, idx)
    scale = D ** -0.5
    o, lse = fwd_kernel_pp(H, D, T, scale, lazy=8.0)(q, kv, sink.float(), idx)
    o_rel, _ = fwd_kernel_pp(H, D, T, scale)(q, kv, sink.float(), idx)
    # (before the asserts: scripts/precompile_kernels.py builds the kernels a test reaches on zero outputs)
    o2, lse2 = fwd_kernel_pp(H, D, T, scale, ctas=132, lazy=8.0)(q, kv, sink.float(), idx)
    empty = (idx < 0).all(-1)
    assert torch.isfinite(o.float()).all() and (o[empty] == 0).all()
    cd = cosine_diff(o, reference.sparse_attn(q, kv, sink, idx, scale, 64))
    lerr = (lse - _lse_ref(q, kv, sink, idx, scale))[~empty].abs().max().item()
    exact = _attn_fp64(q, kv, sink, idx, scale)
    e_lazy, e_rel = (o.double() - exact).abs(), (o_rel.double() - exact).abs()
    print(f"LAZY {tuple(q.shape)} T={T} {'ramp' if ramp else 'random'}: cos diff {cd:.2e}, lse err {lerr:.2e}; "
          f"error vs fp64 mean {e_lazy.mean():.3e} / max {e_lazy.max():.3e}, release numerics' "
          f"{e_rel.mean():.3e} / {e_rel.max():.3e}")
    assert cd < 1e-4 and lerr < 1e-3
    assert e_lazy.mean() <= 1.25 * e_rel.mean() and e_lazy.max() <= 2 * e_rel.max()
    assert torch.equal(o2, o) and torch.equal(lse2, lse)


@pytest.mark.parametrize("ctas", [0, 3])
def test_sparse_attn_fwd_pp_trace(ctas):
    """diag="trace" (the bench's attntrace): the same O as the plain kernel, and each consumer's clock64 stamps in the
    LSE row increase in that consumer's program order (so every slot is written where the bench says it is); in a
    persistent grid each query's stamps in its own row, a CTA's next query after its previous one."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang.sparse_attn_pp_tl import fwd_kernel_pp
    B, M, H, D, N, T = 1, 8, 64, 512, 700, 640
    q, kv, sink, idx = _attn_inputs(B, M, H, D, N, T, seed=15)
    scale = D ** -0.5
    o, _ = fwd_kernel_pp(H, D, T, scale)(q, kv, sink.float(), idx)
    ot, st = fwd_kernel_pp(H, D, T, scale, diag="trace", ctas=ctas)(q, kv, sink.float(), idx)
    assert torch.equal(ot, o)
    if ctas:
        assert (st[0, ctas:, 2] > st[0, :-ctas, 62]).all()     # query n + ctas's S0 after query n's C0 epilogue
    st = st[0].double()                                # [M, 64] cycles since each CTA's start
    NP = T // 128
    c0, c1 = [], []
    for i in range(NP):
        b = 12 * i
        c0 += [b + 2, b + 3, b + 4, b + 0, b + 1] + ([b + 5, b + 6] if i < NP - 1 else [])
        c1 += [b + 7, b + 8, b + 9, b + 10, b + 11]
    for order in (c0 + [60, 12 * NP - 7, 12 * NP - 6, 62], c1 + [61, 63]):   # C0's epilogue: last pair's slots
        seq = st[:, order]
        assert (seq[:, 0] > 0).all() and (seq[:, 1:] > seq[:, :-1]).all(), order


def test_sparse_attn_fwd_pp_traceb():
    """diag="traceb" (the bench's attntraceb): the default path's persistent kernel gives the same O as without the
    stamps, and every query-boundary stamp (BOUNDARY_STAMPS) sits where its role's program order puts it."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    from functional_dsv41.kernels.tilelang.sparse_attn_pp_tl import fwd_kernel_pp
    B, M, H, D, N, T, G = 1, 12, 64, 512, 700, 640, 3
    q, kv, sink, idx = _attn_inputs(B, M, H, D, N, T, seed=16)
    scale = D ** -0.5
    kw = dict(ctas=G, **sa.FWD_PP_BOUNDARY)
    o, _ = fwd_kernel_pp(H, D, T, scale, **kw)(q, kv, sink.float(), idx)
    ot, st = fwd_kernel_pp(H, D, T, scale, diag="traceb", **kw)(q, kv, sink.float(), idx)
    assert torch.equal(ot, o)
    st = st[0].double()                                # [M, 64] cycles since each CTA's start
    b = lambda j: 12 + j                               # noqa: E731  (a boundary stamp's slot)
    e = 12 * (T // 128 - 1)                            # the last pair's slots
    orders = [                                         # each role's program order within a query's row
        [e + 4, 60, e + 5, e + 6, b(0), b(1), b(2), b(3), b(4), 62],     # C0, end of the query
        [61, b(5), b(6), 63],                                            # C1, end of the query
        [b(7), b(8), 7, 8],                                              # C1, start of the query
        [2, 3],                                                          # C0, start of the query
        [b(12), b(13), b(14), b(15), b(16), b(17), b(10), b(11)],        # the producer
    ]
    rows = st[G:M - G]                                 # the queries with a previous and a next one in their CTA
    for order in orders:
        seq = rows[:, order]
        assert (seq[:, 0] > 0).all() and (seq[:, 1:] > seq[:, :-1]).all(), order
    assert (rows[:, b(9)] > rows[:, 2]).all() and (rows[:, b(9)] < rows[:, 3]).all()   # C0's P0 waits the old O
    assert (st[G:, 2] > st[:-G, b(4)]).all() and (st[G:, 2] > st[:-G, 62]).all()   # S0: issued in row k, done
    assert (st[G:, b(7)] > st[:-G, 63]).all()         # C1's next query after its epilogue
    assert (st[G:, b(12)] > st[:-G, b(11)]).all()     # the next query's index row after its Q's load was issued


@pytest.mark.parametrize("ctas", [0, 7])
def test_sparse_attn_fwd_pp_diag_ablations(ctas):
    """The bench's ablations of the pp forward (attnbound, attndiag) run to the end, one CTA a query and persistent
    with the default path's options: "gather" (no compute: the consumers free each stage as it lands), "compute"
    (stale rows after the first pair), "nolatency" (stages signalled before their rows land), "smemwrite" (every
    stage half overwritten with zeros, nothing gathered), "smemwrite_quarter" (a quarter of each stage half
    overwritten, the rest uninitialised: its values are undefined, only that it ends is checked), "nosoftmax"
    (P = S, unnormalised: inf and NaN by design) and, persistent, "nostore" (O never stored); "compute" gives finite
    outputs (its values are meaningless by design), "smemwrite" O = 0 exactly (V = 0 in every stage: any half it
    failed to overwrite would show)."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang import sparse_attn_tl as sa
    from functional_dsv41.kernels.tilelang.sparse_attn_pp_tl import fwd_kernel_pp
    B, M, H, D, N, T = PP_SHAPES[0]
    q, kv, sink, idx = _pp_inputs(PP_SHAPES[0])
    opts = dict(ctas=ctas, **sa.FWD_PP_BOUNDARY) if ctas else {}
    for diag in ("gather", "compute", "nolatency", "smemwrite", "smemwrite_quarter", "nosoftmax") + (
            ("nostore",) if ctas else ()):
        o, lse = fwd_kernel_pp(H, D, T, D ** -0.5, diag=diag, **opts)(q, kv, sink.float(), idx)
        torch.cuda.synchronize()
        assert o.shape == q.shape and lse.shape == (B, M, H)
        if diag == "compute":
            assert torch.isfinite(o.float()).all()
        if diag == "smemwrite":
            assert (o == 0).all(), "diag='smemwrite' left gathered rows in a stage"


def test_sparse_attn_fwd_pp_option_errors():
    from functional_dsv41.kernels.tilelang import sparse_attn_pp_tl as pp
    with pytest.raises(ValueError, match="H must be 64"):
        pp.fwd_kernel_pp(32, 512, 640, 0.1)
    with pytest.raises(ValueError, match="multiple of 2\\*BI"):
        pp.fwd_kernel_pp(64, 512, 576, 0.1)
    with pytest.raises(ValueError, match="shared memory"):
        pp.fwd_kernel_pp(64, 512, 16 * 1024, 0.1)
    with pytest.raises(ValueError, match="504"):
        pp.fwd_kernel_pp(64, 512, 640, 0.1, nreg=(232, 72))
    with pytest.raises(ValueError, match="diag"):
        pp.fwd_kernel_pp(64, 512, 640, 0.1, diag="bogus")
    with pytest.raises(ValueError, match="trace"):
        pp.fwd_kernel_pp(64, 512, 1280, 0.1, diag="trace")
    with pytest.raises(ValueError, match="traceb"):
        pp.fwd_kernel_pp(64, 512, 640, 0.1, diag="traceb", ctas=4, late_s0=True)     # without o_in_p
    with pytest.raises(ValueError, match="traceb"):
        pp.fwd_kernel_pp(64, 512, 384, 0.1, diag="traceb", ctas=4, late_s0=True, o_in_p=True)
    with pytest.raises(ValueError, match="ctas"):
        pp.fwd_kernel_pp(64, 512, 640, 0.1, ctas=-1)
    with pytest.raises(ValueError, match="lazy"):
        pp.fwd_kernel_pp(64, 512, 640, 0.1, lazy=40.0)
    with pytest.raises(ValueError, match="late_s0"):
        pp.fwd_kernel_pp(64, 512, 640, 0.1, late_s0=True)
    with pytest.raises(ValueError, match="o_in_p"):
        pp.fwd_kernel_pp(64, 512, 640, 0.1, ctas=132, o_in_p=True)
    with pytest.raises(ValueError, match="q_tma"):
        pp.fwd_kernel_pp(64, 512, 640, 0.1, q_tma=True)
    with pytest.raises(ValueError, match="q_late"):
        pp.fwd_kernel_pp(64, 512, 640, 0.1, q_late=True)
    with pytest.raises(ValueError, match="q_prefetch"):
        pp.fwd_kernel_pp(64, 512, 640, 0.1, q_prefetch=True)
    with pytest.raises(ValueError, match="s0_first"):
        pp.fwd_kernel_pp(64, 512, 640, 0.1, ctas=4, late_s0=True, s0_first=True)     # without o_in_p
    assert pp.pp_fits(64, 512, 640) and not pp.pp_fits(64, 512, 576) and not pp.pp_fits(16, 128, 640)
    # the kernel's own option dict: o_in_p's extra piece fits beside two 640-slot index rows, not two 1280-slot ones
    on = dict(ctas=132, late_s0=True, o_in_p=True, lazy=8.0)
    assert pp.pp_fits(64, 512, 640, **on) and not pp.pp_fits(64, 512, 1280, **on)
    assert pp.pp_fits(64, 512, 1280, **dict(on, o_in_p=False))
    with pytest.raises(TypeError, match="late_s1"):
        pp.pp_fits(64, 512, 640, late_s1=True)


CL_SHAPES = PP_SHAPES + [(3, 37, 64, 256, 333, 64)]      # + one block a query (the epilogue right after the first)


@pytest.mark.parametrize("ctas", [4, 132])
@pytest.mark.parametrize("shape", CL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sparse_attn_fwd_cl(shape, ctas):
    """fwd_kernel_cl (2-CTA clusters splitting D, two queries an SM) against the reference with pp's hole patterns
    (a whole block of holes: a row's max stays where it was; a leading run: the max from -1e30). 4 CTAs: two
    clusters, each slot running through many queries (the barrier phases and the Q / stage reuse across queries);
    132 outnumber the first shape's 128 queries (idle slots). Repeated launches give the same bits (no race between
    the roles or across the cluster), and the D halves' sums agree bit for bit across the cluster (LSE from rank 0
    only, O from both: a disagreement would show as a mismatch against the reference)."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang.sparse_attn_cl_tl import fwd_kernel_cl
    B, M, H, D, N, T = shape
    q, kv, sink, idx = _pp_inputs(shape)
    scale = D ** -0.5
    o, lse = fwd_kernel_cl(H, D, T, scale, ctas)(q, kv, sink.float(), idx)
    _check_fwd_out(o, lse, q, kv, sink, idx, scale, 64, f"cl ctas={ctas}")
    for _ in range(3):
        o2, lse2 = fwd_kernel_cl(H, D, T, scale, ctas)(q, kv, sink.float(), idx)
        assert torch.equal(o2, o) and torch.equal(lse2, lse)


def test_sparse_attn_fwd_cl_errors():
    """fwd_kernel_cl refuses what it cannot run: an odd grid (clusters of two), H != 64, T not a multiple of 64."""
    _need_tilelang()
    from functional_dsv41.kernels.tilelang.sparse_attn_cl_tl import cl_fits, fwd_kernel_cl
    with pytest.raises(ValueError, match="even"):
        fwd_kernel_cl(64, 512, 640, 0.04, 131)
    with pytest.raises(ValueError, match="H and BI"):
        fwd_kernel_cl(32, 512, 640, 0.04, 132)
    with pytest.raises(ValueError, match="multiple of BI"):
        fwd_kernel_cl(64, 512, 600, 0.04, 132)
    assert cl_fits(64, 512, 640) and not cl_fits(64, 512, 600) and not cl_fits(32, 512, 640)
