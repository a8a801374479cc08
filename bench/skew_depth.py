"""How strongly a generated model's popularity skew routes at each depth (CPU; `strata run --skew`'s weights).

The runtime's math in float32 (rmsnorm, router, top k, SwiGLU experts, residual add) over a 48-layer, 128-expert,
top-8 model of hidden 512 and expert FFN 64 (the skew's carrier math depends on depth, experts and top k, not on the
FFN width), 256 prompt tokens: the share of each layer's routed rows that its most popular half of experts takes, and
what a half cache would hit if it held that half. Writes skew_depth.json under --out (--label names the run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np

from strata_core.models.synthetic import generate_weights, model_spec, popular_half_shares

L, E, K, H, F, V, T = 48, 128, 8, 512, 64, 2048, 256


def shares(skew: float) -> list[float]:
    """Top-half share of the routed rows, layer by layer."""
    w = generate_weights(model_spec("skew-depth", L, E, K, H, F, V), 0, popularity_skew=skew)
    return popular_half_shares(w, np.random.default_rng(1).integers(0, V, T))


def main() -> int:
    """Measure skew 1 and 0; add the run to the JSON under --out."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--label", default="this tree")
    args = ap.parse_args()
    path = Path(args.out) / "skew_depth.json"
    res = json.loads(path.read_text()) if path.is_file() else {"schema": "strata.bench.skew_depth/1", "runs": {}}
    res["shape"] = {"layers": L, "experts": E, "top_k": K, "hidden": H, "expert_ffn": F, "tokens": T}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    run = {"commit": commit, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for skew in (1.0, 0.0):
        s = shares(skew)
        run[f"skew_{skew:g}"] = {"top_half_share_by_layer": [round(v, 4) for v in s],
                                 "mean_top_half_share": round(float(np.mean(s)), 4), "first": round(s[0], 4),
                                 "last": round(s[-1], 4)}
        print(f"{args.label} skew {skew:g}: first {s[0]:.3f} last {s[-1]:.3f} mean {np.mean(s):.3f}")
    res["runs"][args.label] = run
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
