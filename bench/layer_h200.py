"""One Qwen3-30B-A3B MoE layer through strata_cuda.fast.FastMoE (the ops `strata run` calls) on the H200, per GEMM
mode, uniform and skewed routing; plus the synthetic generator's speed at real size. Writes layer_h200.json.

Shape: 128 experts, top-8, hidden 2048, expert FFN 768, a 4096-token chunk. Skewed routing: the expert of popularity
rank r gets a logit bias of -ln(1+r) (the cache sweep's skew). Every figure: CUDA events on the op's stream after
warm-up, the median of `--reps` runs; every output checked on 64 tokens spread over the chunk against a float64
numpy reference; the same inputs run twice give the same sha256. A variant is gemm_mode:streams[:split_rows].
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from dataclasses import astuple
from pathlib import Path

import numpy as np

E, K, H, F, T = 128, 8, 2048, 768, 4096
RING = 32


def log(msg: str) -> None:
    """One progress line at once."""
    print(msg, flush=True)


def rel_err(out: np.ndarray, want: np.ndarray) -> float:
    """||out - want|| / ||want|| in float64; inf if out has a non-finite value."""
    out = np.asarray(out, dtype=np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - want) / np.linalg.norm(want))


def reference(x, logits, w13, w2) -> np.ndarray:
    """float64 MoE layer of a few tokens."""
    from strata_core.reference.kernels import route_topk
    ids, w = route_topk(logits, K)
    x = x.astype(np.float64)
    y = np.zeros((x.shape[0], H))
    for e in np.unique(ids):
        rows, ks = np.nonzero(ids == e)
        gu = x[rows] @ w13[e].astype(np.float64).T
        y_e = (gu[:, :F] / (1 + np.exp(-gu[:, :F])) * gu[:, F:]) @ w2[e].astype(np.float64).T
        np.add.at(y, rows, w[rows, ks, None].astype(np.float64) * y_e)
    return y


def time_ms(cp, fn, stream, reps: int, warmup: int = 3) -> dict:
    """Median, min and max of fn() between two events on `stream`, after warm-up."""
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b))
    return {"median_ms": float(np.median(ts)), "min_ms": float(np.min(ts)), "max_ms": float(np.max(ts)), "reps": reps}


def layer(args, res: dict) -> None:
    """The layer timings."""
    import cupy as cp
    from strata_cuda.fast import FastMoE
    from strata_core.reference.kernels import ExpertPool, route_topk
    rng = np.random.default_rng(7)
    w13 = (rng.standard_normal((E, 2 * F, H), dtype=np.float32) / np.sqrt(H)).astype(np.float16)
    w2 = (rng.standard_normal((E, H, F), dtype=np.float32) / np.sqrt(F)).astype(np.float16)
    x = rng.standard_normal((T, H)).astype(np.float32)
    lg_u = rng.standard_normal((T, E)).astype(np.float32)
    lg_s = lg_u + (-np.log1p(rng.permutation(E))).astype(np.float32)
    pool = ExpertPool("f16", {"w_gate_up": cp.empty((E + RING, 2 * F, H), cp.float16),
                              "w_down": cp.empty((E + RING, H, F), cp.float16)})
    pool.arrays["w_gate_up"][:E] = cp.asarray(w13)
    pool.arrays["w_down"][:E] = cp.asarray(w2)
    hmem = [cp.cuda.alloc_pinned_memory(a.nbytes) for a in (w13, w2)]
    h13 = np.frombuffer(hmem[0], np.float16, w13.size).reshape(w13.shape)
    h2 = np.frombuffer(hmem[1], np.float16, w2.size).reshape(w2.shape)
    h13[...] = w13
    h2[...] = w2
    host = ExpertPool("f16", {"w_gate_up": h13, "w_down": h2})
    x_d = cp.asarray(x)
    out = cp.empty((T, H), cp.float32)
    warm = np.arange(E)
    cold = np.full(E, -1)
    # 64 tokens spread over the chunk: a hot expert's later pieces (split_rows) hold the last tokens' rows
    check = np.unique(np.r_[np.arange(16), np.linspace(16, T - 1, 48).astype(np.int64)])
    refs = {name: reference(x[check], lg[check], w13, w2) for name, lg in (("uniform", lg_u), ("skewed", lg_s))}
    counts = {name: np.bincount(route_topk(lg, K)[0].reshape(-1), minlength=E) for name, lg in
              (("uniform", lg_u), ("skewed", lg_s))}
    res["routing"] = {n: {"max_rows": int(c.max()), "min_rows": int(c.min()), "used": int((c > 0).sum())}
                      for n, c in counts.items()}
    # floors, measured here
    a = cp.empty(1 << 28, cp.uint16)
    b = cp.empty_like(a)
    res["hbm_copy"] = time_ms(cp, lambda: b.__setitem__(slice(None), a), cp.cuda.get_current_stream(), 10)
    res["hbm_bytes_per_s"] = 2 * a.nbytes / (res["hbm_copy"]["median_ms"] / 1e3)
    del a, b
    m = cp.asarray(rng.standard_normal((8192, 8192)).astype(np.float16))
    res["gemm_8192"] = time_ms(cp, lambda: cp.matmul(m, m), cp.cuda.get_current_stream(), 10)
    res["gemm_f16_flops"] = 2 * 8192 ** 3 / (res["gemm_8192"]["median_ms"] / 1e3)
    del m
    dev = cp.empty(w13.nbytes // 2, cp.uint8)
    res["link_copy"] = time_ms(cp, lambda: cp.cuda.runtime.memcpyAsync(
        dev.data.ptr, h13.ctypes.data, dev.nbytes, 1, cp.cuda.get_current_stream().ptr),
        cp.cuda.get_current_stream(), 5)
    res["link_bytes_per_s"] = dev.nbytes / (res["link_copy"]["median_ms"] / 1e3)
    del dev
    flops = 2 * T * K * 3 * H * F
    res["layer_flops"] = flops
    res["layer_weight_bytes"] = int(w13.nbytes + w2.nbytes)
    res["floor_warm_ms"] = max(flops / res["gemm_f16_flops"], res["layer_weight_bytes"] / res["hbm_bytes_per_s"]) * 1e3
    res["floor_cold_ms"] = res["layer_weight_bytes"] / res["link_bytes_per_s"] * 1e3
    res["modes"] = {}
    from strata_cuda import fast as fast_mod
    res["split_rows_default"] = fast_mod.SPLIT_ROWS
    res["cublas_grouped_gemm_symbol"] = fast_mod._BlasExtra().grouped is not None
    # mode:streams[:split rows][:f<class floor rows>][:t[BMxBNxBKxWARPSxSTAGES[+down's]]], e.g. classes:4,
    # classes:4:1024, classes:4:f64, classes:4:t (the device-table path, triton_moe's default tiles, for the warm
    # layers; without a t token the device-table path is off)
    variants = [v.split(":") for v in args.variants.split(",")]
    for vi, (mode, streams, *extra) in enumerate(variants):
        streams = int(streams)
        name_v = ":".join([mode, str(streams), *extra])
        try:
            moe = FastMoE(E, K, H, F, gemm_mode=mode, gemm_streams=streams)
        except ValueError as e:
            res["modes"][name_v] = {"unavailable": str(e)}
            continue
        device = "off"  # no t token: the cuBLAS mode itself, also for the warm layers
        for tok in extra:
            if tok.startswith("f"):
                moe.class_floor = int(tok[1:])
            elif tok.startswith("t"):
                device = tok[1:].replace("x", ":").replace("+", "/")
            elif tok:
                moe.split_rows = int(tok)
        moe.set_device_gemm(device)
        if device != "off" and moe.device_gemm is None:
            res["modes"][name_v] = {"unavailable": "triton_moe: Triton/torch missing or the shape does not tile"}
            continue
        dg = moe.device_gemm
        r = res["modes"][name_v] = {"gemm_mode": mode, "gemm_streams": streams, "split_rows": moe.split_rows,
                                    "class_floor": moe.class_floor,
                                    "device_gemm": None if dg is None else {"gate_up": list(astuple(dg.gate_up)),
                                                                            "down": list(astuple(dg.down))}}
        for name, lg in (("uniform", lg_u), ("skewed", lg_s)):
            lg_d = cp.asarray(lg)
            out.fill(np.nan)
            moe.prefill_layer(x_d, lg_d, pool, warm, out=out)
            moe.compute_stream.synchronize()
            y1 = out.get()
            moe.prefill_layer(x_d, lg_d, pool, warm, out=out)
            moe.compute_stream.synchronize()
            same = hashlib.sha256(y1.tobytes()).hexdigest() == hashlib.sha256(out.get().tobytes()).hexdigest()
            host_s: list = []

            def call():
                t0 = time.perf_counter()
                moe.prefill_layer(x_d, lg_d, pool, warm, out=out)
                host_s.append(time.perf_counter() - t0)
            t = time_ms(cp, call, moe.compute_stream, args.reps)
            r[f"warm_{name}"] = {**t, "rel_err": rel_err(y1[check], refs[name]), "same_bits_twice": same,
                                 "stack_rows": moe.stats.stack_rows, "gemm_problems": moe.stats.gemm_problems,
                                 "device_table": moe.stats.device_table,
                                 "host_call_ms": float(np.median(host_s[-args.reps:])) * 1e3}
            log(f"{name_v:14s} warm {name:8s} {t['median_ms']:.3f} ms  err {r[f'warm_{name}']['rel_err']:.1e}  "
                f"same bits {same}  stack rows {moe.stats.stack_rows}  problems {moe.stats.gemm_problems}  "
                f"host {r[f'warm_{name}']['host_call_ms']:.3f} ms")
            if vi == 0:
                moe.trace = []
                moe.prefill_layer(x_d, lg_d, pool, warm, out=out)
                r[f"trace_warm_{name}"] = moe.trace_report()
                moe.trace = None
        if vi == 0:
            for name, lg in (("uniform", lg_u), ("skewed", lg_s)):
                lg_d = cp.asarray(lg)
                out.fill(np.nan)
                moe.prefill_layer(x_d, lg_d, pool, cold, host, (E, RING), out=out)
                moe.compute_stream.synchronize()
                err = rel_err(out.get()[check], refs[name])
                t = time_ms(cp, lambda: moe.prefill_layer(x_d, lg_d, pool, cold, host, (E, RING), out=out),
                            moe.compute_stream, max(5, args.reps // 3))
                r[f"cold_{name}"] = {**t, "rel_err": err, "x_floor": t["median_ms"] / res["floor_cold_ms"]}
                log(f"{name_v:10s} cold {name:8s} {t['median_ms']:.3f} ms  x floor {r[f'cold_{name}']['x_floor']:.3f}"
                    f"  err {err:.1e}")
        # decode, every expert cached, graph replay
        smap = cp.asarray(np.arange(E, dtype=np.int32))
        x1, l1 = x_d[:1], cp.asarray(lg_s[:1])
        o1 = cp.empty((1, H), cp.float32)
        t = time_ms(cp, lambda: moe.decode_layer(x1, l1, pool, smap, out=o1), moe.compute_stream, args.reps * 4)
        r["decode_hits_graph"] = t
        del moe


def generation(args, res: dict) -> None:
    """The synthetic generator at real size: Qwen3-30B-A3B Q8_0 (all 48 layers) and F16 (a slice of the layers)."""
    from strata_core.models.presets import model_from_name
    from strata_core.models.synthetic import generate_weights, model_spec
    p = model_from_name("Qwen3-30B-A3B")
    for dtype, layers in (("q8_0", p.moe_layers), ("f16", args.f16_layers)):
        spec = model_spec(p.name, layers, p.experts_per_layer, p.top_k, p.hidden, p.expert_ffn, p.vocab or 151936,
                          dtype=dtype)
        marks = []
        t0 = time.perf_counter()
        w = generate_weights(spec, 0, dtype=dtype, popularity_skew=1.0,
                             progress=lambda d, tot: marks.append((time.perf_counter() - t0, d)))
        dt = time.perf_counter() - t0
        nb = sum(int(a.nbytes) for a in w.experts.arrays.values())
        res[f"generate_{dtype}"] = {"layers": layers, "expert_bytes": nb, "seconds": dt,
                                    "bytes_per_s": nb / dt, "progress_calls": len(marks)}
        log(f"generate {dtype} {layers} layers: {nb / 1e9:.2f} GB in {dt:.2f} s = {nb / dt / 1e9:.2f} GB/s")
        del w


def main() -> int:
    """Run the sections; write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--f16-layers", type=int, default=12)
    ap.add_argument("--skip", default="")
    ap.add_argument("--variants", default="classes:4,classes:8,grouped:1",
                    help="gemm_mode:streams[:split_rows][:fN][:t[cfg]] to time (cold runs and the trace for the first only)")
    args = ap.parse_args()
    res: dict = {"schema": "strata.bench.layer/1", "python": platform.python_version(),
                 "shape": {"experts": E, "top_k": K, "hidden": H, "ffn": F, "tokens": T, "ring": RING}}
    try:
        import cupy as cp
        res["device"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
        res["cuda_runtime"] = cp.cuda.runtime.runtimeGetVersion()
        res["cupy"] = cp.__version__
    except Exception as e:  # report, and still time the generator
        res["device_error"] = f"{type(e).__name__}: {e}"
    for name, fn in (("layer", layer), ("generation", generation)):
        if name in args.skip.split(","):
            continue
        try:
            fn(args, res)
        except Exception:
            import traceback
            res.setdefault("errors", {})[name] = traceback.format_exc()
            log(f"SECTION {name} FAILED\n{res['errors'][name]}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "layer_h200.json").write_text(json.dumps(res, indent=1, default=str))
    return 1 if res.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
