"""DSpark draft stages (SPEC §7) against the golden ``forward_spec`` calls of tiny-bf16 / tiny-fp8.

The golden run (fixtures/*/README.md): prefill P tokens, ``forward_spec(.., 0)`` seeds the stage rings
('spec_prefill.*'); then per decode step k the main model consumes position P+k and
``forward_spec(decode.{k}.out_ids, decode.{k}.main_hidden, P+k)`` drafts ('decode.{k}.spec.*').
Our rings come from our own prefill/decode states; the draft input (token, main hidden) is the
golden one, so every stage is also checked teacher-forced. At one CPU thread the comparison is
bit-exact; the asserts allow fp32-ulp GEMM differences (other thread counts reorder sums).
"""
from __future__ import annotations

import pytest
import torch

import functional_dsv41 as fd
from functional_dsv41 import dspark
from functional_dsv41.state import init_state

from conftest import cosine_diff, fixture_dir, golden, skip_off_golden_trajectory

INT_KEYS = ("sparse_idx", "gate_idx")


pytestmark = pytest.mark.usefixtures("one_thread")


def _load(name):
    d = fixture_dir(name)
    cfg = fd.Config.from_json(d / "config.json")
    return cfg, fd.load_params(d, cfg), golden(name)


def _check_stage_tensors(dbg, g, k, bound, worst):
    """The draft's per-stage debug tensors of decode step k against the golden ones: index and expert
    choices exact, the rest within cosine ``bound`` (the worst kept in ``worst["cos"]``)."""
    checked = 0
    for key, v in dbg.items():
        gk = f"decode.{k}.spec.{key}"
        if gk not in g:
            continue
        checked += 1
        ref = g[gk]
        got = v.reshape(ref.shape).to(ref.dtype)
        if key.rsplit(".", 1)[1] in INT_KEYS:
            assert torch.equal(got, ref), gk
        else:
            c = cosine_diff(got.float(), ref.float())
            worst["cos"] = max(worst["cos"], c)
            assert c < bound, (gk, c)
    assert checked > 10, f"step {k}: only {checked} debug tensors matched golden names"


@pytest.mark.parametrize("name", ["tiny-bf16", "tiny-fp8"])
def test_dspark_golden(name):
    skip_off_golden_trajectory(name)
    cfg, params, g = _load(name)
    P = int(g["prefill_len"])
    out = fd.forward(params, {"input_ids": g["input_ids"][:, :P]}, cfg=cfg, state=init_state(cfg, 2, cfg.max_seq_len))
    st = dspark.dspark_prefill(params, out.main_hidden, cfg=cfg, state=out.state)
    for s in range(cfg.n_mtp_layers):
        assert torch.equal(st.dspark[s].window_kv, g[f"spec_prefill.stage.{s}.window_kv_cache"]), s
    n_dec = sum(1 for k in g if k.startswith("decode.") and k.endswith(".spec.out_ids"))
    assert n_dec == 8
    worst = {"logits": 0.0, "confidence": 0.0, "cos": 0.0}
    for k in range(n_dec):
        o = fd.forward(params, {"input_ids": g["input_ids"][:, P + k:P + k + 1]}, cfg=cfg, state=st)
        assert torch.equal(o.main_hidden, g[f"decode.{k}.main_hidden"])
        dbg = {}
        d = dspark.dspark_draft(params, g[f"decode.{k}.out_ids"], g[f"decode.{k}.main_hidden"], cfg=cfg,
                                state=o.state, debug=dbg)
        st = d.state
        _check_stage_tensors(dbg, g, k, 1e-6, worst)
        assert torch.equal(d.out_ids, g[f"decode.{k}.spec.out_ids"]), k
        ref = g[f"decode.{k}.spec.logits"]
        err = float((d.logits - ref).abs().max())
        worst["logits"] = max(worst["logits"], err)
        assert err <= 1e-5 * float(ref.abs().max()), (k, err)
        err = float((d.confidence - g[f"decode.{k}.spec.confidence"]).abs().max())
        worst["confidence"] = max(worst["confidence"], err)
        assert err < 1e-5, (k, err)
    print(name, "worst diffs vs golden:", worst)


@pytest.mark.parametrize("name", ["tiny-bf16", "tiny-fp8"])
def test_dspark_golden_teacher_forced(name):
    """The draft stages alone, fed the golden main-model outputs: the rings are seeded from the golden
    ``prefill.main_hidden`` and each step drafts from the golden (out_ids, main_hidden), so this runs
    where the end-to-end test above skips (a machine whose main-model prefill leaves the golden
    trajectory). Bounds are DESIGN.md's: index and expert choices, drafted tokens and rings exact;
    per-block tensors within cosine 1e-4 (bf16) / 1e-3 (fp8); logits within 2e-2 of the largest."""
    cfg, params, g = _load(name)
    P = int(g["prefill_len"])
    bound = 1e-4 if cfg.dtype == "bf16" else 1e-3
    st = init_state(cfg, 2, cfg.max_seq_len).replace(pos=P)     # the main model's position after prefill
    st = dspark.dspark_prefill(params, g["prefill.main_hidden"], cfg=cfg, state=st)
    for s in range(cfg.n_mtp_layers):
        assert torch.equal(st.dspark[s].window_kv, g[f"spec_prefill.stage.{s}.window_kv_cache"]), s
    worst = {"cos": 0.0, "logits": 0.0, "confidence": 0.0}
    for k in range(8):
        dbg = {}
        d = dspark.dspark_draft(params, g[f"decode.{k}.out_ids"], g[f"decode.{k}.main_hidden"], cfg=cfg,
                                state=st.replace(pos=P + k + 1), debug=dbg)
        st = d.state
        _check_stage_tensors(dbg, g, k, bound, worst)
        assert torch.equal(d.out_ids, g[f"decode.{k}.spec.out_ids"]), k
        ref = g[f"decode.{k}.spec.logits"]
        err = float((d.logits - ref).abs().max()) / float(ref.abs().max())
        worst["logits"] = max(worst["logits"], err)
        assert err < 2e-2, (k, err)
        c = cosine_diff(d.confidence.float(), g[f"decode.{k}.spec.confidence"].float())
        worst["confidence"] = max(worst["confidence"], c)
        assert c < bound, (k, c)
    print(name, "worst diffs vs golden (teacher-forced):", worst)


def test_dspark_forward_matches_draft():
    """The stateless teacher-forced draft equals the decode draft when the true continuation is the
    drafted one (same rows, same order; only GEMM shapes differ)."""
    skip_off_golden_trajectory("tiny-bf16")
    cfg, params, g = _load("tiny-bf16")
    P, k = int(g["prefill_len"]), 2
    drafted = g[f"decode.{k}.spec.out_ids"]                        # [given token at P+k+1, 3 drafts]
    seq = torch.cat([g["input_ids"][:, :P + k + 1], drafted], 1)
    mh = fd.forward(params, {"input_ids": seq}, cfg=cfg).main_hidden
    r = dspark.dspark_forward(params, mh, seq, cfg=cfg, anchors=torch.tensor([3, P + k, seq.shape[1] - 2]))
    B = cfg.dspark_block_size
    assert r.logits.shape == (2, 3, B, cfg.vocab_size) and r.confidence.shape == (2, 3, B)
    assert torch.equal(r.targets[:, 1], drafted[:, 1:])
    assert torch.equal(r.targets[:, 0], seq[:, 5:5 + B])
    assert (r.targets[:, 2] == -1).all()                          # anchor S-2: every target lies past the row
    ref = g[f"decode.{k}.spec.logits"]
    assert float((r.logits[:, 1] - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert float((r.confidence[:, 1] - g[f"decode.{k}.spec.confidence"]).abs().max()) < 1e-5


@pytest.mark.parametrize("n", [2, 5, 8, 11])
def test_draft_matches_dspark_forward_before_and_after_the_window_fills(n):
    """The decode draft after an n-token prompt equals the stateless teacher-forced one at anchor p = n - 1, on
    both sides of the window (W = 8: p = 1, 4, 7 leave ring slots unwritten, p = 10 wraps). The golden test above
    drafts only past the window, so a draft that dropped the newest main-KV row of a part-filled ring (ring
    slots ``<= p`` visible, not ``< p``) passed every test: speculative == greedy cannot see a draft's error, it
    only lowers the acceptance rate."""
    cfg, params = _tiny_model()
    assert cfg.window_size == 8
    ids = torch.randint(3, 500, (2, n + 1), generator=torch.Generator().manual_seed(n))
    o = fd.forward(params, {"input_ids": ids[:, :n]}, cfg=cfg, state=init_state(cfg, 2, 32))
    st = dspark.dspark_prefill(params, o.main_hidden, cfg=cfg, state=o.state)
    d = dspark.dspark_draft(params, ids[:, n], o.main_hidden[:, -1:], cfg=cfg, state=st)
    seq = torch.cat([ids[:, :n], d.out_ids], 1)                 # the prompt, the given token, the drafted ones
    mh = fd.forward(params, {"input_ids": seq}, cfg=cfg).main_hidden
    r = dspark.dspark_forward(params, mh, seq, cfg=cfg, anchors=torch.tensor([n - 1]))
    assert torch.equal(r.targets[:, 0], d.out_ids[:, 1:])             # the targets are the drafted tokens
    err = float((r.logits[:, 0] - d.logits).abs().max())
    assert err <= 1e-5 * float(d.logits.abs().max()), err
    assert float((r.confidence[:, 0] - d.confidence).abs().max()) < 1e-5


@pytest.mark.parametrize("top_p, kept", [(1.0, 4), (0.95, 3), (0.75, 2), (0.6, 2), (0.45, 1), (0.3, 1)])
def test_nucleus_keeps_the_token_that_reaches_top_p(top_p, kept):
    """probs(top_p): the smallest set of most likely tokens whose mass reaches top_p, renormalised; the token
    whose mass crosses top_p is kept. Only determinism and the extremes were tested: dropping that token
    (cumsum >= top_p instead of the mass before it) passed."""
    p = torch.tensor([0.15, 0.5, 0.05, 0.3], dtype=torch.float64)
    order = [1, 3, 0, 2]                                            # most likely first
    pr = dspark.probs(p.log().float()[None], 1.0, top_p)[0].double()
    want = torch.zeros(4, dtype=torch.float64)
    want[order[:kept]] = p[order[:kept]] / p[order[:kept]].sum()
    torch.testing.assert_close(pr, want, rtol=1e-6, atol=1e-7)


def test_dspark_forward_packed_and_differentiable():
    cfg = fd.Config.tiny()
    params = fd.init_params(cfg, seed=1)
    ids = torch.randint(0, 500, (1, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    mh = torch.randn(1, 12, 3 * cfg.dim, dtype=torch.bfloat16, requires_grad=True)
    r = dspark.dspark_forward(params, mh, ids, cfg=cfg, positions=pos, qdq=False)
    # anchor 3: p+1 = 4 is in the sample, targets 5.. are not; anchor 4: p+1 starts a new sample
    assert (r.targets[0, 3] == -1).all() and (r.targets[0, 4] == -1).all()
    assert torch.equal(r.targets[0, 5], ids[0, 7:10])
    # a sample's drafts do not see the other sample: change sample 1's hidden, sample 2's logits stay
    mh2 = mh.detach().clone()
    mh2[:, :5] = torch.randn(1, 5, 3 * cfg.dim, dtype=torch.bfloat16)
    r2 = dspark.dspark_forward(params, mh2, ids, cfg=cfg, positions=pos, qdq=False)
    assert torch.equal(r2.logits[0, 5:], r.logits[0, 5:]) and not torch.equal(r2.logits[0, :4], r.logits[0, :4])
    loss = torch.nn.functional.cross_entropy(r.logits[0, 5:].reshape(-1, cfg.vocab_size),
                                             r.targets[0, 5:].reshape(-1), ignore_index=-1)
    loss.backward()
    assert mh.grad is not None and mh.grad[0, 5:].abs().sum() > 0 and mh.grad[0, :5].abs().sum() == 0


def test_dspark_errors_leave_state():
    cfg, params, g = _load("tiny-bf16")
    st = init_state(cfg, 2, 32)
    mh = torch.randn(2, 4, 3 * cfg.dim).bfloat16()
    with pytest.raises(ValueError, match="position"):               # 4 rows but the state is at 0
        dspark.dspark_prefill(params, mh, cfg=cfg, state=st)
    st = st.replace(pos=4)
    with pytest.raises(ValueError, match="rows"):
        dspark.dspark_prefill(params, mh[:1], cfg=cfg, state=st)
    with pytest.raises(ValueError, match="another config"):
        dspark.dspark_prefill(params, mh, cfg=cfg.replace(window_size=16), state=st)
    with pytest.raises(ValueError, match="main_hidden"):
        dspark.dspark_draft(params, torch.tensor([1, 2]), mh[..., :10], cfg=cfg, state=st)
    before = st.dspark[0].window_kv.clone()
    new = dspark.dspark_prefill(params, mh, cfg=cfg, state=st)
    assert torch.equal(st.dspark[0].window_kv, before)              # the input state is not written
    assert not torch.equal(new.dspark[0].window_kv, before)


# ----------------------------------------------------------------------------- ring bookkeeping (dspark_pos)
def _tiny_model():
    cfg = fd.Config.tiny()
    params = fd.init_params(cfg, seed=0)
    params["engram_token_map"] = torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size
    return cfg, params


def test_dspark_rings_must_follow_the_state():
    """DecodeState.dspark_pos records how far the stage rings are filled. A forward without its
    dspark_prefill, or a prefill with another chunk's hidden rows, made dspark_draft attend to empty /
    outdated ring rows silently (other draft tokens, logits off by ~5); both are refused now."""
    import torch.utils._pytree as tp
    from functional_dsv41.state import state_bytes
    cfg, params = _tiny_model()
    ids = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(0))
    st = init_state(cfg, 1, 32)
    o = fd.forward(params, {"input_ids": ids[:, :8]}, cfg=cfg, state=st)
    s_ok = dspark.dspark_prefill(params, o.main_hidden, cfg=cfg, state=o.state)
    o2a = fd.forward(params, {"input_ids": ids[:, 8:11]}, cfg=cfg, state=fd.clone_state(s_ok))
    s_ok2 = dspark.dspark_prefill(params, o2a.main_hidden, cfg=cfg, state=o2a.state)
    last = ids[:, 11]
    d_ok = dspark.dspark_draft(params, last, o2a.main_hidden[:, -1:], cfg=cfg, state=s_ok2)
    # the user forgot the prefill after the first forward
    o2b = fd.forward(params, {"input_ids": ids[:, 8:11]}, cfg=cfg, state=o.state)
    with pytest.raises(ValueError, match=r"dspark_draft: the DSpark rings hold no main KV yet, but the state is at "
                                         r"position 11 .* they lack positions 0..9: call dspark_prefill"):
        dspark.dspark_draft(params, last, o2b.main_hidden[:, -1:], cfg=cfg, state=o2b.state)
    # the recorded positions: forward leaves the rings (and dspark_pos) alone, prefill / draft extend them
    assert (st.dspark_pos, o.state.dspark_pos, s_ok.dspark_pos, o2a.state.dspark_pos, s_ok2.dspark_pos,
            d_ok.state.dspark_pos, o2b.state.dspark_pos) == (0, 0, 8, 8, 11, 11, 0)
    s_ok = s_ok2
    # ... and then prefilled only the last chunk: it does not start where the rings stop
    with pytest.raises(ValueError, match=r"dspark_prefill: the DSpark rings hold no main KV yet, but these 3 "
                                         r"main_hidden rows would cover positions 8..10 .* positions 0..7 were never"):
        dspark.dspark_prefill(params, o2b.main_hidden, cfg=cfg, state=o2b.state)
    # a chunk that was already written (prefilled twice)
    with pytest.raises(ValueError, match=r"the DSpark rings hold the main KV up to position 10, .* "
                                         r"positions 8..10 are already written"):
        dspark.dspark_prefill(params, o2a.main_hidden, cfg=cfg, state=s_ok)
    # every forward's main_hidden since the last prefill, concatenated, is right: the same draft
    s_cat = dspark.dspark_prefill(params, torch.cat([o.main_hidden, o2b.main_hidden], 1), cfg=cfg, state=o2b.state)
    assert s_cat.dspark_pos == 11
    d_cat = dspark.dspark_draft(params, last, o2b.main_hidden[:, -1:], cfg=cfg, state=s_cat)
    assert torch.equal(d_cat.out_ids, d_ok.out_ids)
    torch.testing.assert_close(d_cat.logits, d_ok.logits, rtol=0, atol=1e-3 * float(d_ok.logits.abs().max()))
    # the field is a host int of the pytree: clone, flatten/unflatten and byte counts keep working
    c = fd.clone_state(d_ok.state)
    assert c.dspark_pos == 11 and state_bytes(c) == state_bytes(st)
    leaves, spec_ = tp.tree_flatten(c)
    assert tp.tree_unflatten(leaves, spec_).dspark_pos == 11


def test_dspark_rings_after_rollback():
    """speculative.rollback keeps `before`'s rings and dspark_pos; drafting from the rolled-back state without
    the refresh its docstring asks for is refused, and with it the draft equals the straight-line one."""
    from functional_dsv41 import speculative as spec
    cfg, params = _tiny_model()
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    o = fd.forward(params, {"input_ids": ids[:, :8]}, cfg=cfg, state=init_state(cfg, 2, 32))
    st = dspark.dspark_prefill(params, o.main_hidden, cfg=cfg, state=o.state)
    d = dspark.dspark_draft(params, ids[:, 8], o.main_hidden[:, -1:], cfg=cfg, state=st)
    chunk = ids[:, 8:12]                                              # [last, 3 block tokens]
    for m in (2, 1, 3, 4):                                            # fast path (even pos), re-run (odd), whole chunk
        before = fd.clone_state(d.state)
        v = fd.forward(params, {"input_ids": chunk}, cfg=cfg, state=before)
        rb, reran = spec.rollback(params, before, v.state, chunk[:, :m], cfg=cfg)
        nxt, mh = ids[:, 8 + m], v.main_hidden[:, m - 1:m]
        if m > 1:                                                      # m == 1: the draft writes position 8 itself
            with pytest.raises(ValueError, match=rf"dspark_draft: the DSpark rings hold the main KV up to position 7, "
                                                 rf"but the state is at position {8 + m} .* call dspark_prefill"):
                dspark.dspark_draft(params, nxt, mh, cfg=cfg, state=rb)
        assert rb.pos == 8 + m and rb.dspark_pos == 8 and v.state.dspark_pos == 8 and reran == (m in (1, 3))
        fresh = dspark.dspark_prefill(params, v.main_hidden[:, :m], cfg=cfg, state=rb)
        assert fresh.dspark_pos == 8 + m
        got = dspark.dspark_draft(params, nxt, mh, cfg=cfg, state=fresh)
        # straight line: the accepted tokens consumed by plain forwards, each followed by its prefill
        s = fd.clone_state(st)
        for j in range(m):
            oj = fd.forward(params, {"input_ids": chunk[:, j:j + 1]}, cfg=cfg, state=s)
            s = dspark.dspark_prefill(params, oj.main_hidden, cfg=cfg, state=oj.state)
        want = dspark.dspark_draft(params, nxt, oj.main_hidden, cfg=cfg, state=s)
        assert torch.equal(got.out_ids, want.out_ids), m
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-3 * float(want.logits.abs().max()))


# ----------------------------------------------------------------------------- bad input (forward's checks)
@pytest.fixture(scope="module")
def tiny_inputs():
    """A tiny model, 2 rows of 12 ids with their main_hidden, and a state prefilled with 8 of them."""
    cfg, params = _tiny_model()
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(2))
    mh = fd.forward(params, {"input_ids": ids}, cfg=cfg).main_hidden
    o = fd.forward(params, {"input_ids": ids[:, :8]}, cfg=cfg, state=init_state(cfg, 2, 32))
    st = dspark.dspark_prefill(params, o.main_hidden, cfg=cfg, state=o.state)
    return cfg, params, ids, mh, st, o.main_hidden[:, -1:]


def _with_id(ids, v):
    bad = ids.clone()
    bad[1, 4] = v
    return bad


def _no_mtp(params):
    return {k: v for k, v in params.items() if k != "mtp"}


_PACKED_BAD = torch.tensor([[0, 1, 2, 5, 6, 7, 0, 1, 2, 3, 4, 5]] * 2)       # 2 -> 5 within a sample
_NEGATIVE = torch.tensor([[-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]] * 2)


@pytest.mark.parametrize("make, err, match", [     # make(params, ids) -> (params, input_ids, extra kwargs)
    (lambda p, i: (p, _with_id(i, 600), {}), ValueError,
     r"dspark_forward: token id 600 is outside the vocabulary \[0, 512\)"),
    (lambda p, i: (p, _with_id(i, -1), {}), ValueError, r"dspark_forward: token id -1 is outside the vocabulary"),
    (lambda p, i: (p, i.float() + 0.7, {}), TypeError,
     r"dspark_forward: input_ids must be an integer tensor, got torch.float32"),
    (lambda p, i: (p, i, dict(anchors=torch.tensor([2.5]))), TypeError,
     r"dspark_forward: anchors must be an integer tensor \[n\] of main positions, got torch.float32"),
    (lambda p, i: (p, i, dict(positions=_PACKED_BAD)), ValueError,
     r"dspark_forward: positions must count 0, 1, 2, \.\.\. within each packed sample"),
    (lambda p, i: (p, i, dict(positions=_NEGATIVE)), ValueError,
     r"dspark_forward: positions must count 0, 1, 2, \.\.\. within each packed sample"),
    (lambda p, i: (p, i, dict(positions=torch.arange(12.0).expand(2, 12))), TypeError,
     r"dspark_forward: positions must be an integer tensor"),
    (lambda p, i: (p, i, dict(positions=torch.arange(12)[None])), ValueError,
     r"dspark_forward: positions \(1, 12\) must match input_ids \(2, 12\)"),
    (lambda p, i: (_no_mtp(p), i, {}), ValueError,
     r"dspark_forward: params have 0 DSpark stages \('mtp'\), the config 2"),
], ids=["id-600", "id-negative", "float-ids", "float-anchors", "positions-not-counting", "positions-negative",
        "float-positions", "positions-shape", "no-mtp"])
def test_dspark_forward_refuses_bad_input(tiny_inputs, make, err, match):
    """forward's own input checks (validate.py: _check_ids, _check_inputs' vocabulary range; model.py: make_chunk's
    positions), named after dspark_forward: a bare IndexError from the embedding / KeyError 'mtp' before, and float
    ids, float anchors and bad packed positions ran silently."""
    cfg, params, ids, mh, _, _ = tiny_inputs
    p, x, kw = make(params, ids)
    with pytest.raises(err, match=match):
        dspark.dspark_forward(p, mh, x, cfg=cfg, **kw)


def test_dspark_forward_validate_false_skips_only_the_data_checks(tiny_inputs):
    """validate=False (as forward's) skips the vocabulary range (a device sync); the host-only checks stay."""
    cfg, params, ids, mh, _, _ = tiny_inputs
    with pytest.raises(TypeError, match="dspark_forward: input_ids must be an integer tensor"):
        dspark.dspark_forward(params, mh, ids.float(), cfg=cfg, validate=False)
    with pytest.raises(ValueError, match=r"dspark_forward: params have 0 DSpark stages"):
        dspark.dspark_forward(_no_mtp(params), mh, ids, cfg=cfg, validate=False)
    a = dspark.dspark_forward(params, mh, ids, cfg=cfg, anchors=torch.tensor([1, 6]))
    b = dspark.dspark_forward(params, mh, ids.int(), cfg=cfg, anchors=torch.tensor([1, 6], dtype=torch.int32),
                              validate=False)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.targets, b.targets)


@pytest.mark.parametrize("temperature, top_p", [(-1.0, 1.0), (float("nan"), 1.0), (float("inf"), 1.0),
                                                (True, 1.0), ("0.5", 1.0), (1.0, 0.0), (1.0, 5.0),
                                                (1.0, float("nan")), (1.0, -0.5)])
def test_dspark_draft_refuses_bad_sampling(tiny_inputs, temperature, top_p):
    """generate's rule (generate._real: finite, not a bool): -1 ran greedy silently, NaN / top_p=0 failed inside
    torch.multinomial, top_p=5 was taken."""
    cfg, params, ids, _, st, mh_p = tiny_inputs
    with pytest.raises(ValueError, match=r"dspark_draft: need temperature >= 0 \(0 = greedy\) and 0 < top_p <= 1, "
                                         r"got temperature="):
        dspark.dspark_draft(params, ids[:, 8], mh_p, cfg=cfg, state=st, temperature=temperature, top_p=top_p)


@pytest.mark.parametrize("last, err, match", [
    (torch.tensor([5, 600]), ValueError, r"dspark_draft: last_token holds token id 600, outside the vocabulary "
                                         r"\[0, 512\)"),
    (torch.tensor([-1, 5]), ValueError, r"dspark_draft: last_token holds token id -1, outside the vocabulary"),
    (torch.tensor([4.7, 5.0]), TypeError, r"dspark_draft: last_token must be an integer tensor \[b\] \(or \[b, 1\]\) "
                                          r"of token ids, got torch.float32"),
    ([4, 5], TypeError, r"dspark_draft: last_token must be an integer tensor .* got list"),
])
def test_dspark_draft_refuses_bad_last_token(tiny_inputs, last, err, match):
    """A bare IndexError from the embedding before; a float token was truncated silently. The state is kept."""
    cfg, params, ids, _, st, mh_p = tiny_inputs
    before = [c.window_kv.clone() for c in st.dspark]
    with pytest.raises(err, match=match):
        dspark.dspark_draft(params, last, mh_p, cfg=cfg, state=st)
    assert st.dspark_pos == 8 and all(torch.equal(a, c.window_kv) for a, c in zip(before, st.dspark))


def test_dspark_draft_checks_params_and_validate_flag(tiny_inputs):
    cfg, params, ids, _, st, mh_p = tiny_inputs
    with pytest.raises(ValueError, match=r"dspark_draft: params have 0 DSpark stages \('mtp'\)"):
        dspark.dspark_draft(_no_mtp(params), ids[:, 8], mh_p, cfg=cfg, state=st)
    # validate=False skips only the vocabulary range (a device sync); the result is the same
    a = dspark.dspark_draft(params, ids[:, 8], mh_p, cfg=cfg, state=st)
    b = dspark.dspark_draft(params, ids[:, 8:9], mh_p, cfg=cfg, state=st, validate=False)
    assert torch.equal(a.out_ids, b.out_ids) and torch.equal(a.logits, b.logits)
    with pytest.raises(TypeError, match="dspark_draft: last_token must be an integer tensor"):
        dspark.dspark_draft(params, ids[:, 8].float(), mh_p, cfg=cfg, state=st, validate=False)
    with pytest.raises(ValueError, match="dspark_draft: need temperature >= 0"):
        dspark.dspark_draft(params, ids[:, 8], mh_p, cfg=cfg, state=st, temperature=-1.0, validate=False)
