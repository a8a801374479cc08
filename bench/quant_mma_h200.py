"""quant_mma.cu's two launches alone for the Qwen3-30B-A3B layer shape (128 experts, hidden 2048, ffn 768, a
4096-token chunk, top 8: 32768 routed rows), Q4_K gate|up with Q6_K down, against the same stacks through the f16
device-table GEMMs (triton_moe.DeviceGroupedGEMM, the f16 warm layer's), uniform and skewed routing counts.
Writes quant_mma_h200.json under --out. Run on the H200: python bench/quant_mma_h200.py --out bench/results

Weights: a few experts quantized by the project's quantizer, repeated over the blob (the kernels' speed does not
depend on the values). Timed with CUDA events around --reps launches after a warm-up, medians reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

E, H, F, T, K = 128, 2048, 768, 4096, 8


def counts_of(skew: bool, rng: np.random.Generator) -> np.ndarray:
    """Rows per expert: every expert T*K/E (uniform), or a Zipf-like popularity (s = 1.1) over the experts."""
    if not skew:
        return np.full(E, T * K // E, np.int64)
    p = 1.0 / np.arange(1, E + 1) ** 1.1
    p = rng.permutation(p / p.sum())
    c = np.floor(p * T * K).astype(np.int64)
    c[np.argmax(c)] += T * K - int(c.sum())
    return c


def main() -> None:
    """Time and check; write the JSON."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", action="store_true",
                    help="one launch of each kernel of each build (for ncu), nothing timed")
    ap.add_argument("--ablations", action="store_true",
                    help="also time the kernels built without the decode (-DQM_SKIP_DECODE) and without the MMAs")
    args = ap.parse_args()
    import cupy as cp
    from strata_core.api.kernels import ExpertFormat
    from strata_core.reference import quants
    from strata_cuda import quant_mma, triton_moe

    from quant_layer_h200 import time_ms  # bench/ is this script's folder

    fmt = ExpertFormat(hidden=H, ffn=F, gate_up="q4_k", down="q6_k")
    rng = np.random.default_rng(0)
    templates = []
    for _ in range(4):
        w13 = (rng.standard_normal((2 * F, H)) * 0.02).astype(np.float32)
        w2 = (rng.standard_normal((H, F)) * 0.02).astype(np.float32)
        templates.append(np.concatenate([quants.quantize("q4_k", w13).reshape(-1),
                                         quants.quantize("q6_k", w2).reshape(-1)]))
    slot_bytes = templates[0].size
    assert slot_bytes == fmt.gate_up_row_bytes * 2 * F + fmt.down_row_bytes * H, slot_bytes
    blob = cp.asarray(np.stack([templates[e % 4] for e in range(E)]))
    f16_13 = cp.asarray(np.stack([quants.dequantize("q4_k", templates[e % 4][:fmt.down_offset].reshape(2 * F, -1), H)
                                  for e in range(4)]).astype(np.float16))
    f16_2 = cp.asarray(np.stack([quants.dequantize("q6_k", templates[e % 4][fmt.down_offset:].reshape(H, -1), F)
                                 for e in range(4)]).astype(np.float16))
    w13_all = cp.concatenate([f16_13] * (E // 4))
    w2_all = cp.concatenate([f16_2] * (E // 4))
    res: dict = {"schema": "strata.bench.quant_mma/1", "python": platform.python_version(),
                 "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "shape":
                 dict(experts=E, hidden=H, ffn=F, tokens=T, top_k=K), "reps": args.reps,
                 "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "routing": {}}

    def build(options=(), block_rows=quant_mma.DEFAULT_BLOCK_ROWS, input_rows=quant_mma.DEFAULT_INPUT_ROWS):
        return quant_mma.QuantMmaGEMM(H, F, E, "q4_k", "q6_k", fmt.gate_up_row_bytes, fmt.down_row_bytes,
                                      fmt.down_offset, options, block_rows, input_rows)
    # (block rows, input rows) of each build; sm_90a also has blocks of 128 weight rows, for 128 input rows and for
    # 256 (each weight decoded for twice the rows)
    shapes = {"quant_mma": (quant_mma.DEFAULT_BLOCK_ROWS, quant_mma.DEFAULT_INPUT_ROWS)}
    if cp.cuda.Device().compute_capability == "90":
        shapes.update(quant_mma_b128=((128, 128), (128, 128)), quant_mma_m256=((128, 128), (256, 256)))
    ablations = {"_no_decode": ("-DQM_SKIP_DECODE",), "_no_mma": ("-DQM_SKIP_MMA",)} if args.ablations else {}
    mma = build()
    variants = {}
    for name, shape in shapes.items():
        if name != "quant_mma":
            variants[name] = build((), *shape)
        variants.update({name + tag: build(opts, *shape) for tag, opts in ablations.items()})
    f16 = triton_moe.DeviceGroupedGEMM(H, F, E) if triton_moe.available() and not args.profile else None
    st = cp.cuda.Stream(non_blocking=True)
    flops = 2.0 * T * K * (2 * F * H + H * F)
    for skew in (False, True):
        c = counts_of(skew, rng)
        row0 = np.concatenate([[0], np.cumsum(c)[:-1]])
        rows = int(c.sum())
        xs = cp.asarray(rng.standard_normal((rows, H)).astype(np.float16))
        act, ys = cp.empty((rows, F), cp.float16), cp.empty((rows, H), cp.float16)
        act16, ys16 = cp.empty_like(act), cp.empty_like(ys)
        counts_d, row0_d = cp.asarray(c.astype(np.int32)), cp.asarray(row0.astype(np.int32))
        slots_d = cp.arange(E, dtype=cp.int32)

        tables = (counts_d.data.ptr, row0_d.data.ptr, slots_d.data.ptr)

        def ours(g=mma, which="both"):
            if which in ("both", "gate_up"):
                g.gate_up(st.ptr, xs.data.ptr, act.data.ptr, blob.data.ptr, slot_bytes, tables, rows)
            if which in ("both", "down"):
                g.down(st.ptr, act.data.ptr, ys.data.ptr, blob.data.ptr, slot_bytes, tables, rows)

        if args.profile:  # each full build once, uniform routing first (ncu's --launch-count picks)
            for g in [mma, *variants.values()]:
                ours(g)
            st.synchronize()
            continue

        def theirs():
            f16.layer(st.ptr, xs.data.ptr, act16.data.ptr, ys16.data.ptr, w13_all.data.ptr, w2_all.data.ptr,
                      counts_d.data.ptr, row0_d.data.ptr, None, rows)

        r: dict = {"counts_max": int(c.max()), "counts_min": int(c.min()), "row_tiles": len(triton_moe.tile_table(c, quant_mma.BM)[0])}
        timed = [("quant_mma", ours), ("quant_mma_gate_up", lambda: ours(which="gate_up")),
                 ("quant_mma_down", lambda: ours(which="down")), ("f16_device_gemm", theirs if f16 else None)]
        for vname, g in variants.items():
            timed += [(f"{vname}_gate_up", lambda g=g: ours(g, "gate_up")), (f"{vname}_down", lambda g=g: ours(g, "down"))]
        for name, fn in timed:
            if fn is None:
                continue
            t = r[name] = time_ms(cp, fn, st, args.reps)
            part = 2 / 3 if name.endswith("gate_up") else 1 / 3 if name.endswith("down") else 1.0
            t["TFLOP_per_s"] = part * flops / t["median_ms"] / 1e9
        if f16 is not None:  # the same weights (f16 of the same blocks), so the outputs agree to f16 rounding
            def rel(a, b):
                return float(cp.linalg.norm((a - b).astype(cp.float32)) / cp.linalg.norm(b.astype(cp.float32)))
            # each full build's outputs (the ablations' are not products), outside the timed region
            for vname, g in [("quant_mma", mma)] + [(n, g) for n, g in variants.items() if not n.endswith(
                    ("_no_decode", "_no_mma"))]:
                ours(g)
                st.synchronize()
                key = "rel_diff_vs_f16" if vname == "quant_mma" else f"{vname}_rel_diff_vs_f16"
                r[key] = {"act": rel(act, act16), "y": rel(ys, ys16)}
            r["x_f16"] = r["quant_mma"]["median_ms"] / r["f16_device_gemm"]["median_ms"]
        res["routing"]["skewed" if skew else "uniform"] = r
        print(("skewed " if skew else "uniform ") + json.dumps(r), flush=True)
    if args.profile:
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "quant_mma_h200.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
