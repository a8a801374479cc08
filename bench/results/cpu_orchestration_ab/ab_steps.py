# in-process A/B per decode step, symmetric: both sets loaded from tree copies and called through the same wrappers
import sys, io, json, contextlib, time, importlib.util, functools, statistics
import numpy as np
from strata_core.reference import kernels as ref
variant, treeA, treeB = sys.argv[1], sys.argv[2], sys.argv[3]
if variant == "noop":
    def moe_grouped_ffn(self, x, offsets, slots, weights, out=None):
        out.fill(0); return out
    ref.ReferenceKernels.moe_grouped_ffn = moe_grouped_ffn
def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec); sys.modules[name] = m; spec.loader.exec_module(m); return m
from strata_core.builtin import cpu
from strata_core.runtime import cache, layer_ops, executor as ex
KN = ["route_topk", "scatter_add", "rmsnorm", "gather", "linear"]
def build(tree, tag):
    c = load(tree + "/strata_core/builtin/cpu.py", tag + "_cpu")
    ca = load(tree + "/strata_core/runtime/cache.py", tag + "_cache")
    lo = load(tree + "/strata_core/runtime/layer_ops.py", tag + "_lo")
    obj = c.HostKernels()
    def via(f):
        @functools.wraps(f)
        def g(self, *a, **k): return f(obj, *a, **k)
        return g
    return [(cpu.HostKernels, n, via(getattr(c.HostKernels, n))) for n in KN] + \
           [(cache.ExpertCache, n, getattr(ca.ExpertCache, n)) for n in ("lookup_distinct", "admit_distinct", "tick")] + \
           [(layer_ops.ComposedLayerOps, "_decode_host", lo.ComposedLayerOps._decode_host)]
sets = {"A": build(treeA, "A"), "B": build(treeB, "B")}
T = {"A": [], "B": []}
o = ex.Executor.decode_step
n = [0]
def ds(self, t):
    n[0] += 1
    tag = "A" if n[0] % 2 else "B"
    for cls, name, f in sets[tag]: setattr(cls, name, f)
    t0 = time.perf_counter()
    try: return o(self, t)
    finally: T[tag].append(time.perf_counter() - t0)
ex.Executor.decode_step = ds
from strata_core.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
    main(["run", "--backend", "cpu", "--json", "--prompt-tokens", "256", "--decode-tokens", sys.argv[4] if len(sys.argv) > 4 else "1024"])
d = json.loads(out.getvalue())
mA, mB = statistics.median(T["A"]) / 8 * 1e6, statistics.median(T["B"]) / 8 * 1e6
print(f"A {mA:6.1f}  B {mB:6.1f} us/layer  B/A {mB / mA:.3f}  sha {d['outputs_sha256'] if d.get('outputs_sha256') else d['tokens'][:4]}")
