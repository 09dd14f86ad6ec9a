"""load_params / save_params (params/checkpoint.py): byte-exact fixture round trips, strict errors,
index path traversal, sharding, atomic saves, memory-mapped Engram tables."""
import json
import os
import struct

import pytest
import torch

import functional_dsv41 as fd
from functional_dsv41.params import checkpoint as ck
from functional_dsv41.params.checkpoint import CheckpointError

from conftest import fixture_dir


def _raw(path):
    """name -> (dtype, header shape, raw bytes) of a safetensors file."""
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        hdr = json.loads(fh.read(n))
        data = fh.read()
    meta = hdr.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in hdr.items()}, meta


def _cfg(name):
    return fd.Config.from_json(fixture_dir(name) / "config.json")


@pytest.mark.parametrize("name", ["tiny-bf16", "tiny-fp8", "tiny-vl"])
def test_fixture_load_save_byte_exact(tmp_path, name):
    src = fixture_dir(name) / "model.safetensors"
    params = fd.load_params(fixture_dir(name), _cfg(name))
    files = fd.save_params(params, tmp_path, _cfg(name))
    assert files == [str(tmp_path / "model.safetensors")]
    a, _ = _raw(src)
    b, meta = _raw(tmp_path / "model.safetensors")
    assert meta == {"format": "pt"} and a.keys() == b.keys()
    for k in a:
        assert a[k] == b[k], k
    from safetensors.torch import load_file  # the file is readable by safetensors itself
    sd = load_file(str(tmp_path / "model.safetensors"))
    assert sd["layers.0.ffn.experts.0.w1.weight"].dtype == (torch.float4_e2m1fn_x2 if name != "tiny-bf16"
                                                            else torch.bfloat16)


def test_load_forms_and_token_map(tmp_path):
    cfg = _cfg("tiny-fp8")
    p_dir = fd.load_params(fixture_dir("tiny-fp8"), cfg)
    p_file = fd.load_params(fixture_dir("tiny-fp8") / "model.safetensors", cfg)
    assert fd.tree_diff(p_dir, p_file, atol=0).ok
    # the token map comes from tokenizer.json, is int64 [vocab], and is not a checkpoint tensor
    tm = p_dir.get("engram_token_map")
    if tm is not None:
        assert tm.dtype == torch.int64 and tm.shape == (cfg.vocab_size,)
        assert int(tm.max()) + 1 == cfg.engram_compressed_vocab_size
    fd.save_params(p_dir, tmp_path, cfg)  # ignored by save
    assert "engram_token_map" not in _raw(tmp_path / "model.safetensors")[0]
    back = fd.load_params(tmp_path, cfg)  # no tokenizer.json there -> no map
    assert "engram_token_map" not in back
    d = fd.tree_diff(p_dir, back, atol=0)
    assert {r.path for r in d.problems()} <= {"engram_token_map"}


def _write(path, tensors):
    ck._write_shard(tensors, str(path))


def test_strict_reports_everything_at_once(tmp_path):
    cfg = fd.Config.tiny()
    flat = fd.flatten_with_paths(fd.init_params(cfg, seed=0))
    del flat["layers.3.attn.wkv.weight"]
    flat["layers.3.attn.bogus"] = torch.zeros(2)
    flat["layers.4.ffn.gate.bias"] = flat["layers.4.ffn.gate.bias"].bfloat16()
    flat["head.weight"] = flat["head.weight"][:-1]
    _write(tmp_path / "model.safetensors", flat)
    with pytest.raises(CheckpointError) as ei:
        fd.load_params(tmp_path, cfg)
    msg = str(ei.value)
    for part in ("missing: layers.3.attn.wkv.weight", "unexpected: layers.3.attn.bogus",
                 "wrong dtype: layers.4.ffn.gate.bias", "wrong shape: head.weight"):
        assert part in msg
    assert len(ei.value.problems) == 4 and isinstance(ei.value, ValueError)
    loose = fd.load_params(tmp_path, cfg, strict=False)
    assert loose["layers"][3]["attn"]["bogus"].shape == (2,) and "wkv" not in loose["layers"][3]["attn"]


def test_save_validates_before_writing(tmp_path):
    cfg = fd.Config.tiny()
    p = fd.init_params(cfg, seed=0)
    del p["layers"][0]["attn"]["wq_a"]
    p["layers"][1]["ffn_norm"]["weight"] = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError) as ei:
        fd.save_params(p, tmp_path / "out", cfg)
    assert "layers.0.attn.wq_a.weight" in str(ei.value) and "layers.1.ffn_norm.weight" in str(ei.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shard", ["../evil.safetensors", "/tmp/evil.safetensors", "sub/../../evil.safetensors"])
def test_index_path_traversal_refused(tmp_path, shard):
    ck_dir = tmp_path / "ck"
    ck_dir.mkdir()
    _write(tmp_path / "evil.safetensors", {"embed.weight": torch.zeros(2)})
    (ck_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"embed.weight": shard}}))
    with pytest.raises(CheckpointError, match="leaves the checkpoint folder"):
        fd.load_params(ck_dir, fd.Config.tiny(), strict=False)


def test_sharded_round_trip_and_layout_switch(tmp_path):
    cfg = _cfg("tiny-fp8")
    p = fd.init_params(cfg, seed=5)
    files = fd.save_params(p, tmp_path, cfg, max_shard_bytes=400_000)
    names = sorted(os.listdir(tmp_path))
    assert names[-1] == "model.safetensors.index.json" and len(files) == len(names) >= 4
    assert all(n.startswith("model-") and n.endswith(f"-of-{len(names) - 1:05d}.safetensors") for n in names[:-1])
    wmap = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(wmap) == set(fd.flatten_with_paths(fd.param_spec(cfg)))
    back = fd.load_params(tmp_path, cfg)
    assert fd.tree_diff(p, back, atol=0).ok
    # a single-file save into the same folder replaces the sharded checkpoint entirely
    p2 = fd.init_params(cfg, seed=6)
    fd.save_params(p2, tmp_path, cfg)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    assert fd.tree_diff(p2, fd.load_params(tmp_path, cfg), atol=0).ok
    # and back to shards: the old single file is removed
    fd.save_params(p, tmp_path, cfg, max_shard_bytes=400_000)
    assert "model.safetensors" not in os.listdir(tmp_path)
    assert fd.tree_diff(p, fd.load_params(tmp_path, cfg), atol=0).ok


def test_interrupted_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    cfg = fd.Config.tiny()
    fd.save_params(fd.init_params(cfg, seed=1), tmp_path, cfg, max_shard_bytes=300_000)
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    assert len(before) >= 3
    real, calls = ck._write_shard, []

    def failing(tensors, fname):
        if calls:
            raise OSError("disk full (simulated)")
        calls.append(fname)
        real(tensors, fname)

    monkeypatch.setattr(ck, "_write_shard", failing)
    with pytest.raises(OSError, match="simulated"):
        fd.save_params(fd.init_params(cfg, seed=2), tmp_path, cfg, max_shard_bytes=300_000)
    assert len(calls) == 1 and not os.path.exists(calls[0])  # the first shard was written, then removed
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == before  # no temp files either


def _mapped_files():
    """(start, end, path) of every file-backed mapping of this process."""
    out = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/"):
                a, b = (int(x, 16) for x in parts[0].split("-"))
                out.append((a, b, parts[5]))
    return out


def _rss():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_mmap_engram_tables_stay_mapped(tmp_path):
    rows = 1 << 20  # a 32 MiB table (head_dim 32): large enough to see in the resident set
    cfg = fd.Config.tiny(engram_num_embeddings=(rows, 2712))
    p = fd.init_params(fd.Config.tiny(), seed=0)
    p["layers"][1]["engram"]["embed"]["weight"] = torch.ones(rows, 32, dtype=torch.uint8).view(torch.float8_e4m3fn)
    p["layers"][1]["engram"]["embed"]["scale"] = torch.full((rows, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    fd.save_params(p, tmp_path, cfg)
    del p
    path = os.path.realpath(tmp_path / "model.safetensors")
    rss0 = _rss()
    q = fd.load_params(tmp_path, cfg, mmap_engram=True)
    t = q["layers"][1]["engram"]["embed"]["weight"]
    assert t.dtype == torch.float8_e4m3fn and t.shape == (rows, 32)
    grown = _rss() - rss0
    assert grown < rows * 32 // 4, f"resident memory grew by {grown} bytes"
    ptr = t.data_ptr()
    assert any(a <= ptr < b and f == path for a, b, f in _mapped_files())   # a view of the file mapping
    assert t.untyped_storage().nbytes() > t.nbytes                        # the storage is the whole file
    assert int(t[12345].view(torch.uint8)[3]) == 1                         # reads through the mapping
    # default: materialised into its own memory
    full = fd.load_params(tmp_path, cfg)
    u = full["layers"][1]["engram"]["embed"]["weight"]
    assert u.untyped_storage().nbytes() == u.nbytes
    assert not any(a <= u.data_ptr() < b and f == path for a, b, f in _mapped_files())
    assert torch.equal(t.view(torch.uint8), u.view(torch.uint8))


def test_hf_layout_fp8_wo_a_is_dequantised_on_load(tmp_path):
    """The Hugging Face release stores attn.wo_a as fp8 + scale (its convert.py makes it bf16): loading
    such a file gives the bf16 wo_a of our layout; everything else is untouched."""
    from safetensors.torch import load_file, save_file

    from conftest import fixture_dir
    from functional_dsv41 import quant
    d = fixture_dir("tiny-fp8")
    cfg = fd.Config.from_json(d / "config.json")
    flat = load_file(str(d / "model.safetensors"))
    hf = dict(flat)
    for name in [n for n in flat if n.endswith(".attn.wo_a.weight")]:
        q, s = quant.quant_fp8_block(flat[name].float())
        hf[name], hf[name[: -len("weight")] + "scale"] = q, s
    save_file(hf, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    p = fd.load_params(tmp_path, cfg)
    got = p["layers"][3]["attn"]["wo_a"]
    assert set(got) == {"weight"} and got["weight"].dtype == torch.bfloat16
    want = quant.dequant_fp8_block(hf["layers.3.attn.wo_a.weight"], hf["layers.3.attn.wo_a.scale"])
    assert torch.equal(got["weight"], want)
    assert torch.equal(p["layers"][3]["attn"]["wq_a"]["weight"].view(torch.uint8),
                       flat["layers.3.attn.wq_a.weight"].view(torch.uint8))
