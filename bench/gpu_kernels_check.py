"""Time the cuda backend's MoE kernels at one Qwen3-30B-A3B layer (128 experts, top-8, hidden 2048, expert FFN 768),
and check the grouped FFN's output against the float64 reference at the bound of its declared precision path.

A benchmark, never a test: it prints one JSON object (`strata.bench.gpu_kernels/1`) and, with --out, writes it there.
The targets the kernels are to be optimized for (H200): warm prefill of one layer at chunk 4096 under 1 ms, decode
of one token under 50 us. Times are the median of --repeat runs after --warmup, measured with CUDA events. After the
timings, the prefill and decode outputs of the first `CHECK_EXPERTS` experts' rows are downloaded and compared with
`strata_core.testing.reference64` on the same (exactly dequantized) weights; each result carries `check` (relative
error, bound, precision path, passed) and the script exits 1 when any check fails.

    python bench/gpu_kernels_check.py [--chunk 4096] [--dtype f16|q8_0|both] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

HIDDEN, FFN, EXPERTS, TOP_K = 2048, 768, 128, 8
#: Experts whose rows the float64 check recomputes (all rows of those groups; the rest of the output is not read).
CHECK_EXPERTS = 4


def _device_pool(cp, dtype: str):
    """128 random experts on the device, in the ExpertPool layout of strata_core.reference.kernels."""
    from strata_core.reference.kernels import QK8_0, ExpertPool
    rs = cp.random.RandomState(0)
    w13 = (rs.standard_normal((EXPERTS, 2 * FFN, HIDDEN), dtype=cp.float32) / np.sqrt(HIDDEN))
    w2 = (rs.standard_normal((EXPERTS, HIDDEN, FFN), dtype=cp.float32) / np.sqrt(FFN))
    if dtype == "f16":
        return ExpertPool("f16", {"w_gate_up": w13.astype(cp.float16), "w_down": w2.astype(cp.float16)})
    arrays = {}
    for name, w in (("gate_up", w13), ("down", w2)):
        b = w.reshape(*w.shape[:-1], w.shape[-1] // QK8_0, QK8_0)
        d = cp.abs(b).max(axis=-1) / 127.0
        q = cp.rint(b / cp.where(d > 0, d, 1)[..., None]).clip(-127, 127).astype(cp.int8)
        arrays[f"{name}_q"], arrays[f"{name}_d"] = q.reshape(w.shape), d.astype(cp.float16)
    return ExpertPool("q8_0", arrays)


def _routed(cp, kernels, tokens: int):
    """Rows of x grouped by expert from routing random logits: (x_rows, offsets numpy, slots numpy)."""
    logits = cp.random.standard_normal((tokens, EXPERTS), dtype=cp.float32)
    ids, _ = kernels.route_topk(logits, TOP_K)
    flat = ids.reshape(-1)
    order = cp.argsort(flat)
    x = cp.random.standard_normal((tokens, HIDDEN), dtype=cp.float32)
    rows = kernels.gather(x, (order // TOP_K).astype(cp.int32))
    counts = cp.bincount(flat, minlength=EXPERTS).get()
    return rows, np.concatenate(([0], np.cumsum(counts))).astype(np.int32), np.arange(EXPERTS, dtype=np.int32)


def _check(cp, kernels, x, offsets, slots, pool, out) -> dict:
    """The first CHECK_EXPERTS groups of `out` against the float64 reference on the same weights, at the path's bound."""
    from strata_core.testing import reference64 as r64
    from strata_core.testing.tolerance import bound_of, precision_of
    groups = [g for g in range(len(slots)) if offsets[g + 1] > offsets[g]][:CHECK_EXPERTS]
    host_pool = pool.with_arrays({n: cp.asnumpy(a[cp.asarray(slots[groups])]) for n, a in pool.arrays.items()})
    got, want = [], []
    for i, g in enumerate(groups):
        lo, hi = int(offsets[g]), int(offsets[g + 1])
        got.append(cp.asnumpy(out[lo:hi]))
        want.append(r64.expert_ffn(host_pool, i, cp.asnumpy(x[lo:hi])))
    path = precision_of(kernels, "moe_grouped_ffn")
    err = r64.relative_error(np.concatenate(got), np.concatenate(want))
    return {"rows": int(sum(len(a) for a in got)), "experts": len(groups), "rel_err": err, "bound": bound_of(path),
            "precision": path, "passed": bool(err <= bound_of(path))}


def _median_ms(cp, fn, warmup: int, repeat: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def main(argv=None) -> int:
    """Run the benchmark and print its JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=4096, help="prompt chunk, tokens")
    ap.add_argument("--dtype", choices=("f16", "q8_0", "both"), default="both")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)

    import cupy as cp
    from strata_cuda.kernels import CupyKernels
    from strata_cuda.probe import probe

    pr = probe()
    if not pr.available:
        print(json.dumps({"schema": "strata.bench.gpu_kernels/1", "error": pr.reason}))
        return 1
    kernels = CupyKernels(0, fast_grouped_ffn=True)
    device = pr.devices[0]
    result = {"schema": "strata.bench.gpu_kernels/1", "device": getattr(device, "info", device).to_json(),
              "version": pr.version,
              "shape": {"hidden": HIDDEN, "ffn": FFN, "experts": EXPERTS, "top_k": TOP_K, "chunk": args.chunk},
              "targets_ms": {"prefill_layer": 1.0, "decode_token": 0.05}, "results": []}
    prefill_x, prefill_off, prefill_slots = _routed(cp, kernels, args.chunk)
    decode_x = cp.random.standard_normal((TOP_K, HIDDEN), dtype=cp.float32)
    decode_off = np.arange(TOP_K + 1, dtype=np.int32)
    decode_slots = np.arange(0, EXPERTS, EXPERTS // TOP_K, dtype=np.int32)[:TOP_K]
    for dtype in (("f16", "q8_0") if args.dtype == "both" else (args.dtype,)):
        pool = _device_pool(cp, dtype)
        flops = 2 * 3 * HIDDEN * FFN * args.chunk * TOP_K
        prefill_ms = _median_ms(cp, lambda: kernels.moe_grouped_ffn(prefill_x, prefill_off, prefill_slots, pool),
                                args.warmup, args.repeat)
        decode_ms = _median_ms(cp, lambda: kernels.moe_grouped_ffn(decode_x, decode_off, decode_slots, pool),
                               args.warmup, args.repeat)
        route_ms = _median_ms(cp, lambda: kernels.route_topk(cp.random.standard_normal((args.chunk, EXPERTS),
                                                                                       dtype=cp.float32), TOP_K),
                              args.warmup, args.repeat)
        checks = {"prefill": _check(cp, kernels, prefill_x, prefill_off, prefill_slots, pool,
                                    kernels.moe_grouped_ffn(prefill_x, prefill_off, prefill_slots, pool)),
                  "decode": _check(cp, kernels, decode_x, decode_off, decode_slots, pool,
                                   kernels.moe_grouped_ffn(decode_x, decode_off, decode_slots, pool))}
        result["results"].append({"dtype": dtype, "prefill_layer_ms": round(prefill_ms, 4),
                                  "prefill_tflops": round(flops / prefill_ms / 1e9, 2),
                                  "decode_token_ms": round(decode_ms, 4),
                                  "route_topk_chunk_ms_incl_logit_rng": round(route_ms, 4), "check": checks})
        del pool
        cp.get_default_memory_pool().free_all_blocks()
    result["check_passed"] = all(c["passed"] for r in result["results"] for c in r["check"].values())
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if result["check_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
