"""Decode-state handling for generation: speculative rollback equals consuming only the accepted
tokens, and bad input is refused with the state left as it was."""
from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as tp

import functional_dsv41 as fd
from functional_dsv41 import speculative as spec
from functional_dsv41.state import init_state


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    cfg = fd.Config.tiny()                              # ratio-2 and ratio-1 sources, Engram, window 8
    params = fd.init_params(cfg, seed=5)
    params["engram_token_map"] = torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size
    return cfg, params


def _bounded(st):
    """The pieces of a state that rollback rebuilds (histories are shared buffers, compared by count)."""
    out = [torch.tensor(st.pos)]
    for c in st.layers:
        out += [c.window_kv] + [t for t in (c.partial_kv, c.partial_score) if t is not None]
    return out + [st.ngram.tail]


@pytest.mark.parametrize("start, n", [(12, 4), (13, 4), (3, 9)])
def test_rollback_equals_consuming_the_accepted_tokens(model, start, n):
    """(3, 9): a chunk one longer than the window (W = 8), whose accepted prefix's window rows the chunk itself
    overwrote, so every m must re-run (a fast path there restored stale window rows: logits off by ~1.6)."""
    cfg, params = model
    assert cfg.window_size == 8
    ids = torch.randint(0, cfg.vocab_size, (2, start + n), generator=torch.Generator().manual_seed(start))
    prefix = fd.forward(params, {"input_ids": ids[:, :start]}, cfg=cfg, state=init_state(cfg, 2, 32)).state
    chunk = ids[:, start:]
    kinds = set()
    for m in range(1, n + 1):
        # every trial and its reference grow their own copy of the prefix state: one future per state
        before = fd.clone_state(prefix)
        after = fd.forward(params, {"input_ids": chunk}, cfg=cfg, state=before).state
        st, reran = spec.rollback(params, before, after, chunk[:, :m], cfg=cfg)
        kinds.add(reran)
        s = fd.clone_state(prefix)
        for j in range(m):                                # plain one-token decode of the accepted tokens
            s = fd.forward(params, {"input_ids": chunk[:, j:j + 1]}, cfg=cfg, state=s).state
        for a, b in zip(_bounded(st), _bounded(s)):
            assert torch.equal(a, b), (m, reran)
        nxt = torch.tensor([[7], [8]])
        assert torch.equal(fd.forward(params, {"input_ids": nxt}, cfg=cfg, state=st).logits,
                           fd.forward(params, {"input_ids": nxt}, cfg=cfg, state=s).logits)
    if n > cfg.window_size:                               # (m = n returns ``after`` itself: nothing to rebuild)
        assert all(spec.fast_rollback_ok(before, after, m, cfg) is False for m in range(1, n))
    else:
        assert kinds == {False, True}                     # both the fast path and the re-run were used
        assert spec.fast_rollback_ok(before, after, 4 - start % 2, cfg)


def test_bad_input_leaves_state(model):
    cfg, params = model
    st = fd.forward(params, {"input_ids": torch.tensor([[0, 5, 6], [0, 7, 8]])}, cfg=cfg,
                    state=init_state(cfg, 2, 8)).state
    snap = [t.clone() for t in tp.tree_leaves(st) if isinstance(t, torch.Tensor)]
    with pytest.raises(ValueError, match="max_seq_len"):
        fd.forward(params, {"input_ids": torch.zeros(2, 6, dtype=torch.long)}, cfg=cfg, state=st)
    with pytest.raises(ValueError, match="rows"):
        fd.forward(params, {"input_ids": torch.zeros(3, 1, dtype=torch.long)}, cfg=cfg, state=st)
    with pytest.raises(ValueError, match="another config"):
        fd.forward(params, {"input_ids": torch.zeros(2, 1, dtype=torch.long)}, cfg=cfg.replace(window_size=16),
                   state=st)
    with pytest.raises(ValueError, match="another config"):
        from functional_dsv41.dspark import dspark_draft
        dspark_draft(params, torch.tensor([1, 2]), torch.zeros(2, 1, 3 * cfg.dim, dtype=torch.bfloat16),
                     cfg=cfg.replace(window_size=16), state=st)
    with pytest.raises(ValueError, match="empty"):
        fd.generate(params, [[]], cfg=cfg, max_new_tokens=1)
    assert st.pos == 3
    for a, b in zip(snap, [t for t in tp.tree_leaves(st) if isinstance(t, torch.Tensor)]):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- branching a state
def _grow(params, cfg, st, ids):
    return fd.forward(params, {"input_ids": ids}, cfg=cfg, state=st)


def test_a_one_token_future_goes_stale_too(model):
    """The staleness bounds at their edge: a first future one token long (a decode step) is as stale as a longer
    one once its parent grows again (a limit off by one accepted it, reading the overwritten history)."""
    cfg, params = model
    g = torch.Generator().manual_seed(2)
    P, A, B, C = (torch.randint(3, 500, (2, n), generator=g) for n in (10, 1, 1, 1))
    st0 = _grow(params, cfg, init_state(cfg, 2, 32), P).state
    a = _grow(params, cfg, st0, A).state
    _grow(params, cfg, st0, B)
    with pytest.raises(ValueError, match=r"stale.*fd\.clone_state"):
        _grow(params, cfg, a, C)


def test_growing_a_state_twice_makes_the_first_future_stale(model):
    """The append-only histories are shared buffers: growing st0 again overwrites what the first
    continuation wrote, so that continuation must be refused, not silently read (it used to give
    logits off by ~1)."""
    cfg, params = model
    g = torch.Generator().manual_seed(1)
    P, A, B, C = (torch.randint(3, 500, (2, n), generator=g) for n in (10, 3, 3, 2))
    st0 = _grow(params, cfg, init_state(cfg, 2, 32), P).state
    a = _grow(params, cfg, st0, A).state
    b = _grow(params, cfg, st0, B).state                  # regrowing st0 itself is allowed ...
    with pytest.raises(ValueError, match=r"stale.*fd\.clone_state"):
        _grow(params, cfg, a, C)                          # ... but its first future is gone
    with pytest.raises(ValueError, match="stale"):
        fd.clone_state(a)
    # the newest future and st0 stay valid: same logits as an unbranched history
    ref = _grow(params, cfg, init_state(cfg, 2, 32), P).state
    ref_b = _grow(params, cfg, ref, B).state
    assert torch.equal(_grow(params, cfg, b, C).logits, _grow(params, cfg, ref_b, C).logits)


def test_clone_state_keeps_two_futures(model):
    cfg, params = model
    g = torch.Generator().manual_seed(2)
    P, A, B, C = (torch.randint(3, 500, (2, n), generator=g) for n in (10, 3, 3, 2))
    st0 = _grow(params, cfg, init_state(cfg, 2, 32), P).state
    branch = st0.clone()
    a = _grow(params, cfg, st0, A).state
    b = _grow(params, cfg, branch, B).state
    for mid, st in ((A, a), (B, b)):                      # each equals its own unbranched history
        ref = _grow(params, cfg, _grow(params, cfg, init_state(cfg, 2, 32), P).state, mid).state
        assert torch.equal(_grow(params, cfg, st, C).logits, _grow(params, cfg, ref, C).logits)


def test_init_state_and_state_argument_refusals(model):
    cfg, params = model
    for bs, n in ((0, 32), (2.5, 32), (True, 32), (2, 0), (2, -4), (2, 32.0)):
        with pytest.raises(ValueError, match="init_state: (batch_size|max_seq_len) must be an integer >= 1"):
            init_state(cfg, bs, n)
    assert init_state(cfg, 2).max_seq_len == cfg.max_seq_len      # None still means the config's
    out = _grow(params, cfg, init_state(cfg, 1, 16), torch.tensor([[1, 2, 3]]))
    with pytest.raises(TypeError, match=r"DecodeState.*got ForwardOutput \(pass out.state"):
        _grow(params, cfg, out, torch.tensor([[4]]))
    with pytest.raises(TypeError, match="DecodeState"):
        fd.forward(params, {"input_ids": torch.tensor([[4]])}, cfg=cfg, state=out, validate=False)


def test_state_checks_hold_under_validate_false(model):
    """validate=False (the decode loops' setting) skips the data-dependent checks only: a state of another
    config ran silently (same shapes, another index_topk), one of another batch size or past its max_seq_len
    failed inside the layers (Engram's n-gram tail, a full compressed history)."""
    cfg, params = model
    st = fd.forward(params, {"input_ids": torch.tensor([[0, 5, 6], [0, 7, 8]])}, cfg=cfg,
                    state=init_state(cfg, 2, 8)).state
    for validate in (True, False):
        with pytest.raises(ValueError, match="the state was built for another config"):
            fd.forward(params, {"input_ids": torch.tensor([[4], [5]])}, cfg=cfg.replace(index_topk=2), state=st,
                       validate=validate)
        with pytest.raises(ValueError, match="the state holds 2 rows, the batch has 3"):
            fd.forward(params, {"input_ids": torch.zeros(3, 1, dtype=torch.long)}, cfg=cfg, state=st,
                       validate=validate)
        with pytest.raises(ValueError, match="chunk of 6 tokens at position 3 runs past max_seq_len 8"):
            fd.forward(params, {"input_ids": torch.zeros(2, 6, dtype=torch.long)}, cfg=cfg, state=st,
                       validate=validate)
    out = fd.forward(params, {"input_ids": torch.tensor([[4], [5]])}, cfg=cfg, state=st, validate=False)
    assert out.state.pos == 4


def test_state_built_under_inference_mode(model):
    """A state grown under torch.inference_mode() and continued outside it failed inside attention with torch's
    'Inplace update to inference tensor outside InferenceMode'; it is refused up front, naming the two ways on,
    and the state stays usable."""
    cfg, params = model
    with torch.inference_mode():
        st = _grow(params, cfg, init_state(cfg, 2, 16), torch.tensor([[0, 5, 6], [0, 7, 8]])).state
        ref = _grow(params, cfg, st, torch.tensor([[9], [10]])).logits
    with pytest.raises(ValueError, match=r"built under torch\.inference_mode\(\).*fd\.clone_state"):
        _grow(params, cfg, st, torch.tensor([[9], [10]]))
    with pytest.raises(ValueError, match="inference_mode"):
        fd.forward(params, {"input_ids": torch.tensor([[9], [10]])}, cfg=cfg, state=st, validate=False)
    assert torch.equal(_grow(params, cfg, fd.clone_state(st), torch.tensor([[9], [10]])).logits, ref)
    with torch.inference_mode():
        assert torch.equal(_grow(params, cfg, st, torch.tensor([[9], [10]])).logits, ref)


# ----------------------------------------------------------------------------- state device, config fingerprint
def test_init_state_on_meta_puts_every_leaf_there(model):
    """init_state(device=...) left the Engram n-gram tail on the CPU (a CUDA state carried a CPU tail)."""
    cfg, _ = model
    assert cfg.engram_layer_ids
    st = init_state(cfg, 2, 16, device="meta")
    leaves = [t for t in tp.tree_leaves(st) if isinstance(t, torch.Tensor)]
    assert st.ngram.tail.device.type == "meta"
    assert len(leaves) > 10 and {t.device.type for t in leaves} == {"meta"}


def test_config_fingerprint_ignores_sampling_and_capacity_fields(model):
    """temperature / max_seq_len / max_batch_size change neither a state's layout nor the math (a state keeps
    its own max_seq_len; RoPE/YaRN read original_seq_len), so forward no longer refuses the state for them;
    every other field still changes the fingerprint, and the refusal names the fields that differ."""
    from functional_dsv41 import state as state_mod
    cfg, params = model
    st = fd.forward(params, {"input_ids": torch.tensor([[0, 5, 6], [0, 7, 8]])}, cfg=cfg,
                    state=init_state(cfg, 2, 16)).state
    nxt = {"input_ids": torch.tensor([[7], [9]])}
    ref = fd.forward(params, nxt, cfg=cfg, state=st).logits
    for ch in ({"temperature": 0.7}, {"max_seq_len": 128}, {"max_batch_size": 8}):
        assert torch.equal(fd.forward(params, nxt, cfg=cfg.replace(**ch), state=st).logits, ref)
    config_id, config_mismatch = state_mod.config_id, state_mod.config_mismatch
    for ch in ({"temperature": 0.7}, {"max_seq_len": 128}, {"max_batch_size": 8}):
        other = cfg.replace(**ch)
        assert config_id(other) == config_id(cfg) and config_mismatch(st.config_id, other) is None
    for ch in ({"index_topk": 2}, {"window_size": 16}, {"original_seq_len": 4096}, {"rope_factor": 4},
               {"gate_temp": 0.5}, {"norm_eps": 1e-6}, {"norm_topk_prob": False}, {"dspark_block_size": 2}):
        assert config_id(cfg.replace(**ch)) != config_id(cfg), ch
    assert config_mismatch(st.config_id, cfg.replace(index_topk=2)) == \
        "the state was built for another config (index_topk 4 in it, 2 in cfg)"
    many = config_mismatch(st.config_id, cfg.replace(index_topk=2, window_size=16, gate_temp=0.5, hc_eps=1e-3,
                                                     rope_factor=4, temperature=0.3))
    assert many.startswith("the state was built for another config (gate_temp 1.0 in it, 0.5 in cfg; hc_eps")
    assert many.endswith("; and 1 more field(s))") and "temperature" not in many
    with pytest.raises(ValueError, match=r"forward: the state was built for another config \(index_topk 4 in it, "
                                         r"2 in cfg\)"):
        fd.forward(params, nxt, cfg=cfg.replace(index_topk=2), state=st)


def test_rollback_refuses_mismatched_inputs(model):
    """rollback checked nothing: tokens of another batch size and a state of another config failed deep in
    torch ("Sizes of tensors must match", "INDICES element is out of DATA bounds")."""
    cfg, params = model
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    before = fd.forward(params, {"input_ids": ids[:, :6]}, cfg=cfg, state=init_state(cfg, 2, 32)).state
    after = fd.forward(params, {"input_ids": ids[:, 6:10]}, cfg=cfg, state=before).state
    with pytest.raises(ValueError, match="rollback: tokens have 1 rows but the states hold 2"):
        spec.rollback(params, before, after, ids[:1, 6:8], cfg=cfg)
    with pytest.raises(ValueError, match="rollback: tokens have 3 rows but the states hold 2"):
        spec.rollback(params, before, after, torch.cat([ids, ids[:1]])[:, 6:8], cfg=cfg)
    with pytest.raises(ValueError, match=r"rollback: tokens must be the accepted tokens \[b, m\], got a tensor \(2,\)"):
        spec.rollback(params, before, after, ids[:, 6], cfg=cfg)
    with pytest.raises(ValueError, match=r"rollback: the state `before` was built for another config "
                                         r"\(window_size 8 in it, 16 in cfg\)"):
        spec.rollback(params, before, after, ids[:, 6:8], cfg=cfg.replace(window_size=16))
    other = fd.forward(params, {"input_ids": ids[:, 6:10]}, cfg=cfg.replace(index_topk=2),
                       state=init_state(cfg.replace(index_topk=2), 2, 32)).state
    with pytest.raises(ValueError, match=r"rollback: the state `after` was built for another config \(index_topk"):
        spec.rollback(params, before, other, ids[:, 6:8], cfg=cfg)
    three = fd.forward(params, {"input_ids": ids[:1, :10].expand(3, 10)}, cfg=cfg, state=init_state(cfg, 3, 32)).state
    with pytest.raises(ValueError, match="rollback: `before` holds 2 rows but `after` 3"):
        spec.rollback(params, before, three, ids[:, 6:8], cfg=cfg)
    with pytest.raises(ValueError, match=r"rollback: `after` \(position 6\) is not ahead of `before` \(position 6\)"):
        spec.rollback(params, before, before, ids[:, 6:8], cfg=cfg)
    st, _ = spec.rollback(params, before, after, ids[:, 6:8], cfg=cfg)       # the right call still works
    assert st.pos == 8


def test_rollback_refuses_a_wrong_number_of_accepted_tokens(model):
    """m must be in [1, chunk]: 0 accepted tokens, or one more than the verified chunk, is a ValueError, not a state
    whose position is not what the forward consumed (start 6, chunk 3: m = 0 and m = 4 both land on positions
    aligned to the ratio-2 groups, where the fast path would build a state without a forward)."""
    cfg, params = model
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    before = fd.forward(params, {"input_ids": ids[:, :6]}, cfg=cfg, state=init_state(cfg, 2, 32)).state
    after = fd.forward(params, {"input_ids": ids[:, 6:9]}, cfg=cfg, state=before).state
    with pytest.raises(ValueError, match="rollback: 0 accepted tokens for a chunk of 3"):
        spec.rollback(params, before, after, ids[:, 6:6], cfg=cfg)
    with pytest.raises(ValueError, match="rollback: 4 accepted tokens for a chunk of 3"):
        spec.rollback(params, before, after, ids[:, 6:10], cfg=cfg)


def test_rollback_of_the_whole_chunk_needs_no_rerun(model):
    """Every token of the chunk accepted: the verify forward's state is the answer, with no extra forward, also
    where the new position (13 + 4 = 17) is inside a ratio-2 group (the case a rollback must otherwise re-run)."""
    cfg, params = model
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(13))
    before = fd.forward(params, {"input_ids": ids[:, :13]}, cfg=cfg, state=init_state(cfg, 2, 32)).state
    after = fd.forward(params, {"input_ids": ids[:, 13:]}, cfg=cfg, state=before).state
    st, reran = spec.rollback(params, before, after, ids[:, 13:], cfg=cfg)
    assert reran is False and st.pos == after.pos == 17
    for a, b in zip(_bounded(st), _bounded(after)):
        assert torch.equal(a, b)


def test_fast_rollback_of_a_chunk_as_long_as_the_window(model):
    """A verified chunk of exactly window_size (8) tokens wrote every ring slot once, so restoring the rejected
    slots from `before` is exact: the fast path applies (module docstring: valid when the chunk is at most
    window_size long) and equals plain one-token decode of the accepted tokens."""
    cfg, params = model
    start, n = 4, cfg.window_size
    ids = torch.randint(0, cfg.vocab_size, (2, start + n), generator=torch.Generator().manual_seed(21))
    prefix = fd.forward(params, {"input_ids": ids[:, :start]}, cfg=cfg, state=init_state(cfg, 2, 32)).state
    chunk = ids[:, start:]
    for m in (2, 6):
        before = fd.clone_state(prefix)
        after = fd.forward(params, {"input_ids": chunk}, cfg=cfg, state=before).state
        assert spec.fast_rollback_ok(before, after, m, cfg)
        st, reran = spec.rollback(params, before, after, chunk[:, :m], cfg=cfg)
        assert reran is False
        s = fd.clone_state(prefix)
        for j in range(m):
            s = fd.forward(params, {"input_ids": chunk[:, j:j + 1]}, cfg=cfg, state=s).state
        for a, b in zip(_bounded(st), _bounded(s)):
            assert torch.equal(a, b), m
        nxt = torch.tensor([[7], [8]])
        assert torch.equal(fd.forward(params, {"input_ids": nxt}, cfg=cfg, state=st).logits,
                           fd.forward(params, {"input_ids": nxt}, cfg=cfg, state=s).logits)


def test_forward_refuses_a_state_on_another_device(model):
    """A state built on another device than input_ids failed inside torch ("Expected all tensors to be on the
    same device", a review helper's GPU probe); forward names both devices (host-side: no device work)."""
    cfg, params = model
    st = init_state(cfg, 1, 16, device="meta")
    with pytest.raises(ValueError, match=r"forward: the state is on meta but input_ids are on cpu: build it with "
                                         r"fd.init_state\(cfg, \.\.\., device='cpu'\)"):
        fd.forward(params, {"input_ids": torch.tensor([[0, 5, 6]])}, cfg=cfg, state=st, validate=False)
