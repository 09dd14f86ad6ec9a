"""scripts/pack_tl_cache.sh, the archive of compiled TileLang kernels that GPU calls carry: a KEEP list packs only
the kernels it names, and every failure (a kernel the list names but the cache lacks, a missing list, an archive
over the cap) leaves the archive that was there as it was. Runs on a fake cache: no TileLang needed."""
import os
import shutil
import subprocess
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "pack_tl_cache.sh")

pytestmark = pytest.mark.skipif(not (shutil.which("xz") and shutil.which("tar") and shutil.which("bash")),
                                reason="needs bash, tar and xz")


def _cache(tmp_path, kernels):
    """A cache laid out as TileLang 0.1.15's: <root>/0.1.15/linux-x86_64/kernels/<key>/executable.so, plus the
    nvcc-output folder the archive leaves out. ``kernels``: key -> bytes of its executable.so."""
    root = tmp_path / "cache"
    for key, blob in kernels.items():
        d = root / "0.1.15" / "linux-x86_64" / "kernels" / key
        d.mkdir(parents=True)
        (d / "executable.so").write_bytes(blob)
        (d / "device_kernel.cu").write_text(f"// {key}\n")
    (root / "0.1.15" / "cuda-binaries").mkdir(parents=True)
    (root / "0.1.15" / "cuda-binaries" / "nvcc-out").write_text("x")
    return root


def _run(tmp_path, cache, out, **env):
    nofix = tmp_path / "nofixtures"
    nofix.mkdir(exist_ok=True)
    e = dict(os.environ, TILELANG_CACHE_DIR=str(cache), DSV41_FIXTURES=str(nofix), TLCACHE_OUT=str(out), **env)
    return subprocess.run(["bash", SCRIPT], env=e, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def _members(path):
    with tarfile.open(path) as t:
        return {m.name.lstrip("./") for m in t.getmembers() if m.isfile()}


def test_keep_packs_only_the_listed_kernels(tmp_path):
    cache = _cache(tmp_path, {"aaa": b"A" * 100, "bbb": b"B" * 100, "ccc": b"C" * 100})
    (tmp_path / "keys.txt").write_text("aaa\n\nccc\n")
    out = tmp_path / "tl.tar.xz"
    r = _run(tmp_path, cache, out, KEEP="keys.txt")        # relative to the caller's folder
    assert r.returncode == 0, r.stderr
    names = _members(out)
    assert "0.1.15/linux-x86_64/kernels/aaa/executable.so" in names
    assert "0.1.15/linux-x86_64/kernels/ccc/executable.so" in names
    assert not any("/bbb/" in n for n in names) and not any("cuda-binaries" in n for n in names)
    # without KEEP: the whole cache, still without the nvcc outputs
    r = _run(tmp_path, cache, out)
    assert r.returncode == 0, r.stderr
    names = _members(out)
    assert {n.split("/")[3] for n in names if "/kernels/" in n} == {"aaa", "bbb", "ccc"}
    assert not any("cuda-binaries" in n for n in names)


@pytest.mark.parametrize("case", ["missing_kernel", "no_list", "empty_list", "over_cap"])
def test_failures_keep_the_old_archive(tmp_path, case):
    cache = _cache(tmp_path, {"aaa": b"A" * 100, "big": os.urandom(2 * 1024 * 1024)})
    out = tmp_path / "tl.tar.xz"
    out.write_bytes(b"the good archive")
    env = {}
    if case == "missing_kernel":
        (tmp_path / "keys.txt").write_text("aaa\nzzz\n")
        env["KEEP"] = str(tmp_path / "keys.txt")
        msg = "zzz"
    elif case == "no_list":
        env["KEEP"] = str(tmp_path / "nowhere.txt")
        msg = "is not a file"
    elif case == "empty_list":
        (tmp_path / "keys.txt").write_text("\n")
        env["KEEP"] = str(tmp_path / "keys.txt")
        msg = "lists no kernels"
    else:                                                  # 2 MiB of random bytes do not compress under 1 MiB
        env["CAP_MB"] = "1"
        msg = "> 1 MiB"
    r = _run(tmp_path, cache, out, **env)
    assert r.returncode == 1
    assert msg in r.stderr and "left as it was" in r.stderr
    assert out.read_bytes() == b"the good archive"
    assert not os.path.exists(str(out) + ".tmp")
