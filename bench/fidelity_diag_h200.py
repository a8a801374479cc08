"""Where a cuda run's measured device peak goes beyond its plan (engineer F's diagnostic for issue 12 item 2).

Runs `strata run --backend cuda --json` in-process (the cli's main, one subprocess per configuration, so every
baseline starts from a fresh context) with read-only hooks:
- cupy's memory hook: every pool malloc after the run's baseline (PlanMemory's construction) with its call site,
  kept while live (stray arrays outside the plan's regions), and every cudaMalloc the pool makes with the driver's
  used-memory delta around it (the driver's rounding of that block);
- memGetInfo deltas of the memory cupy's pool does not hold ("non-pool": cuBLAS workspaces, graphs, modules, driver
  rounding) around the first calls of the layer ops, the LM head, the graph captures, the GEMMs and the start-up;
- every PlanMemory.sample: the driver's used memory, the pool's used and total bytes, the live strays by site.
One JSON (fidelity_diag.json) under --out; a summary table printed last.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import functools
import json
import os
import subprocess
import sys
import time
import traceback

CONFIGS = {
    "tiny_4096": ["--backend", "cuda", "--prompt-tokens", "4096", "--decode-tokens", "8", "--set", "prefill.chunk=4096"],
    "q8_4096": ["--backend", "cuda", "--model", "Qwen3-30B-A3B@Q8_0", "--prompt-tokens", "4096", "--decode-tokens", "8",
                "--set", "prefill.chunk=4096"],
    "q8_16384": ["--backend", "cuda", "--model", "Qwen3-30B-A3B@Q8_0", "--prompt-tokens", "16384", "--decode-tokens", "8",
                 "--set", "prefill.chunk=16384"],
    "f16_1536": ["--backend", "cuda", "--model", "Qwen3-30B-A3B@F16", "--prompt-tokens", "4096", "--decode-tokens", "8",
                 "--set", "prefill.chunk=4096", "--set", "memory.expert_cache=1536"],
}


def _site(skip: int = 2, depth: int = 5) -> str:
    """The innermost strata frames of the current stack, innermost first."""
    frames = [f for f in traceback.extract_stack()[:-skip]
              if ("strata" in f.filename and "fidelity_diag" not in f.filename)]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in reversed(frames[-depth:]))


def child(name: str, argv: list[str], out_path: str) -> int:
    """One run with the hooks; its record to out_path."""
    import cupy
    from cupy.cuda import memory_hook, runtime
    rec: dict = {"name": name, "argv": argv, "allocs": [], "calls": {}, "samples": [], "phase_marks": []}
    state = {"armed": False, "phase": "open", "engine": None}
    pool = cupy.get_default_memory_pool()
    live: dict[int, tuple[int, str, str]] = {}

    def nvml_used() -> int | None:
        try:
            import pynvml
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            return int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
        except Exception:
            return None

    rec["nvml_used_before_context"] = nvml_used()

    def snap() -> dict:
        free, total = runtime.memGetInfo()
        used = int(total) - int(free)
        return {"driver_used": used, "pool_used": int(pool.used_bytes()), "pool_total": int(pool.total_bytes()),
                "nonpool": used - int(pool.total_bytes())}

    def nonpool() -> int:
        free, total = runtime.memGetInfo()
        return int(total) - int(free) - int(pool.total_bytes())

    class Hook(memory_hook.MemoryHook):
        name = "fidelity-diag"

        def alloc_preprocess(self, **kw):
            self._pre = runtime.memGetInfo()[0]

        def alloc_postprocess(self, **kw):
            delta = int(self._pre) - int(runtime.memGetInfo()[0])
            rec["allocs"].append({"phase": state["phase"], "mem_size": int(kw["mem_size"]), "driver_delta": delta,
                                  "site": _site(3) if state["armed"] else ""})

        def malloc_postprocess(self, **kw):
            if state["armed"] and kw.get("mem_ptr"):
                live[int(kw["mem_ptr"])] = (int(kw["mem_size"]), _site(3), state["phase"])

        def free_postprocess(self, **kw):
            live.pop(int(kw["mem_ptr"]), None)

    hook = Hook()
    hook.__enter__()

    def strays() -> dict:
        by = collections.Counter()
        for size, site, phase in live.values():
            by[f"[{phase}] {site}"] += size
        return {"bytes": sum(by.values()), "top": by.most_common(10)}

    def wrap(owner, attr: str, label: str, keep: int = 4) -> None:
        f = getattr(owner, attr, None)
        if f is None:
            return
        c = rec["calls"].setdefault(label, {"calls": 0, "nonpool_total": 0, "pool_total_delta": 0, "first": []})

        @functools.wraps(f)
        def g(*a, **kw):
            s0 = snap()
            try:
                return f(*a, **kw)
            finally:
                s1 = snap()
                c["calls"] += 1
                d_np, d_pt = s1["nonpool"] - s0["nonpool"], s1["pool_total"] - s0["pool_total"]
                c["nonpool_total"] += d_np
                c["pool_total_delta"] += d_pt
                if (d_np or d_pt) and len(c["first"]) < keep:
                    c["first"].append({"call": c["calls"], "phase": state["phase"], "nonpool": d_np,
                                       "pool_total": d_pt, "pool_used": s1["pool_used"] - s0["pool_used"]})
        setattr(owner, attr, g)

    from strata_core.runtime import devmem, engine as eng_mod, executor as ex_mod
    from strata_cuda import backend as be, fast, kernels, layer_ops
    init0, seal0, sample0 = devmem.PlanMemory.__init__, devmem.PlanMemory.seal, devmem.PlanMemory.sample

    def pm_init(self, *a, **kw):
        rec["at_baseline"] = snap()
        init0(self, *a, **kw)
        state["armed"], state["phase"] = True, "start"
        rec["phase_marks"].append(("baseline", snap()))

    def pm_seal(self):
        seal0(self)
        state["phase"] = "sealed"
        rec["at_seal"] = dict(snap(), regions=dict(self.regions), sampled_peak=self._sampled_peak,
                              strays=strays())

    def pm_sample(self):
        sample0(self)
        if len(rec["samples"]) < 40:
            rec["samples"].append(dict(snap(), phase=state["phase"], sampled_peak=self._sampled_peak,
                                       strays=strays()))

    devmem.PlanMemory.__init__, devmem.PlanMemory.seal, devmem.PlanMemory.sample = pm_init, pm_seal, pm_sample
    e_init0 = eng_mod.Engine.__init__

    def e_init(self, *a, **kw):
        e_init0(self, *a, **kw)
        state["engine"] = self

    eng_mod.Engine.__init__ = e_init
    for phase, meth in (("prefill", "prefill"), ("decode", "decode_step")):
        f0 = getattr(ex_mod.Executor, meth)

        def make(f0=f0, phase=phase):
            @functools.wraps(f0)
            def g(*a, **kw):
                state["phase"] = phase
                return f0(*a, **kw)
            return g
        setattr(ex_mod.Executor, meth, make())
    open0 = be.CupyBackendPlugin.open

    def b_open(self, *a, **kw):
        t0 = time.perf_counter()
        s = open0(self, *a, **kw)
        rec["session_open_s"] = time.perf_counter() - t0
        rec["after_open"] = snap()
        rec["nvml_used_after_open"] = nvml_used()
        return s

    be.CupyBackendPlugin.open = b_open
    for owner, attr in ((fast.FastMoE, "_capture"), (fast.FastMoE, "prefill_layer"), (fast.FastMoE, "decode_stack"),
                        (fast.FastMoE, "_gemm_problems"), (fast.FastMoE, "_gemm_tn"), (fast.FastMoE, "grouped_ffn"),
                        (fast.FastMoE, "decode_layer"), (fast.FastMoE, "__init__"), (fast.FastMoE, "use_buffers"),
                        (layer_ops.CudaLayerOps, "prefill_layer"), (layer_ops.CudaLayerOps, "decode_launch"),
                        (layer_ops.CudaLayerOps, "decode_done"), (layer_ops.CudaLayerOps, "decode_step"),
                        (layer_ops.CudaLayerOps, "_decode_layers"), (layer_ops.CudaLayerOps, "_fallback"),
                        (kernels.CupyKernels, "linear"), (kernels.CupyKernels, "rmsnorm"),
                        (kernels.CupyKernels, "moe_grouped_ffn"), (kernels.CupyKernels, "route_topk"),
                        (ex_mod.Executor, "_head"), (ex_mod.Executor, "_embed"), (ex_mod.Executor, "_works"),
                        (ex_mod.Executor, "_decode_works"), (ex_mod.Executor, "__init__"),
                        (eng_mod.Engine, "_warm"), (eng_mod.Engine, "_upload_dense"), (eng_mod.Engine, "_alloc_pool"),
                        (eng_mod.Engine, "_take_regions"), (eng_mod.Engine, "executor_stream")):
        wrap(owner, attr, f"{owner.__name__}.{attr}")

    def finish() -> None:
        e = state["engine"]
        rec["end"] = dict(snap(), strays=strays())
        if e is not None:
            v = e.plan.vram
            rec["plan_vram"] = {k: int(getattr(v, k)) for k in ("dense_bytes", "kv_bytes", "workspace_bytes",
                                                                 "expert_cache_bytes", "owned_prompt_bytes")}
            rec["planned"] = int(e.device_bytes_planned)
            rec["measured"] = list(e.dm.peak_measured())
            rec["regions"] = dict(e.dm.regions)
            rec["used0"] = e.dm._used0
            ops = getattr(e.executor, "ops", None)
            rec["layer_ops_counts"] = getattr(ops, "counts", None)
        if name.startswith("tiny"):
            try:
                rec["cublas_probe"] = cublas_probe(cupy, nonpool)
            except Exception as ex:
                rec["cublas_probe"] = {"error": f"{type(ex).__name__}: {ex}"[:300]}
        with open(out_path, "w") as fh:
            json.dump(rec, fh, indent=1, default=str)

    atexit.register(finish)
    from strata_core.cli import main as cli_main
    sys.argv = ["strata", "run", "--json", *argv]
    rc = cli_main()
    return rc


def cublas_probe(cupy, nonpool) -> dict:
    """Non-pool bytes of cuBLAS: handle creation, first GEMM, a GEMM on a new stream, and with a workspace set."""
    import ctypes

    import numpy as np
    out: dict = {}
    try:
        from cupy_backends.cuda.libs import cublas
        from strata_cuda.fast import _find_cublas
        lib = _find_cublas()
        n = 4096
        a = cupy.ones((n, n), dtype=cupy.float32)
        c = cupy.empty((n, n), dtype=cupy.float32)
        one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:300]}

    def gemm(h, stream) -> int:
        cublas.setStream(h, stream.ptr)
        n0 = nonpool()
        cublas.sgemm(h, 0, 0, n, n, n, one.ctypes.data, a.data.ptr, n, a.data.ptr, n, zero.ctypes.data,
                     c.data.ptr, n)
        stream.synchronize()
        return nonpool() - n0

    try:
        n0 = nonpool()
        h = cublas.create()
        out["create"] = nonpool() - n0
        s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
        out["gemm_first_stream"] = gemm(h, s1)
        out["gemm_same_stream_again"] = gemm(h, s1)
        out["gemm_second_stream"] = gemm(h, s2)
        h2 = cublas.create()
        ws = cupy.empty(32 << 20, dtype=cupy.uint8)
        s3 = cupy.cuda.Stream(non_blocking=True)
        cublas.setStream(h2, s3.ptr)
        st = lib.cublasSetWorkspace_v2(ctypes.c_void_p(h2), ctypes.c_void_p(int(ws.data.ptr)),
                                       ctypes.c_size_t(32 << 20)) if lib is not None else None
        out["set_workspace_status"] = st
        n0 = nonpool()
        cublas.sgemm(h2, 0, 0, n, n, n, one.ctypes.data, a.data.ptr, n, a.data.ptr, n, zero.ctypes.data,
                     c.data.ptr, n)
        s3.synchronize()
        out["gemm_with_workspace_set"] = nonpool() - n0
        out["gemm_with_workspace_then_setstream_new"] = gemm(h2, cupy.cuda.Stream(non_blocking=True))
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def main() -> int:
    """Run every configuration in its own subprocess; write fidelity_diag.json and print a summary."""
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[5:], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--timeout", type=int, default=90)
    args = ap.parse_args()
    res = {"schema": "strata.bench.fidelity_diag/1", "runs": {}}
    for name in args.configs.split(","):
        path = os.path.join(args.out, f"diag_{name}.json")
        t0 = time.perf_counter()
        try:
            p = subprocess.run([sys.executable, __file__, "--child", name, path, "--", *CONFIGS[name]],
                               capture_output=True, text=True, timeout=args.timeout)
            rc, err = p.returncode, p.stderr[-1500:]
        except subprocess.TimeoutExpired:
            rc, err = "timeout", ""
        try:
            with open(path) as fh:
                r = json.load(fh)
            os.remove(path)
        except Exception as e:
            r = {"error": f"no record ({e})"}
        r["exit"], r["stderr_tail"], r["wall_s"] = rc, err, time.perf_counter() - t0
        res["runs"][name] = r
        m = r.get("measured") or [None]
        print(f"{name}: exit {rc} wall {r['wall_s']:.1f}s planned {r.get('planned')} measured {m[0]} "
              f"over {(m[0] or 0) - (r.get('planned') or 0)}", flush=True)
        for k in ("at_baseline", "at_seal", "end"):
            print(f"  {k}: {json.dumps({a: b for a, b in (r.get(k) or {}).items() if a != 'strays'})}")
        st = (r.get("end") or {}).get("strays") or {}
        print(f"  strays live at end: {st.get('bytes')} top {json.dumps(st.get('top', [])[:4])}")
        for lab, c in (r.get("calls") or {}).items():
            if c["nonpool_total"] or c["pool_total_delta"]:
                print(f"  {lab}: calls {c['calls']} nonpool {c['nonpool_total']} pool_total {c['pool_total_delta']} "
                      f"first {json.dumps(c['first'][:2])}")
        post = [a for a in r.get("allocs", []) if a["phase"] != "open"]
        print(f"  cudaMallocs after baseline: {len(post)}, bytes {sum(a['mem_size'] for a in post)}, driver "
              f"{sum(a['driver_delta'] for a in post)}")
        if r.get("cublas_probe"):
            print(f"  cublas probe: {json.dumps(r['cublas_probe'])}")
        if rc:
            print(err[-800:])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fidelity_diag.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
