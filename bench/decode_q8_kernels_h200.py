"""The Q8_0 decode kernels at Qwen3-30B-A3B shape (E 128, K 8, H 2048, F 768) on the H200, every expert cached, per
compiled variant of the third-form Q8_0 pair (strata_cuda.fast.Q8_DECODE_VARIANTS: the int8 conversion or the exact
byte permute; 16-quant chunks a lane or whole Q8_0 blocks): the 48-layer stack as one graph replay
(FastMoE.decode_stack, the path `strata run`'s decode step replays) and each kernel alone (48 launches over 48 layers
in one graph, so L2 serves none of them). Times are CUDA events around `reps` replays after warm-up replays; bytes
are the quants and scales each kernel must read (each once). Every variant's stack output must equal, bit for bit,
the first variant's of its sum order (fast.Q8_DECODE_CHUNK_ORDER: the same products summed in the same order) and is
compared with a float64 reference of the 48 layers computed on the host from the pool's own quants and scales
(q x d exactly; --no-reference skips it, as under a profiler). Writes decode_q8_kernels_h200.json under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_kernels_h200 import events_seconds, graph_seconds  # noqa: E402

LAYERS, E, K, H, F = 48, 128, 8, 2048, 768
SLOTS = 2048  # 10 GB of Q8_0 experts: layer l's expert e in slot (l * E + e) % SLOTS
QK = 32


def q8_pool(cp, rdev):
    """Device Q8_0 arrays of SLOTS experts: quants uniform in [-127, 127], scales |N(0, 2e-4)| with random signs."""
    gq = cp.empty((SLOTS, 2 * F, H), cp.int8)
    dq = cp.empty((SLOTS, H, F), cp.int8)
    for s in range(0, SLOTS, 128):  # int32 draws a slice at a time (the whole pool's would be 40 GB)
        gq[s:s + 128] = rdev.integers(-127, 128, size=gq[s:s + 128].shape, dtype=cp.int32).astype(cp.int8)
        dq[s:s + 128] = rdev.integers(-127, 128, size=dq[s:s + 128].shape, dtype=cp.int32).astype(cp.int8)
    gd = (rdev.standard_normal((SLOTS, 2 * F, H // QK), dtype=cp.float32) * 2e-4).astype(cp.float16)
    dd = (rdev.standard_normal((SLOTS, H, F // QK), dtype=cp.float32) * 2e-4).astype(cp.float16)
    return {"gate_up_q": gq, "gate_up_d": gd.view(cp.uint16), "down_q": dq, "down_d": dd.view(cp.uint16)}


def exact(cp, q, d, slot: int) -> np.ndarray:
    """One slot's matrix as q x d in float64 (the Q8_0 decode kernels compute from exactly these values)."""
    qq = q[slot].get().astype(np.float64)
    dd = d[slot].view(cp.float16).get().astype(np.float64)
    return qq * np.repeat(dd, QK, axis=1)


def f64_stack(cp, x0, layers, arrays, k: int):
    """The 48-layer decode stack in float64 (rmsnorm, router, top-k, SwiGLU experts from the pool's slots, residual)."""
    x = x0.astype(np.float64)[0]
    ids_all = []
    for lay in layers:
        nw, r = lay.norm_w.get().astype(np.float64), lay.router_w.get().astype(np.float64)
        xn = x / np.sqrt((x * x).mean() + lay.eps) * nw
        logits = r @ xn
        ids = np.argsort(-logits, kind="stable")[:k]
        w = np.exp(logits[ids] - logits[ids[0]])
        w /= w.sum()
        slots = lay.slot_map.get()[ids]
        y = np.zeros_like(x)
        for j in range(k):
            gu = exact(cp, arrays["gate_up_q"], arrays["gate_up_d"], int(slots[j])) @ xn
            dn = exact(cp, arrays["down_q"], arrays["down_d"], int(slots[j]))
            y += w[j] * (dn @ (gu[:F] / (1 + np.exp(-gu[:F])) * gu[F:]))
        x = x + y
        ids_all.append(ids)
    return x[None, :], np.array(ids_all, dtype=np.int32)


def main() -> int:
    """Time every variant; print a line each and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-reference", action="store_true", help="skip the float64 reference (its figures are NaN)")
    ap.add_argument("--variants", default="", help="Q8_DECODE_VARIANTS keys (default: all, the cast first)")
    args = ap.parse_args()
    import cupy as cp
    from strata_core.api.kernels import ExpertPool
    from strata_cuda import fast
    from strata_cuda.fast import DecodeLayer, FastMoE
    variants = [v for v in args.variants.split(",") if v] or ["cast"] + [v for v in fast.Q8_DECODE_VARIANTS
                                                                        if v != "cast"]
    res: dict = {"schema": "strata.bench.decode_q8_kernels/1",
                 "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                 "shape": {"layers": LAYERS, "E": E, "K": K, "H": H, "F": F, "slots": SLOTS},
                 "decode_form": fast.DECODE_FORM, "default_variant": fast.Q8_DECODE}
    rng = np.random.default_rng(0)
    rdev = cp.random.default_rng(1)
    t0 = time.perf_counter()
    arrays = q8_pool(cp, rdev)
    pool = ExpertPool("q8_0", arrays)
    gu_bytes = int(arrays["gate_up_q"][0].nbytes + arrays["gate_up_d"][0].nbytes)
    dn_bytes = int(arrays["down_q"][0].nbytes + arrays["down_d"][0].nbytes)
    maps = cp.asarray(((np.arange(LAYERS)[:, None] * E + np.arange(E)[None, :]) % SLOTS).astype(np.int32))
    ids = cp.zeros((LAYERS, K), cp.int32)
    wts = cp.zeros((LAYERS, K), cp.float32)
    slots = cp.zeros((LAYERS, K), cp.int32)
    norms = [cp.asarray((1 + 0.1 * rng.standard_normal(H)).astype(np.float32)) for _ in range(LAYERS)]
    routers = [cp.asarray((rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32)) for _ in range(LAYERS)]
    layers = [DecodeLayer(norm_w=norms[i], router_w=routers[i], pool=pool, slot_map=maps[i], ids=ids[i], w=wts[i])
              for i in range(LAYERS)]
    x0 = cp.asarray(rng.standard_normal((1, H), dtype=np.float32))
    x = x0.copy()
    cp.cuda.Device().synchronize()
    res["setup_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    if args.no_reference:
        want, want_ids = np.full((1, H), np.nan), np.full((LAYERS, K), -1, np.int32)
    else:
        want, want_ids = f64_stack(cp, x0.get(), layers, arrays, K)
    res["reference_s"] = time.perf_counter() - t1
    rows, base_outs = [], {}  # the first variant of each sum order: the others of that order must give its bits
    for v in variants:
        moe = FastMoE(E, K, H, F, q8_decode=v)
        bufs = moe.decode_buffers()
        stream = moe.compute_stream
        row = {"variant": v, "compiled": dict(zip(("prmt", "blk", "min_blocks"), fast.Q8_DECODE_VARIANTS[v]))}
        x[...] = x0
        cp.cuda.Device().synchronize()
        moe.decode_stack(x, layers, graph=True)
        stream.synchronize()
        out = x.get()
        order = "chunk" if v in fast.Q8_DECODE_CHUNK_ORDER else "block"
        base_out = base_outs.setdefault(order, out)
        row["sum_order"] = order
        row["stack_bits_equal_first"] = bool(np.array_equal(out.view(np.uint32), base_out.view(np.uint32)))
        row["stack_vs_f64_rel"] = float(np.linalg.norm(out - want) / np.linalg.norm(want))
        row["layers_routed_unlike_f64"] = int((np.sort(ids.get(), axis=1) != np.sort(want_ids, axis=1)).any(1).sum())
        row["finite"] = bool(np.isfinite(out).all())
        x[...] = x0
        cp.cuda.Device().synchronize()
        row["stack_s"] = events_seconds(cp, stream, lambda: moe.decode_stack(x, layers, graph=True), args.reps)
        row["stack_us_per_layer"] = row["stack_s"] / LAYERS * 1e6
        row["stack_routed_bytes_per_s"] = K * (gu_bytes + dn_bytes) * LAYERS / row["stack_s"]
        xn, lg, out_buf = bufs["xn"], bufs["logits"], bufs["out"]

        def norm_body():
            for lay in layers:
                moe._dlaunch("strata_fast_decode_norm_route2", ((E + 3) // 4,), (128,),
                             (x, lay.norm_w, lay.router_w, np.int32(E), np.int32(H), np.float32(1e-6), xn, lg))

        def gate_up_body():
            for i, lay in enumerate(layers):
                moe._gate_up(xn, lg, pool, lay.slot_map, None, 0, 0, ids_out=lay.ids, w_out=lay.w, slots_out=slots[i])

        def down_body():
            for i, lay in enumerate(layers):
                moe._down(pool, lay.slot_map, None, 0, out_buf, 0, accumulate=0, ids=lay.ids, w=lay.w, slots=slots[i])

        for name, body, nbytes in (("norm_route", norm_body, E * H * 4), ("gate_up", gate_up_body, K * gu_bytes),
                                   ("down", down_body, K * dn_bytes)):
            sec = graph_seconds(cp, moe._capture_stream, body, args.reps) / LAYERS
            row[f"{name}_us"] = sec * 1e6
            row[f"{name}_bytes_per_s"] = nbytes / sec
        rows.append(row)
        res["variants"] = rows
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "decode_q8_kernels_h200.json").write_text(json.dumps(res, indent=1))
        print(f"{v:14s} stack {row['stack_s'] * 1e3:.3f} ms ({row['stack_us_per_layer']:.1f} us/layer, "
              f"{row['stack_routed_bytes_per_s'] / 1e12:.2f} TB/s) bits==first {row['stack_bits_equal_first']} "
              f"f64 {row['stack_vs_f64_rel']:.1e} ({row['layers_routed_unlike_f64']} routed otherwise); alone x48: "
              f"norm {row['norm_route_us']:.1f} us, gate/up {row['gate_up_us']:.1f} us "
              f"({row['gate_up_bytes_per_s'] / 1e12:.2f} TB/s), down {row['down_us']:.1f} us "
              f"({row['down_bytes_per_s'] / 1e12:.2f} TB/s)", flush=True)
        del moe
    bad = [r["variant"] for r in rows if not (r["stack_bits_equal_first"] and r["finite"])]
    res["all_variants_bit_equal"] = not bad
    (Path(args.out) / "decode_q8_kernels_h200.json").write_text(json.dumps(res, indent=1))
    if bad:
        print(f"variants whose stack differs from the first or is not finite: {bad}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
