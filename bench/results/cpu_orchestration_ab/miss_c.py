# Engineer C: where a cpu decode run's misses go. One `strata run --backend cpu --json` (256 prompt tokens, 128 decode;
# no-op FFN unless "real" is given), host timers around ExpertCache.admit_distinct and StoreSource.upload (the two
# copies of a missed expert) and around each decode step; per range of steps: us a layer, misses a step, us a call.
# Run from the repository root: python bench/results/cpu_orchestration_ab/miss_c.py [real]
import contextlib, io, sys, time

import numpy as np

from strata_core.reference import kernels as ref

if "real" not in sys.argv[1:]:
    def moe_grouped_ffn(self, x, offsets, slots, weights, out=None):
        out.fill(0)
        return out
    ref.ReferenceKernels.moe_grouped_ffn = moe_grouped_ffn
from strata_core.runtime import cache, executor as ex, layer_ops

pc, cur, rows = time.perf_counter, {}, []


def timed(cls, name):
    f = getattr(cls, name)

    def g(*a, **k):
        t0 = pc()
        try:
            return f(*a, **k)
        finally:
            cur[name] = cur.get(name, 0.0) + pc() - t0
            cur["n_" + name] = cur.get("n_" + name, 0) + 1
    setattr(cls, name, g)


timed(cache.ExpertCache, "admit_distinct")
timed(layer_ops.StoreSource, "upload")
step = ex.Executor.decode_step


def decode_step(self, t):
    cur.clear()
    m0, t0 = self.cache.misses, pc()
    try:
        return step(self, t)
    finally:
        cur["step"], cur["misses"] = pc() - t0, self.cache.misses - m0
        rows.append(dict(cur))


ex.Executor.decode_step = decode_step
from strata_core.cli import main

with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    main(["run", "--backend", "cpu", "--json", "--prompt-tokens", "256", "--decode-tokens", "128"])
print("real FFN" if "real" in sys.argv[1:] else "no-op FFN")
for a, b in ((0, 16), (16, 32), (32, 64), (64, 128)):
    r = rows[a:b]

    def per_call(name):
        n = sum(x.get("n_" + name, 0) for x in r)
        return sum(x.get(name, 0.0) for x in r) / n * 1e6 if n else float("nan")
    print(f"steps {a:3d}-{b:3d}: step {np.mean([x['step'] for x in r]) / 8 * 1e6:6.1f} us a layer, "
          f"{np.mean([x['misses'] for x in r]):5.2f} misses a step; admit_distinct {per_call('admit_distinct'):5.1f} us "
          f"a call ({np.mean([x.get('n_admit_distinct', 0) for x in r]):4.2f} a step), upload {per_call('upload'):5.1f}"
          f" us a miss")
