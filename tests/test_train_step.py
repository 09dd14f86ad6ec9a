"""Step plumbing without the model: remat under torch.func, the trainable/frozen split."""
import re

import pytest
import torch
from torch.func import grad_and_value

from functional_dsv41.train import optim, step as S


def _blk(p, h, pre, *, k):
    y = torch.tanh(h @ p["w"]) * k
    return {"h": y, "idx": y.argmax(-1), "none": None}, pre + y.sum(-1)


def test_remat_matches_plain_gradients_under_torch_func():
    g = torch.Generator().manual_seed(0)
    W = [{"w": torch.randn(4, 4, dtype=torch.float64, generator=g)} for _ in range(3)]
    x = torch.randn(3, 4, dtype=torch.float64, generator=g)

    def f(W, wrap):
        h, pre = x, torch.zeros(3, dtype=torch.float64)
        for p in W:
            o, pre = (S.remat(_blk) if wrap else _blk)(p, h, pre, k=2.0)
            assert o["none"] is None and o["idx"].dtype == torch.long
            h = o["h"]
        return h.sum() + pre.sum()

    (g1, v1), (g0, v0) = grad_and_value(f)(W, True), grad_and_value(f)(W, False)
    assert torch.equal(v1, v0)
    assert all(torch.equal(a["w"], b["w"]) for a, b in zip(g1, g0))


def test_remat_needs_a_model_hook():
    def forward(params, batch, *, cfg, state=None, mode="dequant"):
        return None
    with pytest.raises(NotImplementedError, match="block_wrapper"):
        S.remat_forward_kwargs(forward)

    def forward2(params, batch, *, cfg, block_wrapper=None):
        return None
    assert S.remat_forward_kwargs(forward2)["block_wrapper"] is S.remat


def test_split_params_trainable_and_frozen():
    params = {"embed": {"weight": torch.ones(3, 2, dtype=torch.bfloat16)},
              "layers": [{"engram": {"embed": {"weight": torch.ones(5, 32).to(torch.float8_e4m3fn),
                                               "scale": torch.ones(5, 1).to(torch.float8_e8m0fnu)},
                                     "wkv": {"weight": torch.ones(2, 2)}},
                          "attn": {"wq_a": {"weight": torch.ones(2, 2).to(torch.float8_e4m3fn)}},
                          "table": {"weight": torch.ones(2, 2)}}],
              "engram_token_map": torch.arange(4)}
    tr, fr = S.split_params(params, frozen=("layers.*.table.*",))
    assert set(tr) == {"embed.weight", "layers.0.engram.wkv.weight"}
    assert all(v.dtype == torch.float32 for v in tr.values())
    assert {"engram_token_map", "layers.0.table.weight", "layers.0.attn.wq_a.weight",
            "layers.0.engram.embed.weight", "layers.0.engram.embed.scale"} == set(fr)
    tree = S.assemble(tr, fr, {k: torch.bfloat16 for k in tr})
    assert tree["embed"]["weight"].dtype == torch.bfloat16 and tree["engram_token_map"] is fr["engram_token_map"]


class _Out:
    def __init__(self, logits, main_hidden=None):
        self.logits, self.main_hidden = logits, main_hidden


def _bigram_forward(params, inputs, *, cfg, state=None, mode="dequant"):
    """A stand-in model: logits are a learned table's row per input token; main_hidden is there, as with a
    config that names DSpark target layers."""
    return _Out(params["table"][inputs["input_ids"]], main_hidden=torch.zeros(*inputs["input_ids"].shape, 4))


def test_tokens_per_s_counts_non_padding_tokens():
    pad = 0
    ids = torch.tensor([[5, 6, 7, pad, pad, pad], [3, 4, pad, pad, pad, pad]])      # 5 real tokens in 12 slots
    labels = torch.tensor([[6, 7, -100, -100, -100, -100], [4, -100, -100, -100, -100, -100]])
    tr = {"table": torch.zeros(8, 8)}
    step = S.make_step(None, frozen={}, dtypes={"table": torch.float32}, forward=_bigram_forward, coefs={"ce": 1.0},
                       pad_id=pad)
    _, _, m = step(tr, optim.adamw_init(tr), {"input_ids": ids, "labels": labels}, lr=0.1, step_no=1)
    assert m["tokens"] == 3 and m["tokens_per_s"] * m["step_time"] == pytest.approx(5)


def test_draft_loss_without_dspark_stages_is_named():
    """A config with DSpark target layers but no stages: the forward returns main_hidden, the draft has nothing."""
    from types import SimpleNamespace
    from functional_dsv41.train import loss as L
    ids = torch.tensor([[1, 2, 3]])

    def draft_forward(params, *a, **k):
        return params["mtp"]                                     # what dspark_forward reaches first
    with pytest.raises(ValueError, match=r"no DSpark stages \(n_mtp_layers=0\)"):
        L.compute_losses({"table": torch.zeros(4, 4)}, {"input_ids": ids, "labels": ids},
                         cfg=SimpleNamespace(n_mtp_layers=0), coefs={"ce": 1.0, "draft": 0.5},
                         forward=_bigram_forward, draft_forward=draft_forward, pad_id=0)


def test_draft_and_indexer_kl_refuse_a_missing_pad_id():
    """Their targets / query tokens carry no label marking padding: without pad_id they averaged the padding of
    packed rows in. CE alone needs no pad_id (its labels mark padding)."""
    from types import SimpleNamespace
    from functional_dsv41.train import loss as L
    ids = torch.tensor([[5, 6, 7, 0, 0]])
    labels = torch.tensor([[6, 7, -100, -100, -100]])
    calls = []

    def forward(params, inputs, *, cfg, state=None, mode="dequant", aux=False):
        calls.append(1)
        return _bigram_forward(params, inputs, cfg=cfg)
    for coefs, parts in (({"ce": 1.0, "draft": 0.5}, "['draft']"), ({"indexer_kl": 0.1}, "['indexer_kl']"),
                         ({"ce": 1.0, "draft": 1.0, "indexer_kl": 1.0}, "['draft', 'indexer_kl']")):
        msg = re.escape(f"loss part(s) {parts} are on but pad_id is None")
        with pytest.raises(ValueError, match=msg):
            S.make_step(None, frozen={}, dtypes={"table": torch.float32}, forward=forward, coefs=coefs)
        with pytest.raises(ValueError, match=msg):
            L.compute_losses({"table": torch.zeros(8, 8)}, {"input_ids": ids, "labels": labels},
                             cfg=SimpleNamespace(n_mtp_layers=1), coefs=coefs, forward=forward)
    assert not calls                                              # refused before any forward
    # an off part (coefficient <= 0) needs nothing; CE alone runs without pad_id
    S.make_step(None, frozen={}, dtypes={"table": torch.float32}, forward=forward,
                coefs={"ce": 1.0, "draft": 0.0, "indexer_kl": -1.0})
    total, parts = L.compute_losses({"table": torch.zeros(8, 8)}, {"input_ids": ids, "labels": labels},
                                    cfg=None, coefs={"ce": 1.0}, forward=forward)
    assert set(parts) == {"ce"} and calls


def test_per_token_ce_any_number_of_leading_dims():
    """transpose(1, -1) put the class axis right only for 3-D logits: 4-D draft logits [b, n, B, V] with n == B
    came out silently transposed."""
    import torch.nn.functional as F
    from functional_dsv41.train import loss as L
    g = torch.Generator().manual_seed(0)
    for shape in ((2, 4, 4), (2, 3, 5), (3, 4), (2, 3, 4, 4)):
        V = 11
        logits = torch.randn(*shape, V, generator=g)
        labels = torch.randint(0, V, shape, generator=g)
        labels.view(-1)[::3] = L.IGNORE
        want = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none",
                               ignore_index=L.IGNORE).view(shape)
        got = L.per_token_ce(logits, labels)
        assert got.shape == shape
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        n = (labels != L.IGNORE).sum()
        torch.testing.assert_close(got.sum() / n, L.cross_entropy(logits, labels), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"per_token_ce: logits \(2, 4, 11\) must be labels' shape \(4, 2\)"):
        L.per_token_ce(torch.zeros(2, 4, 11), torch.zeros(4, 2, dtype=torch.long))


def test_indexer_kl_is_the_kl_of_the_renormalised_teacher_over_counted_rows():
    """indexer_kl written out row by row: per query token with at least one valid slot (and not masked), p = the
    teacher summed over heads at the valid slots, renormalised; q = softmax of the student over the same slots;
    KL(p || q) = sum p log(p / q); the mean over those tokens. A mean diluted by rows without a valid slot or by
    masked tokens, or a cross-entropy in place of the KL (the same gradient, another value), passed before."""
    from functional_dsv41.train import loss as L
    g = torch.Generator().manual_seed(1)
    b, s, H, k = 2, 4, 3, 5
    t, st = torch.rand(b, s, H, k, generator=g), torch.randn(b, s, k, generator=g)
    valid = torch.rand(b, s, k, generator=g) > 0.3
    valid[0, 1] = False                                  # a token with no valid slot: not counted
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, 3] = False                                   # a masked (padding) token: not counted
    kls = []
    for i in range(b):
        for j in range(s):
            v = valid[i, j]
            if not v.any() or not mask[i, j]:
                continue
            p = t[i, j].double().sum(0)[v]
            p = p / p.sum()
            q = st[i, j].double()[v].softmax(-1)
            kls.append(float((p * (p / q).log()).sum()))
    assert len(kls) == b * s - 2
    got = L.indexer_kl({3: {"teacher": t, "student": st, "valid": valid}}, token_mask=mask)
    assert abs(float(got) - sum(kls) / len(kls)) < 1e-6, (float(got), sum(kls) / len(kls))


def test_indexer_kl_teacher_is_the_attentions_probability_on_the_selected_compressed_slots():
    """attention.indexer_kl_terms' teacher written out: per head, exp(q.kv_t * scale) over the attention's whole
    denominator (every attended slot, window and compressed, plus exp(sink)), at the k compressed slots, which
    follow the window's in idx; -1 slots take no probability. Only its shape, detachment and sum <= 1 were
    tested: the window's slots in place of the compressed ones, or a softmax without the sink, passed."""
    from functional_dsv41.attention import indexer_kl_terms
    g = torch.Generator().manual_seed(2)
    b, s, H, D, n_win, n_comp, k = 1, 3, 2, 8, 4, 6, 3
    q = torch.randn(b, s, H, D, generator=g)
    kv_all = torch.randn(b, n_win + n_comp, D, generator=g)
    sink = torch.randn(H, generator=g)
    topk = torch.tensor([[[0, 2, 5], [1, -1, 4], [3, 0, -1]]])
    widx = torch.tensor([[[0, 1, -1, 3], [0, 1, 2, 3], [-1, 1, 2, 3]]])
    idx = torch.cat([widx, torch.where(topk >= 0, topk + n_win, -1)], -1)
    student = torch.randn(b, s, n_comp, generator=g)
    out = indexer_kl_terms(q, kv_all, sink, idx, topk, student, D ** -0.5)
    want = torch.zeros(b, s, H, k, dtype=torch.float64)
    for j in range(s):
        for h in range(H):
            e = {t: float(torch.dot(q[0, j, h].double(), kv_all[0, t].double()) * D ** -0.5)
                 for t in idx[0, j].tolist() if t >= 0}
            den = sum(torch.tensor(x).exp() for x in e.values()) + sink[h].double().exp()
            for c in range(k):
                t = int(idx[0, j, n_win + c])
                if t >= 0:
                    want[0, j, h, c] = torch.tensor(e[t]).exp() / den
    torch.testing.assert_close(out["teacher"].double(), want, rtol=1e-5, atol=1e-7)
    assert torch.equal(out["valid"], topk >= 0)
    assert torch.equal(out["student"], student.gather(-1, topk.clamp_min(0)))


def test_indexer_kl_averages_over_the_layers_that_count_a_token():
    """A layer whose query tokens all have no valid slot (or are masked) added 0 to the mean over layers and
    halved the others' (a review helper's probe); it is left out of the mean."""
    from functional_dsv41.train import loss as L
    g = torch.Generator().manual_seed(0)
    t, st = torch.rand(1, 3, 4, generator=g), torch.randn(1, 3, 4, generator=g)
    one = {2: {"teacher": t, "student": st}}
    none_valid = {"teacher": t, "student": st, "valid": torch.zeros(1, 3, 4, dtype=torch.bool)}
    alone = L.indexer_kl(one)
    assert alone > 0
    torch.testing.assert_close(L.indexer_kl({**one, 5: none_valid}), alone)
    torch.testing.assert_close(L.indexer_kl({**one, 7: {"teacher": t, "student": st}}), alone)
    assert L.indexer_kl({5: none_valid}) == 0
