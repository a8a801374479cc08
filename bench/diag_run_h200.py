"""Where `strata run --backend cuda` spends its time at Qwen3-30B-A3B shape: the run command in-process, its request
served twice by one engine (the first pays every first-use cost, the second runs warm), under cProfile, with every
phase of the executor and the cuda layer ops timed between device synchronisations (per phase: calls, total, median,
the first and the last few calls).

Prints (and writes to diag_run_h200.json under --out): which paths ran (`CudaLayerOps.counts`), the run's own
strata.run/1 figures, the top 30 functions of the requests by own time, and per phase its calls, total seconds and seconds
per call. The synchronisations serialise host and device, so the phase seconds add up to the wall time of the
request; the run's own prefill/decode rates here are those of a synchronised run (bench/strata_run_h200.py measures
the real ones).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path


def main() -> int:
    """One in-process `strata run` with timers and a profile."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--model", default="Qwen3-30B-A3B@F16")
    ap.add_argument("--cache", type=int, default=0, help="memory.expert_cache (0: every expert)")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--no-sync", action="store_true", help="time phases without device synchronisation")
    args = ap.parse_args()

    import cupy
    from strata_core.runtime import executor as ex_mod
    from strata_core.runtime import engine as eng_mod
    from strata_core.runtime import cache as cache_mod
    from strata_core.runtime import devmem as devmem_mod
    from strata_core.runtime import loan as loan_mod
    from strata_cuda import layer_ops as lo_mod
    from strata_cuda import fast as fast_mod

    ops_seen: list = []
    init0 = lo_mod.CudaLayerOps.__init__

    def init(self, *a, **kw):
        init0(self, *a, **kw)
        ops_seen.append(self)

    lo_mod.CudaLayerOps.__init__ = init
    phases: dict[str, list] = {}
    sync = (lambda: None) if args.no_sync else (lambda: cupy.cuda.Device().synchronize())

    def timed(cls, name, label):
        f = getattr(cls, name)

        def wrapper(*a, **kw):
            sync()
            t0 = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                sync()
                dt = time.perf_counter() - t0
                p = phases.setdefault(label, [0, 0.0, []])
                p[0] += 1
                p[1] += dt
                p[2].append(dt)
        setattr(cls, name, wrapper)

    for cls, name in ((ex_mod.Executor, "_embed"), (ex_mod.Executor, "_head"), (ex_mod.Executor, "_works"),
                      (ex_mod.Executor, "_arena"), (ex_mod.Executor, "prefill"), (ex_mod.Executor, "decode_step"),
                      (lo_mod.CudaLayerOps, "prefill_layer"), (lo_mod.CudaLayerOps, "decode_step"),
                      (lo_mod.CudaLayerOps, "_decode_layers"), (lo_mod.CudaLayerOps, "_fallback"),
                      (fast_mod.FastMoE, "prefill_layer"), (fast_mod.FastMoE, "decode_stack"),
                      (fast_mod.FastMoE, "__init__"), (cache_mod.ExpertCache, "tick"),
                      (cache_mod.ExpertCache, "lookup"), (devmem_mod.PlanMemory, "sample"),
                      (loan_mod.PromptLoan, "lend"), (eng_mod.Engine, "_warm"), (eng_mod.Engine, "serve"),
                      (eng_mod.Engine, "__init__")):
        timed(cls, name, f"{cls.__name__}.{name}")

    requests: list = []
    prof = cProfile.Profile()  # the two requests only (not generation or start-up)
    serve0 = eng_mod.Engine.serve

    def serve_twice(self, prompt, decode_tokens=0):
        # the same request twice in one engine: the first pays every first-use cost, the second runs warm
        for _ in range(2):
            prof.enable()
            try:
                r = serve0(self, prompt, decode_tokens)
            finally:
                prof.disable()
            requests.append({"prefill_s": r.prefill_s, "decode_s": r.decode_s, "decode_steps": r.decode_steps,
                             "prefill_hits": r.prefill_hits, "prefill_lookups": r.prefill_lookups,
                             "decode_hits": r.decode_hits, "decode_lookups": r.decode_lookups})
        return r

    eng_mod.Engine.serve = serve_twice
    from strata_core.cli import main as cli_main
    total = 48 * 128
    cache = args.cache or total + 512
    sys.argv = ["strata", "run", "--backend", "cuda", "--model", args.model, "--prompt-tokens", str(args.prompt),
                "--decode-tokens", str(args.decode), "--json", "--set", f"prefill.chunk={args.prompt}",
                "--set", f"memory.expert_cache={cache}"]
    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        rc = cli_main()
    wall = time.perf_counter() - t0
    try:
        run = json.loads(buf.getvalue())
    except json.JSONDecodeError:
        run = {"stdout_tail": buf.getvalue()[-3000:]}
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    keep = ("prefill_tokens_per_s", "decode_tokens_per_s", "cache_hit_rate_prefill", "cache_hit_rate_decode",
            "time_per_layer_us", "prefill_s", "decode_s", "loans", "fallbacks", "bytes_streamed", "plan",
            "device_bytes_planned", "device_bytes_peak_measured", "layer_ops")
    res = {"argv": sys.argv, "rc": rc, "wall_s": wall, "synchronised": not args.no_sync,
           "counts": [o.counts for o in ops_seen], "run": {k: run.get(k) for k in keep if k in run},
           "requests": requests,
           "phases": {k: {"calls": v[0], "total_s": v[1], "per_call_us": 1e6 * v[1] / max(1, v[0]),
                          "first_us": [round(1e6 * x) for x in v[2][:6]],
                          "median_us": 1e6 * sorted(v[2])[len(v[2]) // 2],
                          "last_us": [round(1e6 * x) for x in v[2][-4:]]}
                      for k, v in sorted(phases.items(), key=lambda kv: -kv[1][1])},
           "profile_top30_tottime": s.getvalue()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = "diag_run_h200_nosync.json" if args.no_sync else "diag_run_h200.json"
    (Path(args.out) / name).write_text(json.dumps(res, indent=1, default=str))
    print("counts:", res["counts"])
    print("run:", json.dumps(res["run"], default=str)[:1500])
    print("requests:", json.dumps(requests))
    for k, v in res["phases"].items():
        print(f"  {k:30s} {v['calls']:5d} calls {v['total_s']:8.4f} s {v['per_call_us']:9.1f} us/call median "
              f"{v['median_us']:9.1f} first {v['first_us']} last {v['last_us']}")
    print("\n".join(res["profile_top30_tottime"].splitlines()[:45]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
