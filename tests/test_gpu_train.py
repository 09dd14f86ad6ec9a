"""Training on a GPU through the TileLang kernels' backwards (issue #7 item 5). GPU only.

The README's training model (``run.tiny_model``) widened to 16 attention heads of 128 dims and 16 indexer heads,
so that the TileLang sparse attention and index scores cover its shapes (their tiles need heads in multiples of
16; the tiny model falls back to torch), with the indexer KL on so the index scores' backward runs too. On CUDA,
``impl="auto"`` (TileLang) and ``impl="torch"`` (the reference) must give the same losses and gradients within
bf16 noise, and the TileLang ops must actually have run, forward and backward, under ``torch.func.grad`` (what
``train.step`` uses). Then a few optimizer steps on one fixed batch must lower the loss.
"""
import pytest
import torch

import functional_dsv41 as fd
from functional_dsv41 import kernels
from functional_dsv41.train import data as D
from functional_dsv41.train import loss as L
from functional_dsv41.train import optim, run
from functional_dsv41.train import step as S
from functional_dsv41.train import tokenizer as T

from conftest import cosine_diff

pytestmark = pytest.mark.gpu

PAD = 2
COUNTED = ("sparse_attn", "hc_split_sinkhorn", "index_scores", "index_topk")


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    cfg = run.tiny_model(n_heads=16, head_dim=128, index_n_heads=16, max_seq_len=256)
    from functional_dsv41.engram import build_token_map
    tm = torch.as_tensor(build_token_map(T.TOKENIZER_JSON), dtype=torch.int64)
    tr, fr = run.init_train_params(cfg, run.RunConfig(seed=0), tm)
    to_cuda = lambda d: {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
    tr, fr = to_cuda(tr), to_cuda(fr)
    samples = list(D.shipped_samples(T.CORPUS_TXT, T.TOKENIZER_JSON))
    ids, pos = D.pack(samples[:40], row_len=128, pad_id=PAD)
    ids, pos = torch.from_numpy(ids[:2]).cuda(), torch.from_numpy(pos[:2]).cuda()
    batch = {"input_ids": ids, "positions": pos, "labels": D.make_labels(ids, pos, PAD)}
    return cfg, tr, fr, batch


@pytest.fixture
def counts(monkeypatch):
    """Calls into the TileLang implementations (forward) and their autograd backwards."""
    import functional_dsv41.kernels.tilelang as tl
    n = {k: 0 for k in COUNTED}
    for name in COUNTED:
        fn = getattr(tl, name)

        def counted(*a, _fn=fn, _name=name, **k):
            n[_name] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(tl, name, counted)
    from functional_dsv41.kernels.tilelang import indexer_tl, sparse_attn_tl
    for mod, fname, key in ((sparse_attn_tl, "_bwd", "sparse_attn.bwd"), (indexer_tl, "_score_bwd", "index_scores.bwd")):
        fn = getattr(mod, fname)
        n[key] = 0

        def counted_b(*a, _fn=fn, _key=key, **k):
            n[_key] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(mod, fname, counted_b)
    kernels._tilelang_op.cache_clear()
    yield n
    kernels._tilelang_op.cache_clear()


def _loss_and_grads(cfg, tr, fr, batch, impl):
    dtypes = S.compute_dtypes(cfg, tr)

    def lf(t):
        return L.compute_losses(S.assemble(t, fr, dtypes), batch, cfg=cfg, coefs={"ce": 1.0, "indexer_kl": 0.1},
                                forward=fd.forward, pad_id=PAD, forward_kwargs={"impl": impl})

    grads, (total, parts) = torch.func.grad_and_value(lf, has_aux=True)(tr)
    return total, parts, grads


def test_tilelang_backwards_match_torch_in_a_training_step(setup, counts):
    cfg, tr, fr, batch = setup
    t_ref, p_ref, g_ref = _loss_and_grads(cfg, tr, fr, batch, "torch")
    assert all(v == 0 for v in counts.values()), counts
    t_tl, p_tl, g_tl = _loss_and_grads(cfg, tr, fr, batch, "auto")
    print("TileLang calls:", counts)
    for key in ("sparse_attn", "hc_split_sinkhorn", "index_scores", "sparse_attn.bwd", "index_scores.bwd"):
        assert counts[key] > 0, f"{key} never ran on TileLang: {counts}"
    for k in p_ref:
        assert float(p_tl[k]) == pytest.approx(float(p_ref[k]), rel=2e-3), (k, float(p_tl[k]), float(p_ref[k]))
    worst = []
    for k in g_ref:
        a, b = g_tl[k].float(), g_ref[k].float()
        assert torch.isfinite(a).all(), k
        if b.abs().max() == 0:
            assert a.abs().max() == 0, f"{k}: TileLang gives a gradient where torch gives none"
            continue
        worst.append((cosine_diff(a.cpu(), b.cpu()), k))
    worst.sort(reverse=True)
    print("worst gradient cosine diffs:", [f"{k} {c:.1e}" for c, k in worst[:5]])
    # bf16 activations: per-tensor gradients agree to bf16 noise (a flipped top-k entry would show as ~1e-1)
    assert worst[0][0] < 1e-2, worst[:5]
    assert sum(c for c, _ in worst) / len(worst) < 1e-3, worst[:5]
    # the attention and indexer weights, whose gradients the TileLang backwards produce
    for k in ("layers.2.attn.wq_b.weight", "layers.0.attn.wkv.weight", "layers.4.attn.indexer.wq_b.weight",
              "layers.0.hc_attn_fn"):
        assert cosine_diff(g_tl[k].float().cpu(), g_ref[k].float().cpu()) < 1e-2, k


def test_training_steps_on_tilelang_lower_the_loss(setup, counts):
    cfg, tr, fr, batch = setup
    step = S.make_step(cfg, frozen=fr, dtypes=S.compute_dtypes(cfg, tr), forward=fd.forward, coefs={"ce": 1.0},
                       pad_id=PAD, adamw=optim.AdamWConfig(weight_decay=0.0), forward_kwargs={"impl": "auto"})
    opt = optim.adamw_init(tr)
    t, losses = tr, []
    for i in range(12):
        t, opt, m = step(t, opt, batch, lr=optim.lr_at(i, peak=1e-2, warmup=2, total=12), step_no=i + 1)
        losses.append(m["loss/ce"])
    print("losses:", [f"{x:.3f}" for x in losses], counts)
    assert counts["sparse_attn.bwd"] >= 12
    assert losses[-1] < losses[0] * 0.7, losses
