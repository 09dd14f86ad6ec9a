"""Summarise an Nsight Compute SASS source page (``ncu --import R --page source --csv --print-source sass``, as
``scripts/ncu_profile.sh`` writes it): per warp-role region, the warp-stall samples, how many sit in mbarrier waits
(the branch that spins on a SYNCS...TRYWAIT) and in WGMMA waits (WARPGROUP.DEPBAR), and the top stall reasons; then
the shared-memory wavefronts per opcode against their ideal (bank conflicts show as the excess); then the
instructions with the most samples. With ``--compare OTHER``, the same instructions' samples in a second profile of
a variant of the same kernel (instructions matched by their text, addresses masked), so an ablation's effect shows
site by site.

    python3 scripts/ncu_sass_summary.py pp.sass.csv --compare pp_compute.sass.csv   (a page may be .csv.xz)

Regions: a kernel's warp roles start at its USETMAXREG instructions (setmaxnreg: the producer's dealloc, then each
consumer's alloc); a kernel without them is one region.
"""
import argparse
import csv
import difflib
import lzma
import os
import re
import sys


def load(path):
    """The page's rows as dicts: text (addresses masked), samples, executed, wavefronts, ideal, stall reasons."""
    opener = lzma.open if path.endswith(".xz") else open      # (the pages kept in benchmarks/results are xz)
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    try:
        start = next(i for i, r in enumerate(rows) if "Source" in r and "Warp Stall Sampling (All Samples)" in r)
    except StopIteration:
        sys.exit(f"ncu_sass_summary: {path} is not an ncu SASS source page (no 'Source' / 'Warp Stall Sampling' header)")
    hdr = rows[start]

    def col(r, name):
        v = r[hdr.index(name)].replace(",", "") if name in hdr else ""
        return int(float(v)) if v not in ("", "-") else 0
    stalls = [k for k in hdr if k.startswith("stall_") and "Not Issued" not in k]
    out = []
    for r in rows[start + 1:]:
        if len(r) != len(hdr):
            continue
        out.append(dict(text=re.sub(r"0x[0-9a-f]{8,}", "ADDR", r[hdr.index("Source")].strip()),
                        samples=col(r, "Warp Stall Sampling (All Samples)"), executed=col(r, "Instructions Executed"),
                        wav=col(r, "L1 Wavefronts Shared"), ideal=col(r, "L1 Wavefronts Shared Ideal"),
                        stalls={k[6:]: col(r, k) for k in stalls}))
    return out


def regions(ins):
    """(start, end, name) of the warp-role regions, split at the USETMAXREG instructions."""
    cuts = [i for i, x in enumerate(ins) if "USETMAXREG" in x["text"]]
    if not cuts:
        return [(0, len(ins), "kernel")]
    bounds = [0] + cuts + [len(ins)]
    names = ["setup"] + [("producer (dealloc)" if "DEALLOC" in ins[c]["text"] else f"consumer {k}")
                         for k, c in enumerate(cuts)]
    out, nc = [], 0
    for (a, b), name in zip(zip(bounds, bounds[1:]), names):
        if name.startswith("consumer"):
            name, nc = f"consumer {nc} (alloc)", nc + 1
        out.append((a, b, name))
    return out


def _unguarded(text):
    """An instruction's text without its predicate guard (``@!P0 ``, ``@UP1 ``)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text)


def _top(counts, n):
    """The n largest nonzero counts of a {name: count}, as "name count, ..."."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:n] if v)


def spin_branches(ins):
    """Per instruction: whether it is the branch of an mbarrier wait's spin loop (``@!Pn BRA`` on the predicate a
    ``SYNCS...TRYWAIT Pn`` wrote, with no other write of Pn between)."""
    from_wait, out = {}, []
    for x in ins:
        t = _unguarded(x["text"])
        guard = re.match(r"^@!(P\d)\s+BRA", x["text"])
        out.append(bool(guard and from_wait.get(guard.group(1))))
        dst = re.match(r"^[\w.]+\s+(P\d)\b", t)           # an instruction whose first operand is a predicate
        if dst:
            from_wait[dst.group(1)] = "TRYWAIT" in t.split()[0]
    return out


def summary(ins, label):
    tot = sum(x["samples"] for x in ins) or 1
    print(f"== {label}: {len(ins)} instructions, {tot} warp-stall samples")
    for a, b, name in regions(ins):
        part = ins[a:b]
        s = sum(x["samples"] for x in part)
        mb = sum(x["samples"] for x, w in zip(part, spin_branches(part)) if w)
        dep = sum(x["samples"] for x in part if "DEPBAR" in x["text"])
        reasons = {}
        for x in part:
            for k, v in x["stalls"].items():
                reasons[k] = reasons.get(k, 0) + v
        print(f"  {name:20s} samples {s:7d} ({s / tot:5.1%}); in mbarrier waits {mb:6d}, WGMMA waits {dep:6d}; "
              f"{_top(reasons, 5)}")
    ops = {}
    for x in ins:
        if x["wav"] or x["ideal"]:
            op = _unguarded(x["text"]).split()[0].split(".")[0]
            o = ops.setdefault(op, [0, 0, 0])
            o[0] += x["wav"]; o[1] += x["ideal"]; o[2] += x["executed"]
    print("  shared-memory wavefronts by opcode (measured / ideal / warp instructions):")
    for op, (w, i, e) in sorted(ops.items(), key=lambda kv: -kv[1][0]):
        print(f"    {op:10s} {w:>14,} / {i:>14,} / {e:>12,}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("page", help="the SASS source page as CSV")
    p.add_argument("--compare", help="a second page (a variant of the same kernel)")
    p.add_argument("--top", type=int, default=20, help="instructions listed (by samples)")
    args = p.parse_args(argv)
    for f in (args.page, args.compare):
        if f is not None and not os.path.isfile(f):
            p.error(f"no such file: {f}")
    a = load(args.page)
    summary(a, args.page)
    b = load(args.compare) if args.compare else None
    match = {}
    if b is not None:
        summary(b, args.compare)
        sm = difflib.SequenceMatcher(None, [x["text"] for x in a], [x["text"] for x in b], autojunk=False)
        for blk in sm.get_matching_blocks():
            for k in range(blk.size):
                match[blk.a + k] = blk.b + k
    print(f"== the {args.top} instructions with the most samples in {args.page}"
          + (f" (and the same instruction's in {args.compare}; '-' where it has no match)" if b else ""))
    for i in sorted(range(len(a)), key=lambda i: -a[i]["samples"])[:args.top]:
        x = a[i]
        other = "" if b is None else f"{b[match[i]]['samples']:7d}" if i in match else "      -"
        print(f"  [{i:5d}] {x['samples']:7d} {other}  {x['text'][:64]:64s} {_top(x['stalls'], 2)}")


if __name__ == "__main__":
    main()
