"""Training against the real forward: packing isolation, loss parts, indexer gradient, frozen tables,
overfitting a fixed batch."""
import pytest
import torch

import functional_dsv41 as fd
from functional_dsv41.train import data as D
from functional_dsv41.train import loss as L
from functional_dsv41.train import optim, run
from functional_dsv41.train import step as S
from functional_dsv41.train import tokenizer as T

PAD = 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Like run.py's default: these small ops run faster on 1 thread, and far faster on a shared machine."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def setup(one_thread):
    torch.manual_seed(0)
    cfg = run.tiny_model()
    rc = run.RunConfig(seed=0, loss_indexer_kl=0.1)        # the indexer trainable (CE alone would freeze it)
    from functional_dsv41.engram import build_token_map
    tm = torch.as_tensor(build_token_map(T.TOKENIZER_JSON), dtype=torch.int64)
    tr, fr = run.init_train_params(cfg, rc, tm)
    samples = list(D.shipped_samples(T.CORPUS_TXT, T.TOKENIZER_JSON))
    short = [x for x in samples if len(x) <= 24][:12]                 # several whole samples per row
    ids, pos = D.pack(short, row_len=48, pad_id=PAD)
    ids, pos = torch.from_numpy(ids[:2]), torch.from_numpy(pos[:2])
    batch = {"input_ids": ids, "positions": pos, "labels": D.make_labels(ids, pos, PAD)}
    return cfg, tr, fr, batch


def _params(cfg, tr, fr):
    return S.assemble(tr, fr, S.compute_dtypes(cfg, tr))


def _segments(pos_row):
    starts = [i for i in range(len(pos_row)) if pos_row[i] == 0] + [len(pos_row)]
    return list(zip(starts, starts[1:]))


def test_packing_isolation(setup):
    """Rewriting one packed sample leaves every other sample's per-token losses unchanged."""
    cfg, tr, fr, batch = setup
    params = _params(cfg, tr, fr)
    segs = _segments(batch["positions"][0].tolist())
    assert len(segs) >= 2, "need a row with at least two samples"
    a, b = segs[0]
    ids2 = batch["input_ids"].clone()
    g = torch.Generator().manual_seed(5)
    ids2[0, a + 1:b] = torch.randint(3, cfg.vocab_size - 6, (b - a - 1,), generator=g)
    with torch.no_grad():
        lg = [fd.forward(params, {"input_ids": x, "positions": batch["positions"]}, cfg=cfg, mode="dequant").logits
              for x in (batch["input_ids"], ids2)]
    ce = [L.per_token_ce(lo, D.make_labels(x, batch["positions"], PAD))
          for lo, x in zip(lg, (batch["input_ids"], ids2))]
    assert torch.equal(lg[0][0, a], lg[1][0, a])                            # causal: the kept first token
    assert not torch.equal(lg[0][0, a + 1], lg[1][0, a + 1])
    assert not torch.equal(ce[0][0, a:b - 1], ce[1][0, a:b - 1])           # the rewritten sample changed
    assert torch.equal(ce[0][0, b:], ce[1][0, b:])                          # the others did not, bit for bit
    assert torch.equal(ce[0][1], ce[1][1])


def test_loss_parts_follow_coefficients(setup):
    cfg, tr, fr, batch = setup
    params = _params(cfg, tr, fr)
    calls = []

    def spy(*a, **k):
        calls.append(k)
        return fd.forward(*a, **{n: v for n, v in k.items()})

    with torch.no_grad():
        total, parts = L.compute_losses(params, batch, cfg=cfg, coefs={"ce": 1.0, "indexer_kl": 0.0, "draft": -1},
                                        forward=spy, pad_id=PAD)
    assert set(parts) == {"ce"} and "aux" not in calls[-1]            # off parts are not computed at all
    assert torch.equal(total, parts["ce"])
    with torch.no_grad():
        total2, parts2 = L.compute_losses(params, batch, cfg=cfg, coefs={"ce": 2.5}, forward=fd.forward, pad_id=PAD)
    assert torch.allclose(total2, 2.5 * parts2["ce"]) and torch.equal(parts2["ce"], parts["ce"])
    with pytest.raises(ValueError, match="nothing to train"):
        L.compute_losses(params, batch, cfg=cfg, coefs={"ce": 0.0}, forward=fd.forward)
    with pytest.raises(KeyError):
        L.compute_losses(params, batch, cfg=cfg, coefs={"cee": 1.0}, forward=fd.forward)


def test_indexer_kl_part_when_the_forward_has_aux(setup):
    cfg, tr, fr, batch = setup
    params = _params(cfg, tr, fr)
    total, parts = L.compute_losses(params, batch, cfg=cfg, coefs={"ce": 1.0, "indexer_kl": 0.1},
                                    forward=fd.forward, pad_id=PAD)
    assert set(parts) == {"ce", "indexer_kl"} and bool(torch.isfinite(parts["indexer_kl"]))
    assert float(parts["indexer_kl"]) >= 0
    assert torch.allclose(total, parts["ce"] + 0.1 * parts["indexer_kl"])
    dtypes = S.compute_dtypes(cfg, tr)
    grads = torch.func.grad(lambda t: L.compute_losses(S.assemble(t, fr, dtypes), batch, cfg=cfg, forward=fd.forward,
                                                       coefs={"indexer_kl": 1.0}, pad_id=PAD)[0])(tr)
    for k in ("layers.2.attn.indexer.wq_b.weight", "layers.5.attn.indexer.weights_proj.weight",
              "layers.2.attn.indexer.wk.weight"):
        assert float(grads[k].abs().max()) > 0, f"the KL gives {k} no gradient"
    # the indexer's inputs are detached: the KL trains the indexer and nothing else (DeepSeek-V3.2)
    reached = sorted(k for k, g in grads.items() if ".attn.indexer." not in k and bool(g.abs().max() > 0))
    assert not reached, f"the indexer KL reaches {len(reached)} non-indexer leaves, e.g. {reached[:3]}"


def test_remat_keeps_the_indexer_kl_and_its_gradients(setup):
    """Per-block remat recomputes the block, the indexer-KL terms included: same loss and gradients."""
    cfg, tr, fr, batch = setup
    dtypes = S.compute_dtypes(cfg, tr)
    coefs = {"ce": 1.0, "indexer_kl": 0.5}

    def loss(t, **fkw):
        fwd = (lambda *a, **k: fd.forward(*a, **k, **fkw)) if fkw else fd.forward
        return L.compute_losses(S.assemble(t, fr, dtypes), batch, cfg=cfg, forward=fwd, coefs=coefs, pad_id=PAD)[0]

    g0, v0 = torch.func.grad_and_value(loss)(tr)
    g1, v1 = torch.func.grad_and_value(lambda t: loss(t, **S.remat_forward_kwargs(fd.forward)))(tr)
    assert torch.equal(v0, v1)
    for k in g0:
        assert torch.equal(g0[k], g1[k]), k
    assert float(g1["layers.2.attn.indexer.wq_b.weight"].abs().max()) > 0


def test_draft_loss_part(setup):
    _, _, _, batch = setup
    cfg = run.PRESETS["tiny-dspark"][0](T.TOKENIZER_JSON)
    from functional_dsv41.engram import build_token_map
    tm = torch.as_tensor(build_token_map(T.TOKENIZER_JSON), dtype=torch.int64)
    tr, fr = run.init_train_params(cfg, run.RunConfig(loss_draft=1.0), tm)
    from functional_dsv41.dspark import dspark_forward
    step = S.make_step(cfg, frozen=fr, dtypes=S.compute_dtypes(cfg, tr), forward=fd.forward,
                       coefs={"ce": 1.0, "draft": 0.5}, pad_id=PAD, draft_forward=dspark_forward,
                       draft_anchor_stride=3)
    t, o, m = step(tr, optim.adamw_init(tr), batch, lr=1e-3, step_no=1)
    assert {"loss/ce", "loss/draft", "loss/total"} <= set(m)
    assert m["loss/total"] == pytest.approx(m["loss/ce"] + 0.5 * m["loss/draft"], rel=1e-5)
    assert not torch.equal(t["mtp.0.main_proj.weight"], tr["mtp.0.main_proj.weight"])   # the draft trains


def test_indexer_gets_no_gradient_without_kl_and_frozen_tables_stay(setup):
    cfg, tr, fr, batch = setup
    assert not any(".engram.embed." in k for k in tr)                 # frozen: no grad, no optimizer state
    assert any(".engram.embed.weight" in k for k in fr) and "engram_token_map" in fr
    dtypes = S.compute_dtypes(cfg, tr)
    step = S.make_step(cfg, frozen=fr, dtypes=dtypes, forward=fd.forward, coefs={"ce": 1.0}, pad_id=PAD)

    def lf(t):
        return L.compute_losses(S.assemble(t, fr, dtypes), batch, cfg=cfg, coefs={"ce": 1.0},
                                forward=fd.forward, pad_id=PAD)[0]

    grads = torch.func.grad(lf)(tr)
    idx = [k for k in grads if ".attn.indexer." in k]
    assert idx and all(float(grads[k].abs().max()) == 0.0 for k in idx), "indexer got a gradient from CE"
    assert float(grads["layers.2.attn.compressor.wkv.weight"].abs().max()) > 0
    assert float(grads["layers.1.engram.wkv.weight"].abs().max()) > 0
    opt = optim.adamw_init(tr)
    assert set(opt["mu"]) == set(tr)
    before = {k: v.clone() for k, v in fr.items() if isinstance(v, torch.Tensor)}
    t2, o2 = tr, opt
    for i in range(2):
        t2, o2, m = step(t2, o2, batch, lr=1e-3, step_no=i + 1)
    assert all(torch.equal(before[k].view(torch.uint8) if before[k].element_size() == 1 else before[k],
                           fr[k].view(torch.uint8) if fr[k].element_size() == 1 else fr[k]) for k in before)
    assert set(o2["mu"]) == set(tr)


def test_overfit_fixed_batch(setup):
    cfg, tr, fr, batch = setup
    step = S.make_step(cfg, frozen=fr, dtypes=S.compute_dtypes(cfg, tr), forward=fd.forward, coefs={"ce": 1.0},
                       pad_id=PAD, adamw=optim.AdamWConfig(weight_decay=0.0))
    opt = optim.adamw_init(tr)
    t, losses = tr, []
    for i in range(25):
        t, opt, m = step(t, opt, batch, lr=optim.lr_at(i, peak=1e-2, warmup=3, total=25), step_no=i + 1)
        losses.append(m["loss/ce"])
    assert losses[-1] < losses[0] / 4, losses


def test_qat_mode_reaches_the_model(setup):
    """mode="qat" is passed through: on the fp8/fp4 preset the fake-quantised forward differs from the
    plain one, and straight-through gradients reach the fp32 master weights of the routed experts."""
    _, _, _, batch = setup
    cfg = run.PRESETS["tiny-qat"][0](T.TOKENIZER_JSON)
    from functional_dsv41.engram import build_token_map
    tm = torch.as_tensor(build_token_map(T.TOKENIZER_JSON), dtype=torch.int64)
    tr, fr = run.init_train_params(cfg, run.RunConfig(loss_draft=1.0), tm)
    assert tr["layers.0.ffn.experts.0.w1.weight"].dtype == torch.float32            # master, not fp4 storage
    dtypes = S.compute_dtypes(cfg, tr)

    def lf(t, mode):
        return L.compute_losses(S.assemble(t, fr, dtypes), batch, cfg=cfg, coefs={"ce": 1.0}, forward=fd.forward,
                                mode=mode, pad_id=PAD)[0]

    g_q, l_q = torch.func.grad_and_value(lambda t: lf(t, "qat"))(tr)
    with torch.no_grad():
        l_d = lf(tr, "dequant")
    assert bool(torch.isfinite(l_q)) and float(l_q) != float(l_d)
    assert float(g_q["layers.0.ffn.experts.0.w1.weight"].abs().max()) > 0
    assert all(bool(torch.isfinite(g).all()) for g in g_q.values())


def test_params_no_active_loss_reaches_are_frozen():
    """CE alone reaches neither the indexer (its inputs are detached, its scores only select) nor the DSpark
    stages: their gradient is exactly zero, and AdamW's weight decay would still shrink them every step, so
    run.py freezes them (step.unreached_patterns); each joins the trainable set with its own loss part."""
    cfg = run.PRESETS["tiny-dspark"][0](T.TOKENIZER_JSON)
    from functional_dsv41.engram import build_token_map
    tm = torch.as_tensor(build_token_map(T.TOKENIZER_JSON), dtype=torch.int64)
    for coefs, frozen_parts in (({}, (".attn.indexer.", "mtp.")), ({"loss_draft": 1.0}, (".attn.indexer.",)),
                                ({"loss_indexer_kl": 1.0}, ("mtp.",)),
                                ({"loss_draft": 1.0, "loss_indexer_kl": 1.0}, ())):
        tr, fr = run.init_train_params(cfg, run.RunConfig(**coefs), tm)
        for part in (".attn.indexer.", "mtp."):
            in_tr = any(part in k for k in tr)
            assert in_tr == (part not in frozen_parts), (coefs, part)
            if part in frozen_parts:
                assert any(part in k for k in fr), (coefs, part)


def test_draft_loss_leaves_out_padding_and_needs_pad_id(setup):
    """With pad_id=None the draft and indexer-KL parts averaged the packed rows' padding in; now they refuse, and
    with pad_id the draft is the mean per-token CE over the real (non-padding, in-sample) targets."""
    _, _, _, batch = setup
    assert bool((batch["input_ids"] == PAD).any())                     # the rows are padded
    cfg = run.PRESETS["tiny-dspark"][0](T.TOKENIZER_JSON)
    from functional_dsv41.dspark import dspark_forward
    from functional_dsv41.engram import build_token_map
    tm = torch.as_tensor(build_token_map(T.TOKENIZER_JSON), dtype=torch.int64)
    tr, fr = run.init_train_params(cfg, run.RunConfig(loss_draft=1.0), tm)
    params = _params(cfg, tr, fr)
    seen = {}

    def spy(*a, **k):
        seen["d"] = dspark_forward(*a, **k)
        return seen["d"]
    for coefs in ({"draft": 1.0}, {"ce": 1.0, "indexer_kl": 0.1}):
        with pytest.raises(ValueError, match=r"are on but pad_id is None"):
            L.compute_losses(params, batch, cfg=cfg, coefs=coefs, forward=fd.forward, draft_forward=spy)
    with torch.no_grad():
        _, parts = L.compute_losses(params, batch, cfg=cfg, coefs={"draft": 1.0}, forward=fd.forward, pad_id=PAD,
                                    draft_forward=spy)
    d = seen["d"]
    real = (d.targets >= 0) & (d.targets != PAD)
    assert bool(((d.targets == PAD) & (d.targets >= 0)).any())        # padding had draft targets to leave out
    want = L.per_token_ce(d.logits, torch.where(real, d.targets, torch.full_like(d.targets, L.IGNORE))).sum() \
        / real.sum()
    torch.testing.assert_close(parts["draft"], want, rtol=1e-5, atol=1e-6)
