"""One Qwen3-30B-A3B MoE layer in Q4_K_M's expert bytes (gate/up Q4_K, down Q6_K) on the H200, through the cuda
KernelSet's moe_grouped_ffn over a 'gguf' pool (strata_cuda/moe_quant.cu: the path `strata run` takes for such a
file). Writes bench/results/quant_layer_h200.json.

Shape: 128 experts, top-8, hidden 2048, expert FFN 768; a 4096-token prefill chunk (uniform random routing: every
expert is used) and 1-token decode. Figures, each the median of --reps runs between CUDA events after warm-up:
- link floor: the layer's expert bytes (128 slots of the Q4_K/Q6_K slot bytes) / the measured page-locked H2D rate;
- cold prefill: every expert missing: its bytes copied from page-locked host memory into device slots on a copy
  stream, in --batches batches, each batch's experts computed on the compute stream once its copy is done (copy of
  batch i+1 overlaps compute of batch i); target <= 1.10 x the link floor;
- warm prefill: every expert cached, the grouped FFN alone; against the same layer as an f16 pool through the same
  KernelSet (its f16 path, strata_cuda.fast where it applies); target <= 1.5 x the f16 warm time;
- decode: one token, its 8 experts cached, the grouped FFN; target <= 50 us.
Each figure is taken for both of moe_quant.cu's variants: "simt" (f32 FMA, what the KernelSet runs by default) and
"mma" (tensor cores, f16 inputs; strata_cuda.quant_ffn.MMA_BY_DEFAULT turns it on once tests/gpu passes for it).
The experts are --templates distinct experts quantized by strata_core.reference.quants (Q4_K/Q6_K), repeated over
the 128 slots (quantizing 128 experts in numpy would take minutes); outputs are checked on 8 tokens against a
float64 reference of the same bytes (strata_core.testing.reference64).

Run (on the H200, from the repository root, with the tree's venv: `pip install -e '.[cuda]'`):
    python bench/quant_layer_h200.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

E, K, H, F, T = 128, 8, 2048, 768, 4096
COLD_TARGET, WARM_TARGET, DECODE_TARGET_US = 1.10, 1.5, 50.0
#: ||out - ref|| / ||ref|| bound: f32 accumulation of exactly dequantized weights (f16 pool: f16 inputs)
TOL_QUANT, TOL_F16 = 1e-4, 1e-2


def log(msg: str) -> None:
    """One progress line at once."""
    print(msg, flush=True)


def time_ms(cp, fn, stream, reps: int, warmup: int = 2) -> dict:
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


def routed_groups(rng, tokens: int, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Uniform random top-K routing of `tokens` tokens: (token of each routed row, offsets, slots) grouped by expert."""
    from strata_core.reference.kernels import route_topk
    ids, _ = route_topk(rng.standard_normal((tokens, E)).astype(np.float32), K)
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    ex, counts = np.unique(flat[order], return_counts=True)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return (order // K).astype(np.int32), offsets, experts[ex].astype(np.int32)


def build(args):
    """(ExpertFormat, host blob [E, slot] u8 page-locked-able, f16 w13 [E,2F,H], f16 w2 [E,H,F]) from templates."""
    from strata_core.api.kernels import ExpertFormat
    from strata_core.reference import quants
    fmt = ExpertFormat("q4_k", "q6_k", H, F)
    rng = np.random.default_rng(0)
    blob = np.empty((E, fmt.nbytes), np.uint8)
    w13 = np.empty((E, 2 * F, H), np.float16)
    w2 = np.empty((E, H, F), np.float16)
    t0 = time.perf_counter()
    for t in range(args.templates):
        gu = quants.quantize("q4_k", rng.standard_normal((2 * F, H), dtype=np.float32) / np.sqrt(H))
        dn = quants.quantize("q6_k", rng.standard_normal((H, F), dtype=np.float32) / np.sqrt(F))
        row = np.concatenate([gu.reshape(-1), dn.reshape(-1)])
        f13 = quants.dequantize("q4_k", gu, H).astype(np.float16)
        f2 = quants.dequantize("q6_k", dn, F).astype(np.float16)
        for e in range(t, E, args.templates):
            blob[e] = row
            w13[e], w2[e] = f13, f2
    log(f"quantized {args.templates} template experts in {time.perf_counter() - t0:.1f} s; slot {fmt.nbytes} B")
    return fmt, blob, w13, w2


def run(args, res: dict) -> None:
    """Every figure of the module docstring into res, for each of moe_quant.cu's variants (res["simt"], res["mma"])."""
    import cupy as cp

    from strata_core.api.kernels import ExpertPool
    from strata_core.testing import reference64 as r64
    from strata_cuda.kernels import CupyKernels
    from strata_cuda.quant_ffn import QuantGroupedFFN

    fmt, blob, w13, w2 = build(args)
    layer_bytes = int(blob.nbytes)
    res["slot_bytes"], res["layer_expert_bytes"] = fmt.nbytes, layer_bytes
    res["f16_layer_expert_bytes"] = int(w13.nbytes + w2.nbytes)
    k = CupyKernels(fast_grouped_ffn=True)
    compute, copy = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    dev_blob = cp.empty(blob.shape, cp.uint8)
    pool = ExpertPool("gguf", {"blob": dev_blob}, (fmt,))
    host_mem = cp.cuda.alloc_pinned_memory(layer_bytes)
    host = np.frombuffer(host_mem, np.uint8, layer_bytes).reshape(blob.shape)
    host[:] = blob
    dev_blob.set(blob)
    rng = np.random.default_rng(1)
    rows, offsets, slots = routed_groups(rng, T, np.arange(E))
    x = rng.standard_normal((T, H)).astype(np.float32)
    xg = cp.asarray(x[rows])
    host_pool = ExpertPool("gguf", {"blob": blob}, (fmt,))
    d_rows, d_off, d_slots = routed_groups(rng, 1, np.arange(E))
    xd = cp.asarray(x[:1][d_rows])

    # link floor: one page-locked copy of the layer's bytes
    def one_copy():
        cp.cuda.runtime.memcpyAsync(dev_blob.data.ptr, host.ctypes.data, layer_bytes,
                                    cp.cuda.runtime.memcpyHostToDevice, copy.ptr)
    res["link_copy"] = time_ms(cp, one_copy, copy, args.reps)
    res["link_bytes_per_s"] = layer_bytes / (res["link_copy"]["median_ms"] / 1e3)
    res["floor_cold_ms"] = res["link_copy"]["median_ms"]
    log(f"link {res['link_bytes_per_s'] / 1e9:.1f} GB/s: floor {res['floor_cold_ms']:.3f} ms for "
        f"{layer_bytes / 1e6:.1f} MB")

    # the reference on 8 tokens' rows (every group cut to its rows of those tokens)
    pick = np.flatnonzero(rows < 8)
    sub_off = np.searchsorted(pick, offsets).astype(np.int64)
    want = r64.moe_grouped_ffn(x[rows[pick]], sub_off, slots, host_pool)

    # the f16 pool of the same (dequantized) weights through the same KernelSet, every expert cached
    f16_pool = ExpertPool("f16", {"w_gate_up": cp.asarray(w13), "w_down": cp.asarray(w2)})
    with compute:
        y16 = cp.asnumpy(k.moe_grouped_ffn(xg, offsets, slots, f16_pool))
    compute.synchronize()
    res["f16_rel_err"] = r64.relative_error(y16[pick], want)
    res["warm_f16"] = time_ms(cp, lambda: _on(compute, lambda: k.moe_grouped_ffn(xg, offsets, slots, f16_pool)),
                              compute, args.reps)
    del f16_pool
    log(f"warm f16 {res['warm_f16']['median_ms']:.3f} ms (rel err {res['f16_rel_err']:.2e})")
    bounds = np.linspace(0, len(slots), args.batches + 1).astype(int)

    def cold():
        start = cp.cuda.Event()
        start.record(compute)
        copy.wait_event(start)
        for b in range(args.batches):
            g0, g1 = int(bounds[b]), int(bounds[b + 1])
            s0, s1 = int(slots[g0]), int(slots[g1 - 1]) + 1   # ascending slots: one contiguous copy per batch
            n = (s1 - s0) * fmt.nbytes
            cp.cuda.runtime.memcpyAsync(dev_blob.data.ptr + s0 * fmt.nbytes, host.ctypes.data + s0 * fmt.nbytes, n,
                                        cp.cuda.runtime.memcpyHostToDevice, copy.ptr)
            done = cp.cuda.Event()
            done.record(copy)
            compute.wait_event(done)
            r0, r1 = int(offsets[g0]), int(offsets[g1])
            _on(compute, lambda: k.moe_grouped_ffn(xg[r0:r1], offsets[g0:g1 + 1] - r0, slots[g0:g1], pool))

    for name, mma in (("simt", False), ("mma", True)):
        v: dict = {}
        res[name] = v
        try:
            k._quant = QuantGroupedFFN(cp, mma=mma)   # the KernelSet's gguf path, this variant
            with compute:
                y = k.moe_grouped_ffn(xg, offsets, slots, pool)
            compute.synchronize()
            v["rel_err"] = r64.relative_error(cp.asnumpy(y)[pick], want)
            bound = TOL_F16 if mma else TOL_QUANT
            v["warm"] = time_ms(cp, lambda: _on(compute, lambda: k.moe_grouped_ffn(xg, offsets, slots, pool)),
                                compute, args.reps)
            v["warm_x_f16"] = v["warm"]["median_ms"] / res["warm_f16"]["median_ms"]
            v["cold"] = time_ms(cp, cold, compute, args.reps)
            v["cold_x_floor"] = v["cold"]["median_ms"] / res["floor_cold_ms"]
            v["decode"] = time_ms(cp, lambda: _on(compute, lambda: k.moe_grouped_ffn(xd, d_off, d_slots, pool)),
                                  compute, max(args.reps, 50))
            v["decode_us"] = v["decode"]["median_ms"] * 1e3
            v["targets"] = {"cold_prefill_le_1.10x_link_floor": v["cold_x_floor"] <= COLD_TARGET,
                            "warm_prefill_le_1.5x_f16": v["warm_x_f16"] <= WARM_TARGET,
                            "decode_le_50us": v["decode_us"] <= DECODE_TARGET_US,
                            "output_within_bound": v["rel_err"] <= bound}
            log(f"{name}: err {v['rel_err']:.2e} (bound {bound:g}); warm {v['warm']['median_ms']:.3f} ms "
                f"x{v['warm_x_f16']:.2f} of f16 (<= {WARM_TARGET}); cold {v['cold']['median_ms']:.3f} ms "
                f"x{v['cold_x_floor']:.3f} of the link floor (<= {COLD_TARGET}); decode {v['decode_us']:.1f} us "
                f"(<= {DECODE_TARGET_US})")
        except Exception:
            import traceback
            v["error"] = traceback.format_exc()
            log(f"{name} FAILED\n{v['error']}")
    res["targets"] = {name: res[name].get("targets", {}) for name in ("simt", "mma")}


def _on(stream, fn):
    """fn() with `stream` as cupy's current stream."""
    with stream:
        return fn()


def main() -> int:
    """Run; write the JSON (errors included) to --out/quant_layer_h200.json."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--batches", type=int, default=4, help="copy/compute batches of the cold prefill (default 4)")
    ap.add_argument("--templates", type=int, default=4, help="distinct quantized experts (default 4)")
    args = ap.parse_args()
    res: dict = {"schema": "strata.bench.quant_layer/1", "python": platform.python_version(),
                 "shape": {"experts": E, "top_k": K, "hidden": H, "ffn": F, "tokens": T, "gate_up": "q4_k",
                           "down": "q6_k"}}
    try:
        import cupy as cp
        res["device"] = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
        res["cuda_runtime"] = cp.cuda.runtime.runtimeGetVersion()
        res["cupy"] = cp.__version__
        run(args, res)
    except Exception:
        import traceback
        res["error"] = traceback.format_exc()
        log(f"FAILED\n{res['error']}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "quant_layer_h200.json").write_text(json.dumps(res, indent=1, default=str))
    log(json.dumps(res.get("targets", {}), indent=1))
    met = [all(t.values()) and t for t in res.get("targets", {}).values()]
    return 0 if "error" not in res and any(met) else 1


if __name__ == "__main__":
    sys.exit(main())
