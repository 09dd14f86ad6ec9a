"""load_params / save_params (params/checkpoint.py, params/save.py): byte-exact fixture round trips, strict errors,
index path traversal, sharding, memory-mapped Engram tables. What a save leaves when it fails or is killed:
test_checkpoint_atomic.py."""
import json
import os
import struct

import pytest
import torch

import functional_dsv41 as fd
from functional_dsv41.params import checkpoint as ck
from functional_dsv41.params import save as sv
from functional_dsv41.params.checkpoint import CheckpointError

from conftest import deterministic_algorithms, fixture_dir


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


def test_load_and_save_under_deterministic_algorithms(tmp_path):
    """torch.use_deterministic_algorithms(True) (reproducible runs): load_params of a checkpoint with fp4 experts
    gives the same tree, and its save the same bytes. A plain clone raised there: torch fills a new tensor's
    storage first in that mode and has no fill for float4_e2m1fn_x2."""
    want = fd.load_params(fixture_dir("tiny-fp8"), _cfg("tiny-fp8"))
    with deterministic_algorithms():
        got = fd.load_params(fixture_dir("tiny-fp8"), _cfg("tiny-fp8"))
        fd.save_params(got, tmp_path, _cfg("tiny-fp8"))
    assert fd.tree_diff(want, got, atol=0).ok
    assert got["layers"][0]["ffn"]["experts"][0]["w1"]["weight"].dtype == torch.float4_e2m1fn_x2
    a, _ = _raw(fixture_dir("tiny-fp8") / "model.safetensors")
    b, _ = _raw(tmp_path / "model.safetensors")
    assert a == b


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
    assert (fixture_dir("tiny-fp8") / "tokenizer.json").exists()
    tm = p_dir["engram_token_map"]
    assert tm.dtype == torch.int64 and tm.shape == (cfg.vocab_size,)
    assert int(tm.max()) + 1 == cfg.engram_compressed_vocab_size
    fd.save_params(p_dir, tmp_path, cfg)  # ignored by save
    assert "engram_token_map" not in _raw(tmp_path / "model.safetensors")[0]
    back = fd.load_params(tmp_path, cfg)  # no tokenizer.json there -> no map
    assert "engram_token_map" not in back
    d = fd.tree_diff(p_dir, back, atol=0)
    assert {r.path for r in d.problems()} <= {"engram_token_map"}


def _write(path, tensors):
    sv._write_shard(tensors, str(path))


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


def _off_layout(rows=100):
    """A config built in code whose Engram tables have ``rows`` rows (not the hash layout's 2514 / 2712: only
    Config.from_dict refuses that), and a params tree with tables of those rows: it matches param_spec(cfg)."""
    good = fd.Config.tiny()
    cfg = good.replace(engram_num_embeddings=(rows, rows))
    flat = fd.flatten_with_paths(fd.init_params(good, seed=0))
    for L in cfg.engram_layer_ids:
        for leaf in ("weight", "scale"):
            flat[f"layers.{L}.engram.embed.{leaf}"] = flat[f"layers.{L}.engram.embed.{leaf}"][:rows].clone()
    return cfg, flat


_OFF_LAYOUT = (r"the config's Engram tables do not fit the hash layout \(SPEC §6.2: forward refuses them\)(.|\n)*"
               r"engram layout: layer 1 needs 2514 table rows \(sum of its primes\), config engram_num_embeddings\[0\] "
               r"= 100")


def test_save_refuses_a_config_off_the_engram_layout(tmp_path):
    """Such a config and tables of its rows agreed with each other, so save_params wrote them over the good
    checkpoint in the folder (and load_params read them back); only forward refused the tables."""
    fd.save_params(fd.init_params(fd.Config.tiny(), seed=0), tmp_path, fd.Config.tiny())
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    cfg, flat = _off_layout()
    with pytest.raises(CheckpointError, match="save_params: " + _OFF_LAYOUT) as ei:
        fd.save_params(fd.unflatten_from_paths(flat), tmp_path, cfg)
    assert "nothing was written" in str(ei.value)
    assert {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)} == before     # no temporary file either
    with pytest.raises(CheckpointError, match="save_params: " + _OFF_LAYOUT):          # nor a new folder
        fd.save_params(fd.unflatten_from_paths(flat), tmp_path / "new", cfg, max_shard_bytes=1e5)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("strict", [True, False])
def test_load_refuses_a_config_off_the_engram_layout(tmp_path, strict):
    cfg, flat = _off_layout()
    _write(tmp_path / "model.safetensors", flat)          # (as save_params wrote it before it checked the layout)
    with pytest.raises(CheckpointError, match="load_params: " + _OFF_LAYOUT):
        fd.load_params(tmp_path, cfg, strict=strict)


@pytest.mark.parametrize("shard", ["../evil.safetensors", "/tmp/evil.safetensors", "sub/../../evil.safetensors"])
def test_index_path_traversal_refused(tmp_path, shard):
    ck_dir = tmp_path / "ck"
    ck_dir.mkdir()
    _write(tmp_path / "evil.safetensors", {"embed.weight": torch.zeros(2)})
    (ck_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"embed.weight": shard}}))
    with pytest.raises(CheckpointError, match="leaves the checkpoint folder"):
        fd.load_params(ck_dir, fd.Config.tiny(), strict=False)


def test_index_problems_are_all_named(tmp_path):
    """An index naming shard files that are not there was a bare FileNotFoundError for the first one; tensors listed
    in a shard that lacks them were reported one at a time: now every one, as load_params' docstring promises."""
    _write(tmp_path / "a.safetensors", {"embed.weight": torch.zeros(2)})
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"embed.weight": "a.safetensors", "x.one": "gone-1.safetensors",
                                              "x.two": "gone-2.safetensors", "x.three": "gone-2.safetensors"}}))
    with pytest.raises(CheckpointError, match="names shard files that are not there") as e:
        fd.load_params(tmp_path, fd.Config.tiny(), strict=False)
    assert e.value.problems == ["gone-1.safetensors (holds 1 tensors, e.g. x.one)",
                                "gone-2.safetensors (holds 2 tensors, e.g. x.three)"]
    idx.write_text(json.dumps({"weight_map": {"embed.weight": "a.safetensors", "bogus.one": "a.safetensors",
                                              "bogus.two": "a.safetensors"}}))
    with pytest.raises(CheckpointError, match="lists tensors in shards that do not hold them") as e:
        fd.load_params(tmp_path, fd.Config.tiny(), strict=False)
    assert e.value.problems == ["bogus.one in a.safetensors", "bogus.two in a.safetensors"]


def _raw_file(path, header, data):
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def test_crafted_headers_are_refused(tmp_path):
    """A shape whose int64 product wraps around (2**62 + 1 rows of 4 floats 'need' 16 bytes) passed the size check
    and crashed in torch with strict=False; overlapping tensors were reported with the range reversed."""
    f = tmp_path / "model.safetensors"
    _raw_file(f, {"w": {"dtype": "F32", "shape": [2**62 + 1, 4], "data_offsets": [0, 16]}}, bytes(16))
    with pytest.raises(CheckpointError, match=r"w: data_offsets \[0, 16\] hold 16 bytes, F32"):
        fd.load_params(f, fd.Config.tiny(), strict=False)
    _raw_file(f, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                  "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16))
    with pytest.raises(CheckpointError, match=r"data bytes \[8, 16\) belong to two tensors \(they overlap\)"):
        fd.load_params(f, fd.Config.tiny(), strict=False)
    _raw_file(f, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16))
    with pytest.raises(CheckpointError, match=r"data bytes \[0, 8\) belong to no tensor"):
        fd.load_params(f, fd.Config.tiny(), strict=False)


def test_sharded_round_trip_and_layout_switch(tmp_path):
    cfg = _cfg("tiny-fp8")
    p = fd.init_params(cfg, seed=5)
    files = fd.save_params(p, tmp_path, cfg, max_shard_bytes=400_000)
    names = sorted(os.listdir(tmp_path))
    assert names[-1] == "model.safetensors.index.json" and len(files) == len(names) >= 4
    n = len(names) - 1                                  # the released naming: 1-based, zero-padded to 5 digits
    assert names[:-1] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    total = sum(t.numel() * t.element_size() for t in fd.flatten_with_paths(p).values())
    assert index["metadata"]["total_size"] == total     # bytes, not elements (what loaders pre-allocate by)
    assert sum(os.path.getsize(tmp_path / f) for f in names[:-1]) > total
    wmap = index["weight_map"]
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


def test_max_shard_bytes_is_the_largest_shard_allowed(tmp_path):
    """A tree of exactly max_shard_bytes bytes is one file; one byte less splits it."""
    cfg = _cfg("tiny-fp8")
    p = fd.init_params(cfg, seed=5)
    total = sum(t.numel() * t.element_size() for t in fd.flatten_with_paths(p).values())
    exact = fd.save_params(p, tmp_path / "exact", cfg, max_shard_bytes=total)
    assert [os.path.basename(f) for f in exact] == ["model.safetensors"]
    assert len(fd.save_params(p, tmp_path / "less", cfg, max_shard_bytes=total - 1)) > 1


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
    from functional_dsv41.train.settings import engram_rows
    # tables of ~2**20 rows, 32 MiB each (head_dim 32): large enough to see in the resident set. Their rows are the
    # hash layout's for this engram_vocab_size (6 primes a layer above it): save_params refuses other rows
    probe = fd.Config.tiny(engram_vocab_size=175_000)
    cfg = probe.replace(engram_num_embeddings=engram_rows(probe))
    rows = cfg.engram_num_embeddings[0]
    p = fd.init_params(fd.Config.tiny(), seed=0)
    for L, n in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
        e = p["layers"][L]["engram"]["embed"]
        e["weight"] = torch.ones(n, 32, dtype=torch.uint8).view(torch.float8_e4m3fn)
        e["scale"] = torch.full((n, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
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


@pytest.mark.parametrize("int_dtype", [torch.int8, torch.uint8])
def test_hf_layout_int8_packed_fp4_experts_load_as_fp4(tmp_path, int_dtype):
    """The Hugging Face release stores the packed fp4 routed experts under an integer dtype (I8 bytes [N, K/2] beside
    the e8m0 [N, K/32] scale, SPEC §9): strict loading refused every one of them as 'wrong dtype'. They load as the
    same bytes in float4_e2m1fn_x2, and save back in the released F4 layout."""
    from safetensors.torch import load_file, save_file

    d = fixture_dir("tiny-fp8")
    cfg = fd.Config.from_json(d / "config.json")
    flat = load_file(str(d / "model.safetensors"))
    hf = {k: (v.view(int_dtype) if v.dtype == torch.float4_e2m1fn_x2 else v) for k, v in flat.items()}
    assert sum(v.dtype == int_dtype for v in hf.values()) == sum(".experts." in k and k.endswith(".weight")
                                                                 for k in flat) > 0
    (tmp_path / "hf").mkdir()
    save_file(hf, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    got = fd.load_params(tmp_path / "hf", cfg, tokenizer=d / "tokenizer.json")
    want = fd.load_params(d, cfg)
    assert fd.tree_diff(want, got, atol=0).ok
    g, w = fd.flatten_with_paths(got), fd.flatten_with_paths(want)
    assert all(g[k].dtype == w[k].dtype and torch.equal(g[k].view(torch.uint8), w[k].view(torch.uint8))
               for k in w if k != "engram_token_map")
    fd.save_params(got, tmp_path / "out", cfg)
    a, b = _raw(d / "model.safetensors")[0], _raw(tmp_path / "out" / "model.safetensors")[0]
    assert a == b
    loose = fd.flatten_with_paths(fd.load_params(tmp_path / "hf", cfg, strict=False))
    assert loose["layers.0.ffn.experts.0.w1.weight"].dtype == torch.float4_e2m1fn_x2


def _corrupt(path, edit):
    """Rewrite a safetensors file after ``edit(header, data) -> (header, data)``."""
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        hdr, data = json.loads(fh.read(n)), fh.read()
    hdr, data = edit(hdr, data)
    raw = hdr if isinstance(hdr, bytes) else json.dumps(hdr).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw + data)


def _set(name, key, value):
    def edit(h, d):
        h[name][key] = value
        return h, d
    return edit


@pytest.mark.parametrize("edit, match", [
    (lambda h, d: (h, d[:-1]), r"past the end of the file .*truncated"),
    (lambda h, d: (h, d[: len(d) // 2]), r"truncated"),
    (lambda h, d: (h, d + b"\0" * 16), r"16 bytes after the last tensor"),
    (lambda h, d: (b"{not json", d), r"not valid JSON"),
    (lambda h, d: (b"[1, 2]", d), r"header is a JSON list"),
    (_set("norm.weight", "dtype", "F99"), r"norm.weight: unknown dtype 'F99'"),
    (_set("norm.weight", "data_offsets", None), r"norm.weight: data_offsets None"),
    (_set("norm.weight", "shape", [7]), r"norm.weight: data_offsets .* hold 256 bytes, BF16 \[7\] needs 14"),
])
@pytest.mark.parametrize("strict", [True, False])
def test_corrupt_file_named_and_refused(tmp_path, edit, match, strict):
    cfg = fd.Config.tiny()
    fd.save_params(fd.init_params(cfg, seed=0), tmp_path, cfg)
    assert _raw(tmp_path / "model.safetensors")[0]["norm.weight"][:2] == ("BF16", [128])
    _corrupt(tmp_path / "model.safetensors", edit)
    with pytest.raises(CheckpointError, match=match) as e:
        fd.load_params(tmp_path, cfg, strict=strict)
    assert str(tmp_path / "model.safetensors") in str(e.value)


def test_fp4_odd_logical_width_refused(tmp_path):
    cfg = _cfg("tiny-fp8")
    fd.save_params(fd.load_params(fixture_dir("tiny-fp8"), cfg), tmp_path, cfg)
    h = _raw(tmp_path / "model.safetensors")[0]
    name = next(n for n, (dt, _, _) in h.items() if dt == "F4")
    shape = list(h[name][1])
    _corrupt(tmp_path / "model.safetensors", _set(name, "shape", shape[:-1] + [shape[-1] + 1]))
    with pytest.raises(CheckpointError, match=f"{name}: F4 shape .* needs an even last dimension"):
        fd.load_params(tmp_path, cfg)


@pytest.mark.parametrize("index, match", [
    ("{\"weight_map\": {", "not valid JSON"),
    ("", "not valid JSON"),
    ("[1, 2]", "no 'weight_map' object"),
    ('{"weight_map": {"embed.weight": 5}}', "weight_map values must be shard file names"),
])
def test_malformed_index_named(tmp_path, index, match):
    cfg = fd.Config.tiny()
    fd.save_params(fd.init_params(cfg, seed=0), tmp_path, cfg, max_shard_bytes=300_000)
    (tmp_path / ck.INDEX).write_text(index)
    with pytest.raises(CheckpointError, match=match) as e:
        fd.load_params(tmp_path, cfg)
    assert ck.INDEX in str(e.value)


@pytest.mark.parametrize("damage", ["{\"weight_map\": {", "[1, 2]", "a folder"])
@pytest.mark.parametrize("max_shard_bytes", [5e9, 200_000])
def test_save_over_unreadable_index_refused(tmp_path, damage, max_shard_bytes):
    """A save into a folder whose index cannot be read removed that index and left the shards it listed beside the
    new checkpoint (they were unknown, so never removed): the folder held a mix. Such a save is refused, naming the
    index, before anything is written or removed."""
    cfg = fd.Config.tiny()
    fd.save_params(fd.init_params(cfg, seed=1), tmp_path, cfg, max_shard_bytes=300_000)
    idx = tmp_path / ck.INDEX
    if damage == "a folder":                    # an OSError on reading, not a parse error
        idx.unlink()
        idx.mkdir()
    else:
        idx.write_text(damage)
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path) if n != ck.INDEX}
    with pytest.raises(CheckpointError, match="cannot be read") as e:
        fd.save_params(fd.init_params(cfg, seed=2), tmp_path, cfg, max_shard_bytes=max_shard_bytes)
    assert f"{idx} cannot be read" in str(e.value) and "nothing was written" in str(e.value)
    assert sorted(os.listdir(tmp_path)) == sorted([*before, ck.INDEX])
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    assert idx.is_dir() if damage == "a folder" else idx.read_text() == damage


def test_shard_tensor_missing_from_index_is_unexpected(tmp_path):
    cfg = fd.Config.tiny()
    fd.save_params(fd.init_params(cfg, seed=0), tmp_path, cfg, max_shard_bytes=300_000)
    index = json.loads((tmp_path / ck.INDEX).read_text())
    shard = index["weight_map"]["embed.weight"]
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / shard))
    tensors["bogus.extra"] = torch.zeros(3)
    save_file(tensors, str(tmp_path / shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"unexpected: bogus.extra \(in {shard}, not in the index\)"):
        fd.load_params(tmp_path, cfg)


def test_hub_snapshot_with_symlinked_shards_loads(tmp_path):
    """A Hugging Face hub snapshot: snapshots/<rev>/<shard> are symlinks into ../../blobs."""
    cfg = fd.Config.tiny()
    p = fd.init_params(cfg, seed=0)
    src = tmp_path / "src"
    fd.save_params(p, src, cfg, max_shard_bytes=300_000)
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(os.listdir(src))):
        os.replace(src / f, blobs / f"blob{i}")
        os.symlink(os.path.relpath(blobs / f"blob{i}", snap), snap / f)
    assert fd.tree_diff(p, fd.load_params(snap, cfg), atol=0).ok


@pytest.mark.parametrize("scale", ["f32", "rows"])
def test_hf_fp8_wo_a_scale_checked(tmp_path, scale):
    from safetensors.torch import load_file, save_file

    from functional_dsv41 import quant
    d = fixture_dir("tiny-fp8")
    cfg = fd.Config.from_json(d / "config.json")
    hf = load_file(str(d / "model.safetensors"))
    name = "layers.3.attn.wo_a.weight"
    q, s = quant.quant_fp8_block(hf[name].float())
    hf[name] = q
    hf[name[: -len("weight")] + "scale"] = quant.e8m0_to_float(s) if scale == "f32" else torch.cat([s, s])
    save_file(hf, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers.3.attn.wo_a.scale is (F32|F8_E8M0) .*expected F8_E8M0"):
        fd.load_params(tmp_path, cfg)


def test_token_map_checked(tmp_path):
    d = fixture_dir("tiny-fp8")
    cfg = fd.Config.from_json(d / "config.json")
    with pytest.raises(FileNotFoundError, match="tokenizer .*nope.json does not exist"):
        fd.load_params(d, cfg, tokenizer=tmp_path / "nope.json")
    with pytest.raises(IsADirectoryError, match="tokenizer .* is a folder: pass its tokenizer.json"):
        fd.load_params(d, cfg, tokenizer=d)          # (it said the folder did not exist)
    # a config without Engram layers reads no tokenizer, but a path that is not there is still a mistake (it was
    # ignored)
    plain = fd.Config.tiny(engram_layer_ids=(), engram_num_embeddings=())
    fd.save_params(fd.init_params(plain, seed=0), tmp_path / "plain", plain)
    with pytest.raises(FileNotFoundError, match="tokenizer .*nope.json does not exist$"):
        fd.load_params(tmp_path / "plain", plain, tokenizer=tmp_path / "nope.json")
    bad = cfg.replace(engram_compressed_vocab_size=cfg.engram_compressed_vocab_size - 1)
    with pytest.raises(ValueError, match="compressed classes"):
        fd.load_params(d, bad)


def test_load_and_save_need_a_config(tmp_path):
    d = fixture_dir("tiny-bf16")
    for bad in (str(d / "config.json"), {"dim": 8}):
        with pytest.raises(TypeError, match=r"load_params: cfg must be a functional_dsv41.Config"):
            fd.load_params(d, bad)
        with pytest.raises(TypeError, match=r"save_params: cfg must be a functional_dsv41.Config"):
            fd.save_params({}, tmp_path / "out", bad)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("strict", [True, False])
def test_hf_fp8_wo_a_with_partial_blocks_loads_strict_or_not(tmp_path, strict):
    """An fp8 wo_a whose rows are not a multiple of 32 (o_lora_rank 20: [40, 128]) carries one e8m0 scale per 32 x 32
    block, partial blocks included: ceil(40/32) x ceil(128/32) = [2, 4] (SPEC §9). It loads, strict or not, as the
    bf16 wo_a of our layout: the dequantised values, and no wo_a.scale left in the tree."""
    from safetensors.torch import save_file

    from functional_dsv41 import quant
    cfg = fd.Config.tiny(o_lora_rank=20)
    flat = fd.flatten_with_paths(fd.init_params(cfg, seed=0))
    name = "layers.3.attn.wo_a.weight"
    assert tuple(flat[name].shape) == (40, 128)
    hf = {k: v.contiguous() for k, v in flat.items()}
    q, s = quant.quant_fp8_block(flat[name].float())
    assert tuple(s.shape) == (2, 4)
    hf[name], hf["layers.3.attn.wo_a.scale"] = q, s
    save_file(hf, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    got = fd.load_params(tmp_path, cfg, strict=strict)
    wo_a = got["layers"][3]["attn"]["wo_a"]
    assert set(wo_a) == {"weight"} and wo_a["weight"].dtype == torch.bfloat16
    e = s.view(torch.uint8).long() - 127                   # W[i, j] = q[i, j] * 2^(E[i//32, j//32] - 127)
    want = q.float() * torch.exp2(e.repeat_interleave(32, 0)[:40].repeat_interleave(32, 1)[:, :128].float())
    assert torch.equal(wo_a["weight"], want.bfloat16())
    assert set(fd.flatten_with_paths(got)) == set(flat)
