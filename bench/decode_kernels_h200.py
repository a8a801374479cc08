"""The fused decode kernels at Qwen3-30B-A3B shape (E 128, K 8, H 2048, F 768) on the H200, f16 and Q8_0 pools,
every expert cached: each kernel of one layer alone (norm + router, gate/up, down) and the 48-layer stack as one
graph replay, timed with CUDA events around `reps` launches after a warm-up; with the bytes each reads and the HBM
rate that gives. Writes decode_kernels_h200.json under --out. The weights are random (the kernels' time does not
depend on the values); every layer reads its own slots, so the stack is not served from L2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

LAYERS, E, K, H, F = 48, 128, 8, 2048, 768


def timed(cp, fn, reps: int) -> float:
    """Seconds per call of fn on the current stream (events around `reps` calls, after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return cp.cuda.get_elapsed_time(s, e) / 1e3 / reps


def main() -> int:
    """Time the kernels; print and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    import cupy as cp
    from strata_core.api.kernels import ExpertPool
    from strata_cuda.fast import DecodeLayer, FastMoE
    res: dict = {"schema": "strata.bench.decode_kernels/1", "shape": {"layers": LAYERS, "E": E, "K": K, "H": H, "F": F},
                 "runs": {}}
    rng = np.random.default_rng(0)
    slots = LAYERS * E
    for dtype in ("f16", "q8_0"):
        moe = FastMoE(E, K, H, F)
        shapes = ({"w_gate_up": ((2 * F, H), cp.float16), "w_down": ((H, F), cp.float16)} if dtype == "f16" else
                  {"gate_up_q": ((2 * F, H), cp.int8), "gate_up_d": ((2 * F, H // 32), cp.float16),
                   "down_q": ((H, F), cp.int8), "down_d": ((H, F // 32), cp.float16)})
        arrays = {n: cp.empty((slots, *shp), dt) for n, (shp, dt) in shapes.items()}
        for n, a in arrays.items():  # random values made on the device, 256 slots at a time
            for s0 in range(0, slots, 256):
                part = a[s0:s0 + 256]
                if a.dtype == cp.int8:
                    part[...] = cp.random.randint(-127, 128, part.shape, dtype=cp.int32).astype(cp.int8)
                elif n.endswith("_d"):
                    part[...] = cp.float16(1e-4)
                else:
                    part[...] = (cp.random.standard_normal(part.shape, dtype=cp.float32) * 0.02).astype(cp.float16)
        cp.cuda.Device().synchronize()
        pool = ExpertPool(dtype, arrays)
        expert_bytes = sum(int(a[0].nbytes) for a in arrays.values())
        maps = cp.asarray((np.arange(LAYERS)[:, None] * E + np.arange(E)[None, :]).astype(np.int32))
        ids = cp.zeros((LAYERS, K), cp.int32)
        wts = cp.zeros((LAYERS, K), cp.float32)
        norms = [cp.ones(H, cp.float32) for _ in range(LAYERS)]
        routers = [cp.asarray(rng.standard_normal((E, H), dtype=np.float32) / np.sqrt(H)) for _ in range(LAYERS)]
        layers = [DecodeLayer(norm_w=norms[i], router_w=routers[i], pool=pool, slot_map=maps[i], ids=ids[i],
                              w=wts[i]) for i in range(LAYERS)]
        x = cp.asarray(rng.standard_normal((1, H), dtype=np.float32))
        b = moe.decode_buffers()
        stream = moe.compute_stream
        warps = 256 // 32
        lay = layers[0]
        row = {"expert_bytes": expert_bytes}
        with stream:
            row["norm_route_s"] = timed(cp, lambda: moe._k["strata_fast_decode_norm_route"](
                ((E + warps - 1) // warps,), (256,), (x, lay.norm_w, lay.router_w, np.int32(E), np.int32(H),
                                                       np.float32(1e-6), b["xn"], b["logits"])), args.reps)
            row["gate_up_s"] = timed(cp, lambda: moe._gate_up(b["xn"], b["logits"], pool, lay.slot_map, None, 0, 0,
                                                              ids_out=lay.ids, w_out=lay.w), args.reps)
            row["down_s"] = timed(cp, lambda: moe._down(pool, lay.slot_map, None, 0, b["out"], 0, accumulate=0,
                                                        ids=lay.ids, w=lay.w), args.reps)
        moe.decode_stack(x, layers, graph=True)  # capture once
        stream.synchronize()
        with stream:
            row["stack_graph_s"] = timed(cp, lambda: moe.decode_stack(x, layers, graph=True), args.reps)
        row["stack_us_per_layer"] = row["stack_graph_s"] / LAYERS * 1e6
        # the routed experts' bytes of one layer, read once: what the HBM must deliver per layer at least
        row["routed_bytes_per_layer"] = K * expert_bytes
        row["stack_hbm_bytes_per_s"] = K * expert_bytes * LAYERS / row["stack_graph_s"]
        res["runs"][dtype] = row
        print(f"{dtype}: norm+route {row['norm_route_s'] * 1e6:.1f} us, gate/up {row['gate_up_s'] * 1e6:.1f} us, "
              f"down {row['down_s'] * 1e6:.1f} us; 48-layer graph {row['stack_graph_s'] * 1e3:.3f} ms "
              f"({row['stack_us_per_layer']:.1f} us/layer, {row['stack_hbm_bytes_per_s'] / 1e12:.2f} TB/s of routed "
              f"weights)", flush=True)
        del pool, arrays, layers, moe
        cp.get_default_memory_pool().free_all_blocks()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_kernels_h200.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
