"""train/run.py's command line on bad input and on SIGINT / SIGTERM: one-line messages, nothing half-written."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from functional_dsv41.params import train_state as C
from functional_dsv41.train import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--steps", "4", "--batch_size", "2", "--seq_len", "48", "--export", "false", "--sample_tokens", "0",
         "--progress", "off"]


def _bad_corpus(tmp_path):
    p = tmp_path / "latin1.txt"
    p.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    return str(p)


@pytest.mark.parametrize("args, message", [
    (["--corpus", "/nonexistent/corpus.txt"], "--corpus /nonexistent/corpus.txt: no such file"),
    (["--corpus", _bad_corpus], "not UTF-8 text"),
    (["--batch_size", "0"], "--batch_size must be >= 1"),
    (["--log_every", "0"], "--log_every must be >= 1"),
    (["--keep_last", "0"], "--keep_last must be >= 1"),
    (["--seed", "-1"], "--seed must be an integer in [0, 2**63)"),
    (["--seed", str(2**63)], "--seed must be an integer in [0, 2**63)"),
    (["--loss_ce", "0"], "every loss coefficient is <= 0"),
    (["--loss_draft", "0.5"], "needs DSpark stages but model tiny has n_mtp_layers=0"),
    (["--sample_tokens", "4", "--sample_prompt", "once upon a time " * 100], "more than the model's max_seq_len 256"),
    (["--resume", "--overwrite"], "--resume and --overwrite contradict"),
    (["--frozen", "layer.*.attn.*"], "--frozen layer.*.attn.*: matches no parameter of model tiny"),
    (["--clip", "nan"], "--clip nan: must be a finite number"),
    (["--lr", "inf"], "--lr inf: must be a finite number"),
    (["--weight_decay", "inf"], "--weight_decay inf: must be a finite number"),
    (["--loss_ce", "nan"], "--loss_ce nan: must be a finite number"),
    (["--device", "gpu0"], "--device 'gpu0': not a device (cpu, cuda or cuda:N)"),
    (["--device", "meta"], "--device 'meta': runs on cpu or cuda, not meta"),
    (["--device", "cpu:1"], "--device 'cpu:1': the CPU is one device (cpu)"),
    (["--device", "cuda:64"], "--device 'cuda:64': "),   # no CUDA here, or not 64 devices: named either way
])
def test_bad_input_is_refused_before_out_is_made(tmp_path, args, message):
    args = [a(tmp_path) if callable(a) else a for a in args]
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        run.main(SMALL + ["--out", str(out)] + args)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not out.exists()


def test_out_naming_a_file_is_refused_and_the_file_kept(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    with pytest.raises(SystemExit, match="exists and is not a folder"):
        run.main(SMALL + ["--out", str(f)])
    assert f.read_text() == "mine"


def test_cli_error_is_one_line_without_traceback(tmp_path):
    res = subprocess.run([sys.executable, "train/run.py", *SMALL, "--out", str(tmp_path / "o"), "--batch_size", "0"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and res.stderr == "--batch_size must be >= 1, got 0\n", res.stderr


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_signal_stops_between_steps_and_names_the_checkpoint(tmp_path, sig):
    """The signal lands right after the step-2 checkpoint's async save started: the run finishes the step it
    is in, waits for the save, says where it is, and exits 128 + signal number."""
    out = str(tmp_path / "run")
    script = textwrap.dedent(f"""
        import os, signal, sys
        from functional_dsv41.train import run
        train = run.train
        def fault(s, trainable):
            if s == 2:
                os.kill(os.getpid(), signal.{sig})
            return trainable
        run.train = lambda rc: train(rc, fault=fault)
        sys.exit(run.main({SMALL + ["--steps", "6", "--ckpt_every", "2", "--out", out]!r}))
    """)
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 128 + getattr(signal, sig), res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    line = f"STOPPED by {sig} after step 3. Last good checkpoint: {os.path.join(out, 'ckpt', '2')}; to continue, " \
           f"run the same command with --resume\n"
    assert res.stderr == line, res.stderr
    assert sorted(os.listdir(os.path.join(out, "ckpt"))) == ["2"]        # no *.orbax-checkpoint-tmp left
    assert C.TrainCheckpointer(os.path.join(out, "ckpt")).restore()["step"] == 2


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_refused_without_cuda(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"^--device 'cuda': no CUDA device here \(torch .*\)$"):
        run.main(SMALL + ["--out", str(out), "--device", "cuda"])
    assert not out.exists()
