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


@pytest.mark.parametrize("start", [12, 13])
def test_rollback_equals_consuming_the_accepted_tokens(model, start):
    cfg, params = model
    ids = torch.randint(0, cfg.vocab_size, (2, start + 4), generator=torch.Generator().manual_seed(start))
    before = fd.forward(params, {"input_ids": ids[:, :start]}, cfg=cfg, state=init_state(cfg, 2, 32)).state
    chunk = ids[:, start:]
    after = fd.forward(params, {"input_ids": chunk}, cfg=cfg, state=before).state
    kinds = set()
    for m in range(1, 5):
        st, reran = spec.rollback(params, before, after, chunk[:, :m], cfg=cfg)
        kinds.add(reran)
        s = before
        for j in range(m):                                # plain one-token decode of the accepted tokens
            s = fd.forward(params, {"input_ids": chunk[:, j:j + 1]}, cfg=cfg, state=s).state
        for a, b in zip(_bounded(st), _bounded(s)):
            assert torch.equal(a, b), (m, reran)
        nxt = torch.tensor([[7], [8]])
        assert torch.equal(fd.forward(params, {"input_ids": nxt}, cfg=cfg, state=st).logits,
                           fd.forward(params, {"input_ids": nxt}, cfg=cfg, state=s).logits)
    assert kinds == {False, True}                         # both the fast path and the re-run were used
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
