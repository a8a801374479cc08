"""Per-layer figures of link_trace_h200.json files: for each traced variant, the compute stream's gap between a
layer's end and the next layer's start, and the link's idle time before each layer's prefetch (from the previous
copy's end), each per layer and summed over a range of layers. Reads committed traces; writes one JSON.

    python bench/link_trace_layers.py OUT.json TRACE.json [TRACE.json ...] [--split 31]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def layer_figures(marks: list) -> dict:
    """(end -> next start) and (previous copy end -> prefetch begin) for every layer boundary, in ms."""
    gaps, idle = [], []
    last_end, last_copy = None, None
    for name, t in marks:
        if name == "end":
            last_end = t
        elif name.startswith("copied_") or name == "prefetched":
            last_copy = t if last_copy is None else max(last_copy, t)
        elif name == "prefetch_begin" and last_copy is not None:
            idle.append(max(0.0, t - last_copy))
        elif name == "start" and last_end is not None:
            gaps.append(t - last_end)
            last_end = None
    return {"compute_gap_ms": [round(g, 4) for g in gaps], "idle_before_prefetch_ms": [round(i, 4) for i in idle]}


def summary(fig: dict, split: int) -> dict:
    """Medians and sums of the per-layer figures before and from layer boundary `split` on."""
    out = {}
    for key, vals in fig.items():
        for part, sel in (("before", vals[:split]), ("from", vals[split:])):
            if sel:
                out[f"{key}_{part}_{split}_median"] = round(statistics.median(sel), 4)
                out[f"{key}_{part}_{split}_sum"] = round(sum(sel), 4)
                out[f"{key}_{part}_{split}_per_layer"] = round(sum(sel) / len(sel), 4)
    return out


def main() -> int:
    """Write the per-layer figures of each trace file's variants."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--split", type=int, default=31)
    a = ap.parse_args()
    res = {"schema": "strata.bench.link_trace_layers/1", "split": a.split, "files": {}}
    for path in a.traces:
        doc = json.loads(Path(path).read_text())
        per = {}
        for variant, run in doc.get("traced", {}).items():
            fig = layer_figures(run.get("marks_ms") or [])
            per[variant] = {**summary(fig, a.split), **fig}
        res["files"][Path(path).name] = per
    Path(a.out).write_text(json.dumps(res, indent=1))
    for name, per in res["files"].items():
        for variant, v in per.items():
            print(name, variant, {k: v[k] for k in v if k.endswith("per_layer")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
