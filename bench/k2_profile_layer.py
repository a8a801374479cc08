"""Host time of one Qwen3-30B-A3B prefill layer through FastMoE (every expert cached, the sweep's skewed and uniform
routing), per GEMM variant: CUDA events around the call (median of --reps), the host's own time in the call, and a
cProfile of --profile-calls calls (top functions by own time). Weights are random on the device (no check: the
layer bench, bench/layer_h200.py, checks the outputs). Writes k2_profile_layer.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np

E, K, H, F, T = 128, 8, 2048, 768, 4096


def main() -> int:
    """Time and profile the variants; write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--profile-calls", type=int, default=20)
    ap.add_argument("--variants", default="classes:4:0,classes:4:128,classes:1:128")
    args = ap.parse_args()
    import cupy as cp
    from strata_cuda.fast import FastMoE
    from strata_core.reference.kernels import ExpertPool
    rng = np.random.default_rng(7)
    g = cp.random.default_rng(1)
    pool = ExpertPool("f16", {"w_gate_up": (g.standard_normal((E, 2 * F, H), dtype=cp.float32) / 45).astype(cp.float16),
                              "w_down": (g.standard_normal((E, H, F), dtype=cp.float32) / 28).astype(cp.float16)})
    x = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
    lg_u = rng.standard_normal((T, E)).astype(np.float32)
    lg_s = lg_u + (-np.log1p(rng.permutation(E))).astype(np.float32)
    out = cp.empty((T, H), cp.float32)
    warm = np.arange(E)
    res: dict = {"schema": "strata.bench.k2_profile_layer/1", "variants": {}}
    for v in args.variants.split(","):
        mode, streams, split = (v.split(":") + ["", ""])[:3]
        moe = FastMoE(E, K, H, F, gemm_mode=mode, gemm_streams=int(streams))
        if split:
            moe.split_rows = int(split)
        r = res["variants"][v] = {}
        for name, lg in (("uniform", lg_u), ("skewed", lg_s)):
            lg_d = cp.asarray(lg)
            for _ in range(3):
                moe.prefill_layer(x, lg_d, pool, warm, out=out)
            cp.cuda.Device().synchronize()
            dev, host = [], []
            for _ in range(args.reps):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record(moe.compute_stream)
                t0 = time.perf_counter()
                moe.prefill_layer(x, lg_d, pool, warm, out=out)
                host.append(time.perf_counter() - t0)
                b.record(moe.compute_stream)
                b.synchronize()
                dev.append(cp.cuda.get_elapsed_time(a, b))
            prof = cProfile.Profile()
            for _ in range(args.profile_calls):
                prof.enable()
                moe.prefill_layer(x, lg_d, pool, warm, out=out)
                prof.disable()
                moe.compute_stream.synchronize()
            moe.trace = []
            moe.prefill_layer(x, lg_d, pool, warm, out=out)
            trace = moe.trace_report()
            moe.trace = None
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
            r[name] = {"device_ms": float(np.median(dev)), "device_min_ms": float(np.min(dev)),
                       "host_ms": 1e3 * float(np.median(host)), "gemm_problems": moe.stats.gemm_problems,
                       "trace_ms": trace, "profile_tottime": s.getvalue()[-6000:]}
            print(f"{v:22s} {name:8s} device {r[name]['device_ms']:.3f} ms (min {r[name]['device_min_ms']:.3f})  "
                  f"host {r[name]['host_ms']:.3f} ms  problems {moe.stats.gemm_problems}  trace "
                  + " ".join(f"{n}={t:.3f}" for n, t in trace[1:]), flush=True)
        del moe
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "k2_profile_layer.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
