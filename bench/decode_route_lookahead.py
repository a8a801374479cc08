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

from strata_core.reference.kernels import linear, rmsnorm

# the replay's model, forward pass and static cache (a script beside this one: bench/ is on the path when run)
from decode_cache_replay import DECODE, E, F, H, K, L, PROMPT, V, best_static_half, routes, skew_model

LOOKAHEAD = (1, 2, 4, 8)


def main() -> int:
    """The lookahead's recalls into decode_route_lookahead.json."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    w = skew_model()
    d = w.dense
    rng = np.random.default_rng(1)
    pr, xs = routes(w, rng.integers(0, V, PROMPT)), []
    dec = routes(w, rng.integers(0, V, DECODE), xs)
    cached = best_static_half(pr)
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
