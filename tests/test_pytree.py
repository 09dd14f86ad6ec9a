"""Path-keyed pytree tools and tree_diff (functional_dsv41/pytree.py)."""
import dataclasses
import re
from typing import Optional

import pytest
import torch

import functional_dsv41 as fd
from functional_dsv41 import quant
from functional_dsv41.pytree import register_carrier

from conftest import cosine_diff


def _tree():
    return {
        "embed": {"weight": torch.arange(6.0).view(2, 3)},
        "layers": [{"attn": {"w": torch.ones(2)}, "ffn": {"experts": [torch.zeros(1), torch.full((1,), 2.0)]}},
                   {"attn": {"w": torch.full((2,), 3.0)}, "ffn": {"experts": [torch.zeros(1), torch.ones(1)]}}],
        "image_start": torch.tensor([7.0]),
    }


def test_flatten_paths_and_round_trip():
    t = _tree()
    flat = fd.flatten_with_paths(t)
    assert set(flat) == {"embed.weight", "layers.0.attn.w", "layers.0.ffn.experts.0", "layers.0.ffn.experts.1",
                         "layers.1.attn.w", "layers.1.ffn.experts.0", "layers.1.ffn.experts.1", "image_start"}
    assert flat["layers.1.attn.w"] is t["layers"][1]["attn"]["w"]
    back = fd.unflatten_from_paths(flat)
    assert isinstance(back["layers"], list) and isinstance(back["layers"][0]["ffn"]["experts"], list)
    assert fd.flatten_with_paths(back).keys() == flat.keys()
    assert all(fd.flatten_with_paths(back)[k] is v for k, v in flat.items())
    # the order does not depend on insertion order
    t2 = {"image_start": t["image_start"], "layers": t["layers"], "embed": t["embed"]}
    assert list(fd.flatten_with_paths(t2)) == list(flat)


def test_unflatten_lists_only_for_dense_indices():
    a, b = torch.zeros(1), torch.ones(1)
    assert isinstance(fd.unflatten_from_paths({"x.1": a, "x.0": b})["x"], list)
    assert fd.unflatten_from_paths({"x.1": a, "x.0": b})["x"][0] is b
    gap = fd.unflatten_from_paths({"x.0": a, "x.2": b})["x"]
    assert isinstance(gap, dict) and set(gap) == {"0", "2"}
    mixed = fd.unflatten_from_paths({"x.0": a, "x.w": b})["x"]
    assert isinstance(mixed, dict)
    assert isinstance(fd.unflatten_from_paths({"x.00": a})["x"], dict)  # "00" is a name, not index 0
    with pytest.raises(ValueError, match="a.b"):
        fd.unflatten_from_paths({"a": a, "a.b": b})
    with pytest.raises(ValueError, match="a"):
        fd.unflatten_from_paths({"a.b": b, "a": a})


def test_keys_with_a_dot_or_empty_are_refused():
    """A dict key holding "." flattened to a path that read back as deeper nesting ({"a.b": x} -> "a.b" ->
    {"a": {"b": x}}), so two different trees shared one path set; an empty key left an empty path part. Such a key
    is a ValueError naming it and where it sits; unflatten_from_paths refuses empty parts for the same reason."""
    x = torch.ones(1)
    for tree, key, where in [({"a.b": x}, "'a.b'", "at the top level"),
                             ({"layers": [{"attn": {"wq.weight": x}}]}, "'wq.weight'", "under 'layers.0.attn'"),
                             ({"a": {"": x}}, "''", "under 'a'"),
                             ({"a": {1.5: x}}, "1.5", "under 'a'")]:
        with pytest.raises(ValueError, match=rf"^flatten_with_paths: the key {re.escape(key)} {where} "):
            fd.flatten_with_paths(tree)
        with pytest.raises(ValueError, match=rf"^tree_map_with_path: the key {re.escape(key)} {where} "):
            fd.tree_map_with_path(lambda p, v: v, tree)
    # the two trees that shared the path set {"a.b"}: the nested one flattens and round-trips, the other is refused
    nested = {"a": {"b": x}}
    assert list(fd.flatten_with_paths(nested)) == ["a.b"]
    back = fd.unflatten_from_paths(fd.flatten_with_paths(nested))
    assert list(back) == ["a"] and list(back["a"]) == ["b"] and back["a"]["b"] is x
    with pytest.raises(ValueError, match=r"^tree_diff \(b\): the key 'a.b' at the top level"):
        fd.tree_diff(nested, {"a.b": x})
    for path in ("", "a..b", "a.", ".a"):
        with pytest.raises(ValueError, match=rf"^unflatten_from_paths: the path {re.escape(repr(path))} has an empty"):
            fd.unflatten_from_paths({path: x})


def test_tree_map_with_path():
    t = _tree()
    out = fd.tree_map_with_path(lambda p, x: p, t)
    assert out["layers"][1]["ffn"]["experts"][0] == "layers.1.ffn.experts.0"
    assert out["embed"]["weight"] == "embed.weight"
    two = fd.tree_map_with_path(lambda p, x, y: x + y, t, t)
    assert torch.equal(two["layers"][1]["attn"]["w"], torch.full((2,), 6.0))


@register_carrier
@dataclasses.dataclass(frozen=True)
class _Cache:
    kv: torch.Tensor
    pos: Optional[torch.Tensor] = None


def test_carriers_flatten_by_field_name():
    c = _Cache(kv=torch.ones(2), pos=torch.zeros(1))
    flat = fd.flatten_with_paths({"layers": [c]})
    assert list(flat) == ["layers.0.kv", "layers.0.pos"]
    m = fd.tree_map_with_path(lambda p, x: x + 1, {"layers": [c]})
    assert isinstance(m["layers"][0], _Cache) and torch.equal(m["layers"][0].kv, torch.full((2,), 2.0))
    assert list(fd.flatten_with_paths(_Cache(kv=torch.ones(1)))) == ["kv"]  # None is not a leaf


# ----------------------------------------------------------------------------- tree_diff
def test_tree_diff_each_kind_of_difference():
    a = {"same": torch.ones(3), "gone": torch.ones(1), "shape": torch.ones(2, 2), "dtype": torch.ones(2),
         "val": torch.tensor([1.0, 2.0, 3.0]), "n": 3}
    b = {"same": torch.ones(3), "new": torch.ones(1), "shape": torch.ones(4), "dtype": torch.ones(2).double(),
         "val": torch.tensor([1.0, 2.5, 3.0]), "n": 4}
    d = fd.tree_diff(a, b)
    by = {r.path: r for r in d.rows}
    assert by["same"].status == "ok" and by["same"].max_abs == 0 and by["same"].cos_diff == 0
    assert by["gone"].status == "missing" and by["new"].status == "extra"
    assert by["shape"].status == "shape" and by["shape"].shape_b == (4,)
    assert by["dtype"].status == "dtype" and by["dtype"].max_abs == 0  # values still compared
    assert by["n"].status == "value"
    assert by["val"].status == "ok"  # without atol values are reported, not judged
    assert by["val"].max_abs == pytest.approx(0.5)
    assert by["val"].cos_diff == pytest.approx(cosine_diff(a["val"], b["val"]), rel=1e-12, abs=0)
    assert not d.ok and {r.path for r in d.problems()} == {"gone", "new", "shape", "dtype", "n"}
    assert fd.tree_diff(a, b, atol=0.1).rows[[r.path for r in d.rows].index("val")].status == "value"
    assert fd.tree_diff(a, b, atol=0.6).rows[[r.path for r in d.rows].index("val")].status == "ok"
    assert fd.tree_diff(a, a, atol=0.0).ok
    text = str(d)
    for p in ("gone", "new", "shape", "dtype", "val", "missing", "extra", "5.000e-01"):
        assert p in text
    worst = d.worst(3)
    assert {r.status for r in worst[:2]} == {"missing", "extra"} and worst[2].path == "shape"
    assert d.worst(100)[-1].path == "same"


def test_tree_diff_worst_ranks_by_cosine():
    a = {"x": torch.tensor([1.0, 0.0]), "y": torch.tensor([1.0, 0.0]), "z": torch.tensor([1.0, 0.0])}
    b = {"x": torch.tensor([1.0, 0.1]), "y": torch.tensor([0.0, 1.0]), "z": torch.tensor([1.0, 0.0])}
    assert [r.path for r in fd.tree_diff(a, b).worst(3)] == ["y", "x", "z"]


def test_tree_diff_quantized_by_value():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=g)
    q, s = quant.quant_fp8_block(w)
    q2 = q.view(torch.uint8).clone()
    q2[0, 0] ^= 1  # one ulp-ish change of one element
    q2 = q2.view(quant.FP8)
    d = fd.tree_diff({"w": {"weight": q, "scale": s}}, {"w": {"weight": q2, "scale": s}})
    row = {r.path: r for r in d.rows}["w.weight"]
    ref = (quant.dequant_fp8_block(q, s, torch.float64) - quant.dequant_fp8_block(q2, s, torch.float64)).abs().max()
    assert row.max_abs == pytest.approx(float(ref)) and row.max_abs > 0
    assert {r.path: r for r in d.rows}["w.scale"].note == "bytewise"
    # fp4 experts and fp8 rows decode through their scale as well
    f4, f4s = quant.quant_fp4(w)
    r8, r8s = quant.quant_fp8_rows(w)
    tree = {"e": {"weight": f4, "scale": f4s}, "t": {"weight": r8, "scale": r8s}}
    dq = {"e": {"weight": quant.dequant_fp4(f4, f4s, torch.float32)},
          "t": {"weight": quant.dequant_fp8_rows(r8, r8s, torch.float32)}}
    d = fd.tree_diff(tree, dq)
    rows = {r.path: r for r in d.rows}
    assert rows["e.weight"].status == "dtype" and rows["e.weight"].max_abs == 0
    assert rows["t.weight"].status == "dtype" and rows["t.weight"].max_abs == 0
    assert rows["e.scale"].status == "missing"
    # a scale that differs bytewise fails only when values are judged
    s2 = s.view(torch.uint8).clone()
    s2[0, 0] += 1
    d = fd.tree_diff({"s": s}, {"s": s2.view(quant.E8M0)})
    assert d.ok and "1 bytes differ" in d.rows[0].note
    assert not fd.tree_diff({"s": s}, {"s": s2.view(quant.E8M0)}, atol=1.0).ok


def test_tree_diff_decodes_large_tensors_in_pieces(monkeypatch):
    """Diffing against the release decoded each tensor whole to float64 (and made several more copies): a release
    Engram table (384M x 256 fp8) needs ~800 GB that way. Every decode now sees a bounded piece, and the figures
    are those of the whole tensor (fp8 32x32 blocks cut at whole blocks, fp4 / fp8 rows at their rows)."""
    g = torch.Generator().manual_seed(0)
    seen, real_rows = [], quant.dequant_fp8_rows
    for name in ("dequant_fp8_block", "dequant_fp4", "dequant_fp8_rows"):
        real = getattr(quant, name)
        monkeypatch.setattr(quant, name, lambda q, s, dt=torch.bfloat16, real=real: seen.append(q.numel()) or real(q, s, dt))
    table = torch.randn(1 << 18, 64, generator=g)                                  # 16M values, 16 MB in fp8
    q, s = quant.quant_fp8_rows(table)
    q2 = q.clone()
    q2.view(torch.uint8)[200_000, 5] ^= 3
    d = fd.tree_diff({"t": {"weight": q, "scale": s}}, {"t": {"weight": q2, "scale": s}}, atol=0)
    assert max(seen) <= table.numel() // 4, max(seen)
    row = {r.path: r for r in d.rows}["t.weight"]
    want = (real_rows(q, s, torch.float64) - real_rows(q2, s, torch.float64)).abs().max()
    assert row.status == "value" and row.max_abs == float(want) > 0
    # figures of pieces = figures of the whole, for each storage format against float masters
    for w, qz, dq in ((torch.randn(4100, 1100, generator=g), quant.quant_fp8_block, quant.dequant_fp8_block),
                      (torch.randn(5000, 2048, generator=g), quant.quant_fp4, quant.dequant_fp4),
                      (torch.randn(70_000, 96, generator=g), quant.quant_fp8_rows, quant.dequant_fp8_rows)):
        qw, sw = qz(w)
        x, y = dq(qw, sw, torch.float64).flatten(), w.double().flatten()
        seen.clear()
        row = fd.tree_diff({"w": {"weight": qw, "scale": sw}}, {"w": {"weight": w}}).rows[-1]
        assert row.path == "w.weight" and len(seen) > 1, (qz, seen)
        assert row.max_abs == float((x - y).abs().max())
        assert row.cos_diff == pytest.approx(float(1 - 2 * (x * y).sum() / ((x * x).sum() + (y * y).sum())), rel=1e-9)


def test_tree_diff_exact_values_infinities_integers_numpy_and_containers():
    import numpy as np
    t = torch.tensor([1.0, float("inf"), -float("inf"), float("nan")])
    assert fd.tree_diff({"x": t}, {"x": t.clone()}, atol=0).ok                 # inf - inf is not a difference
    d = fd.tree_diff({"x": t}, {"x": torch.tensor([1.0, -float("inf"), -float("inf"), float("nan")])}, atol=0)
    assert [r.status for r in d.rows] == ["value"]
    big = torch.tensor([2 ** 60], dtype=torch.int64)                          # apart by 1, equal in float64
    d = fd.tree_diff({"i": big}, {"i": big + 1}, atol=0)
    assert [(r.status, r.max_abs) for r in d.rows] == [("value", 1.0)]
    a = np.arange(4.0)
    assert fd.tree_diff({"n": a}, {"n": a.copy()}, atol=0).ok
    d = fd.tree_diff({"n": a}, {"n": a + 0.5}, atol=0.1)
    assert [(r.status, r.max_abs) for r in d.rows] == [("value", 0.5)]
    d = fd.tree_diff({"l": [torch.ones(1)]}, {"l": {"0": torch.ones(1)}})      # same leaf path, other container
    assert not d.ok and [(r.path, r.status, r.note) for r in d.problems()] == [("l", "type", "list vs dict")]


def test_tree_diff_integers_exact_at_the_ends_of_their_range():
    """uint64 (a safetensors U64 tensor) compares exactly too, and an int64 difference that overflows is not
    reported as a small one."""
    u = torch.tensor([2 ** 63 + 5], dtype=torch.uint64)                       # apart by 1, equal in float64
    d = fd.tree_diff({"u": u}, {"u": torch.tensor([2 ** 63 + 6], dtype=torch.uint64)}, atol=0)
    assert [r.status for r in d.rows] == ["value"] and d.rows[0].max_abs >= 1
    assert fd.tree_diff({"u": u}, {"u": u.clone()}, atol=0).ok
    lo, hi = torch.tensor([-2 ** 63]), torch.tensor([2 ** 63 - 1])
    d = fd.tree_diff({"i": lo}, {"i": hi}, atol=0)
    assert [r.status for r in d.rows] == ["value"] and d.rows[0].max_abs > 1e19


def test_tree_diff_fp4_with_a_non_e8m0_scale_is_compared_bytewise():
    q, s = quant.quant_fp4(torch.randn(4, 64))
    a = {"w": {"weight": q, "scale": quant.e8m0_to_float(s)}}                # a float scale is no e8m0 scale
    d = fd.tree_diff(a, {"w": {"weight": q.clone(), "scale": a["w"]["scale"].clone()}}, atol=0)
    assert d.ok and d.rows[1].note == "bytewise"


def test_tree_diff_worst_ranks_inf_and_nan_first():
    """A tensor that turned inf or NaN has a NaN cosine diff; as a sort key that left it wherever it happened
    to be, so worst(1) showed a finite difference instead."""
    a = {k: torch.ones(4) for k in "abc"}
    for bad in (float("inf"), float("nan")):
        b = {"a": torch.tensor([1.0, 1, 1, 2]), "b": torch.tensor([1.0, 1, 1, bad]), "c": torch.tensor([1.0, 1, 1, 1.5])}
        for atol in (None, 0.1):
            assert [r.path for r in fd.tree_diff(a, b, atol=atol).worst(1)] == ["b"], (bad, atol)


def test_tree_diff_equal_non_finite_values_do_not_spoil_the_cosine():
    """Identical tensors holding NaN or inf had cos_diff NaN and so outranked a sign-flipped tensor in worst()
    (a helper's probe); equal non-finite pairs now leave the cosine, unequal ones still make it NaN."""
    a = {"same_with_nan": torch.tensor([1.0, float("nan"), 3.0]), "same_with_inf": torch.tensor([float("inf"), 1.0]),
         "flipped": torch.tensor([1.0, 2.0, 3.0])}
    b = {"same_with_nan": a["same_with_nan"].clone(), "same_with_inf": a["same_with_inf"].clone(),
         "flipped": -a["flipped"]}
    d = fd.tree_diff(a, b)
    cos = {r.path: r.cos_diff for r in d.rows}
    assert cos["same_with_nan"] == 0.0 and cos["same_with_inf"] == 0.0 and cos["flipped"] == pytest.approx(2.0)
    assert [r.path for r in d.worst(1)] == ["flipped"]
    d = fd.tree_diff({"x": torch.tensor([1.0, float("nan")])}, {"x": torch.tensor([1.0, 2.0])})
    assert d.rows[0].cos_diff != d.rows[0].cos_diff                      # NaN against a number: still NaN


def test_leaves_on_one_path_are_refused_not_overwritten():
    """{0: x, "0": y} has two leaves whose paths are both "0": a flat {path: leaf} view holds one of them, so the
    other would vanish from a save or a tree_diff. Refused by name instead."""
    x, y = torch.zeros(1), torch.ones(1)
    with pytest.raises(ValueError, match=r"^flatten_with_paths: two leaves share the path '0'"):
        fd.flatten_with_paths({0: x, "0": y})
    with pytest.raises(ValueError, match=r"^tree_diff \(b\): two leaves share the path 'a.1'"):
        fd.tree_diff({"a": {1: x}}, {"a": {1: x, "1": y}})


def test_tree_diff_non_tensor_leaves_of_other_types():
    """Non-tensor leaves that compare equal with == but differ in type (3 vs 3.0, True vs 1) are a 'type' row naming
    both types (DiffRow's status list), not 'ok'."""
    d = fd.tree_diff({"n": 3, "b": True, "s": "x"}, {"n": 3.0, "b": 1, "s": "x"}, atol=0)
    rows = {r.path: r for r in d.rows}
    assert (rows["n"].status, rows["n"].note) == ("type", "int vs float")
    assert (rows["b"].status, rows["b"].note) == ("type", "bool vs int")
    assert rows["s"].status == "ok" and not d.ok
