"""The benchmark / helper scripts' command lines on bad arguments: an argparse-style one-line error (rc 2), or
the documented nonzero rc with a one-line message, never a traceback; each case exits before any heavy work."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTHERE = "/nonexistent/dsv41_cli_args"


def _run(cmd, timeout=120):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)             # no local TileLang on the path: the checks below run without it
    return subprocess.run([sys.executable, *cmd], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _check(r, rc, name):
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    assert r.returncode == rc, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines, r.stdout
    last = lines[-1]
    if rc == 2:                             # argparse: usage lines, then one "prog: error: ..." line
        assert ": error: " in last, r.stderr
    else:
        assert len(lines) == 1, r.stderr
    assert name in last, r.stderr


BAD = [
    # (script or -m module, args, rc, text the message names)
    ("benchmarks/decode.py", ["--batch", "0"], 2, "--batch"),
    ("benchmarks/decode.py", ["--new", "-1"], 2, "--new"),
    ("benchmarks/decode.py", ["--threads", "0"], 2, "--threads"),
    ("benchmarks/forward.py", ["--lengths", "0"], 2, "--lengths"),
    ("benchmarks/forward.py", ["--lengths", "abc"], 2, "--lengths"),
    ("benchmarks/forward.py", ["--repeat", "0"], 2, "--repeat"),
    ("benchmarks/forward.py", ["--threads", "-1"], 2, "--threads"),
    ("benchmarks/engram_lookup.py", ["--rows", "0"], 2, "--rows"),
    ("benchmarks/engram_lookup.py", ["--iters", "0"], 2, "--iters"),
    ("benchmarks/engram_lookup.py", ["--decode-steps", "0"], 2, "--decode-steps"),
    ("benchmarks/engram_lookup.py", ["--dim", "-4"], 2, "--dim"),
    ("benchmarks/engram_lookup.py", ["--dim", "40"], 2, "--dim"),
    ("benchmarks/engram_lookup.py", ["--dir", NOTHERE], 2, "--dir"),
    ("benchmarks/train_throughput.py", ["--steps", "0"], 2, "--steps"),
    ("benchmarks/train_throughput.py", ["--mode", "bogus"], 2, "--mode"),
    ("benchmarks/release_layers.py", ["--impls", "auto,bogus"], 2, "bogus"),
    ("benchmarks/release_layers.py", ["--repeat", "0"], 2, "--repeat"),
    ("benchmarks/host_overhead.py", ["--calls", "0"], 2, "--calls"),
    ("-m functional_dsv41.kernels.bench", ["--m", "0"], 2, "--m"),
    ("-m functional_dsv41.kernels.bench", ["--only", "gemm,bogus"], 2, "bogus"),
    ("-m functional_dsv41.kernels.bench", ["--rounds", "0"], 2, "--rounds"),
    ("-m functional_dsv41.kernels.bench", ["--attn-data", "bogus"], 2, "--attn-data"),
    ("-m functional_dsv41.kernels.bench", ["--json", NOTHERE + "/rows.json"], 2, "--json"),
    ("-m functional_dsv41.kernels.ncu_one", ["bogus"], 2, "invalid choice"),
    ("-m functional_dsv41.kernels.ncu_one", ["attn", "--kw", "{bad"], 2, "--kw"),
    ("-m functional_dsv41.kernels.ncu_one", ["attn", "--kw", "[1]"], 2, "--kw"),
    ("-m functional_dsv41.kernels.ncu_one", ["gemm", "--mnk", "4096,5120"], 2, "--mnk"),
    ("scripts/ncu_sass_summary.py", [NOTHERE + ".csv"], 2, NOTHERE),
    ("scripts/param_count.py", ["a.json", "extra"], 2, "unrecognized arguments: extra"),
    ("scripts/param_count.py", [NOTHERE + ".json"], 2, NOTHERE),
    ("scripts/kernel_sources.py", ["compare", NOTHERE + "_a", NOTHERE + "_b"], 2, NOTHERE),
    ("data/make_corpus.py", ["--stories", "-5", "--out", NOTHERE + ".txt"], 2, "--stories"),
]


@pytest.mark.parametrize("script, args, rc, name", BAD, ids=[f"{s.split('/')[-1]} {' '.join(a)}" for s, a, _, _ in BAD])
def test_bad_argument(script, args, rc, name):
    _check(_run([*script.split(), *args]), rc, name)


def test_param_count_help():
    r = _run(["scripts/param_count.py", "--help"])
    assert r.returncode == 0 and "usage:" in r.stdout and "Traceback" not in r.stderr, r.stderr


def test_kernel_sources_compare_empty(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    _check(_run(["scripts/kernel_sources.py", "compare", str(a), str(b)]), 1, "nothing to compare")


def test_kernel_sources_dump_without_tilelang(tmp_path):
    if importlib.util.find_spec("tilelang") is not None:
        pytest.skip("tilelang importable here: dump would lower the kernels")
    _check(_run(["scripts/kernel_sources.py", "dump", str(tmp_path / "out")]), 1, "tilelang")
    assert not (tmp_path / "out").exists()


def test_host_overhead_without_tilelang():
    if importlib.util.find_spec("tilelang") is not None:
        pytest.skip("tilelang importable here: the benchmark would run")
    _check(_run(["benchmarks/host_overhead.py", "--calls", "1"]), 1, "tilelang")


def _fake_cuda(monkeypatch):
    """What kernels.bench.main asks of CUDA before and between its sections, answered as if a GPU were there."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_kernels_bench_failed_section_exits_1(monkeypatch, capsys, tmp_path):
    """A section that raises is reported and the run continues, but main() exits 1 naming it."""
    from functional_dsv41.kernels import bench

    def boom(results, args):
        raise RuntimeError("boom")

    def ok(results, args):
        results.append({"name": "ok"})

    monkeypatch.setitem(bench.SECTIONS, "boom", boom)
    monkeypatch.setitem(bench.SECTIONS, "ok", ok)
    _fake_cuda(monkeypatch)
    out = tmp_path / "rows.json"
    with pytest.raises(SystemExit) as e:
        bench.main(["--only", "boom,ok", "--json", str(out)])
    assert isinstance(e.value.code, str) and e.value.code.endswith("1 section(s) failed: boom")  # exit status 1
    assert "!! boom failed: RuntimeError: boom" in capsys.readouterr().out
    assert out.exists()                     # the rows of the sections that ran are still written
    bench.main(["--only", "ok"])            # no failure: returns normally (exit 0)


def test_kernels_bench_json_after_each_section(monkeypatch, capsys, tmp_path):
    """--json is rewritten after every section, so a run stopped in a later section (here by an exception that is
    not an ordinary failure, as a time limit's signal would be) keeps the earlier sections' rows; each section's
    time is printed."""
    import json
    from functional_dsv41.kernels import bench

    def first(results, args):
        results.append({"name": "first"})

    def killed(results, args):
        results.append({"name": "half"})
        raise KeyboardInterrupt

    monkeypatch.setitem(bench.SECTIONS, "first", first)
    monkeypatch.setitem(bench.SECTIONS, "killed", killed)
    _fake_cuda(monkeypatch)
    out = tmp_path / "rows.json"
    out.write_text("[]")
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--only", "first,killed", "--json", str(out)])
    assert json.loads(out.read_text()) == [{"name": "first"}]
    assert [f.name for f in tmp_path.iterdir()] == ["rows.json"]        # no temporary file left beside it
    assert "== section first: " in capsys.readouterr().out


def test_interleaved_rounds_order_and_medians(monkeypatch, capsys):
    """The bench's interleaved rounds: every variant once a round, in order; then a median row each, whose note
    gets that median."""
    from functional_dsv41.kernels import _bench_common as bc
    calls, fake = [], {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 6.0])}
    monkeypatch.setattr(bc, "bench", lambda fn: fn())

    def timed(name):
        def fn():
            calls.append(name)
            return next(fake[name])
        return fn
    results = []
    med = bc.interleaved_rounds(results, 3, [("a", timed("a"), 2e9, None, lambda m: f"a med {m}"),
                                             ("b", timed("b"), None, 1e6, None)])
    assert calls == ["a", "b"] * 3
    assert med == {"a": 2.0, "b": 5.0}
    assert [r["name"] for r in results] == [f"  {n} (round {i})" for i in (1, 2, 3) for n in "ab"] + \
        ["  a (median of 3)", "  b (median of 3)"]
    assert results[-2]["note"] == "a med 2.0" and results[-2]["tflops"] == pytest.approx(1.0)
    assert results[-1]["note"] == "" and results[-1]["gbps"] == pytest.approx(0.2)
    assert "median over 3 rounds" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available(),
                    reason="with a GPU ncu_one would profile: the no-GPU message is what is checked here")
def test_ncu_one_without_gpu():
    _check(_run(["-m", "functional_dsv41.kernels.ncu_one", "attn"]), 1, "needs a CUDA GPU")


def test_gpu_run_summary(tmp_path):
    """scripts/gpu_run.sh (run here with gpu_env.sh stubbed): each command's own exit status in the summary (124 when
    its time limit stops it), the call's status 1 when any failed, TileLang's cache-load lines dropped from the output
    and the log, and a kernel compiled during the call kept and counted in its command's summary line."""
    import shutil
    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(REPO, "scripts", "gpu_run.sh"), tmp_path / "scripts")
    (tmp_path / "scripts" / "gpu_env.sh").write_text("true\n")
    out = tmp_path / "out"
    out.mkdir()
    tl = "2026 [TileLang:tilelang.{}:INFO] (x.py:1): {}"
    (tmp_path / "emit.sh").write_text("".join(f"echo '{tl.format(*m)}'\n" for m in (
        ("cache", "Found kernel in cache"), ("jit.kernel", "TileLang begins to compile kernel k"),
        ("jit.kernel", "TileLang completes to compile kernel k"))) + "echo row\n")
    r = subprocess.run(["bash", "scripts/gpu_run.sh", "1", "bash emit.sh", "echo plain; exit 3", "sleep 5"],
                       cwd=tmp_path, env=dict(os.environ, OUT=str(out)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.stdout, r.stderr)
    log = (out / "gpu_run.log").read_text()
    for text in (r.stdout, log):
        assert "Found kernel" not in text and "completes to compile" not in text
        assert "begins to compile kernel k" in text and "row" in text
        summary = text.split("== summary\n", 1)[1].splitlines()
        assert summary[0].startswith("rc=0 ") and "(1 kernel(s) compiled here" in summary[0]
        assert summary[1].startswith("rc=3 ") and "compiled here" not in summary[1]
        assert summary[2].startswith("rc=124 ")
        assert summary[3] == "gpu_run.sh: 2 of 3 command(s) failed"
