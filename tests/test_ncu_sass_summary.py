"""scripts/ncu_sass_summary.py on a small SASS source page written here in ncu's CSV layout: the warp-role regions
(split at setmaxnreg), which branches count as mbarrier-wait spins (the predicate a TRYWAIT wrote, however far
back, unless rewritten since), the shared-memory wavefronts per opcode, and the matching of instructions between
two pages. The expected figures are counted by hand from the rows below."""
import csv
import importlib.util
import lzma
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("ncu_sass_summary", os.path.join(REPO, "scripts", "ncu_sass_summary.py"))
nss = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nss)

HDR = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
       "Instructions Executed", "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal", "stall_long_sb",
       "stall_selected", "stall_barrier", "stall_long_sb (Not Issued)"]
# (source, samples, executed, wavefronts, ideal, long_sb, selected, barrier)
ROWS = [
    ("S2R R0, SR_TID.X", 2, 384, 0, 0, 0, 2, 0),                                   # 0  setup
    ("USETMAXREG.DEALLOC.CTAPOOL 0x38", 0, 128, 0, 0, 0, 0, 0),                    # 1  producer
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2+URZ], R3", 1, 4, 0, 0, 1, 0, 0),      # 2
    ("@!P0  BRA 0x7f506ee467f0", 50, 4, 0, 0, 50, 0, 0),                           # 3  a spin: 50
    ("LDGSTS.E.BYPASS.128 [R31+0x400], desc[UR24][R12.64], P1", 0, 4, 16, 16, 0, 0, 0),  # 4
    ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe0", 0, 128, 0, 0, 0, 0, 0),             # 5  consumer 0
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR14+0x10], R4", 0, 4, 0, 0, 0, 0, 0),   # 6
    ("ISETP.GT.AND P2, PT, R1, -0x1, PT", 3, 4, 0, 0, 0, 3, 0),                    # 7  writes P2, not P3
    ("@!P3  BRA 0x7f506ee469e0", 40, 4, 0, 0, 40, 0, 0),                           # 8  a spin: 40
    ("ISETP.GT.AND P3, PT, R1, -0x1, PT", 1, 4, 0, 0, 0, 1, 0),                    # 9  P3 rewritten
    ("@!P3  BRA 0x7f506ee46a00", 7, 4, 0, 0, 7, 0, 0),                             # 10 not a spin
    ("HGMMA.64x64x16.F32.BF16 R152, gdesc[UR16], R152", 5, 4, 32, 32, 0, 5, 0),    # 11
    ("WARPGROUP.DEPBAR.LE gsb0, 0x0", 9, 4, 0, 0, 0, 0, 9),                        # 12 a WGMMA wait: 9
    ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe0", 0, 128, 0, 0, 0, 0, 0),             # 13 consumer 1
    ("STS [R23+0x30800], R22", 4, 4, 8, 4, 0, 4, 0),                               # 14 2-way conflict
]


def _write(path, rows, xz=False):
    opener = lzma.open if xz else open
    with opener(path, "wt", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "k"])
        w.writerow(HDR)
        for i, (src, smp, ex, wav, ideal, lsb, sel, bar) in enumerate(rows):
            w.writerow([f"0x7f50{i:08x}", f"      {src}", f"{smp:,}", "0", f"{ex:,}", f"{wav:,}", f"{ideal:,}",
                        lsb, sel, bar, "0"])


def test_regions_spins_and_wavefronts(tmp_path, capsys):
    page = tmp_path / "k.sass.csv.xz"
    _write(page, ROWS, xz=True)
    ins = nss.load(str(page))
    assert len(ins) == len(ROWS) and ins[3]["text"] == "@!P0  BRA ADDR"      # addresses masked
    assert [i for i, w in enumerate(nss.spin_branches(ins)) if w] == [3, 8]
    assert nss.regions(ins) == [(0, 1, "setup"), (1, 5, "producer (dealloc)"), (5, 13, "consumer 0 (alloc)"),
                                (13, 15, "consumer 1 (alloc)")]
    nss.main([str(page), "--top", "2"])
    out = capsys.readouterr().out
    assert "15 instructions, 122 warp-stall samples" in out
    assert "producer (dealloc)   samples      51 (41.8%); in mbarrier waits     50, WGMMA waits      0" in out
    assert "consumer 0 (alloc)   samples      65 (53.3%); in mbarrier waits     40, WGMMA waits      9" in out
    assert "consumer 1 (alloc)   samples       4" in out
    lines = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines() if ln.startswith("    ")}
    assert lines["HGMMA"] == ["32", "/", "32", "/", "4"]
    assert lines["LDGSTS"] == ["16", "/", "16", "/", "4"]
    assert lines["STS"] == ["8", "/", "4", "/", "4"]                         # the excess is the bank conflict
    top = [ln for ln in out.splitlines() if ln.startswith("  [")]
    assert len(top) == 2 and top[0].split()[:2] == ["[", "3]"] and " 50 " in top[0] and "long_sb 50" in top[0]


def test_compare_matches_instructions(tmp_path, capsys):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    _write(a, ROWS)
    rows_b = list(ROWS)
    rows_b.insert(4, ("IADD3 R8, P2, R6, UR34, RZ", 0, 4, 0, 0, 0, 0, 0))     # an extra instruction shifts the rest
    rows_b[9] = ("@!P3  BRA 0x7f506ee469e0", 11, 4, 0, 0, 11, 0, 0)           # the consumer's spin: 40 -> 11
    _write(b, rows_b)
    nss.main([str(a), "--compare", str(b), "--top", "3"])
    top = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.startswith("  [")]
    assert [t[2:4] for t in top] == [["50", "50"], ["40", "11"], ["9", "9"]]


def test_not_a_sass_page(tmp_path):
    bad = tmp_path / "x.csv"
    bad.write_text('"Metric Name","Value"\n"Duration","1"\n')
    with pytest.raises(SystemExit, match="not an ncu SASS source page"):
        nss.load(str(bad))
