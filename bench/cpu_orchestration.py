"""Host orchestration on the numpy path: `strata run --backend cpu --json` with the real expert FFN, then with a no-op.

The no-op replaces `ReferenceKernels.moe_grouped_ffn` (a monkeypatch in the child process, nothing in the product)
with one that only zero-fills its output buffer: what is left of decode's time is the host's orchestration (routing,
grouping, the cache's bookkeeping, copies of missed experts, the other kernels). The figure of merit is
orchestration_fraction = no-op decode time per layer / real decode time per layer (issue 13 asks for <= 0.20).

    python bench/cpu_orchestration.py [--prompt-tokens N] [--decode-tokens N] [--repeats N] [--out PATH]
                                      [--before-label TEXT]

Each variant runs in its own process, `repeats` times, the two interleaved; the fastest run of each is kept (the
machine is shared), and the median over repeats of each adjacent pair's ratio is reported beside it (a load change
between the fastest real run and the fastest no-op run moves the first figure, less the second). With
--before-label the figures already in --out are kept under "before" with that label (earlier "before" entries too);
--baseline-tree measures another checkout's strata_core in the same run, interleaved with this one. The child also
times each of strata run's decode steps: orchestration_fraction_step_median is no-op over real of the median step (each
run's median, the median over repeats), which a slow stretch of a run hardly moves; _step_median_paired is the median
over repeats of each repeat's no-op median step over its real one (the two run back to back).
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
DEFAULT_OUT = HERE / "results" / "cpu_orchestration.json"

CHILD = r"""
import json, sys
tree = sys.argv.pop(1)
if tree != "-":
    # another checkout's strata_core (the --baseline-tree), ahead of this one's editable install
    sys.meta_path[:] = [f for f in sys.meta_path if "strata_core" not in repr(f)]
    sys.path.insert(0, tree)
import numpy as np
import strata_core
assert tree == "-" or strata_core.__file__.startswith(tree), (tree, strata_core.__file__)
from strata_core.reference import kernels as ref
if sys.argv[1] == "noop":
    def moe_grouped_ffn(self, x, offsets, slots, weights, out=None):
        y = out if out is not None else np.empty_like(np.asarray(x, dtype=np.float32))
        y.fill(0)
        return y
    ref.ReferenceKernels.moe_grouped_ffn = moe_grouped_ffn
import io, contextlib, statistics, time
from strata_core.runtime import executor
steps = []
step = executor.Executor.decode_step
def timed_step(self, token):
    # a timer around each of strata run's own decode steps (its embed, layers and LM head)
    t0 = time.perf_counter()
    try:
        return step(self, token)
    finally:
        steps.append(time.perf_counter() - t0)
executor.Executor.decode_step = timed_step
from strata_core.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    rc = main(["run", "--backend", "cpu", "--json"] + sys.argv[2:])
r = json.loads(out.getvalue())
r["decode_step_median_s"] = statistics.median(steps) if steps else None
print(json.dumps(r))
sys.exit(rc)
"""


def run_variant(variant: str, args: list[str], tree: str = "-") -> dict:
    """One `strata run --backend cpu --json` in a child process (of `tree`'s strata_core, "-": this checkout's);
    its strata.run/1 object."""
    p = subprocess.run([sys.executable, "-c", CHILD, tree, variant, *args], capture_output=True, text=True,
                       check=False)
    if p.returncode != 0:
        raise SystemExit(f"{variant} run failed (exit {p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout)


def figures(r: dict) -> dict:
    """The fields of one run this benchmark reports."""
    return {k: r.get(k) for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "prefill_s", "decode_s",
                                  "decode_cpu_s", "decode_step_median_s",
                                  "time_per_layer_us", "cache_hit_rate_prefill", "cache_hit_rate_decode",
                                  "chunk", "decode_tokens", "prompt_tokens")}


def main() -> int:
    """Run both variants, write the JSON, print the fraction."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--before-label", default=None, help="keep the figures already in --out under 'before'")
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="a folder holding another checkout's strata_core (git archive REV strata_core | tar -x): "
                         "measured interleaved with this one, reported under 'baseline_same_run'")
    ap.add_argument("--baseline-label", default=None, help="what the baseline tree is (its commit)")
    a = ap.parse_args()
    args = ["--prompt-tokens", str(a.prompt_tokens), "--decode-tokens", str(a.decode_tokens)]
    load0 = list(os.getloadavg())  # the shared cores' load as the runs begin (machine.loadavg: as they end)
    trees = ["-"] + ([str(a.baseline_tree)] if a.baseline_tree else [])
    best: dict[str, dict[str, dict]] = {t: {} for t in trees}
    pairs: dict[str, list[tuple[float, float]]] = {t: [] for t in trees}  # (no-op / real wall, CPU) a repeat
    step_medians: dict[str, dict[str, list[float]]] = {t: {"real": [], "noop": []} for t in trees}
    for i in range(a.repeats):
        for tree in (trees if i % 2 == 0 else trees[::-1]):
            got = {}
            for variant in ("real", "noop"):
                r = got[variant] = run_variant(variant, args, tree)
                step_medians[tree][variant].append(r["decode_step_median_s"])
                if variant not in best[tree] or r["decode_s"] < best[tree][variant]["decode_s"]:
                    best[tree][variant] = r
            pairs[tree].append((got["noop"]["decode_s"] / got["real"]["decode_s"],
                                got["noop"]["decode_cpu_s"] / got["real"]["decode_cpu_s"]))
    def by_step(tree: str) -> dict:
        """The median decode step of each variant (median over the repeats of each run's median step) and their
        ratio: one slow stretch of a run moves a run's total, hardly its median step."""
        m = {v: statistics.median(step_medians[tree][v]) for v in ("real", "noop")}
        # each repeat's no-op median step over its own real run's (the two run back to back): a load change
        # between repeats moves both of a pair
        paired = [n / r for r, n in zip(step_medians[tree]["real"], step_medians[tree]["noop"])]
        return {"decode_step_median_us_per_layer": {v: 1e6 * s / layers for v, s in m.items()},
                "orchestration_fraction_step_median": m["noop"] / m["real"],
                "orchestration_fraction_step_median_paired": statistics.median(paired),
                "step_median_paired_fractions": paired,
                "step_medians_s": step_medians[tree]}

    layers = int(best[trees[0]]["real"]["model"]["moe_layers"])
    baseline = None
    if a.baseline_tree:
        b, bp = best[str(a.baseline_tree)], pairs[str(a.baseline_tree)]
        breal, bnoop = b["real"]["time_per_layer_us"]["decode"], b["noop"]["time_per_layer_us"]["decode"]
        baseline = {"tree": a.baseline_label or str(a.baseline_tree), "real": figures(b["real"]),
                    "noop_ffn": figures(b["noop"]), "decode_real_us_per_layer": breal,
                    "decode_orchestration_us_per_layer": bnoop, "orchestration_fraction": bnoop / breal,
                    "orchestration_fraction_cpu_time": b["noop"]["decode_cpu_s"] / b["real"]["decode_cpu_s"],
                    "orchestration_fraction_paired_median": statistics.median(p[0] for p in bp),
                    "orchestration_fraction_cpu_time_paired_median": statistics.median(p[1] for p in bp),
                    "paired_fractions": [list(p) for p in bp], **by_step(str(a.baseline_tree))}
    best, pairs = best["-"], pairs["-"]
    real_us = best["real"]["time_per_layer_us"]["decode"]
    noop_us = best["noop"]["time_per_layer_us"]["decode"]
    out = {
        "schema": "strata.bench.cpu_orchestration/1",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "loadavg": list(os.getloadavg()), "loadavg_at_start": load0},
        "model": best["real"]["model"]["name"],
        "args": args,
        "repeats": a.repeats,
        "real": figures(best["real"]),
        "noop_ffn": figures(best["noop"]),
        "decode_orchestration_us_per_layer": noop_us,
        "decode_real_us_per_layer": real_us,
        "orchestration_fraction": noop_us / real_us if real_us else None,
        "orchestration_fraction_cpu_time": (best["noop"]["decode_cpu_s"] / best["real"]["decode_cpu_s"]
                                            if best["real"].get("decode_cpu_s") else None),
        "orchestration_fraction_paired_median": statistics.median(p[0] for p in pairs),
        "orchestration_fraction_cpu_time_paired_median": statistics.median(p[1] for p in pairs),
        "paired_fractions": [list(p) for p in pairs],
        **by_step("-"),
        "target_fraction": 0.20,
        "how": "noop_ffn replaces ReferenceKernels.moe_grouped_ffn by a zero-fill in the child process; "
               "time_per_layer_us.decode is strata run's own decode_s / (decode steps x MoE layers); the fastest of "
               "`repeats` runs of each variant is kept; the _cpu_time fraction uses strata run's decode_cpu_s (process CPU "
               "seconds), steadier than wall time when other work shares the cores; _step_median: a timer around "
               "each of strata run's decode steps in the child (Executor.decode_step: embed, layers, LM head), the "
               "median step of each run, the median of those over the repeats, no-op over real; "
               "_step_median_paired: the median over repeats of each repeat's no-op median step over its real one",
    }
    out["target_met"] = out["orchestration_fraction"] <= out["target_fraction"]
    if baseline is not None:
        out["baseline_same_run"] = baseline
    if a.before_label and a.out.exists():
        old = json.loads(a.out.read_text())
        earlier = old.pop("before", [])
        earlier = earlier if isinstance(earlier, list) else [earlier]
        keep = {k: old.get(k) for k in ("measured_at", "machine", "repeats", "decode_real_us_per_layer",
                                        "decode_orchestration_us_per_layer", "orchestration_fraction",
                                        "orchestration_fraction_cpu_time", "orchestration_fraction_paired_median",
                                        "decode_step_median_us_per_layer", "orchestration_fraction_step_median",
                                        "orchestration_fraction_step_median_paired") if k in old}
        out["before"] = [{"tree": a.before_label, **keep}] + earlier
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    sm = out["decode_step_median_us_per_layer"]
    print(f"median decode step per layer: real {sm['real']:.0f} us, no-op FFN {sm['noop']:.0f} us -> "
          f"{out['orchestration_fraction_step_median']:.1%} (paired by repeat "
          f"{out['orchestration_fraction_step_median_paired']:.1%})" + (
              f" (baseline tree {baseline['orchestration_fraction_step_median']:.1%})" if baseline else ""))
    print(f"decode per layer: real {real_us:.0f} us, no-op FFN {noop_us:.0f} us -> orchestration "
          f"{out['orchestration_fraction']:.1%} of decode wall time, "
          f"{out['orchestration_fraction_cpu_time']:.1%} of its CPU time (target <= 20%); paired medians "
          f"{out['orchestration_fraction_paired_median']:.1%} wall, {out['orchestration_fraction_cpu_time_paired_median']:.1%}"
          f" CPU; written to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
