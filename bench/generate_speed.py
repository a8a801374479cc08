"""How fast a preset's generated experts are made (models/synthetic.generate_weights), each run in a fresh process
(its memory faulted in as `strata run`'s is): DeepSeek-V2-Lite@Q4_K_M by default, the shape that fits a small
machine. Writes generate_speed.json to --out: per run the seconds and GB/s of expert bytes, and their median."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

#: name -> (moe layers, experts, top k, hidden, expert ffn, vocab), as models/presets.py gives them
SHAPES = {"DeepSeek-V2-Lite": (26, 64, 6, 2048, 1408, 102400), "Qwen3-30B-A3B": (48, 128, 8, 2048, 768, 151936)}


def one_run(model: str, quant: str) -> dict:
    """Generate once in this process; the timed region is generate_weights alone."""
    import time
    from strata_core.models.synthetic import generate_weights, generated_expert_formats, model_spec
    layers, experts, top_k, hidden, ffn, vocab = SHAPES[model]
    formats, notes = generated_expert_formats(quant, layers, hidden, ffn)
    spec = model_spec(f"{model}@{quant}", layers, experts, top_k, hidden, ffn, vocab, dtype="gguf", formats=formats,
                      quant=quant, source="preset, generated")
    t = time.perf_counter()
    generate_weights(spec, 0, dtype="gguf", formats=formats)
    s = time.perf_counter() - t
    return {"expert_bytes": spec.experts_total_bytes, "seconds": round(s, 3),
            "gb_per_s": round(spec.experts_total_bytes / 1e9 / s, 3), "formats": sorted({f.label for f in formats}),
            "notes": notes}


def main() -> int:
    """Run --runs fresh processes and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="DeepSeek-V2-Lite", choices=sorted(SHAPES))
    ap.add_argument("--quant", default="Q4_K_M")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=".")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_run(args.model, args.quant)))
        return 0
    runs = []
    for _ in range(args.runs):
        p = subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--quant", args.quant],
                           capture_output=True, text=True, check=True)
        runs.append(json.loads(p.stdout))
        print(runs[-1]["seconds"], "s", runs[-1]["gb_per_s"], "GB/s", flush=True)
    res = {"schema": "strata.bench.generate_speed/1", "model": f"{args.model}@{args.quant}", "cpu_count": os.cpu_count(),
           "runs": runs, "median_gb_per_s": statistics.median(r["gb_per_s"] for r in runs),
           "how": "time.perf_counter around synthetic.generate_weights (experts, routers, embedding, LM head), one "
                  "fresh process a run"}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "generate_speed.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
