"""Benchmark: how long one plan takes (target: under 50 ms), for every shared scenario and a few presets.

Run: .venv/bin/python bench/plan_speed.py [--repeat N] [--scenarios DIR]
Prints the median milliseconds per plan of each case and writes bench/results/plan_speed.json. Not a test.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

from strata_core import __version__
from strata_core.api.facts import MIB
from strata_core.models.resolve import model_from_name
from strata_core.planner import plan_for_machine
from strata_core.registry import load_plugins
from strata_core.scenario import load_scenario

HERE = Path(__file__).resolve().parent
TARGET_MS = 50.0
#: Presets planned on each scenario's machine besides the scenario's own model. A scenario's free VRAM is what was
#: left after its own model's dense weights and KV, so presets get the card as if idle: total less this much.
IDLE_CARD_USED_BYTES = 512 * MIB
PRESETS = ("Qwen3-30B-A3B@Q4_K", "Qwen3-235B-A22B@IQ2_XS", "Mixtral-8x7B@Q4_K", "DeepSeek-V2-Lite@Q8_0",
           "gpt-oss-120b@MXFP4")


def time_plan(plugins, device, host, model, settings, repeat: int) -> tuple[float, str]:
    """Median ms of `repeat` plans, and the outcome ('chunk N' or the refusal)."""
    times_ms = []
    outcome = ""
    for _ in range(repeat):
        t0 = time.perf_counter()
        try:
            plan = plan_for_machine(plugins, plugins.target_for(device, host), model, settings)
            outcome = f"chunk {plan.prompt.chunk}, {plan.expert_cache.slots} slots"
        except Exception as e:  # a refused plan is timed too: refusing is planning
            outcome = f"{type(e).__name__}: {str(e)[:60]}"
        times_ms.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times_ms), outcome


def main() -> int:
    """Time every case, print a line each, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--scenarios", type=Path, default=HERE.parent / ".." / "shared" / "scenarios")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "plan_speed.json")
    args = ap.parse_args()
    plugins = load_plugins()
    files = sorted(args.scenarios.resolve().glob("*.json"))
    if not files:
        print(f"no scenarios in {args.scenarios.resolve()}")
        return 2
    cases = []
    for f in files:
        s = load_scenario(f)
        idle = replace(s.profile.device, vram_free_bytes=s.profile.device.vram_total_bytes - IDLE_CARD_USED_BYTES)
        for model in (s.model, *(model_from_name(p) for p in PRESETS)):
            device = s.profile.device if model is s.model else idle
            ms, outcome = time_plan(plugins, device, s.profile.host, model, s.settings, args.repeat)
            cases.append({"scenario": f.name, "model": model.name, "median_ms": round(ms, 3), "outcome": outcome})
            print(f"{ms:8.2f} ms  {f.stem:40} {model.name:28} {outcome}")
    worst = max(c["median_ms"] for c in cases)
    print(f"worst median {worst:.2f} ms per plan (target < {TARGET_MS:.0f} ms): {'ok' if worst < TARGET_MS else 'SLOW'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "schema": "strata.bench.plan_speed/1", "strata_version": __version__, "python": platform.python_version(),
        "machine": platform.machine(), "processor": platform.processor() or "unknown", "repeat": args.repeat,
        "target_ms": TARGET_MS, "worst_median_ms": round(worst, 3), "cases": cases,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
