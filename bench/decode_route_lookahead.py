"""Could decode fetch a layer's missed experts before the layer routes? A CPU study of routing lookahead.

On the skew-depth model of bench/skew_depth.py (48 layers, 128 experts, top 8, hidden 512, expert FFN 64, skew 1),
for 128 decode tokens: layer l + d's router applied to layer l's input (rmsnorm with layer l + d's norm) predicts
layer l + d's experts. Reported per lookahead d: the recall of the real top 8 by the predicted top 8 and top 16, and
the recall of the experts a half cache misses (the best static half by a 4096-token prompt's counts, as
bench/decode_cache_replay.py), and how many uncached experts each guess holds (what prefetching it would copy, right
or wrong), per token and layer. Writes decode_route_lookahead.json under --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from strata_core.models.synthetic import generate_weights, model_spec
from strata_core.reference.kernels import linear, moe_grouped_ffn, rmsnorm, route_topk, scatter_add

L, E, K, H, F, V = 48, 128, 8, 512, 64, 4096
PROMPT, DECODE, LOOKAHEAD = 4096, 128, (1, 2, 4, 8)


def run(w, tokens: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """[L, T, K] routed experts and each layer's input residual [T, H] (the runtime's math, reference kernels)."""
    d = w.dense
    x = np.asarray(d.embed[tokens], dtype=np.float32)
    ids_all, xs = [], []
    for layer in range(L):
        xs.append(x.copy())
        xn = rmsnorm(x, d.norms[layer])
        ids, wts = route_topk(linear(xn, d.routers[layer]), K)
        ids_all.append(ids.copy())
        order = np.argsort(ids.ravel(), kind="stable")
        experts, starts = np.unique(ids.ravel()[order], return_index=True)
        y = moe_grouped_ffn(xn[order // K], np.append(starts, order.size), layer * E + experts, w.experts)
        scatter_add(x, order // K, y, wts.ravel()[order])
    return np.stack(ids_all), xs


def main() -> int:
    """The lookahead's recalls into decode_route_lookahead.json."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    w = generate_weights(model_spec("skew-depth", L, E, K, H, F, V), 0, popularity_skew=1.0)
    d = w.dense
    rng = np.random.default_rng(1)
    pr, _ = run(w, rng.integers(0, V, PROMPT))
    dec, xs = run(w, rng.integers(0, V, DECODE))
    counts = np.stack([np.bincount(pr[layer].ravel(), minlength=E) for layer in range(L)])
    cached = np.zeros(L * E, bool)
    cached[np.argsort(-counts.ravel())[: L * E // 2]] = True
    cached = cached.reshape(L, E)
    res = {"schema": "strata.bench.decode_route_lookahead/1",
           "shape": {"layers": L, "experts": E, "top_k": K, "hidden": H, "expert_ffn": F, "decode": DECODE},
           "lookahead": {}}
    for dist in LOOKAHEAD:
        hit8 = hit16 = miss_total = miss_hit8 = miss_hit16 = n = fetch8 = fetch16 = 0
        for layer in range(L - dist):
            target = layer + dist
            logits = linear(rmsnorm(xs[layer], d.norms[target]), d.routers[target])
            pred = np.argsort(-logits, axis=1)
            real = dec[target]
            for t in range(DECODE):
                r = set(real[t].tolist())
                p8, p16 = set(pred[t, :K].tolist()), set(pred[t, :2 * K].tolist())
                hit8 += len(r & p8)
                hit16 += len(r & p16)
                n += K
                missed = {e for e in r if not cached[target, e]}
                miss_total += len(missed)
                miss_hit8 += len(missed & p8)
                miss_hit16 += len(missed & p16)
                fetch8 += sum(1 for e in p8 if not cached[target, e])  # what a prefetch of the guess would copy
                fetch16 += sum(1 for e in p16 if not cached[target, e])
        res["lookahead"][str(dist)] = {
            "recall_top8": round(hit8 / n, 4), "recall_top16": round(hit16 / n, 4),
            "missed_experts": miss_total, "missed_recall_top8": round(miss_hit8 / max(1, miss_total), 4),
            "missed_recall_top16": round(miss_hit16 / max(1, miss_total), 4),
            "missed_a_token_layer": round(miss_total / (DECODE * (L - dist)), 4),
            "uncached_guessed_a_token_layer_top8": round(fetch8 / (DECODE * (L - dist)), 4),
            "uncached_guessed_a_token_layer_top16": round(fetch16 / (DECODE * (L - dist)), 4)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_route_lookahead.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
