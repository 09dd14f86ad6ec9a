"""torch.func over the whole model: grad of the param tree, per-example vmap(grad), jvp vs finite differences."""
import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jvp, vmap

import functional_dsv41 as fd
from functional_dsv41 import transforms
from functional_dsv41.pytree import flatten_with_paths, unflatten_from_paths

# vmap with a batched input or trunk param needs torch >= 2.13 (forward refuses it by name on 2.11-2.12)
needs_vmap_view_dtype = pytest.mark.skipif(not transforms.VMAP_VIEW_DTYPE, reason=(
    f"torch {torch.__version__} has no vmap rule for Tensor.view(dtype) (pytorch#180727, fixed in 2.13)"))


def tiny_model(seed=0, **overrides):
    cfg = fd.Config.tiny(max_seq_len=32, **overrides)
    params = fd.init_params(cfg, seed=seed)
    params["engram_token_map"] = torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size
    return cfg, params


def split(params, dtype=None):
    """(differentiable float leaves, the rest) as flat path dicts; optionally cast the float leaves."""
    flat = flatten_with_paths(params)
    train = {k: (v.to(dtype) if dtype else v) for k, v in flat.items()
             if v.is_floating_point() and v.dtype not in (torch.float8_e4m3fn, torch.float8_e8m0fnu)}
    frozen = {k: v for k, v in flat.items() if k not in train}
    return train, frozen


def next_token_loss(train, frozen, ids, cfg, **kw):
    params = unflatten_from_paths({**frozen, **train})
    logits = fd.forward(params, {"input_ids": ids}, cfg=cfg, mode="dequant", **kw).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def test_grad_of_whole_param_tree():
    cfg, params = tiny_model()
    train, frozen = split(params)
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    g = grad(next_token_loss)(train, frozen, ids, cfg)
    assert set(g) == set(train)
    assert all(torch.isfinite(v).all() for v in g.values())
    nonzero = {k for k, v in g.items() if v.abs().max() > 0}
    # every block's attention, mHC and shared expert, the embedding and the head learn
    for k in ("embed.weight", "head.weight", "norm.weight", "layers.0.attn.wq_a.weight", "layers.5.hc_ffn_fn",
              "layers.9.ffn.shared_experts.w2.weight", "layers.1.engram.wkv.weight", "layers.2.attn.attn_sink"):
        assert k in nonzero, k
    # the indexer chooses by top-k: no gradient reaches it without the KL loss (SPEC §5)
    assert "layers.2.attn.indexer.wq_b.weight" not in nonzero
    # DSpark stages are not in the backbone forward
    assert not any(k.startswith("mtp.") for k in nonzero)


@needs_vmap_view_dtype
def test_vmap_per_example_grad_equals_loop():
    cfg, params = tiny_model(seed=1)
    train, frozen = split(params, torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))

    def per_example(tr, x):
        return next_token_loss(tr, frozen, x[None], cfg, dispatch="dense", validate=False)

    batched = vmap(grad(per_example), in_dims=(None, 0))(train, ids)
    for i in range(ids.shape[0]):
        single = grad(per_example)(train, ids[i])
        for k in ("embed.weight", "layers.3.attn.wkv.weight", "layers.7.ffn.experts.1.w3.weight", "layers.4.hc_attn_fn"):
            torch.testing.assert_close(batched[k][i], single[k], atol=1e-6, rtol=1e-4)


def test_jvp_matches_finite_difference_fp32():
    """The smooth fp32 model (no activation QDQ) against central differences along a random direction."""
    cfg, params = tiny_model(seed=2)
    train, frozen = split(params, torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (1, 14), generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    # leaves whose path to the loss is fp32 end to end (the Engram value path is bf16 by design, and a
    # large step along attention queries flips top-k choices: finite differences are meaningless there)
    keys = ["norm.weight", "layers.3.ffn.shared_experts.w1.weight", "layers.5.attn.compressor.wkv.weight",
            "layers.6.hc_ffn_fn", "layers.8.attn.wo_b.weight"]
    direction = {k: (torch.randn(v.shape, generator=gen) if k in keys else torch.zeros_like(v)) for k, v in train.items()}

    def f(tr):
        return next_token_loss(tr, frozen, ids, cfg, qdq=False)

    _, tangent = jvp(f, (train,), (direction,))
    eps = 1e-3
    plus = f({k: v + eps * direction[k] for k, v in train.items()})
    minus = f({k: v - eps * direction[k] for k, v in train.items()})
    fd_est = (plus - minus) / (2 * eps)
    assert abs(tangent.item()) > 1e-2
    assert abs(tangent.item() - fd_est.item()) <= 1e-2 * abs(tangent.item()), (tangent.item(), fd_est.item())


def test_indexer_kl_terms_reach_the_indexer():
    """aux=True: teacher = attention mass on the selected compressed slots (a probability share, detached),
    student = indexer scores there; a loss on the student is the indexer's only gradient path."""
    cfg, params = tiny_model(seed=4)
    train, frozen = split(params, torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(4))

    def kl_loss(tr):
        p = unflatten_from_paths({**frozen, **tr})
        out = fd.forward(p, {"input_ids": ids}, cfg=cfg, mode="dequant", aux=True)
        total = 0
        for L, d in out.aux["indexer"].items():
            assert d["teacher"].shape == (2, 20, cfg.n_heads, d["student"].shape[-1])
            assert not d["teacher"].requires_grad
            share = d["teacher"].sum(-1)                         # per head: mass on compressed slots <= 1
            assert bool((share <= 1 + 1e-5).all()) and bool((share >= 0).all())
            st = torch.where(d["valid"], d["student"].float(), torch.zeros_like(d["student"].float()))
            total = total + (st * d["teacher"].sum(-2)).sum()
        assert set(out.aux["indexer"]) == set(cfg.index_source_layers)
        return total

    g = grad(kl_loss)(train)
    for L in cfg.index_source_layers:
        assert g[f"layers.{L}.attn.indexer.wq_b.weight"].abs().max() > 0, L
        assert g[f"layers.{L}.attn.indexer.weights_proj.weight"].abs().max() > 0, L


def test_qat_fake_quantises_fp8_layers_and_remat_keeps_gradients():
    """mode="qat" on float master weights: every layer the release stores in fp8/fp4 is fake-quantised
    (straight-through), so QAT differs from dequant; per-block activation checkpointing changes nothing."""
    from functional_dsv41.linear import fake_quant_weight, qat_format
    from functional_dsv41.train.step import remat
    cfg = fd.Config.tiny(dtype="fp8", expert_dtype="fp4", max_seq_len=32)
    params = fd.init_params(cfg, seed=5, master=True)
    params["engram_token_map"] = torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size
    assert qat_format(cfg) == "fp8" and qat_format(cfg, "experts") == "fp4"
    assert qat_format(fd.Config.tiny()) is None
    w = params["layers"][0]["attn"]["wq_a"]["weight"]
    assert not torch.equal(fake_quant_weight(w, "fp8"), w)
    train, frozen = split(params)
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(5))

    def loss(tr, mode, wrapper=None):
        p = unflatten_from_paths({**frozen, **tr})
        return fd.forward(p, {"input_ids": ids}, cfg=cfg, mode=mode, block_wrapper=wrapper).logits.square().mean()

    assert not torch.equal(loss(train, "qat"), loss(train, "dequant"))
    g_plain = grad(loss)(train, "qat")
    g_remat = grad(loss)(train, "qat", remat)
    assert g_plain["layers.0.attn.wq_a.weight"].abs().max() > 0
    for k in g_plain:
        torch.testing.assert_close(g_remat[k], g_plain[k], atol=0, rtol=0)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_qat_linear_is_the_release_linear_with_straight_through_gradients(fmt):
    """mode="qat" on a float master weight: forward = the release's linear on the weight quantised to its storage
    format (fp8 activations in 1 x 32 blocks, the block-scaled GEMM); backward = straight through both fake
    quantisers: dL/dx = g fq(W), dL/dW = g^T fq(x). The QAT tests checked only qat != dequant and nonzero
    gradients, so a QAT without the activation quantiser, or straight-through gradients halved, passed."""
    from functional_dsv41 import quant
    from functional_dsv41.linear import linear
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(64, 128, generator=gen) * 0.05).requires_grad_()
    x = torch.randn(3, 5, 128, generator=gen).requires_grad_()
    y = linear(x, {"weight": w}, mode="qat", fake=fmt)
    with torch.no_grad():
        stored = dict(zip(("weight", "scale"), quant.quant_fp8_block(w) if fmt == "fp8" else quant.quant_fp4(w)))
        release = linear(x.bfloat16(), stored, mode="reference").float()
        xq = quant.act_quant_dequant(x.bfloat16()).float()
        wq = quant.dequant_fp8_block(*quant.quant_fp8_block(w), torch.float32) if fmt == "fp8" else \
            quant.dequant_fp4(*quant.quant_fp4(w), torch.float32)
    torch.testing.assert_close(y, xq @ wq.T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y, release, rtol=8e-3, atol=1e-4)         # (the release's GEMM writes bf16)
    gy = torch.randn(y.shape, generator=gen)
    gx, gw = torch.autograd.grad(y, (x, w), gy)
    torch.testing.assert_close(gx, gy @ wq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, gy.flatten(0, 1).T @ xq.flatten(0, 1), rtol=1e-5, atol=1e-5)


def test_grad_through_a_decode_state_equals_the_stateless_grad():
    """Differentiating two chunks joined by a DecodeState gives the gradient of one forward over the whole
    sequence (the values are bit-identical). The compressed-KV history used to be appended in place under
    no_grad, so reverse mode lost every path from the second chunk into the rows the first one wrote (17% off
    here) while jvp kept them."""
    cfg = fd.Config.tiny(max_seq_len=64)
    params = fd.init_params(cfg, seed=6)
    params["engram_token_map"] = torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size
    train, frozen = split(params, torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(6))

    def full(tr):
        p = unflatten_from_paths({**frozen, **tr})
        return fd.forward(p, {"input_ids": ids}, cfg=cfg, mode="dequant").logits[:, 30:].square().mean()

    def chunked(tr):
        p = unflatten_from_paths({**frozen, **tr})
        o = fd.forward(p, {"input_ids": ids[:, :30]}, cfg=cfg, mode="dequant", state=fd.init_state(cfg, 1, 64))
        return fd.forward(p, {"input_ids": ids[:, 30:]}, cfg=cfg, mode="dequant", state=o.state).logits.square().mean()

    assert torch.equal(full(train), chunked(train))
    gen = torch.Generator().manual_seed(7)
    v = {k: torch.randn(x.shape, generator=gen) for k, x in train.items()}
    _, t_full = jvp(full, (train,), (v,))
    g = grad(chunked)(train)
    dot = sum((g[k].double() * v[k].double()).sum() for k in g).item()
    assert abs(dot - t_full.item()) <= 2e-3 * abs(t_full.item()), (dot, t_full.item())
    # the compressor (whose rows the history holds) reaches the second chunk's loss through the state
    g_full = grad(full)(train)
    k = "layers.2.attn.compressor.wkv.weight"
    assert (g[k] - g_full[k]).norm() <= 0.02 * g_full[k].norm(), ((g[k] - g_full[k]).norm(), g_full[k].norm())


@needs_vmap_view_dtype
def test_vmap_can_return_the_forward_output():
    """vmap over forward may return the ForwardOutput itself: its unset fields (state, aux, ...) are no pytree
    leaves for torch either (a torch None leaf made vmap refuse the output: "must only return Tensors")."""
    import torch.utils._pytree as tp
    cfg, params = tiny_model(seed=8)
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(8))

    def one(x):
        return fd.forward(params, {"input_ids": x[None]}, cfg=cfg, mode="dequant", dispatch="dense", validate=False,
                          return_hidden=True)

    out = vmap(one)(ids)
    full = fd.forward(params, {"input_ids": ids}, cfg=cfg, mode="dequant", return_hidden=True)
    assert out.state is None and out.aux is None
    assert torch.equal(out.logits[:, 0], full.logits) and torch.equal(out.hidden[3][:, 0], full.hidden[3])
    assert torch.equal(out.topk[5][:, 0], full.topk[5]) and torch.equal(out.candidates[:, 0], full.candidates)
    # torch and optree see the same leaves of a carrier
    leaves = tp.tree_leaves(full)
    assert all(isinstance(t, torch.Tensor) for t in leaves) and len(leaves) == len(fd.flatten_with_paths(full))
    assert tp.tree_unflatten(leaves, tp.tree_structure(full)).state is None


def test_grad_in_reference_mode_over_fp8_weights_says_to_use_dequant():
    """The release's fp8 path (act_quant + block-scaled GEMM) has no input gradient: grad over the default mode
    with an fp8 checkpoint failed in torch's backward with '"add_stub" not implemented for Float8_e4m3fn', and
    jvp returned a number unrelated to the dequant model's derivative (-4.5 against 12.7 on one tiny model)."""
    import pytest
    cfg = fd.Config.tiny(dtype="fp8", expert_dtype="fp4", max_seq_len=32)
    params = fd.init_params(cfg, seed=9)
    params["engram_token_map"] = torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size
    flat = flatten_with_paths(params)
    train = {k: v.float() for k, v in flat.items() if v.dtype in (torch.bfloat16, torch.float32)}
    frozen = {k: v for k, v in flat.items() if k not in train}                # fp8 / fp4 storage + scales
    ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(9))

    def loss(tr, mode):
        p = unflatten_from_paths({**frozen, **tr})
        return fd.forward(p, {"input_ids": ids}, cfg=cfg, mode=mode).logits.square().mean()

    with pytest.raises(ValueError, match="mode='reference'.*no gradient.*mode='dequant'"):
        grad(loss)(train, "reference")
    # forward mode rounded the tangent to fp8 with the activation: a silently meaningless derivative
    v = {k: torch.randn(x.shape, generator=torch.Generator().manual_seed(10)) for k, x in train.items()}
    with pytest.raises(ValueError, match="mode='reference'.*no gradient"):
        jvp(lambda tr: loss(tr, "reference"), (train,), (v,))
    jvp(lambda tr: loss(tr, "dequant"), (train,), (v,))
    assert grad(loss)(train, "dequant")["layers.0.attn_norm.weight"].abs().max() > 0
    with torch.no_grad():                                    # inference in reference mode is unaffected
        loss(train, "reference")


@needs_vmap_view_dtype
def test_vmap_over_an_ensemble_of_qat_masters():
    """vmap over stacked QAT master trees in mode "qat" failed: the fake quantiser's weight finite check (a host
    sync per QAT linear per step, too) is data-dependent control flow under vmap (a helper's probe)."""
    cfg = fd.Config.tiny(max_seq_len=32, dtype="fp8", expert_dtype="fp4")
    trees = []
    for seed in (0, 1):
        p = fd.init_params(cfg, seed=seed, master=True)
        p["engram_token_map"] = torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size
        trees.append(split(p))
    frozen = trees[0][1]
    stacked = {k: torch.stack([trees[0][0][k], trees[1][0][k]]) for k in trees[0][0]}
    ids = torch.randint(0, cfg.vocab_size, (10,), generator=torch.Generator().manual_seed(0))

    def loss(tr, x):
        logits = fd.forward(unflatten_from_paths({**frozen, **tr}), {"input_ids": x[None]}, cfg=cfg, mode="qat",
                            dispatch="dense", validate=False).logits
        return F.cross_entropy(logits[0, :-1].float(), x[1:])

    batched = vmap(loss, in_dims=(0, None))(stacked, ids)
    for i in range(2):
        torch.testing.assert_close(batched[i], loss({k: v[i] for k, v in stacked.items()}, ids), atol=1e-5, rtol=1e-5)


def _vmap_refused(name):
    """(a call under vmap, the exception, its message) of a vmap setup forward refuses by name. Each failed deep
    inside torch before ("calling .item()", "Cannot access data pointer of Tensor that doesn't have storage",
    "inplace arithmetic ... vmapped over", "TileLang cannot run here"; a helper's probe); forward's docstring
    lists what runs."""
    cfg, params = tiny_model(seed=10)
    ids = torch.randint(0, cfg.vocab_size, (3, 10), generator=torch.Generator().manual_seed(10))
    dense = dict(dispatch="dense", validate=False)

    def per_row(extra=lambda i: {}, **kw):              # vmap over the rows of ids, each run as a batch of one
        return lambda: vmap(lambda x, i: fd.forward(params, {"input_ids": x[None], **extra(i)}, cfg=cfg,
                                                    mode="dequant", **kw).logits)(ids, torch.arange(3))

    leaf = "layers.0.attn.wq_a.weight"
    w = flatten_with_paths(params)[leaf]

    def stacked_leaf():
        return vmap(lambda w: fd.forward(unflatten_from_paths({**flatten_with_paths(params), leaf: w}),
                                         {"input_ids": ids[:1]}, cfg=cfg, mode="dequant").logits)(torch.stack([w, w]))

    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]] * 3)

    def image_rows():                                   # rows holding one image span each, the rows vmapped
        from functional_dsv41.image_processor import expand_image_tokens
        vcfg, vparams = tiny_model(seed=10, vision_n_layers=1)
        vids, types = expand_image_tokens([5, vcfg.image_token_id, 7], [(2, 2)], vcfg)
        image = (torch.zeros(4, 3, vcfg.vision_patch_size, vcfg.vision_patch_size, dtype=torch.bfloat16), (2, 2))
        batch = {"token_types": types[None], "images": [[image]]}
        return vmap(lambda x: fd.forward(vparams, {"input_ids": x[None], **batch}, cfg=vcfg, **dense).logits)(
            torch.stack([vids, vids]))

    return {
        "examples, defaults": (per_row(), ValueError,
                               r"with input_ids batched: pass validate=False \(.*\) and dispatch='dense'"),
        "examples, sorted dispatch": (per_row(validate=False), ValueError,
                                      r"with input_ids batched: pass dispatch='dense' \(dispatch='sorted'"),
        "stacked leaf, sorted dispatch": (stacked_leaf, ValueError, rf"with params {leaf} batched: pass dispatch="),
        "1-D ids": (lambda: vmap(lambda x: fd.forward(params, {"input_ids": x}, cfg=cfg, **dense))(ids), ValueError,
                    r"got shape \(10,\) \(under torch.func.vmap an example's ids are \[seq\]: pass x\[None\]\)"),
        "packed positions": (per_row(lambda i: {"positions": pos[i][None]}, **dense), NotImplementedError,
                             r"packed 'positions' batched by torch.func.vmap are not supported"),
        "decode state": (per_row(state=fd.init_state(cfg, 1, 32), **dense), NotImplementedError,
                         r"a DecodeState cannot be used under torch.func.vmap with input_ids batched"),
        "impl tilelang": (per_row(impl="tilelang", **dense), ValueError,
                          r"impl='tilelang' cannot run under torch.func.vmap"),
        "images, batched rows": (image_rows, NotImplementedError,
                                 r"a batch with images cannot have input_ids batched by torch.func.vmap"),
    }[name]


@pytest.mark.parametrize("name", ["examples, defaults", "examples, sorted dispatch", "stacked leaf, sorted dispatch",
                                  "1-D ids", "packed positions", "decode state", "impl tilelang",
                                  "images, batched rows"])
def test_unsupported_vmap_setups_are_refused_by_name(name):
    call, exc, match = _vmap_refused(name)
    with pytest.raises(exc, match=match):
        call()


def test_vmap_over_a_head_ensemble_runs_with_the_defaults(monkeypatch):
    """Leaves read only after the last MoE router (the head here) may be vmapped with the sorted dispatch and the
    input checks on: forward's vmap refusals must not take them (nothing batched reaches a router). Every kernel
    op runs the torch reference under vmap: on a GPU impl="auto" picked the TileLang ops, whose autograd.Functions
    functorch refuses under vmap even on unbatched tensors ("You tried to vmap over _HcSplitSinkhorn", H200)."""
    from functional_dsv41 import kernels as K
    cfg, params = tiny_model(seed=11)
    ids = torch.randint(0, cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(11))
    heads = torch.stack([params["head"]["weight"], params["head"]["weight"].flip(0)])

    def one(w):
        return fd.forward({**params, "head": {"weight": w}}, {"input_ids": ids}, cfg=cfg, mode="dequant",
                          impl="auto").logits

    impls, resolve = [], K.resolve
    monkeypatch.setattr(K, "resolve", lambda name, impl=None, **kw: impls.append(impl) or resolve(name, impl, **kw))
    out = vmap(one)(heads)
    assert impls and set(impls) == {"torch"}, set(impls)
    monkeypatch.setattr(K, "resolve", resolve)
    for i in range(2):
        torch.testing.assert_close(out[i], one(heads[i]), atol=1e-5, rtol=1e-5)


def test_vmap_on_a_torch_without_the_view_dtype_rule_is_refused_by_name(monkeypatch):
    """torch 2.11-2.12 (the GPU machine's) fail every vmap with a batched input or trunk param deep inside the
    quantisation ("Batching rule not implemented for aten::view.dtype"): forward names the torch version instead,
    after the setup's own fixes; a vmap that reaches no router (a head ensemble) still runs."""
    monkeypatch.setattr(transforms, "VMAP_VIEW_DTYPE", False)
    cfg, params = tiny_model(seed=12)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(12))
    with pytest.raises(NotImplementedError, match=r"input_ids batched needs torch >= 2.13: .*pytorch#180727"):
        vmap(lambda x: fd.forward(params, {"input_ids": x[None]}, cfg=cfg, mode="dequant", dispatch="dense",
                                  validate=False).logits)(ids)
    with pytest.raises(ValueError, match=r"pass validate=False"):       # the setup's own fix is named first
        vmap(lambda x: fd.forward(params, {"input_ids": x[None]}, cfg=cfg, dispatch="dense").logits)(ids)
    heads = torch.stack([params["head"]["weight"]] * 2)
    out = vmap(lambda w: fd.forward({**params, "head": {"weight": w}}, {"input_ids": ids[:1]}, cfg=cfg,
                                    mode="dequant").logits)(heads)
    assert out.shape[0] == 2 and torch.equal(out[0], out[1])


def test_vjp_jacrev_jacfwd_and_hvp_over_split_params_with_the_defaults():
    """README's recipe (train.step.split_params + assemble) under the other transforms forward's docstring names,
    with forward's defaults (mode "reference" on a bf16 tree): vjp and jacrev of the scalar loss give grad's
    gradient; jacfwd (forward mode) agrees with it on one leaf; jvp(grad) (forward-over-reverse Hessian-vector
    product) agrees with reverse-over-reverse."""
    from torch.func import jacfwd, jacrev, vjp
    from functional_dsv41.train.step import assemble, split_params
    cfg, params = tiny_model(seed=13)
    ids = torch.randint(0, cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(13))
    trainable, frozen = split_params(params)

    def loss(t):
        logits = fd.forward(assemble(t, frozen), {"input_ids": ids}, cfg=cfg).logits
        return F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])

    g = grad(loss)(trainable)
    _, pull = vjp(loss, trainable)
    (gv,) = pull(torch.ones(()))
    gr = jacrev(loss)(trainable)
    for k in g:
        torch.testing.assert_close(gv[k], g[k], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(gr[k], g[k], rtol=1e-5, atol=1e-7)
    leaf = "layers.2.attn.attn_sink"
    assert g[leaf].abs().max() > 0

    def f(w):
        return loss({**trainable, leaf: w})

    w = trainable[leaf]
    torch.testing.assert_close(jacfwd(f)(w), g[leaf], rtol=1e-3, atol=1e-6)
    v = torch.randn(w.shape, generator=torch.Generator().manual_seed(1))
    hvp_fwd = jvp(grad(f), (w,), (v,))[1]
    hvp_rev = grad(lambda x: (grad(f)(x) * v).sum())(w)
    assert hvp_fwd.abs().max() > 0
    torch.testing.assert_close(hvp_fwd, hvp_rev, rtol=1e-3, atol=1e-6)
