"""param_spec / init_params / param_count_report (params/; SPEC §9, §11)."""
import pytest
import torch

import functional_dsv41 as fd
from functional_dsv41 import quant
from functional_dsv41.params.checkpoint import _read_header, _storage_shape, _DTYPES

from conftest import fixture_dir

FIXTURES = ("tiny-bf16", "tiny-fp8", "tiny-vl")


def _cfg(name):
    return fd.Config.from_json(fixture_dir(name) / "config.json")


@pytest.mark.parametrize("name", FIXTURES)
def test_spec_matches_fixture_checkpoint(name):
    """Every tensor of the fixture's model.safetensors, nothing more, same storage shape and dtype."""
    hdr, _ = _read_header(fixture_dir(name) / "model.safetensors")
    spec = fd.flatten_with_paths(fd.param_spec(_cfg(name)))
    assert set(spec) == set(hdr)
    for n, t in spec.items():
        assert t.is_meta
        assert (tuple(t.shape), t.dtype) == (_storage_shape(hdr[n]["dtype"], hdr[n]["shape"]),
                                             _DTYPES[hdr[n]["dtype"]]), n


def test_spec_tree_layout():
    cfg = fd.Config.tiny(dtype="fp8", expert_dtype="fp4", vision_n_layers=2)
    p = fd.param_spec(cfg)
    assert isinstance(p["layers"], list) and len(p["layers"]) == 10 and len(p["mtp"]) == 2
    assert len(p["layers"][3]["ffn"]["experts"]) == 8 and len(p["mtp"][0]["ffn"]["experts"]) == 4
    assert p["image_start"].shape == (128,) and len(p["vision"]["blocks"]) == 2
    assert set(p["layers"][2]["attn"]["compressor"]) == {"wkv", "wgate", "norm"}
    assert set(p["layers"][5]["attn"]["compressor"]) == {"wkv", "norm"}
    assert set(p["layers"][7]["attn"]["indexer"]) == {"wq_b", "weights_proj"}
    assert set(p["layers"][5]["attn"]["indexer"]) == {"wq_b", "weights_proj", "wk", "k_norm"}
    assert "compressor" not in p["layers"][3]["attn"] and "indexer" not in p["layers"][6]["attn"]
    assert "main_proj" in p["mtp"][0] and "markov_head" not in p["mtp"][0]
    assert "markov_head" in p["mtp"][1] and "main_proj" not in p["mtp"][1]
    assert "engram_token_map" not in p and "embed" not in p["mtp"][0]
    one = fd.param_spec(cfg.replace(n_mtp_layers=1, compress_ratios=cfg.compress_ratios[:-1]))
    assert {"main_proj", "main_norm", "norm", "markov_head", "confidence_head"} <= set(one["mtp"][0])
    no_shared = fd.param_spec(cfg.replace(n_shared_experts=0))
    assert "shared_experts" not in no_shared["layers"][0]["ffn"]


def test_spec_flash_shapes_spec11():
    """SPEC §11 at the release config, without allocating anything."""
    p = fd.param_spec(fd.Config.flash())
    flat = fd.flatten_with_paths(p)
    E8, F8, F4, BF, F32 = quant.E8M0, quant.FP8, quant.FP4X2, torch.bfloat16, torch.float32
    expect = {
        "embed.weight": ((129280, 5120), BF), "head.weight": ((129280, 5120), BF), "norm.weight": ((5120,), BF),
        "layers.5.attn.wq_a.weight": ((1280, 5120), F8), "layers.5.attn.wq_a.scale": ((40, 160), E8),
        "layers.5.attn.wq_b.weight": ((32768, 1280), F8), "layers.5.attn.wq_b.scale": ((1024, 40), E8),
        "layers.5.attn.wkv.scale": ((16, 160), E8), "layers.5.attn.wo_a.weight": ((8192, 4096), BF),
        "layers.5.attn.wo_b.weight": ((5120, 8192), F8), "layers.5.attn.wo_b.scale": ((160, 256), E8),
        "layers.5.attn.q_norm.weight": ((1280,), BF), "layers.5.attn.kv_norm.weight": ((512,), BF),
        "layers.5.attn.attn_sink": ((64,), F32),
        "layers.8.attn.compressor.wgate.weight": ((512, 5120), BF), "layers.20.attn.compressor.norm.weight":
            ((512,), BF), "layers.24.attn.indexer.wq_b.scale": ((128, 40), E8),
        "layers.36.attn.indexer.weights_proj.weight": ((32, 5120), BF),
        "layers.20.attn.indexer.wk.weight": ((128, 512), BF), "layers.2.attn.indexer.k_norm.weight": ((128,), BF),
        "layers.7.ffn.gate.weight": ((384, 5120), BF), "layers.7.ffn.gate.bias_vl": ((384,), F32),
        "layers.7.ffn.experts.383.w1.weight": ((2304, 2560), F4), "layers.7.ffn.experts.0.w1.scale": ((2304, 160), E8),
        "layers.7.ffn.experts.5.w2.weight": ((5120, 1152), F4), "layers.7.ffn.experts.5.w2.scale": ((5120, 72), E8),
        "layers.7.ffn.shared_experts.w1.scale": ((72, 160), E8), "layers.7.ffn.shared_experts.w2.scale": ((160, 72), E8),
        "layers.7.hc_attn_fn": ((24, 20480), F32), "layers.7.hc_ffn_base": ((24,), F32),
        "layers.7.hc_ffn_scale": ((3,), F32),
        "layers.1.engram.embed.weight": ((384006168, 256), F8), "layers.14.engram.embed.scale": ((384016682, 8), E8),
        "layers.1.engram.wkv.weight": ((25600, 6144), F8), "layers.1.engram.wkv.scale": ((800, 192), E8),
        "layers.14.engram.q_weight": ((4, 5120), BF),
        "mtp.0.main_proj.weight": ((5120, 15360), F8), "mtp.0.main_proj.scale": ((160, 480), E8),
        "mtp.2.markov_head.embed.weight": ((129280, 256), BF), "mtp.2.confidence_head.proj.weight": ((1, 5376), BF),
        "mtp.1.ffn.experts.127.w3.weight": ((2304, 2560), F4), "vision.blocks.31.attn.wqkv.weight": ((3072, 1024), BF),
        "vision.blocks.0.norm1.weight": ((1024,), F32), "vision.blocks.0.mlp.w1.weight": ((5632, 1024), BF),
        "aligner.w1.weight": ((5120, 9216), BF), "image_newline": ((5120,), BF),
    }
    for n, (shape, dtype) in expect.items():
        assert (tuple(flat[n].shape), flat[n].dtype) == (shape, dtype), n
    assert "layers.1.engram.embed.weight" in flat and "layers.2.engram.embed.weight" not in flat
    assert "mtp.0.ffn.experts.128.w1.weight" not in flat and "mtp.0.attn.compressor.wkv.weight" not in flat
    assert "layers.3.attn.compressor.wkv.weight" not in flat and "layers.20.attn.compressor.wgate.weight" not in flat
    # the HF release lists 96,085 tensors (2,401 under mtp.); the converted layout has no wo_a.scale
    # (one per block, 43 in all), see params/count.py
    assert len(flat) == 96085 - 43 and sum(n.startswith("mtp.") for n in flat) == 2401 - 3


def test_count_report_release_figures():
    r = fd.param_count_report(fd.Config.flash())
    assert r["embedding/head"] == 2 * 129280 * 5120                           # 1.32B
    assert r["Engram tables"] == (384006168 + 384016682) * 256                # 196.61B
    assert r.scales["Engram tables"] == (384006168 + 384016682) * 8
    assert r["MoE routed"] == 40 * 384 * 3 * 2304 * 5120                       # fp4 counted logically
    assert r.scales["MoE routed"] == 40 * 384 * (2 * 2304 * 160 + 5120 * 72)
    assert r.storage_bytes["MoE routed"] == 40 * 384 * 3 * 2304 * 5120 // 2 + r.scales["MoE routed"]
    vit = 588 * 1024 + 1024 + 32 * (2 * 1024 + 3072 * 1024 + 3072 + 1024 * 1024 + 1024 + 5632 * 1024
                                    + 1024 * 2816) + 1024
    assert r["vision"] == vit + 9216 * 5120 + 5120 + 5120 * 5120 + 5120 + 3 * 5120   # 0.49B
    backbone = sum(r[g] for g in ("attention", "MoE routed", "MoE shared+router", "mHC", "norms", "Engram other"))
    # the same total from SPEC §11's table, row by row (40 blocks; compressors at layers 2, 8, 14 with a gate and
    # at 20 without; indexer query side at 8 layers, key side at 4; Engram at layers 1 and 14; the final norm)
    block = (1280 * 5120 + 32768 * 1280 + 512 * 5120 + 8192 * 4096 + 5120 * 8192 + 1280 + 512 + 64   # attention
             + 384 * 5120 + 2 * 384 + 2 * 2304 * 5120 + 5120 * 2304                                 # router, shared
             + 384 * 3 * 2304 * 5120 + 2 * 5120 + 2 * (24 * 20480 + 24 + 3))                         # routed, norms, mHC
    spec = (40 * block + 3 * (2 * 512 * 5120 + 512) + 512 * 5120 + 512 + 8 * (4096 * 1280 + 32 * 5120)
            + 4 * (128 * 512 + 128) + 2 * (25600 * 6144 + 2 * 4 * 5120) + 5120)
    assert backbone == spec
    assert round(backbone / 1e9, 2) == 550.56                          # the figure other ports publish (README)
    assert r["mHC"] == 40 * 2 * (24 * 20480 + 24 + 3)
    assert r.total == sum(r.values()) and "total" in r.table() and "Engram tables" in str(r)


def test_count_report_tiny_matches_fixture_elements():
    cfg = _cfg("tiny-fp8")
    hdr, _ = _read_header(fixture_dir("tiny-fp8") / "model.safetensors")
    n_params = 0
    for n, h in hdr.items():
        if not n.endswith(".scale"):
            k = 1
            for d in h["shape"]:  # fp4 header shapes are logical already
                k *= d
            n_params += k
    assert fd.param_count_report(cfg).total == n_params


@pytest.mark.parametrize("name", FIXTURES)
def test_init_storage_dtypes_and_determinism(name):
    cfg = _cfg(name)
    a, b, c = fd.init_params(cfg, seed=3), fd.init_params(cfg, seed=3), fd.init_params(cfg, seed=4)
    d = fd.tree_diff(fd.param_spec(cfg), a)
    assert d.ok, d.format(d.problems())
    fa, fb, fc = (fd.flatten_with_paths(t) for t in (a, b, c))
    assert all(torch.equal(fa[k].view(torch.uint8) if fa[k].element_size() == 1 else fa[k],
                           fb[k].view(torch.uint8) if fb[k].element_size() == 1 else fb[k]) for k in fa)
    assert not torch.equal(fa["embed.weight"], fc["embed.weight"])
    assert torch.equal(fa["layers.0.attn_norm.weight"], torch.ones(cfg.dim, dtype=torch.bfloat16))
    assert not fa["layers.3.attn.attn_sink"].any() and not fa["layers.3.ffn.gate.bias"].any()
    assert 0 < fa["layers.0.hc_attn_fn"].abs().max() < 0.2
    w = fa["layers.0.attn.wkv.weight"]
    if w.dtype == quant.FP8:
        w = quant.dequant_fp8_block(w, fa["layers.0.attn.wkv.scale"], torch.float32)
    assert 0.5 < float(w.float().std() * cfg.dim ** 0.5) < 1.5  # fan-in scaled


def test_init_master_weights_quantize_to_storage():
    cfg = _cfg("tiny-fp8")
    store = fd.flatten_with_paths(fd.init_params(cfg, seed=1))
    master = fd.init_params(cfg, seed=1, master=True)
    d = fd.tree_diff(fd.param_spec(cfg, master=True), master)
    assert d.ok, d.format(d.problems())
    m = fd.flatten_with_paths(master)
    assert not any(k.endswith(".scale") for k in m)
    assert m["layers.0.attn.wq_a.weight"].dtype == torch.float32
    assert m["layers.0.ffn.experts.1.w2.weight"].shape == (128, 32)
    assert m["layers.0.attn.wo_a.weight"].dtype == torch.bfloat16  # stored bf16 -> stays bf16
    pairs = [("layers.0.attn.wq_b", quant.quant_fp8_block), ("layers.0.ffn.experts.1.w2", quant.quant_fp4),
             ("layers.1.engram.embed", quant.quant_fp8_rows), ("mtp.0.main_proj", quant.quant_fp8_block)]
    for name, qf in pairs:
        q, s = qf(m[f"{name}.weight"])
        assert torch.equal(q.view(torch.uint8), store[f"{name}.weight"].view(torch.uint8)), name
        assert torch.equal(s.view(torch.uint8), store[f"{name}.scale"].view(torch.uint8)), name
    bf = fd.flatten_with_paths(fd.init_params(cfg, seed=1, dtype_master=torch.bfloat16))
    assert bf["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16 and bf["layers.0.hc_attn_fn"].dtype == torch.bfloat16


def test_engram_tables_fp8_in_bf16_config():
    p = fd.init_params(fd.Config.tiny(), seed=0)
    e = p["layers"][1]["engram"]
    assert e["embed"]["weight"].dtype == quant.FP8 and e["embed"]["scale"].shape == (2514, 1)
    assert e["wkv"]["weight"].dtype == torch.bfloat16 and "scale" not in e["wkv"]
    assert e["wkv"]["weight"].shape == (5 * 128, 3 * 2 * 32)


def test_init_params_attaches_engram_token_map_from_a_tokenizer():
    from conftest import fixture_dir
    d = fixture_dir("tiny-bf16")
    cfg = fd.Config.tiny()
    p = fd.init_params(cfg, seed=0, tokenizer=d / "tokenizer.json")
    assert p["engram_token_map"].shape == (cfg.vocab_size,) and int(p["engram_token_map"].max()) == 333
    import pytest
    with pytest.raises(ValueError, match="334"):
        fd.init_params(fd.Config.tiny(engram_compressed_vocab_size=300), seed=0, tokenizer=d / "tokenizer.json")


@pytest.mark.parametrize("dtype_master,err,match", [
    (torch.int64, ValueError, r"init_params: dtype_master must be a float dtype \(torch.float32, .*got torch.int64"),
    (torch.float8_e4m3fn, ValueError, r"dtype_master must be a float dtype .*got torch.float8_e4m3fn"),
    ("float32", TypeError, r"init_params: dtype_master must be a torch.dtype such as torch.float32, got 'float32'"),
])
def test_init_params_dtype_master_must_be_a_float_dtype(dtype_master, err, match):
    """torch.int64 gave all-zero integer weights without a word; "float32" failed with "Invalid device string"."""
    with pytest.raises(err, match=match):
        fd.init_params(fd.Config.tiny(), seed=0, dtype_master=dtype_master)


def test_init_params_refuses_engram_tables_off_the_layout():
    """Tables of 100 rows were drawn (and saved, loaded); only forward refused them."""
    cfg = fd.Config.tiny(engram_num_embeddings=(100, 100))      # (built in code: Config.from_dict refuses it)
    with pytest.raises(ValueError, match=r"init_params: engram layout: layer 1 needs 2514 table rows \(sum of its "
                                         r"primes\), config engram_num_embeddings\[0\] = 100"):
        fd.init_params(cfg, seed=0)
