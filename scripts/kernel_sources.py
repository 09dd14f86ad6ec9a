"""Write the CUDA that TileLang generates for the sparse-attention forward kernels, without nvcc or a GPU, and
compare two such dumps: the check that a refactor of a kernel's Python changes no generated code (so the
kernel needs no new GPU run). Lowering takes ~5 s a kernel here; compiling would take minutes.

    source scripts/local_tilelang_env.sh
    git stash; .venv/bin/python scripts/kernel_sources.py dump /tmp/before; git stash pop
    .venv/bin/python scripts/kernel_sources.py dump /tmp/after
    .venv/bin/python scripts/kernel_sources.py compare /tmp/before /tmp/after     # exit 1 if any differs

TileLang 0.1.15 names the cross-warp reductions' shared workspaces (``workspace``, ``workspace_1`` ...) in no fixed
order from one lowering to the next, so ``compare`` reads each name as the shared-memory offset it is declared at.
Where a kernel has several workspaces of the same size, which reduction gets which offset can also change from one
lowering of the same code to the next (the lock-step kernel: two dumps of one commit placed its two reductions differently); such
a file is reported as ``DIFFERS (workspace placement only)`` when it is the same with every workspace read as one. Cases: ``CASES`` (every
forward kernel and its options at the release shape, plus the D = 256 and 16-head ones the tests build).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cases():
    from kernels.tilelang import (sparse_attn_cl_tl as CL, sparse_attn_pp_tl as PP, sparse_attn_seesaw_tl as SS,
                                  sparse_attn_sp_tl as SP, sparse_attn_tl as A)
    r = dict(H=64, D=512, TP=640, scale=0.04)
    return {
        "lockstep": lambda: A.fwd_kernel(**r),
        "lockstep_h16_d256": lambda: A.fwd_kernel(16, 256, 256, 0.06),
        "ws": lambda: A.fwd_kernel_ws(**r, **A.FWD_WS_CFG[64]),
        "ws_d256_block128": lambda: A.fwd_kernel_ws(64, 256, 640, 0.04, **A.FWD_WS_CFG[128]),
        "sp": lambda: SP.fwd_kernel_sp(**r, **SP.FWD_SP_CFG),
        "sp_nosoftmax": lambda: SP.fwd_kernel_sp(**r, diag="nosoftmax"),
        "pp": lambda: PP.fwd_kernel_pp(**r),
        "pp_persistent": lambda: PP.fwd_kernel_pp(**r, ctas=132),
        "pp_persistent_lazy": lambda: PP.fwd_kernel_pp(**r, ctas=132, lazy=8.0),
        "pp_persistent_late_s0": lambda: PP.fwd_kernel_pp(**r, ctas=132, late_s0=True),
        "pp_persistent_o_in_p": lambda: PP.fwd_kernel_pp(**r, ctas=132, late_s0=True, o_in_p=True),
        "pp_trace_persistent": lambda: PP.fwd_kernel_pp(**r, ctas=132, late_s0=True, o_in_p=True, diag="trace"),
        "pp_traceb": lambda: PP.fwd_kernel_pp(**r, ctas=132, late_s0=True, o_in_p=True, diag="traceb"),
        "pp_nosoftmax": lambda: PP.fwd_kernel_pp(**r, diag="nosoftmax"),
        # the producer's options and ablations (persistent, on the default's boundary options)
        "pp_q_tma": lambda: PP.fwd_kernel_pp(**r, ctas=132, late_s0=True, o_in_p=True, q_tma=True),
        "pp_q_late_prefetch": lambda: PP.fwd_kernel_pp(**r, ctas=132, late_s0=True, o_in_p=True, q_late=True,
                                                       q_prefetch=True),
        "pp_s0_first": lambda: PP.fwd_kernel_pp(**r, ctas=132, late_s0=True, o_in_p=True, s0_first=True),
        "pp_gather": lambda: PP.fwd_kernel_pp(**r, ctas=132, late_s0=True, o_in_p=True, diag="gather"),
        "pp_compute": lambda: PP.fwd_kernel_pp(**r, ctas=132, late_s0=True, o_in_p=True, diag="compute"),
        "pp_nolatency": lambda: PP.fwd_kernel_pp(**r, ctas=132, late_s0=True, o_in_p=True, diag="nolatency"),
        "pp_nostore": lambda: PP.fwd_kernel_pp(**r, ctas=132, late_s0=True, o_in_p=True, diag="nostore"),
        "pp_smemwrite": lambda: PP.fwd_kernel_pp(**r, ctas=132, late_s0=True, o_in_p=True, diag="smemwrite"),
        "pp_smemwrite_quarter": lambda: PP.fwd_kernel_pp(**r, ctas=132, late_s0=True, o_in_p=True,
                                                         diag="smemwrite_quarter"),
        "pp_d256": lambda: PP.fwd_kernel_pp(64, 256, 256, 0.06),
        "seesaw": lambda: SS.fwd_kernel_seesaw(**r, **A.FWD_SEESAW_CFG),
        "seesaw_qk_split": lambda: SS.fwd_kernel_seesaw(**r, BI=64, stages=2, qk_split=2),
        "cl": lambda: CL.fwd_kernel_cl(**r, ctas=132),
    }


def _lower_only(func, out_idx=None, pass_configs=None, workspace_alias_ok=False):
    """Stands in for ``_common.compile_kernel``: lowers with the same target and pass configs, returns the CUDA."""
    from tilelang.engine import lower
    from tvm import transform
    from tvm.target import Target
    from kernels.tilelang import _common as C
    cfg = dict(C.PASS_CFG)
    cfg.update(pass_configs or {})
    cfg = {getattr(k, "value", k): v for k, v in cfg.items()}
    target = Target(C.target())
    with transform.PassContext(opt_level=3, config=cfg), target:
        return lower(func, target=target).kernel_source


def dump(out: str, names: list[str]) -> None:
    import importlib
    import pkgutil
    import kernels.tilelang as tl
    for m in pkgutil.iter_modules(tl.__path__):
        mod = importlib.import_module(f"{tl.__name__}.{m.name}")
        if hasattr(mod, "compile_kernel"):
            mod.compile_kernel = _lower_only
    cases = _cases()
    unknown = sorted(set(names) - set(cases))
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {sorted(cases)}")
    os.makedirs(out, exist_ok=True)
    for name in names or list(cases):
        src = cases[name]()
        with open(os.path.join(out, name + ".cu"), "w") as fh:
            fh.write(src)
        print(f"{name}: {len(src)} bytes", flush=True)


_WS_DECL = re.compile(r"void\* (workspace(?:_\d+)?) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);")
_WS = re.compile(r"\bworkspace(?:_\d+)?\b")


def _norm(path: str, placement: bool = True) -> str:
    """The file with each workspace name read as its shared-memory offset (``placement``) or as one name."""
    with open(path) as fh:
        src = fh.read()
    src = _WS_DECL.sub(lambda m: f"void* workspace = ... + {m.group(2)};", src)
    if not placement:
        return _WS.sub("workspace", src)
    at = dict(_WS_DECL.findall(open(path).read()))
    return _WS.sub(lambda m: f"workspace@{at.get(m.group(0), '?')}", src)


def compare(a: str, b: str) -> int:
    names = sorted(set(os.listdir(a)) | set(os.listdir(b)))
    bad = 0
    for n in names:
        pa, pb = os.path.join(a, n), os.path.join(b, n)
        if not (os.path.exists(pa) and os.path.exists(pb)):
            print(f"{n}: only in {a if os.path.exists(pa) else b}")
            bad += 1
        elif _norm(pa) != _norm(pb):
            print(f"{n}: DIFFERS" + (" (workspace placement only)" if _norm(pa, False) == _norm(pb, False) else ""))
            bad += 1
        else:
            print(f"{n}: same")
    print(f"{len(names) - bad} of {len(names)} the same")
    if not names:
        print(f"nothing to compare: {a} and {b} are both empty", file=sys.stderr)
        return 1
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="write OUT/<case>.cu for each case (default: all)")
    d.add_argument("out")
    d.add_argument("cases", nargs="*")
    c = sub.add_parser("compare", help="compare two dumps; exit 1 if any file differs or is missing")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "dump":
        if importlib.util.find_spec("tilelang") is None:
            raise SystemExit("kernel_sources.py dump: tilelang is not importable; "
                             "source scripts/local_tilelang_env.sh first")
        dump(args.out, args.cases)
    else:
        for d in (args.a, args.b):
            if not os.path.isdir(d):
                c.error(f"{d!r} is not a directory")
        sys.exit(compare(args.a, args.b))


if __name__ == "__main__":
    main()
