"""Auto selection on this machine: the default `strata run` against `strata run --backend cpu`, in turn.

Each pair runs `strata run --json` with backend.name = auto (the default) and with `--backend cpu`, alternating,
in child processes; strata run's own prefill/decode tok/s and a wall clock around each whole process are kept, with
the backend auto chose and why (`strata backends --json`: the measured figure per backend). The issue asks that the
default never be slower than `--backend cpu` on a CPU-only machine.

    python bench/cpu_selection.py [--pairs N] [--prompt-tokens N] [--decode-tokens N] [--out PATH] [--extra JSON]

`--extra` merges a JSON file into the result (figures measured by hand, e.g. whole-process paired timings).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "cpu_selection.json"


def strata(args: list[str]) -> tuple[dict, float]:
    """One `strata ...` child process: its JSON object and its wall seconds."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "strata_core.cli", *args], capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"strata {' '.join(args)} failed (exit {p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout), wall


def main() -> int:
    """Run the pairs, write the JSON, print the medians."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--extra", type=Path, default=None)
    a = ap.parse_args()
    sel, _ = strata(["backends", "--json"])
    run = ["run", "--json", "--prompt-tokens", str(a.prompt_tokens), "--decode-tokens", str(a.decode_tokens)]
    rows: dict[str, list[dict]] = {"auto": [], "cpu": []}
    for _ in range(a.pairs):
        for name, extra in (("auto", []), ("cpu", ["--backend", "cpu"])):
            r, wall = strata(run + extra)
            rows[name].append({"backend": r["backend"] if isinstance(r["backend"], str) else r["backend"].get("name"),
                               "prefill_tokens_per_s": r["prefill_tokens_per_s"],
                               "decode_tokens_per_s": r["decode_tokens_per_s"], "wall_s": wall})

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in rows[name])

    ratios = [x["decode_tokens_per_s"] / y["decode_tokens_per_s"] for x, y in zip(rows["auto"], rows["cpu"])]
    walls = [x["wall_s"] / y["wall_s"] for x, y in zip(rows["auto"], rows["cpu"])]
    out = {
        "schema": "strata.bench.cpu_selection/1",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "loadavg": list(os.getloadavg())},
        "args": run[1:],
        "selected": sel["selected"], "selected_by": sel.get("selected_by"),
        "measured_us_per_layer": {b["name"]: b.get("measured_us_per_layer") for b in sel["backends"]
                                  if b.get("measured_us_per_layer") is not None},
        "runs": rows,
        "median": {n: {k: med(n, k) for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "wall_s")}
                   for n in rows},
        "decode_tokens_per_s_ratio_auto_over_cpu_median": statistics.median(ratios),
        "wall_ratio_auto_over_cpu_median": statistics.median(walls),
        "how": "pairs of child processes in turn (auto, then --backend cpu); tok/s are strata run's own timings "
               "(synchronised, --check not used); wall_s is a clock around each whole process (start-up, plugin "
               "loading, probing and weight generation included)",
    }
    if a.extra is not None:
        out.update(json.loads(a.extra.read_text()))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"auto picked {sel['selected']}; decode tok/s auto {out['median']['auto']['decode_tokens_per_s']:.1f} vs "
          f"cpu {out['median']['cpu']['decode_tokens_per_s']:.1f} (paired median ratio "
          f"{out['decode_tokens_per_s_ratio_auto_over_cpu_median']:.3f}); whole-process wall ratio "
          f"{out['wall_ratio_auto_over_cpu_median']:.3f}; written to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
