# one process per tree: a short cpu run, then 1,500 decode steps of the same token on its engine (gc off); the median
# step time / 8 layers, the FFN a zero-fill (as the bench's noop variant); trees alternate between processes
import sys, io, contextlib, time, statistics, gc
tree = sys.argv[1]
sys.meta_path[:] = [f for f in sys.meta_path if "strata_core" not in repr(f)]
sys.path.insert(0, tree)
import strata_core
assert strata_core.__file__.startswith(tree), strata_core.__file__
from strata_core.reference import kernels as ref
def moe_grouped_ffn(self, x, offsets, slots, weights, out=None):
    out.fill(0); return out
ref.ReferenceKernels.moe_grouped_ffn = moe_grouped_ffn
from strata_core.runtime import executor as ex
cap = {}
o = ex.Executor.decode_step
def ds(self, t):
    cap["ex"], cap["t"] = self, t
    return o(self, t)
ex.Executor.decode_step = ds
from strata_core.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    main(["run", "--backend", "cpu", "--json", "--prompt-tokens", "256", "--decode-tokens", "16"])
gc.disable()
ts = []
for i in range(1500):
    t0 = time.perf_counter(); o(cap["ex"], cap["t"]); ts.append(time.perf_counter() - t0)
print(f"{tree}: median {statistics.median(ts[100:]) / 8 * 1e6:.1f} us/layer, fastest {min(ts) / 8 * 1e6:.1f}")
