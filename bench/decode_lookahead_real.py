"""Could half-cached decode read a layer's misses before the layer routes? At the real Qwen3-30B-A3B shape, from
the layer inputs bench/decode_trace_h200.py --residuals recorded on the H200 (Q8_0, half-skewed, 128 steps).

For each lookahead d, layer l + d's router (rmsnorm with its own norm) on layer l's input predicts its top k; reported:
the share of layer l + d's misses (against the cache at the first decode step) the guess holds, and how many uncached
experts a guess names a layer (what prefetching it copies, right or wrong). Then a fluid model of one decode step:
the link reads one expert in READ_US, shared by the reads in flight (demand reads first where `share` < 1: a prefetch
gets that share of the link while a layer's own misses read), a layer computes COMPUTE_US and waits for its own
misses; a prefetch for layer l + d starts when layer l starts. Writes decode_lookahead_real.json under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

READ_US = 101.7     # one Q8_0 expert from mapped page-locked memory (lead_h200_s11/call1_decode_miss_order_h200.json)
COMPUTE_US = 35.25  # the all-cached step over 48 layers (1.692 ms, strata_run_h200_q8_0.json of lead_h200_s11)


def load(res: Path, trace: Path) -> tuple:
    """(inputs [T, L, H] f32, routers [L, E, H] f32, norms [L, H], ids [T, L, K], cached [L, E])."""
    x = np.concatenate([np.load(res / f"decode_residuals_Q8_0_{i}.npy") for i in (0, 1)], axis=1).astype(np.float32)
    r = np.concatenate([np.load(res / f"decode_router_Q8_0_{i}.npy") for i in (0, 1)], axis=0).astype(np.float32)
    nw = np.load(res / "decode_norm_Q8_0.npy")
    z = np.load(trace)
    ids = z["ids"].astype(np.int64)
    return x, r, nw, ids, (z["slot_of"].reshape(r.shape[0], r.shape[1]) >= 0)


def rms(v: np.ndarray, w: np.ndarray) -> np.ndarray:
    """rmsnorm (eps 1e-6)."""
    return v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-6) * w


def predictions(x, r, nw, d: int, k: int) -> np.ndarray:
    """[T, L, k] predicted experts of layer l from layer l - d's input (-1 where l < d)."""
    t_n, l_n, _ = x.shape
    p = np.full((t_n, l_n, k), -1, dtype=np.int64)
    for l in range(d, l_n):
        p[:, l] = np.argsort(-(rms(x[:, l - d], nw[l]) @ r[l].T), -1)[:, :k]
    return p


def step_us(ids, cached, pred, t: int, d: int, k: int, share: float) -> float:
    """One step's time in the fluid model (pred None: no prefetch; else layer l + d's guess is read from layer l's
    start)."""
    now, onboard, dem, pre = 0.0, set(), {}, {}

    def run(until: float, need=None) -> None:
        nonlocal now
        while now < until - 1e-9:
            if not dem and not pre:
                now = until
                return
            rd = ((1 - share) if pre else 1.0) / len(dem) if dem else 0.0
            rp = (share if dem else 1.0) / len(pre) if pre else 0.0
            dt = min([v / rd for v in dem.values()] + [v / rp for v in pre.values()] + [until - now])
            for q, rate in ((dem, rd), (pre, rp)):
                for key in list(q):
                    q[key] -= dt * rate
                    if q[key] <= 1e-9:
                        del q[key]
                        onboard.add(key)
            now += dt
            if need is not None and all(n in onboard for n in need):
                return

    l_n = ids.shape[1]
    for l in range(l_n):
        if pred is not None and l + d < l_n:
            for e in pred[t, l + d, :k].tolist():
                key = (l + d, e)
                if not cached[l + d, e] and key not in onboard and key not in pre and key not in dem:
                    pre[key] = READ_US
        need = [(l, int(e)) for e in ids[t, l] if not cached[l, e]]
        for key in need:
            if key in pre:
                dem[key] = pre.pop(key)
            elif key not in onboard and key not in dem:
                dem[key] = READ_US
        end = now + COMPUTE_US
        if any(n not in onboard for n in need):
            run(float("inf"), need)
        run(max(end, now))
    return now


def main() -> int:
    """Recalls and the fluid model's tok/s into decode_lookahead_real.json."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--residuals", required=True, help="the folder decode_trace_h200.py --residuals wrote")
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args()
    res = Path(a.residuals)
    x, r, nw, ids, cached = load(res, res / "decode_trace_Q8_0.npz")
    t_n, l_n, _ = x.shape
    out = {"schema": "strata.bench.decode_lookahead_real/1", "steps": t_n, "layers": l_n,
           "read_us": READ_US, "compute_us": COMPUTE_US, "recall": [], "model": []}
    preds = {d: predictions(x, r, nw, d, 16) for d in (1, 2, 3)}
    for d, p in preds.items():
        for k in (8, 12, 16):
            hit = tot = guess = 0
            for t in range(t_n):
                for l in range(d, l_n):
                    mis = {e for e in ids[t, l].tolist() if not cached[l, e]}
                    pm = {e for e in p[t, l, :k].tolist() if not cached[l, e]}
                    hit, tot, guess = hit + len(mis & pm), tot + len(mis), guess + len(pm)
            out["recall"].append({"lookahead": d, "top": k, "miss_recall": round(hit / tot, 4),
                                  "uncached_guesses_a_layer": round(guess / (t_n * (l_n - d)), 4),
                                  "misses_a_layer": round(tot / (t_n * (l_n - d)), 4)})
    base = float(np.mean([step_us(ids, cached, None, t, 0, 0, 1.0) for t in range(t_n)]))
    out["model"].append({"prefetch": None, "tokens_per_s": round(1e6 / base, 1)})
    for share in (0.1, 0.3, 0.5):
        for d, k in ((1, 4), (1, 8), (2, 8), (3, 8)):
            us = float(np.mean([step_us(ids, cached, preds[d], t, d, k, share) for t in range(t_n)]))
            out["model"].append({"prefetch": {"lookahead": d, "top": k, "link_share": share},
                                 "tokens_per_s": round(1e6 / us, 1)})
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "decode_lookahead_real.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
