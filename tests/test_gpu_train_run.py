"""``train/run.py --device cuda``: the scripted loop on a GPU. GPU only.

The same run (the main job's ``tiny`` preset, a few steps) on the CPU and on CUDA starts from the same params and
batches, so its per-step losses must agree to bf16 rounding, and both must train; the CUDA run's export must load
with the same tree as the CPU run's, and ``python -m functional_dsv41.generate --device cuda`` must run it there.
A CUDA run interrupted after a checkpoint and resumed must give the same bits as one never interrupted, under
deterministic algorithms (a subprocess: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it starts).
"""
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap

import optree
import pytest
import torch

import functional_dsv41 as fd
from functional_dsv41.train import run

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rc(out, **kw):
    base = dict(config="tiny", steps=6, batch_size=4, seq_len=64, warmup=2, ckpt_every=0, out=str(out),
                export=True, sample_tokens=8, progress="off")
    base.update(kw)
    return run.preset_config(**{"name": base.pop("config"), **base})


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def test_cuda_run_matches_the_cpu_run_and_exports(tmp_path, capsys):
    cpu = run.train(_rc(tmp_path / "cpu"))
    torch.cuda.reset_peak_memory_stats()
    gpu = run.train(_rc(tmp_path / "gpu", device="cuda"))
    assert cpu["status"] == gpu["status"] == "ok" and gpu["step"] == 6
    assert torch.cuda.max_memory_allocated() > 0                  # the step ran there
    assert "on cuda" in capsys.readouterr().out
    mc, mg = _metrics(tmp_path / "cpu"), _metrics(tmp_path / "gpu")
    ce_c, ce_g = [m["loss/ce"] for m in mc], [m["loss/ce"] for m in mg]
    print("ce cpu", ce_c, "\nce cuda", ce_g)
    # step 1: the same params and batch, another device's bf16 roundings; later steps add the updates' drift
    assert abs(ce_g[0] - ce_c[0]) <= 1e-3 * ce_c[0], (ce_c[0], ce_g[0])
    assert all(abs(g - c) <= 2e-2 * c for g, c in zip(ce_g, ce_c)), (ce_c, ce_g)
    assert ce_g[-1] < ce_g[0] - 0.5, ce_g                         # it trains (7.2 at step 1)
    assert [m["lr"] for m in mg] == [m["lr"] for m in mc]
    cfg = fd.Config.from_json(str(tmp_path / "gpu" / "export" / "config.json"))
    a = fd.load_params(str(tmp_path / "cpu" / "export"), cfg)
    b = fd.load_params(str(tmp_path / "gpu" / "export"), cfg)     # strict: every tensor, shape, dtype
    fa, fb = fd.flatten_with_paths(a), fd.flatten_with_paths(b)
    assert sorted(fa) == sorted(fb)
    assert all(fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape and fb[k].device.type == "cpu" for k in fa)
    assert torch.equal(fa["layers.1.engram.embed.weight"].view(torch.uint8),   # frozen: moved, never changed
                       fb["layers.1.engram.embed.weight"].view(torch.uint8))
    prompt = run.RunConfig().sample_prompt
    assert gpu["sample"].startswith(prompt) and len(gpu["sample"]) > len(prompt)
    _generate_cli_on_cuda(tmp_path / "gpu" / "export", cfg, capsys)


def _generate_cli_on_cuda(export, cfg, capsys):
    """``python -m functional_dsv41.generate --device cuda`` on the export: it runs on the GPU and prints what
    ``fd.generate`` gives for the same tree there."""
    gm = importlib.import_module("functional_dsv41.generate")   # (fd.generate is the function)
    seen, real = [], gm.generate

    def spy(params, *a, **k):
        seen.append(params["embed"]["weight"].device.type)
        return real(params, *a, **k)

    prompt = "Once upon a time"
    capsys.readouterr()
    gm.generate = spy
    try:
        rc = gm.main(["--ckpt", str(export), "--prompt", prompt, "--max-new-tokens", "8", "--temperature", "0",
                      "--device", "cuda"])
    finally:
        gm.generate = real
    out = capsys.readouterr().out
    assert rc == 0 and seen == ["cuda"], (rc, seen)
    params = optree.tree_map(lambda x: x.cuda(), fd.load_params(str(export), cfg))
    tok = run.load_tokenizer(str(export / "tokenizer.json"))
    ids = [tok.token_to_id("<｜begin▁of▁sentence｜>")] + tok.encode(prompt, add_special_tokens=False).ids
    want = fd.generate(params, [ids], cfg=cfg, max_new_tokens=8, temperature=0.0,
                       eos_id=tok.token_to_id("<｜end▁of▁sentence｜>"))
    assert out.startswith(prompt + tok.decode(want[0], skip_special_tokens=False)), (out, want[0])


_WORKER = textwrap.dedent("""
    import sys, torch
    torch.use_deterministic_algorithms(True)
    sys.path.insert(0, {repo!r})
    from functional_dsv41.train import run
    rc = run.preset_config(name="tiny", steps=6, batch_size=4, seq_len=64, warmup=2, ckpt_every=3, keep_last=3,
                           out=sys.argv[1], export=True, sample_tokens=0, progress="off", device="cuda",
                           resume=sys.argv[2] == "resume")
    def crash(s, tr):
        if s == 3:
            raise SystemExit(9)   # killed after the step-3 checkpoint
        return tr
    r = run.train(rc, fault=crash if sys.argv[2] == "crash" else None)
    sys.exit(0 if r["status"] == "ok" else 1)
""")


def test_cuda_resume_is_bit_identical(tmp_path):
    pytest.importorskip("orbax.checkpoint", reason="the train-state checkpoints need orbax-checkpoint")
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    code = _WORKER.format(repo=REPO)

    def go(out, how):
        return subprocess.run([sys.executable, "-c", code, str(out), how], env=env, cwd=REPO, capture_output=True,
                              text=True, timeout=600)

    a = go(tmp_path / "a", "plain")
    assert a.returncode == 0, a.stdout[-2000:] + a.stderr[-3000:]
    b = go(tmp_path / "b", "crash")
    assert b.returncode == 9, b.stdout[-2000:] + b.stderr[-3000:]
    b = go(tmp_path / "b", "resume")
    assert b.returncode == 0 and "resumed from" in b.stdout, b.stdout[-2000:] + b.stderr[-3000:]
    ma, mb = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    keys = ("step", "loss/ce", "grad_norm", "lr")
    assert [[m[k] for k in keys] for m in ma] == [[m[k] for k in keys] for m in mb]
    for name in sorted(os.listdir(tmp_path / "a" / "export")):
        if name.endswith(".safetensors"):
            a, b = (tmp_path / run_ / "export" / name for run_ in ("a", "b"))
            assert a.read_bytes() == b.read_bytes(), name


@pytest.mark.parametrize("preset, extra", [
    ("tiny", dict(loss_indexer_kl=0.1, remat=True)),     # the indexer KL's aux path and per-block remat on CUDA
    ("tiny-dspark", {}),                                 # the draft loss; the export generates speculatively
    ("tiny-qat", {}),                                    # fake quantisation; the sample runs the export in
])                                                       # mode "reference" (the block-scaled GEMM kernels)
def test_each_preset_trains_on_cuda(tmp_path, capsys, preset, extra):
    cpu = run.train(_rc(tmp_path / "cpu", config=preset, steps=1, export=False, sample_tokens=0, **extra))
    gpu = run.train(_rc(tmp_path / "gpu", config=preset, steps=8, device="cuda", **extra))
    assert cpu["status"] == gpu["status"] == "ok"
    mc, mg = _metrics(tmp_path / "cpu"), _metrics(tmp_path / "gpu")
    parts = [k for k in mg[0] if k.startswith("loss/") and k != "loss/total"]
    print(preset, {k: [round(m[k], 4) for m in mg] for k in parts})
    for k in parts:     # step 1: the same params and batch as on the CPU, bf16 rounded in another order (the draft
        #                 and indexer-KL parts differ more than the CE: 1e-3 and 4.5e-3 of their value on an H100)
        assert abs(mg[0][k] - mc[0][k]) <= 1e-2 * abs(mc[0][k]), (k, mc[0][k], mg[0][k])
    assert mg[-1]["loss/total"] < mg[0]["loss/total"], [m["loss/total"] for m in mg]
    capsys.readouterr()
    gm = importlib.import_module("functional_dsv41.generate")
    argv = ["--ckpt", str(tmp_path / "gpu" / "export"), "--prompt", "Once upon a time", "--max-new-tokens", "6",
            "--temperature", "0", "--device", "cuda"] + (["--speculative"] if preset == "tiny-dspark" else [])
    assert gm.main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.match(r"\[[1-6] tokens in [\d.]+ s", last) and \
        ("tokens per verify forward" in last) == (preset == "tiny-dspark"), last


def test_a_step_out_of_gpu_memory_stops_with_one_line(tmp_path, capsys):
    """A batch far beyond the GPU's memory: the run stops at step 1 with run.py's one-line report (exit status 2),
    not the allocator's traceback, and gives the memory back."""
    from functional_dsv41.train.settings import tiny_model
    # enough rows that the batch's fp32 logits alone exceed the card's memory (8192 or more: 109k on an 80 GiB card)
    rows = max(8192, -(-torch.cuda.get_device_properties(0).total_memory // (256 * tiny_model().vocab_size * 4)))
    before = torch.cuda.memory_allocated()
    rc = run.main(["--device", "cuda", "--batch_size", str(rows), "--seq_len", "256", "--steps", "1", "--ckpt_every",
                   "0", "--export", "false", "--sample_tokens", "0", "--progress", "off", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and re.fullmatch(r"STOPPED: out of memory in step 1 on cuda:\d \(CUDA out of memory\. Tried to "
                                    r"allocate [\d.]+ [GM]iB\)\. No update was applied\. Last good checkpoint: none; "
                                    r"a smaller --batch_size or --seq_len, or --remat, needs less", err), err
    assert torch.cuda.memory_allocated() <= before + 2**20
