"""One rank of tests/test_sharding.py: python tests/_sharding_worker.py RANK WORLD PORT SCENARIO [FOLDER]
[--device cuda].

Each rank builds the same tiny model, runs it plain and sharded over a gloo CPU mesh (``--device cuda``: an NCCL
mesh, rank r on GPU r), and raises (exit 1, the message on stderr) where the sharded run differs; it prints "ok
SCENARIO" when every check passed.

On the CPU the sharded forward's values are the plain tree's bit for bit (each sum over a mesh dim has one nonzero
term per element). On CUDA the ranks' local GEMMs may be other cuBLAS kernels than the plain tree's (the head's
half of the vocabulary is another shape), so there the values are checked within fp32 rounding of the plain ones
and the worker prints how many of them were bit-equal anyway.
"""
import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import optree  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import functional_dsv41 as fd  # noqa: E402
from functional_dsv41 import sharding  # noqa: E402
from functional_dsv41.dspark import dspark_forward  # noqa: E402
from functional_dsv41.train import optim  # noqa: E402
from functional_dsv41.pytree import flatten_with_paths  # noqa: E402

MESHES = {"ep": ((2,), ("ep",)), "emb": ((2,), ("emb",)), "ep2_emb1": ((2, 1), ("ep", "emb")),
          "ep1_emb2": ((1, 2), ("ep", "emb"))}
DEV = torch.device("cpu")       # main() sets cuda:RANK under --device cuda
EXACT = {"equal": 0, "within rounding": 0}


def to_dev(tree):
    return optree.tree_map(lambda x: x.to(DEV) if isinstance(x, torch.Tensor) else x, tree)


def agree(x, y, what):
    """x == y bit for bit on the CPU; on CUDA within fp32 rounding of y (relative to its largest magnitude)."""
    assert x.shape == y.shape and x.dtype == y.dtype, f"{what}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}"
    if torch.equal(x, y):
        EXACT["equal"] += 1
        return
    err = float((x.float() - y.float()).abs().max())
    assert DEV.type == "cuda" and err <= 1e-5 * float(y.float().abs().max()), f"{what}: max diff {err}"
    EXACT["within rounding"] += 1


def same_tree(a, b, what):
    fa, fb = dict(flatten_with_paths(a)), dict(flatten_with_paths(b))
    assert fa.keys() == fb.keys(), f"{what}: paths differ: {sorted(fa.keys() ^ fb.keys())[:5]}"
    for k, x in fa.items():
        y = fb[k]
        if isinstance(x, torch.Tensor):
            assert type(y) is torch.Tensor, f"{what}: {k} is a {type(y).__name__}"
            assert (x.dtype, x.shape) == (y.dtype, y.shape), f"{what}: {k}: {x.dtype} {x.shape} vs {y.dtype} {y.shape}"
            assert torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                               y.view(torch.uint8) if y.element_size() == 1 else y), f"{what}: {k} values differ"
        else:
            assert x == y, f"{what}: {k}: {x!r} vs {y!r}"


def check_local_sizes(cfg, sh, names, sizes):
    ep = sizes[names.index("ep")] if "ep" in names else 1
    emb = sizes[names.index("emb")] if "emb" in names else 1
    ex = sh["layers"][3]["ffn"]["experts"]
    if "ep" in names:
        w1 = ex["w1"]["weight"]
        assert sharding.is_sharded(w1) and w1.shape[0] == cfg.n_routed_experts, w1.shape
        assert w1.to_local().shape[0] == cfg.n_routed_experts // ep, w1.to_local().shape
        assert sh["mtp"][0]["ffn"]["experts"]["w2"]["scale"].to_local().shape[0] == cfg.dspark_n_routed_experts // ep
    else:
        assert isinstance(ex, list), type(ex)
    if "emb" in names:
        e = sh["embed"]["weight"]
        assert sharding.is_sharded(e) and e.to_local().shape[0] == cfg.vocab_size // emb
        assert sh["head"]["weight"].to_local().shape[0] == cfg.vocab_size // emb
        t = sh["layers"][1]["engram"]["embed"]
        assert t["weight"].to_local().shape[0] == -(-cfg.engram_num_embeddings[0] // emb)
        assert t["scale"].to_local().shape[0] == t["weight"].to_local().shape[0]
    else:
        assert type(sh["embed"]["weight"]) is torch.Tensor


def uneven_rows(mesh):
    """7 rows over 2 ranks (4 + 3): every storage dtype, ids on both ranks' rows."""
    if "emb" not in mesh.mesh_dim_names or mesh.size(list(mesh.mesh_dim_names).index("emb")) < 2:
        return
    g = torch.Generator().manual_seed(3)
    ids = torch.tensor([6, 0, 3, 4, 4, 1], device=DEV)
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e8m0fnu):
        t = (torch.randn(7, 64, generator=g) * 4).to(DEV, dtype)
        d = sharding._shard_rows(t, mesh, "emb")
        assert d.to_local().shape[0] in (4, 3)
        got = sharding.take_rows(d, ids)
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                                                  t[ids].view(torch.uint8) if t.element_size() == 1 else t[ids]), dtype
        if dtype.is_floating_point and t.element_size() > 1:
            assert torch.equal(sharding.embedding(ids[None], d), t[ids][None]), dtype
        same_tree({"w": t}, sharding.full_params({"w": d}), f"uneven {dtype}")
    # the head's columns over 515 rows (258 + 257; BLAS picks other kernels for a few columns, e.g. 4 + 3)
    w = torch.randn(515, 64, generator=g).to(DEV, torch.bfloat16)
    x = torch.randn(5, 64, generator=g).to(DEV)
    agree(sharding.vocab_logits(x, sharding._shard_rows(w, mesh, "emb")), torch.nn.functional.linear(x, w.float()),
          "vocab_logits over uneven rows")


def tiny_model(seed, master=False, **overrides):
    cfg = fd.Config.tiny(**overrides)
    params = fd.init_params(cfg, seed=seed, master=master)
    params["engram_token_map"] = torch.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size  # (no tokenizer)
    return cfg, to_dev(params)


def released_checkpoint(mesh, folder):
    """A checkpoint in the released layout (load_params: packed expert views, the tokenizer's token map), sharded
    over both dims: the same logits, and fd.generate - plain and DSpark-speculative - gives the same tokens."""
    cfg = fd.Config.from_json(Path(folder) / "config.json")
    params = to_dev(fd.load_params(folder, cfg))
    sh = sharding.shard_params(params, mesh)
    ids = torch.tensor([[5, 17, 300, 2, 41, 99, 7]], device=DEV)
    agree(fd.forward(sh, {"input_ids": ids}, cfg=cfg).logits, fd.forward(params, {"input_ids": ids}, cfg=cfg).logits,
          "checkpoint logits")
    for spec in (False, True):
        want = fd.generate(params, [[5, 17, 300]], cfg=cfg, max_new_tokens=5, speculative=spec)
        got = fd.generate(sh, [[5, 17, 300]], cfg=cfg, max_new_tokens=5, speculative=spec)
        assert list(got) == list(want), f"generate(speculative={spec}): {list(got)} vs {list(want)}"


def main():
    global DEV
    ap = argparse.ArgumentParser()
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("port")
    ap.add_argument("scenario", choices=[*MESHES, "checkpoint"])
    ap.add_argument("folder", nargs="?", help="checkpoint: a fixture folder in the released layout")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    rank, world, scenario = args.rank, args.world, args.scenario
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=args.port)
    if args.device == "cuda":
        DEV = torch.device("cuda", rank)
        torch.cuda.set_device(DEV)
        torch.use_deterministic_algorithms(True, warn_only=True)   # (CUBLAS_WORKSPACE_CONFIG: set by the test)
        # (no filling of new storage: torch has no fill for float4_e2m1fn_x2, so .to(device) of an fp4 leaf raised)
        torch.utils.deterministic.fill_uninitialized_memory = False
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=DEV)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    kind = DEV.type
    if scenario == "checkpoint":
        released_checkpoint(init_device_mesh(kind, (2, 1), mesh_dim_names=("ep", "emb")), args.folder)
        released_checkpoint(init_device_mesh(kind, (1, 2), mesh_dim_names=("ep", "emb")), args.folder)
        print(f"values: {EXACT}", flush=True)
        print(f"ok {scenario}", flush=True)
        dist.barrier()
        dist.destroy_process_group()
        return
    sizes, names = MESHES[scenario]
    mesh = init_device_mesh(kind, sizes, mesh_dim_names=names)
    uneven_rows(mesh)

    cfg, params = tiny_model(0, dtype="fp8", expert_dtype="fp4")   # fp8 dense + fp8 Engram tables, fp4 experts
    sh = sharding.shard_params(params, mesh)
    check_local_sizes(cfg, sh, names, sizes)

    ids = torch.randint(0, cfg.vocab_size - 2, (2, 12), generator=torch.Generator().manual_seed(1)).to(DEV)
    plain = fd.forward(params, {"input_ids": ids}, cfg=cfg)
    out = fd.forward(sh, {"input_ids": ids}, cfg=cfg)
    assert type(out.logits) is torch.Tensor
    agree(out.logits, plain.logits, "logits")
    agree(out.main_hidden, plain.main_hidden, "main_hidden")

    # prefill 9 tokens, then three one-token decode steps, plain and sharded
    st_p = fd.init_state(cfg, batch_size=2, max_seq_len=32, device=DEV)
    st_s = fd.init_state(cfg, batch_size=2, max_seq_len=32, device=DEV)
    for a, b in ((0, 9), (9, 10), (10, 11), (11, 12)):
        p = fd.forward(params, {"input_ids": ids[:, a:b]}, cfg=cfg, state=st_p)
        s = fd.forward(sh, {"input_ids": ids[:, a:b]}, cfg=cfg, state=st_s)
        agree(s.logits, p.logits, f"chunk [{a}, {b})")
        st_p, st_s = p.state, s.state

    # the DSpark stages (their experts, the shared embedding and head)
    dp = dspark_forward(params, plain.main_hidden, ids, cfg=cfg)
    ds = dspark_forward(sh, out.main_hidden, ids, cfg=cfg)
    for f in ("logits",):
        agree(getattr(ds, f), getattr(dp, f), f"dspark {f}")

    # the dense dispatch: other partial sums, so within float rounding
    dd = fd.forward(sh, {"input_ids": ids}, cfg=cfg, dispatch="dense")
    pd = fd.forward(params, {"input_ids": ids}, cfg=cfg, dispatch="dense")
    err = (dd.logits - pd.logits).abs().max() / pd.logits.abs().max()
    assert err < 2e-2, f"dense dispatch: relative max diff {err}"

    # refusals: a tree sharded twice, experts that do not divide over ep, a mesh dim the plan does not know
    def refused(fn, words):
        try:
            fn()
        except (ValueError, TypeError) as e:
            assert all(w in str(e) for w in words), str(e)
        else:
            raise AssertionError(f"not refused: {words}")
    refused(lambda: sharding.shard_params(sh, mesh), ["sharded already"])
    if "ep" in names and sizes[names.index("ep")] == 2:
        three = {"layers": [{"ffn": {"experts": [{"w1": {"weight": torch.ones(2, 2)}}] * 3}}]}
        refused(lambda: sharding.shard_params(three, mesh), ["layers.0.ffn.experts", "3 routed experts", "ep=2"])
    refused(lambda: sharding.shard_params(params, init_device_mesh(kind, (2,), mesh_dim_names=("tp",))),
            ["unknown mesh dim", "tp"])
    from torch.distributed.tensor import Replicate, distribute_tensor
    whole = distribute_tensor(params["embed"]["weight"], mesh, [Replicate()] * mesh.ndim)
    refused(lambda: sharding.embedding(ids, whole), ["split over one mesh dim", "Replicate"])
    with tempfile.TemporaryDirectory() as tmp:
        refused(lambda: fd.save_params(sh, tmp, cfg), ["save_params", "DTensor shard", "full_params"])
        assert not os.listdir(tmp)
    refused(lambda: fd.tree_diff(params, sh), ["tree_diff (b)", "DTensor shard", "full_params"])
    from functional_dsv41.params import TrainCheckpointer
    with tempfile.TemporaryDirectory() as tmp:
        ck, zeros = TrainCheckpointer(tmp), {"mu": {}, "nu": {}, "count": 0}
        try:
            refused(lambda: ck.save(1, params=fd.flatten_with_paths(sh), opt_state=zeros, data_state={}),
                    ["TrainCheckpointer.save params", "DTensor shard", "full_params", "one rank"])
        finally:
            ck.close()
        assert ck.all_steps() == [] and not os.listdir(tmp), os.listdir(tmp)
    try:
        torch.func.vmap(lambda i: fd.forward(sh, {"input_ids": i}, cfg=cfg, dispatch="dense",
                                             validate=False).logits)(ids[:, None])
    except NotImplementedError as e:
        assert "sharded tree" in str(e) and "DTensor shard" in str(e), str(e)
    else:
        raise AssertionError("vmap over a sharded tree not refused")
    try:
        from functional_dsv41.train.step import assemble, split_params
        trainable, frozen = split_params(sh)
        torch.func.grad(lambda t: fd.forward(assemble(t, frozen), {"input_ids": ids}, cfg=cfg).logits.sum())(trainable)
    except NotImplementedError as e:
        assert "torch.func transforms" in str(e) and "loss.backward()" in str(e), str(e)
    else:
        raise AssertionError("torch.func.grad over a sharded tree not refused")
    try:
        torch.func.grad(lambda t: dspark_forward(assemble(t, frozen), out.main_hidden, ids, cfg=cfg).logits.sum())(
            trainable)
    except NotImplementedError as e:
        assert "torch.func transforms" in str(e), str(e)
    else:
        raise AssertionError("torch.func.grad over dspark_forward on a sharded tree not refused")

    # back to the released layout, bit for bit
    same_tree(params, sharding.full_params(sh), "full_params")

    # autograd through the sums: the training setting (fp32 masters of the fp8 / fp4 weights, QAT), sharded vs plain,
    # over 8 tokens and over 1 (2 slots: at ep=2 some layers route none to a rank, whose backward must still join
    # the sums over ep)
    for n_tok in (8, 1):
        check_gradients(mesh, ids[:1, :n_tok])
    print(f"values: {EXACT}", flush=True)
    print(f"ok {scenario}", flush=True)
    dist.barrier()          # (a rank tearing gloo down while its peer still finishes a collective can abort)
    dist.destroy_process_group()


def check_gradients(mesh, ids16):
    def trainable():
        cfg16, p16 = tiny_model(2, master=True, dtype="fp8", expert_dtype="fp4")
        for t in flatten_with_paths(p16).values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.requires_grad_(True)
        return cfg16, p16

    def loss(tree):
        return fd.forward(tree, {"input_ids": ids16}, cfg=cfg16, mode="qat").logits.float().logsumexp(-1).mean()
    cfg16, p16 = trainable()
    loss(p16).backward()
    leaves_p = flatten_with_paths(p16)
    _, full16 = trainable()
    s16 = sharding.shard_params(full16, mesh)       # (leaves that require grad: the shards are leaves that do too)
    loss(s16).backward()
    leaves_s = flatten_with_paths(s16)
    for path, t in leaves_s.items():
        if sharding.is_sharded(t):
            assert t.is_leaf and t.requires_grad, f"{path}: the shard is not a trainable leaf"
    checked = []
    for path in ("embed.weight", "head.weight", "layers.1.engram.embed.weight", "layers.3.ffn.experts.w1.weight",
                 "layers.3.ffn.experts.1.w1.weight", "layers.3.attn.wq_a.weight"):
        if path not in leaves_s:
            continue
        g = leaves_s[path].grad
        if g is None and ".experts." in path and path in leaves_p and leaves_p[path].grad is None:
            checked.append(path)            # an expert no token was routed to: no gradient on either side
            continue
        assert g is not None, f"no gradient for {path}"
        g = g.full_tensor() if sharding.is_sharded(g) else g
        if path.endswith("experts.w1.weight"):
            ws = [leaves_p[f"layers.3.ffn.experts.{e}.w1.weight"] for e in range(cfg16.n_routed_experts)]
            want = torch.stack([torch.zeros_like(w) if w.grad is None else w.grad for w in ws])   # (no tokens: no grad)
        else:
            want = leaves_p[path].grad
        g, want = g.float(), want.float()
        cos = 1 - 2 * float((g * want).sum()) / max(float(g.square().sum() + want.square().sum()), 1e-30)
        # bf16 activations: their gradients' partial sums round differently (cos ~1e-4 seen); a gradient
        # that misses the other ranks' part (no sum at the experts' or the head's input) is off by ~0.5
        assert cos < 1e-3, f"{path} ({ids16.shape[1]} tokens): gradient cosine diff {cos:.2e}"
        checked.append(path)
    assert len(checked) == 5, checked

    # the functional AdamW and global-norm clipping over a sharded tree's gradients (DTensor and plain mixed)
    def gathered(t):
        return t.full_tensor() if sharding.is_sharded(t) else t

    def opt_step(leaves, max_norm=0.5):
        params = {k: v.detach() for k, v in leaves.items() if isinstance(v, torch.Tensor) and v.requires_grad}
        grads = {k: leaves[k].grad if leaves[k].grad is not None else torch.zeros_like(v) for k, v in params.items()}
        clipped, norm = optim.clip_by_global_norm(grads, max_norm)
        new, _ = optim.adamw_update(clipped, optim.adamw_init(params), params, lr=1e-2, cfg=optim.AdamWConfig())
        return grads, clipped, float(norm), new
    grads_p, clipped_p, norm_p, new_p = opt_step(leaves_p)
    grads_s, clipped_s, norm_s, new_s = opt_step(leaves_s)
    whole = {k: gathered(g).float() for k, g in grads_s.items()}
    # the norm of the sharded gradients is the norm of their gathered values (other summation order only) ...
    want = float(torch.stack([g.norm() for g in whole.values()]).norm())
    assert abs(norm_s - want) <= 1e-5 * want, (norm_s, want)
    # ... and within rounding of the plain tree's: the experts' input gradient is accumulated per rank there
    # (ep of size 1 shows the same ~0.1-0.4% shift); a norm of local parts only was off by 3.4%
    assert abs(norm_s - norm_p) <= 0.02 * norm_p, (norm_s, norm_p)
    clipped_whole = {k: gathered(g).float() for k, g in clipped_s.items()}
    assert float(torch.stack([g.norm() for g in clipped_whole.values()]).norm()) <= 0.5 * (1 + 1e-4), "not clipped"
    for k, g in clipped_whole.items():             # each leaf scaled by the same coefficient
        tol = 1e-5 if grads_s[k].dtype == torch.float32 else 1e-2          # (bf16 leaves' grads are rounded)
        assert torch.allclose(g, whole[k] * min(1.0, 0.5 / (want + 1e-6)), rtol=tol, atol=1e-12), k
    for path, t in new_s.items():
        if sharding.is_sharded(leaves_s[path]):
            assert sharding.is_sharded(t) and t.placements == leaves_s[path].placements, path
            assert t.to_local().shape == leaves_s[path].to_local().shape, path
            moved = gathered(t).float() - gathered(leaves_s[path]).detach().float()
            assert moved.abs().max() > 0, f"{path}: AdamW left the shard unchanged"
    for path in ("embed.weight", "head.weight", "layers.3.attn.wq_a.weight"):
        a, b = gathered(new_s[path]).float(), new_p[path].float()
        before = gathered(leaves_s[path]).detach().float()
        da, db = a - before, b - before                          # the updates, sharded vs plain
        cos = 1 - 2 * float((da * db).sum()) / max(float(da.square().sum() + db.square().sum()), 1e-30)
        # (Adam's first step is ~lr * sign(g): where g is rounding noise its sign is a coin flip)
        assert cos < 0.05, f"{path}: AdamW update cosine diff {cos:.2e}"


if __name__ == "__main__":
    main()
