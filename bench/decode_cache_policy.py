"""Replay decode cache policies against the routing the H200 recorded (bench/decode_trace_h200.py).

The trace holds the cache at the first decode count and every step's routed experts. This replays the runtime's
own ExpertCache from that state under the pipelined loop's timing (CudaLayerOps: a step's slot maps are read before
the previous step is counted; an admission made while counting step s reaches the maps from step s + 3, and none is
made while one is in flight), and reports per policy the experts a step reads from host memory (what the graph
really missed, not the cache's own counter, which counts against the table at counting time) and the experts it
copies in. `replay` with the runtime's defaults must give the run's own counts (checked: the trace's admissions).
Writes decode_cache_policy.json under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from strata_core.runtime.cache import EMPTY, ExpertCache


#: Counts after an admission that admit nothing (one copy admission in flight; the recorded runs admit at every
#: third count at most: bench/results/s12_h200's admit_step)
BLOCKED_COUNTS = 2
#: One Qwen3-30B-A3B expert's bytes (gate/up and down with their scales) per dtype of the traces
ROW_BYTES = {"Q8_0": 5013504, "F16": 9437184}


@dataclass(frozen=True)
class Policy:
    """One decode admission policy (the runtime's defaults: CudaLayerOps and ExpertCache)."""
    name: str
    decay: float = 0.97
    budget_rows: int = 13          # decode_admit_bytes // row_bytes (64 MiB over a Q8_0 expert)
    hotter_only: bool = True
    seeded_scale: float = 1.0      # the prompt's part of frequency at decode start, scaled
    top_up_rows: int = 0           # empty slots filled with the hottest non-resident experts before decode
    top_up_steps: int = 0          # steps before the top-up's copies land (decode admits nothing meanwhile)


def load_trace(path: Path) -> dict:
    """The trace's arrays."""
    z = np.load(path)
    return {k: z[k] for k in z.files}


def cache_from(trace: dict, experts: int, decay: float, seeded_scale: float) -> ExpertCache:
    """An ExpertCache in the trace's decode-start state."""
    so = trace["slot_of"]
    layers = so.size // experts
    c = ExpertCache(int(trace["on_loan"].size), layers, experts, decay=decay)
    c.slot_of[:] = so
    held = np.flatnonzero(so >= 0)
    c.expert_in[so[held]] = held
    c.freq[:] = trace["freq"] - trace["seeded"] * (1.0 - seeded_scale)
    c.seeded[:] = trace["seeded"] * seeded_scale
    c.on_loan[:] = trace["on_loan"]
    c.trimmed[:] = trace["trimmed"]
    return c


def replay(trace: dict, p: Policy, experts: int = 128) -> dict:
    """Host reads and admissions a step under policy p (see the module docstring for the timing)."""
    c = cache_from(trace, experts, p.decay, p.seeded_scale)
    ids = trace["ids"].astype(np.int64)
    steps, layers, k = ids.shape
    rows_t = (ids + np.arange(layers)[None, :, None] * experts).reshape(steps, -1)
    admitted_log: list[tuple[int, int]] = []
    if p.top_up_rows:
        empty = int(np.count_nonzero(c.usable() & (c.expert_in == EMPTY)))
        out = np.flatnonzero(c.slot_of == EMPTY)
        pick = out[np.argsort(-c.freq[out], kind="stable")][: min(empty, p.top_up_rows)]
        c.place(pick)
        admitted_log += [(-1, int(r)) for r in pick]
    visible: list[tuple[int, np.ndarray]] = []   # (first step whose maps show them, rows)
    hidden = np.zeros(c.slot_of.size, dtype=bool)   # admitted, copy not landed: read from host
    pending_until = -1
    if p.top_up_rows and p.top_up_steps:
        hidden[pick] = True
        visible.append((p.top_up_steps, pick))
        pending_until = p.top_up_steps - 3
    reads = np.zeros(steps, dtype=np.int64)
    reported_hits = 0
    for t in range(steps):
        for v in [v for v in visible if v[0] <= t]:
            hidden[v[1]] = False
            visible.remove(v)
        # the step's graph reads the maps as they are at its launch: counts through t - 2 applied
        if t >= 2:
            s = t - 2
            _count(c, p, rows_t[s], s, visible, hidden, admitted_log, pending_until)
            if visible and visible[-1][0] == s + 3:
                pending_until = s + BLOCKED_COUNTS
        maps = c.slot_of[rows_t[t]]
        reads[t] = int(np.count_nonzero((maps == EMPTY) | hidden[rows_t[t]]))
        reported_hits += 0
    return {"policy": asdict(p), "host_reads_a_step": round(float(reads.mean()), 3),
            "host_reads_total": int(reads.sum()), "admitted": len(admitted_log),
            "admitted_a_step": round(len(admitted_log) / steps, 3),
            "hit_rate_graph": round(1.0 - float(reads.sum()) / rows_t.size, 4)}


def _count(c: ExpertCache, p: Policy, rows: np.ndarray, s: int, visible: list, hidden: np.ndarray,
           log: list, pending_until: int) -> None:
    """Counting step s: tick, lookup, then (no admission in flight) admit the hottest missing routed experts."""
    c.tick()
    used, cnt = np.unique(rows, return_counts=True)
    c.lookup(0, used, cnt.astype(np.float64))
    if s <= pending_until or p.budget_rows <= 0:
        return
    miss = np.unique(rows[c.slot_of[rows] == EMPTY])
    if miss.size == 0:
        return
    miss = miss[np.argsort(-c.freq[miss], kind="stable")][: p.budget_rows]
    if p.hotter_only:
        miss = c.worth_admitting(miss)
    if miss.size == 0:
        return
    got = []
    e_n = c.experts_per_layer
    for layer in np.unique(miss // e_n).tolist():
        r_l = miss[miss // e_n == layer]
        slots = c.admit(int(layer), r_l - layer * e_n, keep=None)
        got += [int(r) for r, sl in zip(r_l.tolist(), slots.tolist()) if sl >= 0]
    if got:
        g = np.asarray(got, dtype=np.int64)
        hidden[g] = True
        visible.append((s + 3, g))
        log += [(s, r) for r in got]


POLICIES = (
    Policy("runtime"),
    Policy("no_admission", budget_rows=0),
    Policy("top_up", top_up_rows=1 << 20),
    Policy("top_up_landing_in_9_steps", top_up_rows=1 << 20, top_up_steps=9),
    Policy("top_up_landing_in_16_steps", top_up_rows=1 << 20, top_up_steps=16),
)


def main() -> int:
    """Replay every policy against each trace given; print and write decode_cache_policy.json."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    res = {"schema": "strata.bench.decode_cache_policy/1", "traces": {}}
    for t in a.traces:
        tr = load_trace(Path(t))
        # decode_admit_bytes (64 MiB) over the trace's expert bytes
        budget = (64 << 20) // ROW_BYTES[Path(t).stem.rsplit("_", 1)[-1] if "F16" in t else "Q8_0"]
        rows = [replay(tr, replace(p, budget_rows=budget if p.budget_rows else 0)) for p in POLICIES]
        res["traces"][Path(t).name] = {"recorded_admissions": int(tr["admit_row"].size), "policies": rows}
        for r in rows:
            print(Path(t).name, r["policy"]["name"], r["host_reads_a_step"], r["admitted"], r["hit_rate_graph"])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_cache_policy.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
