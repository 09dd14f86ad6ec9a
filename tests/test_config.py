"""fd.Config: fixture configs, JSON round trip, release values (SPEC §0), per-layer roles (§0.1), refusals."""
import dataclasses
import json
import os
import re

import pytest

import functional_dsv41 as fd
from functional_dsv41.config import Config, ConfigError

from conftest import fixture_dir


# ----------------------------------------------------------------------------- fixtures and round trip
def test_tiny_bf16_fixture_is_tiny():
    cfg = Config.from_json(fixture_dir("tiny-bf16") / "config.json")
    assert cfg == Config.tiny()
    assert cfg.dtype == "bf16" and cfg.expert_dtype is None and cfg.experts_dtype == "bf16"


@pytest.mark.parametrize("name,changes", [
    ("tiny-fp8", dict(dtype="fp8", expert_dtype="fp4")),
    ("tiny-vl", dict(dtype="fp8", expert_dtype="fp4", vision_n_layers=2)),
])
def test_fixture_configs(name, changes):
    cfg = Config.from_json(fixture_dir(name) / "config.json")
    assert cfg == Config.tiny(**changes)
    raw = json.loads((fixture_dir(name) / "config.json").read_text())
    for k, v in raw.items():  # every key read as written (lists become tuples)
        assert getattr(cfg, k) == (tuple(v) if isinstance(v, list) else v), k
    assert cfg.vision_enabled == (name == "tiny-vl")


@pytest.mark.parametrize("cfg", [Config.tiny(), Config.flash(), Config.tiny(dtype="fp8", expert_dtype="fp4",
                                                                             vision_n_layers=2)])
def test_json_round_trip(tmp_path, cfg):
    cfg.to_json(tmp_path / "c.json")
    back = Config.from_json(tmp_path / "c.json")
    assert back == cfg and hash(back) == hash(cfg)
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_to_json_failure_keeps_the_previous_file(tmp_path, monkeypatch):
    """A write that fails midway (disk full) left a torn config.json where a good one stood (train/run.py's export
    rewrites config.json beside the checkpoint it just replaced atomically)."""
    path = tmp_path / "config.json"
    Config.tiny().to_json(path)
    before = path.read_bytes()

    def full(fd):                               # the new text is written, then the disk is full at the sync
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="simulated"):
        Config.tiny(dtype="fp8").to_json(path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["config.json"]


def test_to_json_names_its_target_when_it_cannot_be_written(tmp_path):
    """A folder as the target, or a file or nothing where its folder should be: the error named the temporary
    file ('/tmp.tmp-1065' -> '/tmp'), not the path the caller gave. Nothing is left behind."""
    (tmp_path / "afile").write_text("x")
    for target, exc, says in ((tmp_path, IsADirectoryError, "it is a folder, not a file"),
                              (tmp_path / "afile" / "c.json", NotADirectoryError, "afile is a file, not a folder"),
                              (tmp_path / "nope" / "c.json", FileNotFoundError, "nope does not exist")):
        with pytest.raises(exc, match=f"cannot write {re.escape(str(target))}: .*{says}"):
            Config.tiny().to_json(target)
    assert sorted(os.listdir(tmp_path)) == ["afile"] and (tmp_path / "afile").read_text() == "x"


def test_flash_release_values():
    c = Config.flash()
    assert c == Config()
    expect = dict(vocab_size=129280, dim=5120, n_layers=40, n_mtp_layers=3, n_heads=64, head_dim=512,
                  rope_head_dim=64, q_lora_rank=1280, o_groups=8, o_lora_rank=1024, window_size=128,
                  kv_source_layers=(2, 8, 14, 20), index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
                  compress_rope_theta=160000.0, rope_theta=10000.0, original_seq_len=65536, rope_factor=16,
                  beta_fast=32, beta_slow=1, index_n_heads=32, index_head_dim=128, index_topk=512,
                  candidate_source_layer=20, candidate_topk_blocks=2048, candidate_block_size=8,
                  n_routed_experts=384, n_activated_experts=6, n_shared_experts=1, moe_inter_dim=2304,
                  score_func="sqrtsoftplus", route_scale=1.5, swiglu_limit=10.0, norm_eps=1e-20, hc_mult=4,
                  hc_sinkhorn_iters=20, hc_eps=1e-6, engram_layer_ids=(1, 14),
                  engram_vocab_size=16000000, engram_num_embeddings=(384006168, 384016682),
                  engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=256, engram_pad_id=2,
                  engram_compressed_vocab_size=99092, dtype="fp8", expert_dtype="fp4", dspark_block_size=5,
                  dspark_noise_token_id=128799, dspark_target_layer_ids=(37, 38, 39), dspark_markov_rank=256,
                  dspark_n_routed_experts=128, dspark_n_activated_experts=3, vision_n_layers=32,
                  vision_dim=1024, vision_n_heads=16, vision_inter_dim=2816, vision_patch_size=14,
                  vision_downsample_ratio=3, vision_rope_theta=10000.0, vision_max_n_token=1024,
                  vision_min_pixels=295936, vision_max_wh_ratio=None, image_token_id=129264,
                  gate_temp=1.0, norm_topk_prob=True)
    for k, v in expect.items():
        assert getattr(c, k) == v, k
    assert c.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    assert c.hc_dim == 20480 and c.n_hc_mix == 24 and c.n_total_layers == 43


# ----------------------------------------------------------------------------- per-layer roles (SPEC §0.1)
def _flash_table():
    """(mode, kv source, index source) of every layer as SPEC §0.1 tabulates it."""
    t = {0: ("window", None, None), 1: ("window", None, None)}
    for src in (2, 8, 14):
        t[src] = ("full", src, src)
        for L in range(src + 1, src + 6):
            t[L] = ("reuse", src, src)
    t[20] = ("full", 20, 20)
    for L in (21, 22, 23):
        t[L] = ("reuse", 20, 20)
    for r in (24, 28, 32, 36):
        t[r] = ("reindex", 20, r)
        for L in range(r + 1, r + 4):
            t[L] = ("reuse", 20, r)
    for L in (40, 41, 42):
        t[L] = ("window", None, None)
    return t


def test_flash_layer_roles():
    c = Config.flash()
    table = _flash_table()
    assert sorted(table) == list(range(43))
    for L, (mode, kv, idx) in table.items():
        assert (c.attn_mode(L), c.kv_source(L), c.index_source(L)) == (mode, kv, idx), L
    assert [L for L in range(40) if c.uses_candidates(L)] == [24, 28, 32, 36]
    assert [c.param_prefix(L) for L in (0, 39, 40, 42)] == ["layers.0", "layers.39", "mtp.0", "mtp.2"]
    assert [c.engram_index(L) for L in (0, 1, 14, 15)] == [None, 0, 1, None]


def test_flash_rope_and_moe():
    c = Config.flash()
    for L in (0, 1, 40, 41, 42):
        assert c.rope_params(L) == (10000.0, False)
    for L in list(range(2, 40)):
        assert c.rope_params(L) == (160000.0, True)
    assert all(c.moe_experts(L) == (384, 6) for L in range(40))
    assert all(c.moe_experts(L) == (128, 3) for L in (40, 41, 42))
    assert list(c.dspark_layer_ids) == [40, 41, 42] and c.is_dspark(40) and not c.is_dspark(39)


def test_tiny_layer_roles():
    c = Config.tiny()  # fixtures/tiny-bf16/README.md "Layer roles"
    assert [c.attn_mode(L) for L in range(12)] == ["window", "window", "full", "reuse", "reuse", "full", "reuse",
                                                   "reindex", "reuse", "reuse", "window", "window"]
    assert [c.kv_source(L) for L in range(10)] == [None, None, 2, 2, 2, 5, 5, 5, 5, 5]
    assert [c.index_source(L) for L in range(10)] == [None, None, 2, 2, 2, 5, 5, 7, 7, 7]
    assert c.moe_experts(10) == (4, 2) and c.moe_experts(9) == (8, 2)


# ----------------------------------------------------------------------------- refusals
FLASH_BAD = [
    ("compress_ratios", dict(compress_ratios=(0,) * 42)),                       # wrong length
    ("compress_ratios", dict(compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 1))),  # DSpark ratio
    ("compress_ratios", dict(compress_ratios=(0, 0) + (2,) * 18 + (1,) * 19 + (-1,) + (0, 0, 0))),
    ("compress_ratios", dict(compress_ratios=(0, 0) + (2,) * 17 + (1,) * 21 + (0, 0, 0))),  # 19 != src 14
    ("kv_source_layers", dict(kv_source_layers=(1, 2, 8, 14, 20))),             # source with ratio 0
    ("index_source_layers", dict(index_source_layers=(0, 2, 8, 14, 20, 24, 28, 32, 36))),
    ("kv_source_layers", dict(kv_source_layers=(8, 14, 20))),                   # layer 2 has no source
    ("kv_source_layers", dict(kv_source_layers=(2, 8, 14, 20, 22))),            # not an index source
    ("kv_source_layers", dict(kv_source_layers=(2, 2, 8, 14, 20))),             # not increasing
    ("kv_source_layers", dict(kv_source_layers=(2, 8, 14, 20, 45))),            # not a backbone layer
    ("candidate_source_layer", dict(candidate_source_layer=22)),               # not an index source
    ("candidate_source_layer", dict(candidate_source_layer=14)),               # reindex over other kv
    ("n_activated_experts", dict(n_activated_experts=385)),
    ("dspark_n_activated_experts", dict(dspark_n_activated_experts=129)),
    ("o_groups", dict(o_groups=7)),
    ("head_dim", dict(head_dim=500)),
    ("index_head_dim", dict(index_head_dim=100, rope_head_dim=64)),
    ("rope_head_dim", dict(rope_head_dim=63)),
    ("rope_head_dim", dict(rope_head_dim=1024)),
    ("dim", dict(dim=5100)),                                                    # fp8 / fp4 block of 32
    ("q_lora_rank", dict(q_lora_rank=1290)),
    ("moe_inter_dim", dict(moe_inter_dim=2300)),
    ("o_lora_rank", dict(o_lora_rank=1020, o_groups=1, n_heads=64)),
    ("engram_head_dim", dict(engram_head_dim=250)),
    ("engram_num_embeddings", dict(engram_num_embeddings=(5,))),
    ("engram_layer_ids", dict(engram_layer_ids=(14, 1))),
    ("engram_layer_ids", dict(engram_layer_ids=(1, 40))),
    ("engram_max_ngram_size", dict(engram_max_ngram_size=1)),
    ("dspark_target_layer_ids", dict(dspark_target_layer_ids=(37, 38, 40))),
    ("dspark_target_layer_ids", dict(dspark_target_layer_ids=(37, 37, 39))),
    ("dspark_target_layer_ids", dict(dspark_target_layer_ids=(39, 38, 37))),
    ("route_scale", dict(route_scale=-1.5)),
    ("dspark_block_size", dict(dspark_block_size=0)),
    ("image_token_id", dict(image_token_id=129280)),
    ("dspark_noise_token_id", dict(dspark_noise_token_id=-1)),
    ("engram_pad_id", dict(engram_pad_id=200000)),
    ("vision_n_heads", dict(vision_n_heads=7)),
    ("dtype", dict(dtype="fp16")),
    ("expert_dtype", dict(expert_dtype="int4")),
    ("score_func", dict(score_func="relu")),
    ("temperature", dict(temperature=-1.0)),
    ("dim", dict(dim=0)),
    ("window_size", dict(window_size=0)),
    ("n_mtp_layers", dict(n_mtp_layers=-1)),
    ("n_shared_experts", dict(n_shared_experts=-1)),
    ("engram_n_heads", dict(engram_n_heads=0)),
    ("engram_num_embeddings", dict(engram_num_embeddings=(0, 5))),
    ("dspark_markov_rank", dict(dspark_markov_rank=0)),
    ("dspark_n_routed_experts", dict(dspark_n_routed_experts=0, dspark_n_activated_experts=0)),
    ("dspark_target_layer_ids", dict(dspark_target_layer_ids=())),
    ("vision_inter_dim", dict(vision_inter_dim=0)),
    ("vision_downsample_ratio", dict(vision_downsample_ratio=0)),
    # types (as a JSON file could give them)
    ("dim", dict(dim=5120.0)),
    ("n_layers", dict(n_layers=True)),
    ("norm_topk_prob", dict(norm_topk_prob=1)),
    ("route_scale", dict(route_scale="1.5")),
    ("route_scale", dict(route_scale=float("nan"))),
    ("kv_source_layers", dict(kv_source_layers=(2.0, 8, 14, 20))),
    ("vision_max_wh_ratio", dict(vision_max_wh_ratio="abc")),                  # Optional[float]
    ("vision_max_wh_ratio", dict(vision_max_wh_ratio=float("inf"))),
    # values the math divides by / takes the log of (forward returned NaN or "math domain error")
    ("rope_theta", dict(rope_theta=0.0)),
    ("compress_rope_theta", dict(compress_rope_theta=1.0)),
    ("vision_rope_theta", dict(vision_rope_theta=-5.0)),
    ("rope_factor", dict(rope_factor=0)),
    ("beta_fast", dict(beta_fast=0)),
    ("beta_slow", dict(beta_slow=-1)),
    ("norm_eps", dict(norm_eps=-1.0)),
    ("norm_eps", dict(norm_eps=0.0)),
    ("gate_temp", dict(gate_temp=0.0)),
    ("original_seq_len", dict(original_seq_len=0)),
    ("hc_eps", dict(hc_eps=-1e-6)),
    ("vision_max_wh_ratio", dict(vision_max_wh_ratio=0.0)),
    ("vision_max_wh_ratio", dict(vision_max_wh_ratio=2.0)),                     # the unimplemented stretch branch
]


@pytest.mark.parametrize("field,changes", FLASH_BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(FLASH_BAD)])
def test_refusals_name_the_field(field, changes):
    with pytest.raises(ConfigError, match=field):
        Config.flash(**changes)


def test_numeric_ranges_accept_the_valid_side():
    Config.flash(vision_max_wh_ratio=None, hc_eps=0.0, gate_temp=0.5, rope_factor=1, original_seq_len=1, route_scale=0.0)
    Config.flash(dspark_target_layer_ids=(5, 20, 39))


def test_optional_part_sizes_only_checked_when_enabled():
    Config.tiny(n_mtp_layers=0, compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 1, 1), dspark_markov_rank=0,
                dspark_target_layer_ids=())
    Config.tiny(vision_n_layers=0, vision_inter_dim=0)
    Config.tiny(engram_layer_ids=(), engram_num_embeddings=(), engram_n_heads=0)


def test_fp4_block_refusal_only_for_fp4_experts():
    # moe_inter_dim not a multiple of 32 is fine in bf16 storage, refused with fp8/fp4 storage
    Config.tiny(moe_inter_dim=40)
    with pytest.raises(ConfigError, match="moe_inter_dim"):
        Config.tiny(moe_inter_dim=40, expert_dtype="fp4")
    with pytest.raises(ConfigError, match="moe_inter_dim"):    # fp8 experts in a bf16 model: forward failed later
        Config.tiny(moe_inter_dim=40, expert_dtype="fp8")


def test_unknown_keys_and_bad_json(tmp_path):
    d = Config.tiny().to_dict()
    d["n_experts"] = 8
    with pytest.raises(ConfigError, match="n_experts"):
        Config.from_dict(d)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json"):
        Config.from_json(tmp_path / "bad.json")
    (tmp_path / "model.safetensors").write_bytes(b"\xf8\x00\x00\x00\x00\x00\x00\x00{")   # not text at all
    with pytest.raises(ConfigError, match="model.safetensors: not valid JSON"):
        Config.from_json(tmp_path / "model.safetensors")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        Config.from_json(tmp_path / "list.json")
    d = Config.tiny().to_dict()
    d["compress_ratios"] = d["compress_ratios"][:-1]
    (tmp_path / "short.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="compress_ratios"):
        Config.from_json(tmp_path / "short.json")


# ----------------------------------------------------------------------------- reading config.json strictly
def _write(tmp_path, d, name="config.json"):
    (tmp_path / name).write_text(json.dumps(d))
    return tmp_path / name


def test_missing_keys_are_refused_not_filled_with_release_values(tmp_path):
    """A key left out of a tiny config.json took the release's value (swiglu_limit 10.0 for the fixture's 2.0:
    other logits, no error); {} gave the whole release config."""
    full = json.loads((fixture_dir("tiny-bf16") / "config.json").read_text())
    d = dict(full)
    del d["swiglu_limit"], d["route_scale"]
    with pytest.raises(ConfigError, match=r"config.json: missing config key\(s\): route_scale, swiglu_limit"):
        Config.from_json(_write(tmp_path, d))
    with pytest.raises(ConfigError, match="missing config key.*vocab_size") as e:
        Config.from_dict({})
    missing = str(e.value).split("missing config key(s): ")[1].split(" (")[0].split(", ")
    assert set(missing) == {f.name for f in dataclasses.fields(Config)} - set(fd.config.OPTIONAL_KEYS)
    assert "vision_dim" in missing and "dtype" in missing and "temperature" not in missing


def test_only_the_five_runtime_keys_may_be_absent(tmp_path):
    """SPEC §0: gate_temp, norm_topk_prob, temperature, max_batch_size, max_seq_len are not in the release's
    config.json; they take the reference's defaults."""
    assert fd.config.OPTIONAL_KEYS == {"gate_temp", "norm_topk_prob", "temperature", "max_batch_size",
                                       "max_seq_len"}
    d = Config.flash().to_dict()
    for k in fd.config.OPTIONAL_KEYS:
        del d[k]
    assert Config.from_json(_write(tmp_path, d)) == Config.flash()     # the release's inference config.json


@pytest.mark.parametrize("name", ["tiny-bf16", "tiny-fp8", "tiny-vl"])
def test_every_fixture_config_and_to_json_output_loads(tmp_path, name):
    cfg = Config.from_json(fixture_dir(name) / "config.json")
    cfg.to_json(tmp_path / "c.json")                                     # what train/run.py's export writes
    assert Config.from_json(tmp_path / "c.json") == cfg


def test_duplicate_keys_are_refused(tmp_path):
    text = json.dumps(Config.tiny().to_dict())[:-1] + ', "dim": 256}'    # json kept the last value silently
    (tmp_path / "dup.json").write_text(text)
    with pytest.raises(ConfigError, match="dup.json: duplicate key 'dim'"):
        Config.from_json(tmp_path / "dup.json")


def test_huge_integer_in_a_float_field(tmp_path):
    """int too large for a float: an OverflowError escaped from math.isfinite."""
    d = Config.tiny().to_dict()
    d["rope_theta"] = int("9" * 400)
    with pytest.raises(ConfigError, match="rope_theta: expected a finite number, got an integer of 400 digits"):
        Config.from_dict(d)
    with pytest.raises(ConfigError, match="c.json: rope_theta"):
        Config.from_json(_write(tmp_path, d, "c.json"))
    text = json.dumps(Config.tiny().to_dict())[:-1] + ', "hc_eps": ' + "9" * 5000 + "}"   # past int_max_str_digits
    assert text.count('"hc_eps": 1e-06, ') == 1
    text = text.replace('"hc_eps": 1e-06, ', "")
    (tmp_path / "big.json").write_text(text)
    with pytest.raises(ConfigError, match="big.json: not valid JSON"):
        Config.from_json(tmp_path / "big.json")


@pytest.mark.parametrize("arg,match", [
    (None, "expected a dict of config.json keys, got NoneType"),
    ("config.json", "got a path 'config.json'.*Config.from_json"),
    (fixture_dir("tiny-bf16") / "config.json", "got a path .*Config.from_json"),
    ([("dim", 128)], "expected a dict of config.json keys, got list"),
    ({1: 2}, r"keys must be config.json key names \(strings\), got 1"),
])
def test_from_dict_needs_a_dict_of_str_keys(arg, match):
    """A path gave "unknown config key(s): ., c, f, ..."; None / a list / int keys gave bare TypeErrors."""
    with pytest.raises(TypeError, match=match):
        Config.from_dict(arg)


def test_from_json_names_the_path_and_the_right_file(tmp_path):
    with pytest.raises(IsADirectoryError, match=f"{tmp_path} is a folder; pass the config.json inside it"):
        Config.from_json(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.json does not exist"):
        Config.from_json(tmp_path / "nope.json")
    hf = {"architectures": ["DeepseekV41ForCausalLM"], "hidden_size": 5120, "num_hidden_layers": 40,
          "num_attention_heads": 64, "vocab_size": 129280, "rms_norm_eps": 1e-20}
    with pytest.raises(ConfigError, match=r"hf.json: this is the Hugging Face config.json \(it has hidden_size, "
                                          r"num_hidden_layers.*inference/config.json"):
        Config.from_json(_write(tmp_path, hf, "hf.json"))
    with pytest.raises(TypeError, match="Config.from_dict"):
        Config.from_json(Config.tiny().to_dict())


def test_vision_head_dim_must_be_a_multiple_of_4():
    """SPEC §12 2D RoPE: head dim 6 (24 / 4) was accepted and vit() failed with a shape mismatch."""
    with pytest.raises(ConfigError, match=r"vision_n_heads: vision head dim vision_dim / vision_n_heads = "
                                          r"24 / 4 = 6 is not a multiple of 4"):
        Config.tiny(vision_n_layers=1, vision_dim=24, vision_n_heads=4)
    Config.tiny(vision_n_layers=0, vision_dim=24, vision_n_heads=4)      # vision off: not used
    Config.tiny(vision_n_layers=1, vision_dim=32, vision_n_heads=4)      # head dim 8


@pytest.mark.parametrize("v", [0, -5, 513])
def test_engram_compressed_vocab_size_range(v):
    """0 divided int64_max in the multiplier bound (ZeroDivisionError later); -5 was accepted."""
    with pytest.raises(ConfigError, match=rf"engram_compressed_vocab_size: must be in \[1, vocab_size 512\]"
                                          rf".*got {v}"):
        Config.tiny(engram_compressed_vocab_size=v)
    Config.tiny(engram_compressed_vocab_size=512)
    Config.tiny(engram_layer_ids=(), engram_num_embeddings=(), engram_compressed_vocab_size=0)   # Engram off


def test_frozen_and_replace():
    c = Config.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.dim = 3
    assert c.replace(temperature=1.0).temperature == 1.0
    with pytest.raises(ConfigError, match="compress_ratios"):
        c.replace(n_layers=11)
    assert fd.Config is Config


@pytest.mark.parametrize("changes,match", [
    (dict(dim=10 ** 40), r"^dim: an integer of 41 digits does not fit in int64"),       # torch: "Overflow when unpacking"
    (dict(vocab_size=2 ** 63), r"^vocab_size: 9223372036854775808 does not fit in int64"),
    (dict(kv_source_layers=[2, 2 ** 64]), r"^kv_source_layers: 18446744073709551616 does not fit in int64"),
    (dict(n_routed_experts=10 ** 12), r"^n_routed_experts: the parameter tree would list ~72000000000768 tensors"),  # hung
    (dict(dim=2 ** 40), r"^dim: a parameter of dspark_target_layer_ids\*dim\*dim = \d+ elements is too large"),
    (dict(vision_n_layers=1, vision_dim=2 ** 31), r"^vision_dim: a parameter of 3\*vision_dim\*vision_dim"),
    (dict(engram_vocab_size=2 ** 40), r"^engram_vocab_size: 1099511627776 > 2\*\*32 \(the Engram layout's primes"),
    (dict(engram_n_heads=1000), r"^engram_n_heads: the Engram layout needs a prime .*: 6000, more than 2\*\*10"),
])
def test_sizes_too_large_to_build_are_refused(changes, match):
    """Integers a JSON file may hold but no model can use: init_params failed inside torch ("Overflow when unpacking
    long long") or, for 10**12 experts, init_params / load_params looped for days."""
    with pytest.raises(ConfigError, match=match):
        Config.from_dict({**Config.tiny().to_dict(), **changes})


def test_size_bounds_leave_room_and_cost_nothing():
    import time
    Config.tiny(n_routed_experts=30000)                               # 2.2M tensors: under the 2**22 bound
    Config.tiny(vision_n_layers=1, vision_dim=2 ** 20)                 # large but fits int64
    Config.tiny(vision_n_layers=0, vision_dim=2 ** 40)                 # vision off: its sizes build nothing
    t = time.perf_counter()
    for _ in range(10):
        Config.flash()
    assert (time.perf_counter() - t) / 10 < 0.05


def test_engram_tables_must_fit_the_hash_layout(tmp_path):
    """engram_num_embeddings [100, 100] passed from_dict, init_params, save_params and load_params; only forward
    refused it (SPEC §6.2: the rows are the sum of the layout's primes)."""
    d = {**Config.tiny().to_dict(), "engram_num_embeddings": [100, 100]}
    with pytest.raises(ConfigError, match=r"^engram_num_embeddings: engram layout: layer 1 needs 2514 table rows "
                                          r"\(sum of its primes\), config engram_num_embeddings\[0\] = 100$"):
        Config.from_dict(d)
    with pytest.raises(ConfigError, match=r"c.json: engram_num_embeddings: engram layout: layer 1 needs 2514"):
        Config.from_json(_write(tmp_path, d, "c.json"))
    with pytest.raises(ConfigError, match=r"layer 4 needs 2712 table rows .* engram_num_embeddings\[1\] = 2713"):
        Config.from_dict({**d, "engram_num_embeddings": [2514, 2713]})
    assert Config.from_dict(Config.flash().to_dict()) == Config.flash()
    Config.from_dict({**d, "engram_layer_ids": [], "engram_num_embeddings": []})     # Engram off
