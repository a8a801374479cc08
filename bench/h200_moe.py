"""One Qwen3-30B-A3B MoE layer on an NVIDIA GPU: our fast paths (cupy, strata_cuda.fast) against PyTorch peers.

Shape: 128 experts, top-8, hidden 2048, expert FFN 768 (9.44 MB of f16 per expert, 1.21 GB per layer), a
4096-token prefill chunk and 1-token decode. Every figure is timed with CUDA events after warm-up, the median of
--reps runs, on random data; every output is checked against a float64 numpy reference on a subset of tokens.
Writes h200_moe.json (card, driver, versions, commit, every figure, pass/fail per target) and the cache-size sweep
PNG into --out. Reproduce: see bench/README.md (put the tree's folders before any --target site folder on
PYTHONPATH: a copy of strata_core or strata_cuda installed there by another run would shadow the tree's).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

E, K, H, F = 128, 8, 2048, 768
#: Qwen3-30B-A3B has 48 MoE layers: the sweep's model-equivalent tok/s divide one layer's rate by this.
MODEL_LAYERS = 48
#: Ring slots lent for streaming (the same pool as the cache), up to 8 experts per copy group (4 groups in flight).
RING_SLOTS = 32
GROUP_EXPERTS = 8
#: Tolerance of ||out - ref|| / ||ref|| against float64: f16 weights, activations and intermediates, f32 sums.
TOL = 1e-2


def log(msg: str) -> None:
    """Print one progress line at once (the device reply keeps the tail)."""
    print(msg, flush=True)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref|| in float64; inf if anything is not finite."""
    out = np.asarray(out, dtype=np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def silu64(v: np.ndarray) -> np.ndarray:
    """SiLU in float64."""
    return v / (1.0 + np.exp(-v))


def reference_layer(x: np.ndarray, logits: np.ndarray, w13_of, w2_of) -> np.ndarray:
    """float64 reference of one MoE layer for a few tokens; w13_of(e)/w2_of(e) give an expert's matrices."""
    from strata_core.reference.kernels import route_topk
    ids, w = route_topk(logits.astype(np.float32), K)
    x = x.astype(np.float64)
    y = np.zeros((x.shape[0], H))
    for e in np.unique(ids):
        rows, ks = np.nonzero(ids == e)
        w13 = w13_of(int(e)).astype(np.float64)
        w2 = w2_of(int(e)).astype(np.float64)
        gu = x[rows] @ w13.T
        y_e = (silu64(gu[:, :F]) * gu[:, F:]) @ w2.T
        np.add.at(y, rows, w[rows, ks, None].astype(np.float64) * y_e)
    return y


class Guard:
    """Run a section; a failure is recorded in res["errors"] with its traceback and the next section goes on."""

    def __init__(self, res: dict, name: str):
        self.res, self.name = res, name

    def __enter__(self):
        log(f"-- {self.name}")
        return self

    def __exit__(self, typ, exc, tb):
        if exc is None:
            return False
        import traceback
        text = "".join(traceback.format_exception(typ, exc, tb))
        self.res.setdefault("errors", {})[self.name] = text
        log(f"SECTION {self.name} FAILED:\n{text}")
        return True


class Timer:
    """CUDA-event timing of a callable on one stream: warm-up, then the median of reps runs (ms)."""

    def __init__(self, reps: int, warmup: int):
        self.reps, self.warmup = reps, warmup

    def cupy(self, fn, stream) -> dict:
        """Time fn() between two cupy events recorded on `stream`."""
        import cupy
        for _ in range(self.warmup):
            fn()
        cupy.cuda.Device().synchronize()
        ts = []
        for _ in range(self.reps):
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(stream)
            fn()
            b.record(stream)
            b.synchronize()
            ts.append(cupy.cuda.get_elapsed_time(a, b))
        cupy.cuda.Device().synchronize()
        return summary(ts)

    def torch(self, fn) -> dict:
        """Time fn() between two torch events on the current stream."""
        import torch
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(self.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        torch.cuda.synchronize()
        return summary(ts)


def summary(ts_ms: list[float]) -> dict:
    """Median, min, max and every sample of a list of times in ms."""
    return {"median_ms": statistics.median(ts_ms), "min_ms": min(ts_ms), "max_ms": max(ts_ms), "runs": len(ts_ms),
            "samples_ms": [round(t, 5) for t in ts_ms]}


def environment(commit: str) -> dict:
    """Card, driver, versions and commit of this run."""
    import cupy
    import torch
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # the figure is informative; its absence must not stop the benchmark
        smi = f"nvidia-smi failed: {e}"
    props = torch.cuda.get_device_properties(0)
    return {"card": torch.cuda.get_device_name(0), "nvidia_smi": smi, "sm_count": props.multi_processor_count,
            "vram_bytes": props.total_memory, "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "cuda_driver": cupy.cuda.runtime.driverGetVersion(), "torch": torch.__version__, "cupy": cupy.__version__,
            "numpy": np.__version__, "python": platform.python_version(), "commit": commit,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def plan_fidelity(models: tuple[str, ...]) -> dict:
    """Plan each model for this very device, start the runtime's Engine on that plan, and compare the device memory
    it really took (cupy pool bytes, memGetInfo) with the plan's figures.

    The Engine runs in accounting mode (no weights, no page-locked arena: allocator None), so its start-up allocates
    what `strata run` allocates before the first request, the expert cache pool of plan.expert_cache.slots slots,
    through strata_cuda's DeviceMemory; dense weights and KV need real weights and are not allocated here.
    """
    import gc

    import cupy
    import strata_cuda.backend as cuda_backend
    from strata_core.models.resolve import model_from_name
    from strata_core.planner import plan_for_machine
    from strata_core.registry import load_from_settings
    from strata_core.runtime.engine import Engine
    from strata_core.runtime.runlog import RunLog
    from strata_core.config.settings import StrataSettings

    settings = StrataSettings()
    host_plugins = load_from_settings(settings, extra=[cuda_backend])
    target = host_plugins.resolve_target(settings.model_copy(update={"backend": settings.backend.model_copy(
        update={"name": "cuda", "device": 0})}))
    device = target.device.info
    pool = cupy.get_default_memory_pool()
    rows = []
    for name in models:
        spec = model_from_name(name)
        plan = plan_for_machine(host_plugins, target, spec, settings)
        session = target.device.open(plan)
        dm, kernels, budget = session.memory, session.kernels, session.budget
        cupy.cuda.Device().synchronize()
        free0, _ = cupy.cuda.runtime.memGetInfo()
        used0, held0 = pool.used_bytes(), pool.total_bytes()
        lines: list[str] = []
        engine = Engine(plan, dm=dm, allocator=None, kernels=kernels, budget=budget, weights=None,
                        log=RunLog(echo=lines.append), accounting_only=True)
        cupy.cuda.Device().synchronize()
        free1, _ = cupy.cuda.runtime.memGetInfo()
        used1, held1 = pool.used_bytes(), pool.total_bytes()
        planned = plan.vram.expert_cache_bytes
        measured = {"cupy_pool_used_bytes": used1 - used0, "cupy_pool_held_bytes": held1 - held0,
                    "mem_get_info_bytes": free0 - free1}
        row = {"model": name, "quant": spec.quant, "slots": plan.expert_cache.slots,
               "slot_bytes": plan.expert_cache.slot_bytes, "engine_pool_slots": engine._pool_slots,
               "planned_cache_bytes": planned, "engine_counted_bytes": engine.device_bytes_allocated,
               "plan_vram": plan.to_json()["vram"], "measured": measured, "engine_log": lines[:20]}
        row["ratios"] = {k: v / planned for k, v in measured.items()}
        row["within_2pct_and_not_above"] = all(0.98 * planned <= v <= planned for v in measured.values())
        rows.append(row)
        log(f"plan fidelity {name}: planned cache {planned / 2**30:.3f} GiB, measured "
            f"{ {k: round(v / 2**30, 3) for k, v in measured.items()} } GiB -> {row['within_2pct_and_not_above']}")
        del engine
        session.close()
        gc.collect()
        pool.free_all_blocks()
    return {"method": plan_fidelity.__doc__.split("\n\n")[1].strip(), "device": device.to_json(), "runs": rows}


def strata_run_fidelity(argv: list[str]) -> dict:
    """Run `strata run` in this process (the CLI's own main) and read the device memory around the Engine's start-up
    (cupy pool bytes, memGetInfo) and after the run, against the plan that run printed."""
    import contextlib
    import io

    import cupy
    import strata_core.runtime.engine as engine_mod
    from strata_core import cli

    pool = cupy.get_default_memory_pool()
    seen: dict = {}
    original = engine_mod.Engine.open

    def measure() -> dict:
        cupy.cuda.Device().synchronize()
        free, _ = cupy.cuda.runtime.memGetInfo()
        return {"free": free, "used": pool.used_bytes(), "held": pool.total_bytes()}

    def wrapped(*a, **kw):  # the Engine's start-up allocates the plan: measure right around it
        seen["before"] = measure()
        engine = original(*a, **kw)
        seen["after_start"] = measure()
        return engine

    engine_mod.Engine.open = wrapped
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            rc = cli.main(argv)
    finally:
        engine_mod.Engine.open = original
    seen["after_run"] = measure()
    report = json.loads(out.getvalue()) if out.getvalue().strip() else {}
    plan = report.get("plan", {})
    vram = plan.get("vram", {})
    b, a, e = seen.get("before"), seen.get("after_start"), seen["after_run"]
    start_planned = vram.get("expert_cache_bytes", 0) + vram.get("dense_bytes", 0)
    run_planned = start_planned + vram.get("kv_bytes", 0) + vram.get("workspace_bytes", 0) + \
        vram.get("owned_prompt_bytes", 0)
    res = {"argv": argv, "rc": rc, "check": report.get("check"), "plan_vram": vram,
           "plan_expert_cache": plan.get("expert_cache"),
           "device_bytes_allocated": report.get("device_bytes_allocated"),
           "device_bytes_planned": report.get("device_bytes_planned"),
           "prefill_tokens_per_s": report.get("prefill_tokens_per_s"),
           "decode_tokens_per_s": report.get("decode_tokens_per_s"), "cache_hit_rate": report.get("cache_hit_rate")}
    if b and a:
        start = {"cupy_pool_used_bytes": a["used"] - b["used"], "cupy_pool_held_bytes": a["held"] - b["held"],
                 "mem_get_info_bytes": b["free"] - a["free"]}
        res["start_measured"] = start
        res["start_planned_bytes"] = start_planned
        res["start_ratios"] = {k: v / start_planned for k, v in start.items()} if start_planned else {}
        res["run_peak_held_bytes"] = e["held"] - b["held"]  # the pool keeps freed blocks: its size is the peak
        res["run_planned_bytes"] = run_planned
        res["run_peak_ratio"] = res["run_peak_held_bytes"] / run_planned if run_planned else None
    log(f"strata run fidelity: rc {rc}, check {res['check']}, start {res.get('start_measured')} vs planned "
        f"{res.get('start_planned_bytes')}, peak {res.get('run_peak_held_bytes')} vs {res.get('run_planned_bytes')}")
    return res


def main() -> int:
    """Run every measurement, print the table, write the JSON and the PNG."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results", help="folder for h200_moe.json and h200_moe_sweep.png")
    ap.add_argument("--tokens", type=int, default=4096, help="prefill chunk (tokens)")
    ap.add_argument("--reps", type=int, default=15, help="timed runs per figure (median reported; >= 10)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--check-tokens", type=int, default=32, help="tokens checked against the float64 reference")
    ap.add_argument("--commit", default="unknown", help="git commit of the tree that runs")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: fidelity,peers,q8,sweep,decode")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    import cupy
    import torch
    import torch.nn.functional as tfn
    from strata_core.reference.kernels import ExpertPool
    from strata_cuda.fast import FastMoE

    T = args.tokens
    tm = Timer(args.reps, args.warmup)
    res: dict = {"schema": "strata.bench.h200_moe/1", "env": environment(args.commit),
                 "shape": {"experts": E, "top_k": K, "hidden": H, "ffn": F, "chunk_tokens": T,
                           "ring_slots": RING_SLOTS, "group_experts": GROUP_EXPERTS},
                 "method": "CUDA events around each call after warm-up; median of runs; random normal data; outputs "
                           "checked vs float64 numpy on a token subset", "checks": {}, "ours": {}, "peers": {},
                 "floors": {}, "targets": {}}
    log(f"env: {res['env']}")
    if "fidelity" not in skip:
        with Guard(res, "plan_fidelity"):
            res["plan_fidelity"] = plan_fidelity(("Qwen3-30B-A3B", "Qwen3-30B-A3B@Q8_0"))
    dev = torch.device("cuda")
    torch.manual_seed(7)
    rng = np.random.default_rng(7)

    # ---- weights: expert order for the peers, a permuted cache pool (plus ring slots) for ours -----------------
    w13 = (torch.randn(E, 2 * F, H, device=dev) * (1.0 / math.sqrt(H))).half()
    w2 = (torch.randn(E, H, F, device=dev) * (1.0 / math.sqrt(F))).half()
    expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
    layer_bytes_f16 = E * expert_bytes
    perm = torch.randperm(E).tolist()
    slot_of = np.asarray(perm, dtype=np.int64)  # expert e lives in cache slot perm[e]
    pool13 = torch.empty(E + RING_SLOTS, 2 * F, H, dtype=torch.float16, device=dev)
    pool2 = torch.empty(E + RING_SLOTS, H, F, dtype=torch.float16, device=dev)
    pool13[torch.tensor(perm, device=dev)] = w13
    pool2[torch.tensor(perm, device=dev)] = w2
    pool = ExpertPool("f16", {"w_gate_up": cupy.asarray(pool13), "w_down": cupy.asarray(pool2)})
    host13 = torch.empty(E, 2 * F, H, dtype=torch.float16, pin_memory=True)
    host2 = torch.empty(E, H, F, dtype=torch.float16, pin_memory=True)
    host13.copy_(w13)
    host2.copy_(w2)
    host_pool = ExpertPool("f16", {"w_gate_up": host13.numpy(), "w_down": host2.numpy()})
    h13_np, h2_np = host13.numpy(), host2.numpy()

    # Q8_0 (ggml's blocks of 32): quantized on the GPU, kept page-locked on the host
    def q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
        d = b.abs().amax(-1) / 127.0
        q = torch.round(b / torch.where(d > 0, d, torch.ones_like(d))[..., None]).clamp(-127, 127).to(torch.int8)
        return q.reshape(w.shape), d.half()

    q13, d13 = q8(w13)
    q2, d2 = q8(w2)
    hq = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for n, t in
          (("gate_up_q", q13), ("gate_up_d", d13), ("down_q", q2), ("down_d", d2))}
    for n, t in (("gate_up_q", q13), ("gate_up_d", d13), ("down_q", q2), ("down_d", d2)):
        hq[n].copy_(t)
    host_pool_q8 = ExpertPool("q8_0", {n: t.numpy() for n, t in hq.items()})
    layer_bytes_q8 = sum(t.numel() * t.element_size() for t in hq.values())
    ring_q8 = ExpertPool("q8_0", {n: cupy.empty((RING_SLOTS,) + tuple(t.shape[1:]),
                                              dtype=cupy.dtype(str(t.numpy().dtype)))
                                  for n, t in hq.items()})
    torch.cuda.synchronize()

    def deq_np(q: np.ndarray, d: np.ndarray) -> np.ndarray:
        return (q.reshape(*q.shape[:-1], -1, 32).astype(np.float64) * d.astype(np.float64)[..., None]).reshape(q.shape)

    x = torch.randn(T, H, device=dev)
    logits = torch.randn(T, E, device=dev)
    x16 = x.half()
    x_cp, logits_cp = cupy.asarray(x), cupy.asarray(logits)
    chk = np.sort(rng.choice(T, size=args.check_tokens, replace=False))
    x_np, lg_np = x.cpu().numpy(), logits.cpu().numpy()
    log("reference (float64) ...")
    ref = reference_layer(x_np[chk], lg_np[chk], lambda e: h13_np[e], lambda e: h2_np[e])
    ref_q8 = reference_layer(x_np[chk], lg_np[chk],
                             lambda e: deq_np(host_pool_q8.arrays["gate_up_q"][e], host_pool_q8.arrays["gate_up_d"][e]),
                             lambda e: deq_np(host_pool_q8.arrays["down_q"][e], host_pool_q8.arrays["down_d"][e]))

    def check(name: str, out, reference=ref, rows=chk) -> float:
        o = out.get() if hasattr(out, "get") else out.detach().float().cpu().numpy()
        err = rel_err(o[rows] if rows is not None else o, reference)
        res["checks"][name] = {"rel_err": err, "ok": err < TOL}
        log(f"check {name}: rel_err {err:.2e} {'ok' if err < TOL else 'FAILED'}")
        return err

    # ---- ceilings and floors, measured in this run ---------------------------------------------------------------
    cs = cupy.cuda.Stream(non_blocking=True)
    dst13 = cupy.empty((E, 2 * F, H), dtype=cupy.float16)
    dst2 = cupy.empty((E, H, F), dtype=cupy.float16)

    def copy_all_f16():
        cupy.cuda.runtime.memcpyAsync(dst13.data.ptr, host13.data_ptr(), dst13.nbytes, 1, cs.ptr)
        cupy.cuda.runtime.memcpyAsync(dst2.data.ptr, host2.data_ptr(), dst2.nbytes, 1, cs.ptr)

    link = tm.cupy(copy_all_f16, cs)
    link_bw = layer_bytes_f16 / (link["median_ms"] * 1e-3)
    dstq = {n: cupy.empty(t.shape, dtype=cupy.dtype(str(t.numpy().dtype))) for n, t in hq.items()}

    def copy_all_q8():
        for n, t in hq.items():
            cupy.cuda.runtime.memcpyAsync(dstq[n].data.ptr, t.data_ptr(), dstq[n].nbytes, 1, cs.ptr)

    link_q8 = tm.cupy(copy_all_q8, cs)
    del dst13, dst2, dstq
    page = np.random.default_rng(1).standard_normal(64 * 2**20 // 4).astype(np.float32)
    pdst = cupy.empty(page.shape, dtype=cupy.float32)
    pageable = Timer(10, 2).cupy(lambda: pdst.set(page, stream=cs), cs)
    big = torch.randn(8192, 8192, device=dev).half()
    gemm = tm.torch(lambda: big @ big)
    gemm_tflops = 2 * 8192**3 / (gemm["median_ms"] * 1e-3) / 1e12
    dcopy_src = torch.randn(2**29 // 2, device=dev).half()  # 512 MiB... of f16 -> 0.5 GiB
    dcopy_dst = torch.empty_like(dcopy_src)
    dcopy = tm.torch(lambda: dcopy_dst.copy_(dcopy_src))
    hbm_bw = 2 * dcopy_src.numel() * 2 / (dcopy["median_ms"] * 1e-3)
    del big, dcopy_src, dcopy_dst
    flops = 2 * T * K * 3 * H * F
    res["floors"] = {
        "link_pinned_h2d_bytes_per_s": link_bw, "link_copy_all_f16": link,
        "link_pageable_h2d_bytes_per_s": page.nbytes / (pageable["median_ms"] * 1e-3),
        "gemm_f16_8192_tflops": gemm_tflops, "hbm_copy_bytes_per_s": hbm_bw,
        "layer_bytes_f16": layer_bytes_f16, "layer_bytes_q8_0": layer_bytes_q8, "expert_bytes_f16": expert_bytes,
        "pcie_floor_f16_ms": link["median_ms"], "pcie_floor_q8_0_ms": link_q8["median_ms"],
        "pcie_floor_q8_0_from_bw_ms": layer_bytes_q8 / link_bw * 1e3,
        "compute_floor_ms": flops / (gemm_tflops * 1e12) * 1e3, "prefill_flops": flops,
        "decode_floor_us": K * expert_bytes / hbm_bw * 1e6}
    log(f"floors: link {link_bw / 1e9:.1f} GB/s (f16 layer {link['median_ms']:.2f} ms, "
        f"q8 {link_q8['median_ms']:.2f} ms),"
        f" pageable {res['floors']['link_pageable_h2d_bytes_per_s'] / 1e9:.1f} GB/s, gemm {gemm_tflops:.0f} TFLOP/s,"
        f" hbm {hbm_bw / 1e12:.2f} TB/s")

    # ---- ours ------------------------------------------------------------------------------------------------------
    moe = FastMoE(E, K, H, F, group_experts=GROUP_EXPERTS)
    st = moe.compute_stream
    out_cp = cupy.empty((T, H), dtype=cupy.float32)
    ring = (E, RING_SLOTS)
    all_miss = np.full(E, -1, dtype=np.int64)

    def poisoned():
        out_cp.fill(float("nan"))
        cupy.cuda.Device().synchronize()
        return out_cp

    with Guard(res, "warm_f16"):
        # warm
        moe.prefill_layer(x_cp, logits_cp, pool, slot_of, out=poisoned())
        st.synchronize()
        check("ours_warm_f16", out_cp)
        res["ours"]["warm_prefill_f16"] = tm.cupy(
            lambda: moe.prefill_layer(x_cp, logits_cp, pool, slot_of, out=out_cp), st)
        res["ours"]["warm_prefill_f16"]["stack_rows"] = moe.stats.stack_rows
    res["kernels"] = moe.kernel_report()
    log(f"kernels: {res['kernels']}")
    with Guard(res, "warm_variants"):
        # cached experts in batched GEMMs of at most N experts (each batch padded to its own largest group)
        default_batch = moe.hit_batch_experts
        for nb in (0, 16, 64):
            moe.hit_batch_experts = nb
            moe.prefill_layer(x_cp, logits_cp, pool, slot_of, out=poisoned())
            st.synchronize()
            check(f"ours_warm_f16_batch{nb}", out_cp)
            res["ours"][f"warm_prefill_f16_batch{nb}"] = tm.cupy(
                lambda: moe.prefill_layer(x_cp, logits_cp, pool, slot_of, out=out_cp), st)
        moe.hit_batch_experts = default_batch
        res["ours"]["warm_prefill_f16"]["hit_batch_experts"] = default_batch
    with Guard(res, "cold_f16"):
        # cold f16
        moe.prefill_layer(x_cp, logits_cp, pool, all_miss, host_pool, ring, out=poisoned())
        st.synchronize()
        check("ours_cold_f16", out_cp)
        res["ours"]["cold_prefill_f16"] = tm.cupy(
            lambda: moe.prefill_layer(x_cp, logits_cp, pool, all_miss, host_pool, ring, out=out_cp), st)
        res["ours"]["cold_prefill_f16"]["bytes_streamed"] = moe.stats.bytes_streamed
    with Guard(res, "q8"):
        if "q8" not in skip:
            moe.prefill_layer(x_cp, logits_cp, ring_q8, all_miss, host_pool_q8, (0, RING_SLOTS), out=poisoned())
            st.synchronize()
            check("ours_cold_q8_0", out_cp, ref_q8)
            res["ours"]["cold_prefill_q8_0"] = tm.cupy(
                lambda: moe.prefill_layer(x_cp, logits_cp, ring_q8, all_miss, host_pool_q8, (0, RING_SLOTS),
                                          out=out_cp), st)
            res["ours"]["cold_prefill_q8_0"]["bytes_streamed"] = moe.stats.bytes_streamed
            pool_q8 = ExpertPool("q8_0", {"gate_up_q": cupy.asarray(q13), "gate_up_d": cupy.asarray(d13),
                                          "down_q": cupy.asarray(q2), "down_d": cupy.asarray(d2)})
            ident = np.arange(E, dtype=np.int64)
            moe.prefill_layer(x_cp, logits_cp, pool_q8, ident, out=poisoned())
            st.synchronize()
            check("ours_warm_q8_0", out_cp, ref_q8)
            res["ours"]["warm_prefill_q8_0"] = tm.cupy(
                lambda: moe.prefill_layer(x_cp, logits_cp, pool_q8, ident, out=out_cp), st)
    with Guard(res, "traces"):
        # where the time goes: events at each stage of one call (after the timed runs, so everything is warm; the
        # events themselves add a little)
        traces = {}
        for name, call in (("warm_f16", lambda: moe.prefill_layer(x_cp, logits_cp, pool, slot_of, out=out_cp)),
                           ("cold_f16", lambda: moe.prefill_layer(x_cp, logits_cp, pool, all_miss, host_pool, ring,
                                                                  out=out_cp)),
                           ("cold_q8_0", lambda: moe.prefill_layer(x_cp, logits_cp, ring_q8, all_miss, host_pool_q8,
                                                                   (0, RING_SLOTS), out=out_cp))):
            moe.trace = []
            call()
            traces[name] = [(n, round(t, 4)) for n, t in moe.trace_report()]
            moe.trace = None
        res["traces"] = traces
        log(f"trace warm: {traces['warm_f16']}")
        log(f"trace cold (first/last marks): {traces['cold_f16'][:6]} ... {traces['cold_f16'][-6:]}")
    log(f"ours: {json.dumps({k: round(v['median_ms'], 3) for k, v in res['ours'].items()})}")

    # decode: one token, all hits (plain launches, decode_layer's cached graph, an explicit graph), then m misses
    dec = res["ours"]["decode"] = {}  # filled as it goes, so a failure later in the section keeps what ran
    with Guard(res, "decode"):
        if "decode" not in skip:
            t0 = int(chk[0])
            x1, lg1 = x_cp[t0:t0 + 1].copy(), logits_cp[t0:t0 + 1].copy()
            slot_map = cupy.asarray(slot_of.astype(np.int32))
            ref1 = ref[0:1]
            outd = moe.decode_buffers()["out"]

            def run_check(name, fn, out):
                out.fill(float("nan"))
                cupy.cuda.Device().synchronize()
                fn()
                cupy.cuda.Device().synchronize()
                check(name, out, ref1, rows=None)

            # all hits: two plain launches per call, then decode_layer as called (a cached graph per buffers)
            moe.decode_graphs = False
            run_check("ours_decode_f16_launches", lambda: moe.decode_layer(x1, lg1, pool, slot_map), outd)
            dec["hits_launches"] = tm.cupy(lambda: moe.decode_layer(x1, lg1, pool, slot_map), st)
            moe.decode_graphs = True
            run_check("ours_decode_f16", lambda: moe.decode_layer(x1, lg1, pool, slot_map), outd)
            dec["hits"] = tm.cupy(lambda: moe.decode_layer(x1, lg1, pool, slot_map), st)
            graph = moe.capture_decode(x1, lg1, pool, slot_map)
            run_check("ours_decode_f16_graph", lambda: graph.launch(st), outd)
            dec["hits_graph"] = tm.cupy(lambda: graph.launch(st), st)
            # back to back: 100 graph replays between two events, per replay (what a 48-layer step pays per layer)
            dec["hits_graph_back_to_back"] = tm.cupy(lambda: [graph.launch(st) for _ in range(100)], st)
            dec["hits_graph_back_to_back"]["per_layer_us"] = dec["hits_graph_back_to_back"]["median_ms"] * 10
            # each kernel alone, 100 launches back to back between two events, per launch
            b = moe.decode_buffers()
            with st:
                dec["gate_up_kernel_back_to_back"] = tm.cupy(
                    lambda: [moe._gate_up(x1, lg1, pool, slot_map, None, 0) for _ in range(100)], st)
                dec["down_kernel_back_to_back"] = tm.cupy(
                    lambda: [moe._down(pool, slot_map, None, 0, b["out"]) for _ in range(100)], st)
            for kname in ("gate_up_kernel_back_to_back", "down_kernel_back_to_back"):
                dec[kname]["per_launch_us"] = dec[kname]["median_ms"] * 10
            # variants of the gate/up kernel: FFN rows per warp (2 is the default)
            for rows in (1, 4):
                alt = FastMoE(E, K, H, F, group_experts=GROUP_EXPERTS, decode_rows_per_warp=rows)
                alt_out = alt.decode_buffers()["out"]
                run_check(f"ours_decode_f16_rows{rows}", lambda: alt.decode_layer(x1, lg1, pool, slot_map), alt_out)
                g_alt = alt.capture_decode(x1, lg1, pool, slot_map)
                dec[f"hits_graph_back_to_back_rows{rows}"] = tm.cupy(
                    lambda: [g_alt.launch(alt.compute_stream) for _ in range(100)], alt.compute_stream)
                dec[f"hits_graph_back_to_back_rows{rows}"]["per_layer_us"] = \
                    dec[f"hits_graph_back_to_back_rows{rows}"]["median_ms"] * 10
                del alt, g_alt
            routed = [int(e) for e in moe.decode_buffers()["ids"].get()]
            # m misses: read by the kernels from mapped page-locked host memory (the default), and through copies
            mapped = moe.host_device_ptrs(host_pool) is not None
            res["host_pool_mapped"] = mapped
            res["host_pool_mapping"] = moe.host_mapping_report(
                (host_pool.arrays["w_gate_up"].ctypes.data, host_pool.arrays["w_down"].ctypes.data))
            log(f"host pool mapped for the device: {mapped}")
            for m in (1, 2, 4, 8):
                so = slot_of.copy()
                so[routed[:m]] = -1
                smap = cupy.asarray(so.astype(np.int32))
                o1 = cupy.empty((1, H), dtype=cupy.float32)
                if mapped:
                    run_check(f"ours_decode_f16_{m}_misses", lambda: moe.decode_layer(x1, lg1, pool, smap, out=o1,
                                                                                      host_pool=host_pool), o1)
                    dec[f"misses_{m}"] = tm.cupy(lambda: moe.decode_layer(x1, lg1, pool, smap, out=o1,
                                                                          host_pool=host_pool), st)
                    dec[f"misses_{m}"]["bytes_streamed"] = m * expert_bytes
                run_check(f"ours_decode_f16_{m}_misses_copies",
                          lambda: moe.decode_layer_misses(x1, lg1, pool, so, smap, host_pool, ring, out=o1), o1)
                dec[f"misses_{m}_copies"] = tm.cupy(
                    lambda: moe.decode_layer_misses(x1, lg1, pool, so, smap, host_pool, ring, out=o1), st)
                dec[f"misses_{m}_copies"]["bytes_streamed"] = moe.stats.bytes_streamed
            log(f"decode: {json.dumps({k: round(v['median_ms'] * 1e3, 1) for k, v in dec.items()})} us")
    cupy.cuda.Device().synchronize()

    # ---- peers (PyTorch, same weights, same inputs) -----------------------------------------------------------------
    with Guard(res, "peers"):
        if "peers" not in skip:
            peers = res["peers"]

            def route_t(lg):
                v, i = lg.topk(K, dim=1)
                return i, torch.softmax(v, dim=1)

            buf13 = torch.empty(2 * F, H, dtype=torch.float16, device=dev)
            buf2 = torch.empty(H, F, dtype=torch.float16, device=dev)

            def naive(cold: bool):
                ids, w = route_t(logits)
                out = torch.zeros(T, H, device=dev)
                for e in range(E):
                    if cold:
                        buf13.copy_(host13[e], non_blocking=True)
                        buf2.copy_(host2[e], non_blocking=True)
                        a13, a2 = buf13, buf2
                    else:
                        a13, a2 = w13[e], w2[e]
                    tok, kk = torch.where(ids == e)
                    if tok.numel() == 0:
                        continue
                    h = x16[tok] @ a13.T
                    y = (tfn.silu(h[:, :F]) * h[:, F:]) @ a2.T
                    out.index_add_(0, tok, y.float() * w[tok, kk, None])
                return out

            check("peer_naive_warm", naive(False))
            peers["naive_warm"] = tm.torch(lambda: naive(False))
            check("peer_naive_cold", naive(True))
            peers["naive_cold"] = tm.torch(lambda: naive(True))

            gm_dtype = torch.float16
            try:
                torch._grouped_mm(x16[:16].contiguous(), w13[:1].transpose(1, 2),
                                  offs=torch.tensor([16], device=dev, dtype=torch.int32))
            except Exception as exc:  # some builds take bf16 only; record it and use bf16 copies
                gm_dtype = torch.bfloat16
                log(f"_grouped_mm refused f16 ({str(exc).splitlines()[0]}); peer runs bf16")
            g13 = (w13 if gm_dtype == torch.float16 else w13.to(gm_dtype)).transpose(1, 2)
            g2 = (w2 if gm_dtype == torch.float16 else w2.to(gm_dtype)).transpose(1, 2)
            gx = x.to(gm_dtype)

            def grouped():
                ids, w = route_t(logits)
                flat = ids.flatten()
                order = torch.argsort(flat, stable=True)
                tok = order // K
                offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
                h = torch._grouped_mm(gx[tok], g13, offs=offs)
                a = tfn.silu(h[:, :F]) * h[:, F:]
                y = torch._grouped_mm(a, g2, offs=offs)
                return torch.zeros(T, H, device=dev).index_add_(0, tok, y.float() * w.flatten()[order, None])

            check("peer_grouped_mm_warm", grouped())
            peers["grouped_mm_warm"] = tm.torch(grouped)
            peers["grouped_mm_warm"]["dtype"] = str(gm_dtype)
            del gx
            if gm_dtype != torch.float16:
                del g13, g2

            copy_stream = torch.cuda.Stream()
            bufs = [(torch.empty(2 * F, H, dtype=torch.float16, device=dev),
                     torch.empty(H, F, dtype=torch.float16, device=dev))
                    for _ in range(2)]
            ready = [torch.cuda.Event() for _ in range(2)]
            free = [torch.cuda.Event() for _ in range(2)]

            def overlapped():
                ids, w = route_t(logits)
                flat = ids.flatten()
                order = torch.argsort(flat, stable=True)
                tok = order // K
                offs = [0] + torch.bincount(flat, minlength=E).cumsum(0).tolist()
                xs, ws = x16[tok], w.flatten()[order]
                out = torch.zeros(T, H, device=dev)
                main = torch.cuda.current_stream()

                def issue(e):
                    s = e % 2
                    copy_stream.wait_stream(main) if e < 2 else copy_stream.wait_event(free[s])
                    with torch.cuda.stream(copy_stream):
                        bufs[s][0].copy_(host13[e], non_blocking=True)
                        bufs[s][1].copy_(host2[e], non_blocking=True)
                        ready[s].record(copy_stream)

                issue(0)
                issue(1)
                for e in range(E):
                    s = e % 2
                    main.wait_event(ready[s])
                    lo, hi = offs[e], offs[e + 1]
                    if hi > lo:
                        h = xs[lo:hi] @ bufs[s][0].T
                        y = (tfn.silu(h[:, :F]) * h[:, F:]) @ bufs[s][1].T
                        out.index_add_(0, tok[lo:hi], y.float() * ws[lo:hi, None])
                    free[s].record(main)
                    if e + 2 < E:
                        issue(e + 2)
                return out

            check("peer_overlapped_cold", overlapped())
            peers["overlapped_cold"] = tm.torch(overlapped)

            t0 = int(chk[0])
            xd, ld = x16[t0:t0 + 1].clone(), logits[t0:t0 + 1].clone()

            def decode_peer():
                v, i = ld.topk(K, dim=1)
                w = torch.softmax(v, dim=1)
                a13, a2 = w13[i[0]], w2[i[0]]
                h = torch.bmm(a13, xd.expand(K, H).unsqueeze(2))
                a = tfn.silu(h[:, :F]) * h[:, F:]
                y = torch.bmm(a2, a)
                return (y.squeeze(2).float() * w[0, :, None]).sum(0, keepdim=True)

            check("peer_decode_bmm", decode_peer(), ref[0:1], rows=None)
            peers["decode_bmm_eager"] = tm.torch(decode_peer)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    decode_peer()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static_out = decode_peer()
            static_out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            check("peer_decode_bmm_graph", static_out, ref[0:1], rows=None)
            peers["decode_bmm_graph"] = tm.torch(g.replay)
            log(f"peers: {json.dumps({k: round(v['median_ms'], 3) for k, v in peers.items()})}")
            del bufs
            torch.cuda.synchronize()

    # ---- cache-size sweep: skewed routing, the hottest experts cached, the rest streamed --------------------------
    sweep = []
    with Guard(res, "sweep"):
        if "sweep" not in skip:
            rank_bias = -1.0 * np.log1p(np.arange(E))  # Zipf-like popularity: expert hot[r] has rank r
            hot = rng.permutation(E)
            bias = np.empty(E)
            bias[hot] = rank_bias
            lg_skew_np = (lg_np + bias[None, :]).astype(np.float32)
            lg_skew = cupy.asarray(lg_skew_np)
            dec_steps = 40
            dec_rows = rng.choice(T, size=dec_steps, replace=False)
            for frac in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
                c = int(round(frac * E))
                so = np.full(E, -1, dtype=np.int64)
                so[hot[:c]] = np.arange(c)
                idx = torch.tensor(hot[:c], device=dev)
                pool13[:c] = w13[idx]
                pool2[:c] = w2[idx]
                torch.cuda.synchronize()
                moe.prefill_layer(x_cp, lg_skew, pool, so, host_pool, ring, out=poisoned())
                st.synchronize()
                ref_s = reference_layer(x_np[chk[:8]], lg_skew_np[chk[:8]], lambda e: h13_np[e], lambda e: h2_np[e])
                err = rel_err(out_cp.get()[chk[:8]], ref_s)
                pre = Timer(max(10, args.reps // 2 + 3), 2).cupy(
                    lambda: moe.prefill_layer(x_cp, lg_skew, pool, so, host_pool, ring, out=out_cp), st)
                stats = moe.stats
                smap = cupy.asarray(so.astype(np.int32))
                times, hit, tot = [], 0, 0
                o1 = cupy.empty((1, H), dtype=cupy.float32)
                # one step's inputs live in fixed buffers (as an executor's do), so decode_layer replays its graph;
                # missed experts are read from the mapped page-locked host pool by the kernels
                x1, l1 = cupy.empty((1, H), dtype=cupy.float32), cupy.empty((1, E), dtype=cupy.float32)
                for j, r in enumerate(dec_rows):
                    with st:
                        x1[...] = x_cp[r:r + 1]
                        l1[...] = lg_skew[r:r + 1]
                    a, b = cupy.cuda.Event(), cupy.cuda.Event()
                    a.record(st)
                    if c == E or moe.host_device_ptrs(host_pool) is not None:
                        moe.decode_layer(x1, l1, pool, smap, out=o1, host_pool=host_pool if c < E else None)
                    else:
                        moe.decode_layer_misses(x1, l1, pool, so, smap, host_pool, ring, out=o1)
                    b.record(st)
                    b.synchronize()
                    if j >= 3:  # the first steps warm up
                        times.append(cupy.cuda.get_elapsed_time(a, b))
                        ids1 = np.argsort(-lg_skew_np[r], kind="stable")[:K]
                        hit += int(np.sum(so[ids1] >= 0))
                        tot += K
                dec_mean = statistics.fmean(times)
                row = {"cache_fraction": frac, "cache_slots": c, "prefill_ms": pre["median_ms"],
                       "prefill_hit_rate_rows": stats.routed_rows_hit / stats.routed_rows,
                       "prefill_experts_missed": stats.misses, "prefill_bytes_streamed": stats.bytes_streamed,
                       "prefill_tok_s_layer": T / (pre["median_ms"] * 1e-3),
                       "prefill_tok_s_model": T / (pre["median_ms"] * 1e-3) / MODEL_LAYERS,
                       "decode_hit_rate": hit / tot, "decode_median_ms": statistics.median(times),
                       "decode_mean_ms": dec_mean, "decode_steps": len(times),
                       "decode_tok_s_layer": 1e3 / dec_mean, "decode_tok_s_model": 1e3 / dec_mean / MODEL_LAYERS,
                       "check_rel_err": err}
                sweep.append(row)
                log(f"sweep {frac:.1f}: prefill {pre['median_ms']:.2f} ms hit {row['prefill_hit_rate_rows']:.2f}, "
                    f"decode {dec_mean * 1e3:.0f} us hit {row['decode_hit_rate']:.2f}, err {err:.1e}")
            res["sweep"] = sweep
            res["checks"]["sweep"] = {"rel_err": max(r["check_rel_err"] for r in sweep),
                                      "ok": all(r["check_rel_err"] < TOL for r in sweep)}
            try:
                draw_sweep(sweep, out_dir / "h200_moe_sweep.png")
            except Exception as exc:  # the JSON holds every figure; a missing plot must not lose them
                log(f"sweep PNG failed: {exc}")

    evaluate(res)
    (out_dir / "h200_moe.json").write_text(json.dumps(res, indent=1))
    if "fidelity" not in skip:
        # last, so a run that hangs or fails cannot cost the figures above (they are written already)
        import signal

        def too_long(signum, frame):
            raise TimeoutError("strata run took more than 180 s")

        signal.signal(signal.SIGALRM, too_long)
        signal.alarm(180)
        with Guard(res, "strata_run_fidelity"):
            res.setdefault("plan_fidelity", {})["strata_run"] = strata_run_fidelity(
                ["run", "--backend", "cuda", "--json", "--check", "--prompt-tokens", "3000", "--decode-tokens", "32"])
        signal.alarm(0)
        res["targets"].clear()
        evaluate(res)
        (out_dir / "h200_moe.json").write_text(json.dumps(res, indent=1))
    print_table(res)
    return 0 if all(c["ok"] for c in res["checks"].values()) else 1


def evaluate(res: dict) -> None:
    """Targets of issue 7, pass or fail, with the figures they compare (a figure a failed section lacks is skipped)."""
    fl, ours, peers, tg = res["floors"], res["ours"], res["peers"], res["targets"]

    def med(d: dict, *keys: str):
        for k in keys:
            if not isinstance(d, dict) or k not in d:
                return None
            d = d[k]
        return d["median_ms"]

    def put(name, value, limit, unit, ok=None):
        if value is None or limit is None:
            return
        tg[name] = {"value": value, "limit": limit, "unit": unit, "pass": (value <= limit) if ok is None else ok}

    def ratio(a, b):
        return None if a is None or b is None else a / b

    put("cold_prefill_f16_vs_floor", ratio(med(ours, "cold_prefill_f16"), fl["pcie_floor_f16_ms"]), 1.10, "x floor")
    put("cold_prefill_q8_0_vs_floor", ratio(med(ours, "cold_prefill_q8_0"), fl["pcie_floor_q8_0_ms"]), 1.10, "x floor")
    put("warm_prefill_f16_ms", med(ours, "warm_prefill_f16"), 1.0, "ms")
    dec = ours.get("decode", {})
    for name, key in (("decode_hits_us", "hits"), ("decode_hits_us_graph", "hits_graph"),
                      ("decode_hits_us_two_launches", "hits_launches")):
        v = med(dec, key)
        put(name, None if v is None else v * 1e3, 50.0, "us")
    for m in (1, 2, 4, 8):
        for suffix in ("", "_copies"):
            d = dec.get(f"misses_{m}{suffix}")
            if d:
                lim = 1.10 * d["bytes_streamed"] / fl["link_pinned_h2d_bytes_per_s"] * 1e6 + 50.0
                put(f"decode_{m}_misses_us{suffix}", d["median_ms"] * 1e3, lim, "us")
    pairs = (("naive_warm", "warm_prefill_f16"), ("naive_cold", "cold_prefill_f16"),
             ("grouped_mm_warm", "warm_prefill_f16"), ("overlapped_cold", "cold_prefill_f16"))
    for peer, mine in pairs:
        r = ratio(med(ours, mine), med(peers, peer))
        put(f"ratio_ours_{mine}_over_{peer}", r, 1.0, "ours/peer", ok=r is not None and r < 1.0)
    sr = res.get("plan_fidelity", {}).get("strata_run", {})
    if sr.get("start_ratios"):
        # the allocations themselves (cupy's pool) against the plan's cache + dense figures, within 2% and never
        # above; the driver's view (memGetInfo) also holds module code and page rounding, which the plan's reserve
        # is there to absorb: it must stay within figures + reserve
        ratios = sr["start_ratios"]
        reserve = sr["plan_vram"].get("reserve_bytes", 0)
        driver_ok = sr["start_measured"]["mem_get_info_bytes"] <= sr["start_planned_bytes"] + reserve
        put("plan_fidelity_strata_run_start_pool", ratios["cupy_pool_used_bytes"], 1.0, "measured/planned",
            ok=0.98 <= ratios["cupy_pool_used_bytes"] <= 1.0 and driver_ok)
    for run in res.get("plan_fidelity", {}).get("runs", []):
        worst = max(run["ratios"].values())
        least = min(run["ratios"].values())
        put(f"plan_fidelity_{run['model']}", worst, 1.0, "measured/planned",
            ok=run["within_2pct_and_not_above"] and least >= 0.98)
    for mine, peer in (("hits", "decode_bmm_graph"), ("hits_graph", "decode_bmm_graph"),
                       ("hits_launches", "decode_bmm_eager")):
        r = ratio(med(dec, mine), med(peers, peer))
        put(f"ratio_ours_decode_{mine}_over_peer_{peer}", r, 1.0, "ours/peer", ok=r is not None and r < 1.0)


def print_table(res: dict) -> None:
    """The short table the README shows."""
    fl = res["floors"]
    log(f"\nlink {fl['link_pinned_h2d_bytes_per_s'] / 1e9:.1f} GB/s; floors: PCIe f16 "
        f"{fl['pcie_floor_f16_ms']:.2f} ms, q8_0 {fl['pcie_floor_q8_0_ms']:.2f} ms, compute "
        f"{fl['compute_floor_ms']:.3f} ms, decode {fl['decode_floor_us']:.1f} us")
    for k, v in res["ours"].items():
        if k == "decode":
            for kk, vv in v.items():
                per = vv.get("per_launch_us", vv.get("per_layer_us"))
                shown = per if per is not None else vv["median_ms"] * 1e3
                log(f"ours decode {kk:28s} {shown:10.1f} us{' (per launch of 100 back to back)' if per else ''}")
        else:
            log(f"ours {k:35s} {v['median_ms']:10.3f} ms")
    for k, v in res["peers"].items():
        log(f"peer {k:35s} {v['median_ms']:10.3f} ms")
    for k, v in res["targets"].items():
        log(f"target {k:45s} {v['value']:10.3f} <= {v['limit']:9.3f} {v['unit']:10s} {'PASS' if v['pass'] else 'FAIL'}")
    bad = [k for k, c in res["checks"].items() if not c["ok"]]
    log(f"checks: {len(res['checks']) - len(bad)} ok, failed: {bad}")


def draw_sweep(sweep: list[dict], path: Path) -> None:
    """Hit rate and prefill/decode tok/s against the cache fraction, one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fr = [100 * r["cache_fraction"] for r in sweep]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    ax[0].plot(fr, [r["prefill_hit_rate_rows"] for r in sweep], "o-", label="prefill (routed rows)")
    ax[0].plot(fr, [r["decode_hit_rate"] for r in sweep], "s-", label="decode (routed experts)")
    ax[0].set(xlabel="experts cached (%)", ylabel="hit rate", title="hit rate")
    ax[0].legend()
    ax[1].plot(fr, [r["prefill_tok_s_layer"] for r in sweep], "o-")
    ax[1].set(xlabel="experts cached (%)", ylabel="tokens/s per MoE layer", title="prefill, chunk 4096", yscale="log")
    ax[2].plot(fr, [r["decode_tok_s_layer"] for r in sweep], "s-")
    ax[2].set(xlabel="experts cached (%)", ylabel="tokens/s per MoE layer", title="decode, 1 token", yscale="log")
    for a in ax:
        a.grid(alpha=0.3)
    fig.suptitle("Qwen3-30B-A3B MoE layer on the H200: cache-size sweep "
                 "(skewed routing, rest streamed from pinned RAM)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
