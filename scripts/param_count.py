"""Print the logical parameter count of a config by group (default: the release, Config.flash()).

    .venv/bin/python scripts/param_count.py [config.json]
"""
import sys

import functional_dsv41 as fd


def main(argv):
    cfg = fd.Config.from_json(argv[1]) if len(argv) > 1 else fd.Config.flash()
    r = fd.param_count_report(cfg)
    print(r.table())
    backbone = sum(r[g] for g in ("attention", "MoE routed", "MoE shared+router", "mHC", "norms", "Engram other"))
    print(f"\nbackbone (layers.* without Engram tables, + final norm): {backbone:,} = {backbone / 1e9:.2f}B")


if __name__ == "__main__":
    main(sys.argv)
