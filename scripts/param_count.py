"""Print the logical parameter count of a config by group (default: the release, Config.flash()).

    .venv/bin/python scripts/param_count.py [config.json]
"""
import argparse
import os
import sys

import functional_dsv41 as fd


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=None,
                    help="a config JSON file (Config.from_json); default: the release, Config.flash()")
    a = ap.parse_args(argv)
    if a.config is not None and not os.path.isfile(a.config):
        ap.error(f"argument config: no such file: {a.config!r}")
    cfg = fd.Config.from_json(a.config) if a.config is not None else fd.Config.flash()
    r = fd.param_count_report(cfg)
    print(r.table())
    backbone = sum(r[g] for g in ("attention", "MoE routed", "MoE shared+router", "mHC", "norms", "Engram other"))
    print(f"\nbackbone (layers.* without Engram tables, + final norm): {backbone:,} = {backbone / 1e9:.2f}B")


if __name__ == "__main__":
    main(sys.argv[1:])
