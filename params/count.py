"""Parameter counts by group, from the spec alone (no allocation; SPEC §11).

Counts are LOGICAL elements: a packed fp4 weight ``[N, K/2]`` counts ``N*K``; e8m0 block scales are
not parameters and are reported separately (elements and bytes). ``storage_bytes`` is what the
checkpoint holds for the group (weights + scales).
"""
from __future__ import annotations

import re

from functional_dsv41.config import Config

from .spec import _entries

GROUPS = ("embedding/head", "attention", "MoE routed", "MoE shared+router", "mHC", "norms",
          "Engram tables", "Engram other", "DSpark", "vision")


def group_of(name: str) -> str:
    """The report group of a checkpoint tensor name."""
    if name.startswith("mtp."):
        return "DSpark"
    if name.startswith(("vision.", "aligner.", "image_")):
        return "vision"
    if name in ("embed.weight", "head.weight"):
        return "embedding/head"
    if re.match(r"layers\.\d+\.engram\.embed\.", name):
        return "Engram tables"
    if re.match(r"layers\.\d+\.engram\.", name):
        return "Engram other"
    if re.match(r"layers\.\d+\.hc_", name):
        return "mHC"
    if name.endswith("norm.weight"):
        return "norms"
    if ".ffn.experts." in name:
        return "MoE routed"
    if ".ffn." in name:
        return "MoE shared+router"
    if ".attn." in name:
        return "attention"
    raise ValueError(f"param_count_report: no group for {name!r}")


class ParamCountReport(dict):
    """``dict`` group -> logical parameter count, plus ``total``, ``scales`` (group -> scale
    elements), ``storage_bytes`` (group -> bytes in the checkpoint) and a printable table."""

    def __init__(self, counts: dict, scales: dict, storage_bytes: dict):
        super().__init__(counts)
        self.scales = scales
        self.storage_bytes = storage_bytes

    @property
    def total(self) -> int:
        return sum(self.values())

    def table(self) -> str:
        rows = [("group", "params", "billions", "scale elems", "storage GB")]
        for g in self:
            rows.append((g, f"{self[g]:,}", f"{self[g] / 1e9:.2f}", f"{self.scales[g]:,}",
                         f"{self.storage_bytes[g] / 1e9:.2f}"))
        rows.append(("total", f"{self.total:,}", f"{self.total / 1e9:.2f}", f"{sum(self.scales.values()):,}",
                     f"{sum(self.storage_bytes.values()) / 1e9:.2f}"))
        w = [max(len(r[i]) for r in rows) for i in range(5)]
        out = [" | ".join(c.ljust(w[0]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)) for r in rows]
        out.insert(1, "-+-".join("-" * x for x in w))
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()


def param_count_report(cfg: Config) -> ParamCountReport:
    """Logical parameter counts of ``cfg`` by :data:`GROUPS` (zero groups kept, in that order)."""
    from functional_dsv41.config import require_config
    require_config(cfg, "param_count_report")
    counts = {g: 0 for g in GROUPS}
    scales = {g: 0 for g in GROUPS}
    nbytes = {g: 0 for g in GROUPS}
    for e in _entries(cfg):
        g = group_of(e.name)
        n_store = 1
        for d in e.shape:
            n_store *= d
        nbytes[g] += n_store * e.dtype.itemsize
        if e.fmt == "scale":
            scales[g] += e.numel
        else:
            counts[g] += e.numel
    return ParamCountReport(counts, scales, nbytes)
