"""save_params is atomic (params/save.py): a save that fails, is killed, or dies while moving its files into place
leaves the previous checkpoint or the new one, never a mix; its temporary files name their writer, so the next save
removes a dead writer's and keeps a live one's; saved files get the usual mode."""
import os

import pytest

import functional_dsv41 as fd
from functional_dsv41.params import save as sv


def test_interrupted_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    cfg = fd.Config.tiny()
    fd.save_params(fd.init_params(cfg, seed=1), tmp_path, cfg, max_shard_bytes=300_000)
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    assert len(before) >= 3
    real, calls = sv._write_shard, []

    def failing(tensors, fname):
        if calls:
            raise OSError("disk full (simulated)")
        calls.append(fname)
        real(tensors, fname)

    monkeypatch.setattr(sv, "_write_shard", failing)
    with pytest.raises(OSError, match="simulated"):
        fd.save_params(fd.init_params(cfg, seed=2), tmp_path, cfg, max_shard_bytes=300_000)
    assert len(calls) == 1 and not os.path.exists(calls[0])  # the first shard was written, then removed
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == before  # no temp files either


_KILLED_SAVE = """
import os, signal, sys
import functional_dsv41 as fd
from functional_dsv41.params import save as sv
real = sv._write_shard
def dying(tensors, fname):            # the second shard: half written, then the process is killed outright
    if dying.n:
        with open(fname, "wb") as fh:
            fh.write(b"x" * 4096)
        os.kill(os.getpid(), signal.SIGKILL)
    dying.n += 1
    real(tensors, fname)
dying.n = 0
sv._write_shard = dying
cfg = fd.Config.tiny()
fd.save_params(fd.init_params(cfg, seed=2), sys.argv[1], cfg, max_shard_bytes=300_000)
"""


@pytest.mark.skipif(os.name != "posix", reason="SIGKILL")
def test_killed_save_leaves_files_the_next_save_removes(tmp_path):
    """A save killed outright cannot clean up: its hidden temp files stay (the previous checkpoint intact
    beside them) until the next save into the folder, which removes those of dead writers on this host and
    says so, and keeps a live writer's and another host's."""
    import signal
    import subprocess
    import sys
    cfg = fd.Config.tiny()
    p1 = fd.init_params(cfg, seed=1)
    fd.save_params(p1, tmp_path, cfg, max_shard_bytes=300_000)
    before = set(os.listdir(tmp_path))
    r = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(tmp_path)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr
    left = sorted(set(os.listdir(tmp_path)) - before)
    assert len(left) == 2 and all(f.startswith(".model-0000") and f.endswith(".tmp") for f in left), left
    assert fd.tree_diff(p1, fd.load_params(tmp_path, cfg), atol=0).ok          # still the previous checkpoint
    live = tmp_path / f".model.safetensors.pid{os.getpid()}@{sv._host()}.abcd1234.tmp"
    other = tmp_path / ".model.safetensors.pid1@another-host.abcd1234.tmp"
    live.write_bytes(b"a save in progress")
    other.write_bytes(b"another machine's save")
    p3 = fd.init_params(cfg, seed=3)
    with pytest.warns(UserWarning, match=r"removed 2 temporary file\(s\).*interrupted save") as rec:
        fd.save_params(p3, tmp_path, cfg)
    assert all(f in str(rec[0].message) for f in left)
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith(".")) == sorted([live.name, other.name])
    assert fd.tree_diff(p3, fd.load_params(tmp_path, cfg), atol=0).ok


def test_save_temp_names_carry_the_writer(tmp_path, monkeypatch):
    """The names the stale-file sweep relies on: every temp file a save writes matches it, with this pid."""
    cfg = fd.Config.tiny()
    seen = []
    real = sv._write_shard

    def spy(tensors, fname):
        seen.append(os.path.basename(fname))
        real(tensors, fname)

    monkeypatch.setattr(sv, "_write_shard", spy)
    fd.save_params(fd.init_params(cfg, seed=1), tmp_path, cfg, max_shard_bytes=300_000)
    assert len(seen) >= 2
    for f in seen:
        m = sv._STALE.match(f)
        assert m and int(m.group(1)) == os.getpid() and m.group(2) == sv._host(), f


@pytest.mark.parametrize("crash_at", [1, 2, 3, 4, 5])
def test_interrupted_commit_leaves_one_whole_checkpoint(tmp_path, monkeypatch, crash_at):
    """A save that dies while its files are moved into place (the n-th os.replace of the commit) leaves the
    folder loading as the previous checkpoint or the new one, never a mix, and no temporary files; the shard
    names of both saves are the same, so each new shard lands on a name the previous index uses."""
    cfg = fd.Config.tiny()
    p1, p2 = fd.init_params(cfg, seed=1), fd.init_params(cfg, seed=2)
    fd.save_params(p1, tmp_path, cfg, max_shard_bytes=300_000)
    n_files = len(os.listdir(tmp_path))
    real, calls = os.replace, []

    def flaky(a, b):
        calls.append(b)
        if len(calls) == crash_at:
            raise OSError("crash (simulated)")
        return real(a, b)

    monkeypatch.setattr(sv.os, "replace", flaky)
    with pytest.raises(OSError, match="simulated"):
        fd.save_params(p2, tmp_path, cfg, max_shard_bytes=300_000)
    monkeypatch.setattr(sv.os, "replace", real)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    got = fd.load_params(tmp_path, cfg)
    assert fd.tree_diff(p1, got, atol=0).ok or fd.tree_diff(p2, got, atol=0).ok
    # the next save completes and cleans up everything of the interrupted one
    fd.save_params(p2, tmp_path, cfg, max_shard_bytes=300_000)
    assert fd.tree_diff(p2, fd.load_params(tmp_path, cfg), atol=0).ok
    assert len(os.listdir(tmp_path)) == n_files and not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_saved_files_have_the_usual_mode(tmp_path):
    cfg = fd.Config.tiny()
    mask = os.umask(0o022)
    try:
        for f in fd.save_params(fd.init_params(cfg, seed=0), tmp_path, cfg, max_shard_bytes=300_000):
            assert os.stat(f).st_mode & 0o777 == 0o644, f       # not mkstemp's 0600
    finally:
        os.umask(mask)
