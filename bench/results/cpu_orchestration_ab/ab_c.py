# Engineer C, 2026-12-01: in-process A/B of cpu decode steps, the previous host path against this tree's, interleaved
# step by step in one process (the shared cores' load moves both alike).
#   before: fe188bc's Executor.decode_step (a new Arena a step, the embedding row by an index array) and the layer
#           op's primitive path (HostKernels.row_step hidden: rmsnorm, linear, route_topk, gather, FFN, scatter_add)
#   after:  this tree (the step arena keeping its views, the one-row kernels route_row / experts_row)
# Run from the repository root: python bench/results/cpu_orchestration_ab/ab_c.py BASE_EXECUTOR_PY [noop|real]
# (BASE_EXECUTOR_PY: fe188bc's strata_core/runtime/executor.py, e.g. from `git show fe188bc:strata_core/runtime/...`).
# A short cpu run (256 prompt tokens, 128 decode), then its decode tokens replayed in a cycle, 3 rounds of 3000 steps;
# each variant's median and fastest step over 8 layers, in us a layer. The cache sees the run's tokens again, so
# nearly every lookup hits: this measures the hit path and the step's own work, not the misses' copies.
import contextlib, gc, importlib.util, io, statistics, sys, time

import numpy as np

from strata_core.reference import kernels as ref

base_executor, variant = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "noop")
if variant == "noop":
    def moe_grouped_ffn(self, x, offsets, slots, weights, out=None):
        out.fill(0)
        return out
    ref.ReferenceKernels.moe_grouped_ffn = moe_grouped_ffn

from strata_core.builtin import cpu
from strata_core.runtime import executor as ex

spec = importlib.util.spec_from_file_location("base_executor", base_executor)
base = importlib.util.module_from_spec(spec)
sys.modules["base_executor"] = base
spec.loader.exec_module(base)

new_step, old_step, row_step = ex.Executor.decode_step, base.Executor.decode_step, cpu.HostKernels.row_step
cap, tokens = {}, []


def capture(self, t):
    cap["ex"] = self
    tokens.append(t)
    return new_step(self, t)


ex.Executor.decode_step = capture
from strata_core.cli import main

with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    main(["run", "--backend", "cpu", "--json", "--prompt-tokens", "256", "--decode-tokens", "128"])
E = cap["ex"]


def before(on):
    cpu.HostKernels.row_step = None if on else row_step


variants = {"before": (old_step, before), "after": (new_step, lambda on: None)}
for rnd in range(3):
    T = {v: [] for v in variants}
    gc.disable()
    for i in range(3000):
        v = "before" if i % 2 == 0 else "after"
        step, switch = variants[v]
        switch(True)
        t0 = time.perf_counter()
        step(E, tokens[i % len(tokens)])
        T[v].append(time.perf_counter() - t0)
        switch(False)
    gc.enable()
    med = {v: statistics.median(t) / 8 * 1e6 for v, t in T.items()}
    print(f"{variant} round {rnd}: before median {med['before']:6.1f} fastest {min(T['before']) / 8 * 1e6:5.1f}  "
          f"after median {med['after']:6.1f} fastest {min(T['after']) / 8 * 1e6:5.1f} us a layer  "
          f"after/before {med['after'] / med['before']:.3f}", flush=True)
