"""How fast `strata run` generates a preset's weights: the loader its resolve_run_model returns
(models/synthetic.generate_weights), each run in a fresh process (its memory faulted in as `strata run`'s is):
DeepSeek-V2-Lite@Q4_K_M by default, the shape that fits a small machine. Writes generate_speed.json to --out: per run
the seconds and GB/s of expert bytes, and their median."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

def one_run(model: str) -> dict:
    """Resolve `model` as `strata run --model` does and time its weights' loader once in this process."""
    import time
    from strata_core.commands.run import resolve_run_model
    from strata_core.config import LoadedSettings, settings_from_partial
    spec, load, _ = resolve_run_model(model, LoadedSettings(settings_from_partial({}), {}), 0)
    t = time.perf_counter()
    weights = load()
    s = time.perf_counter() - t
    return {"expert_bytes": spec.experts_total_bytes, "seconds": round(s, 3),
            "gb_per_s": round(spec.experts_total_bytes / 1e9 / s, 3), "expert_dtype": weights.experts.dtype,
            "formats": sorted({f.label for f in weights.experts.formats})}


def main() -> int:
    """Run --runs fresh processes and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="DeepSeek-V2-Lite@Q4_K_M", help="a preset NAME@QUANT (default %(default)s)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=".")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_run(args.model)))
        return 0
    runs = []
    for _ in range(args.runs):
        p = subprocess.run([sys.executable, __file__, "--child", "--model", args.model], capture_output=True,
                           text=True, check=True)
        runs.append(json.loads(p.stdout))
        print(runs[-1]["seconds"], "s", runs[-1]["gb_per_s"], "GB/s", flush=True)
    res = {"schema": "strata.bench.generate_speed/1", "model": args.model, "cpu_count": os.cpu_count(),
           "runs": runs, "median_gb_per_s": statistics.median(r["gb_per_s"] for r in runs),
           "how": "time.perf_counter around the loader of commands.run.resolve_run_model (synthetic.generate_weights: "
                  "experts, routers, embedding, LM head), one fresh process a run"}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "generate_speed.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
