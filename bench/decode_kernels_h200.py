"""The fused decode kernels at Qwen3-30B-A3B shape (E 128, K 8, H 2048, F 768) on the H200, f16 pools, every expert
cached: each kernel of the decode stack alone (norm + router, gate/up, down: 48 launches over 48 layers in one graph,
so each reads other weights than the last and L2 serves none of them), the 48-layer stack as one graph replay, per
kernel form (FastMoE.decode_form) and with or without programmatic dependent launches (FastMoE.decode_pdl); the LM
head GEMV (151936 x 2048 f16) and the logits' download; a device-to-device copy for the HBM ceiling. Times are CUDA
events around `reps` graph replays after warm-up replays; bytes are the weights each kernel must read (each once).
Every variant's stack output is compared with the first form's, launched plainly, and with a float64 reference of the
48 layers computed on the host from the pool's own weights (its routing, in float64, compared layer by layer with the
ids the kernels published). Writes decode_kernels_h200.json under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

LAYERS, E, K, H, F, VOCAB = 48, 128, 8, 2048, 768, 151936
SLOTS = 1024  # 9.7 GB of f16 experts: layer l's expert e in slot (l * E + e) % SLOTS, reused 8 layers later


def fill_random(cp, a, rng_dev) -> None:
    """a (f16, any shape) filled with N(0, 0.02) values: one 64 MB random block tiled over it (never zeros)."""
    flat = a.reshape(-1)
    blk = (rng_dev.standard_normal(32 << 20, dtype=cp.float32) * 0.02).astype(cp.float16)
    for s in range(0, flat.size, blk.size):
        n = min(blk.size, flat.size - s)
        flat[s:s + n] = blk[:n]


def graph_seconds(cp, stream, body, reps: int) -> float:
    """Seconds per replay of a graph of body's launches (captured on `stream`), events around `reps` replays."""
    with stream:
        stream.begin_capture()
        body()
        g = stream.end_capture()
    for _ in range(3):
        g.launch(stream)
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record(stream)
    for _ in range(reps):
        g.launch(stream)
    e.record(stream)
    e.synchronize()
    return cp.cuda.get_elapsed_time(s, e) / 1e3 / reps


def events_seconds(cp, stream, fn, reps: int) -> float:
    """Seconds per call of fn on `stream` (events around `reps` calls after 3 warm-up calls)."""
    with stream:
        for _ in range(3):
            fn()
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record(stream)
        for _ in range(reps):
            fn()
        e.record(stream)
        e.synchronize()
    return cp.cuda.get_elapsed_time(s, e) / 1e3 / reps


def f64_stack(cp, x0, layers, w13, w2, k: int):
    """The 48-layer decode stack in float64 on the host (rmsnorm, router, top-k, SwiGLU experts read from the pool's
    slots, residual add): (x after the last layer [1,H], each layer's routed ids [L,k])."""
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
        g13, g2 = w13[cp.asarray(slots)].get().astype(np.float64), w2[cp.asarray(slots)].get().astype(np.float64)
        f = g13.shape[1] // 2
        y = np.zeros_like(x)
        for j in range(k):
            gu = g13[j] @ xn
            y += w[j] * (g2[j] @ (gu[:f] / (1 + np.exp(-gu[:f])) * gu[f:]))
        x = x + y
        ids_all.append(ids)
    return x[None, :], np.array(ids_all, dtype=np.int32)


def main() -> int:
    """Time the kernels; print a table and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", default="2", help="decode_rows_per_warp values for gate/up (the first: every variant)")
    ap.add_argument("--forms", default="1,2,3,4,5,6,7,8", help="FastMoE.decode_form values to time")
    args = ap.parse_args()
    args.forms = [int(f) for f in args.forms.split(",") if f]
    import cupy as cp
    from strata_core.api.kernels import ExpertPool
    from strata_cuda.fast import DecodeLayer, FastMoE
    from strata_cuda.kernels import CupyKernels
    res: dict = {"schema": "strata.bench.decode_kernels/2", "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                 "shape": {"layers": LAYERS, "E": E, "K": K, "H": H, "F": F, "vocab": VOCAB, "slots": SLOTS}}
    rng = np.random.default_rng(0)
    rdev = cp.random.default_rng(1)
    t0 = time.perf_counter()
    # HBM ceiling: a 2 GiB device-to-device copy, bytes read plus written
    a = cp.empty(1 << 30, cp.uint16)
    fill_random(cp, a, rdev)
    b = cp.empty_like(a)
    st = cp.cuda.Stream(non_blocking=True)
    cp_s = events_seconds(cp, st, lambda: b.__setitem__(slice(None), a), 10)
    res["hbm_copy_bytes_per_s"] = 2 * a.nbytes / cp_s
    del a, b
    w13 = cp.empty((SLOTS, 2 * F, H), cp.float16)
    w2 = cp.empty((SLOTS, H, F), cp.float16)
    fill_random(cp, w13, rdev)
    fill_random(cp, w2, rdev)
    pool = ExpertPool("f16", {"w_gate_up": w13, "w_down": w2})
    expert_bytes = int(w13[0].nbytes + w2[0].nbytes)
    maps = cp.asarray(((np.arange(LAYERS)[:, None] * E + np.arange(E)[None, :]) % SLOTS).astype(np.int32))
    ids = cp.zeros((LAYERS, K), cp.int32)
    wts = cp.zeros((LAYERS, K), cp.float32)
    slots = cp.zeros((LAYERS, K), cp.int32)  # the third forms' routed slots, one row a layer for the kernels alone
    norms = [cp.asarray((1 + 0.1 * rng.standard_normal(H)).astype(np.float32)) for _ in range(LAYERS)]
    routers = [cp.asarray((rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32)) for _ in range(LAYERS)]
    layers = [DecodeLayer(norm_w=norms[i], router_w=routers[i], pool=pool, slot_map=maps[i], ids=ids[i], w=wts[i])
              for i in range(LAYERS)]
    x0 = cp.asarray(rng.standard_normal((1, H), dtype=np.float32))
    x = x0.copy()
    cp.cuda.Device().synchronize()
    res["setup_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    want, want_ids = f64_stack(cp, x0.get(), layers, w13, w2, K)
    res["reference_s"] = time.perf_counter() - t1
    rows_list = [int(r) for r in args.rows.split(",") if r]
    variants = []
    base_out = None
    for rows in rows_list:
        moe = FastMoE(E, K, H, F, decode_rows_per_warp=rows)
        bufs = moe.decode_buffers()
        stream = moe.compute_stream
        for form in args.forms:
            for pdl in (False, True):
                if rows != rows_list[0] and not (form == 2 and pdl):
                    continue
                moe.decode_form, moe.decode_pdl = form, pdl
                moe._graphs.clear()
                row = {"rows_per_warp": rows, "form": form, "pdl": pdl}
                # one stack replay from x0: its output against the first variant's
                x[...] = x0
                cp.cuda.Device().synchronize()  # the copy ran on the legacy stream; compute_stream does not wait for it
                moe.decode_stack(x, layers, graph=True)
                stream.synchronize()
                out = x.get()
                if base_out is None:
                    base_out = out
                row["stack_vs_first_rel"] = float(np.abs(out - base_out).max() / np.abs(base_out).max())
                row["stack_vs_f64_rel"] = float(np.linalg.norm(out - want) / np.linalg.norm(want))
                unlike = (np.sort(ids.get(), axis=1) != np.sort(want_ids, axis=1)).any(axis=1)
                row["layers_routed_unlike_f64"] = int(unlike.sum())
                row["finite"] = bool(np.isfinite(out).all())
                x[...] = x0
                cp.cuda.Device().synchronize()
                row["stack_s"] = events_seconds(cp, stream, lambda: moe.decode_stack(x, layers, graph=True), args.reps)
                row["stack_us_per_layer"] = row["stack_s"] / LAYERS * 1e6
                row["stack_routed_bytes_per_s"] = K * expert_bytes * LAYERS / row["stack_s"]
                warps = 8
                xn, lg = bufs["xn"], bufs["logits"]

                def norm_body():
                    for lay in layers:
                        if form >= 2:
                            moe._dlaunch("strata_fast_decode_norm_route2", ((E + 3) // 4,), (128,),
                                         (x, lay.norm_w, lay.router_w, np.int32(E), np.int32(H), np.float32(1e-6),
                                          xn, lg))
                        else:
                            moe._dlaunch("strata_fast_decode_norm_route", ((E + warps - 1) // warps,), (256,),
                                         (x, lay.norm_w, lay.router_w, np.int32(E), np.int32(H), np.float32(1e-6),
                                          xn, lg))

                def gate_up_body():
                    for i, lay in enumerate(layers):
                        moe._gate_up(xn, lg, pool, lay.slot_map, None, 0, 0, ids_out=lay.ids, w_out=lay.w,
                                     slots_out=slots[i])

                out_buf = bufs["out"]

                def down_body():
                    for i, lay in enumerate(layers):
                        moe._down(pool, lay.slot_map, None, 0, out_buf, 0, accumulate=0, ids=lay.ids, w=lay.w,
                                  slots=slots[i])

                for name, body, nbytes in (("norm_route", norm_body, E * H * 4),
                                           ("gate_up", gate_up_body, K * int(w13[0].nbytes)),
                                           ("down", down_body, K * int(w2[0].nbytes))):
                    sec = graph_seconds(cp, moe._capture_stream, body, args.reps) / LAYERS
                    row[f"{name}_us"] = sec * 1e6
                    row[f"{name}_bytes_per_s"] = nbytes / sec
                variants.append(row)
                res["variants"] = variants
                Path(args.out).mkdir(parents=True, exist_ok=True)
                (Path(args.out) / "decode_kernels_h200.json").write_text(json.dumps(res, indent=1))
                print(f"f64 {row['stack_vs_f64_rel']:.2e} ({row['layers_routed_unlike_f64']} layers routed otherwise); "
                      f"rows {rows} form {form} pdl {pdl!s:5}: stack {row['stack_s'] * 1e3:.3f} ms "
                      f"({row['stack_us_per_layer']:.1f} us/layer, {row['stack_routed_bytes_per_s'] / 1e12:.2f} TB/s); "
                      f"alone x48: norm+route {row['norm_route_us']:.1f} us, gate/up {row['gate_up_us']:.1f} us "
                      f"({row['gate_up_bytes_per_s'] / 1e12:.2f} TB/s), down {row['down_us']:.1f} us "
                      f"({row['down_bytes_per_s'] / 1e12:.2f} TB/s); vs first {row['stack_vs_first_rel']:.2e}",
                      flush=True)
        del moe
    res["variants"] = variants
    res["expert_bytes"] = expert_bytes
    del pool, w13, w2
    cp.get_default_memory_pool().free_all_blocks()
    # the LM head of one token and its logits' download
    k = CupyKernels(0)
    head = cp.empty((VOCAB, H), cp.float16)
    fill_random(cp, head, rdev)
    xh = cp.asarray(rng.standard_normal((1, H), dtype=np.float32))
    lg_out = cp.empty((1, VOCAB), cp.float32)
    st = cp.cuda.get_current_stream()
    hs = events_seconds(cp, st, lambda: k.linear(xh, head, out=lg_out), args.reps)
    res["lm_head_s"] = hs  # moe.cu's strata_gemv_f16w_f32 (CupyKernels.linear), the head before
    res["lm_head_bytes_per_s"] = head.nbytes / hs
    want = lg_out.get()
    moe = FastMoE(E, K, H, F)
    for pdl in (False, True):
        moe.decode_pdl = pdl
        tag = "pdl" if pdl else "plain"
        lg2 = cp.empty((1, VOCAB), cp.float32)
        sec = events_seconds(cp, st, lambda: moe.gemv_f16w(xh, head, lg2), args.reps)
        got = lg2.get()
        res[f"lm_head_fast_{tag}_s"] = sec
        res[f"lm_head_fast_{tag}_bytes_per_s"] = head.nbytes / sec
        res[f"lm_head_fast_{tag}_vs_before_rel"] = float(np.abs(got - want).max() / np.abs(want).max())
        print(f"LM head, moe_fast GEMV ({tag}): {sec * 1e6:.1f} us ({head.nbytes / sec / 1e12:.2f} TB/s), "
              f"max diff from moe.cu's {res[f'lm_head_fast_{tag}_vs_before_rel']:.2e}", flush=True)
    nb = lg_out.nbytes
    t = []
    for _ in range(20):
        t1 = time.perf_counter()
        h = np.empty(lg_out.shape, np.float32)
        cp.cuda.runtime.memcpy(h.ctypes.data, lg_out.data.ptr, nb, cp.cuda.runtime.memcpyDeviceToHost)
        t.append(time.perf_counter() - t1)
    res["logits_download_pageable_s"] = float(np.median(t))
    pin = cp.cuda.alloc_pinned_memory(nb)
    hp = np.frombuffer(pin, np.float32, VOCAB)
    t = []
    for _ in range(20):
        t1 = time.perf_counter()
        cp.cuda.runtime.memcpy(hp.ctypes.data, lg_out.data.ptr, nb, cp.cuda.runtime.memcpyDeviceToHost)
        t.append(time.perf_counter() - t1)
    res["logits_download_pinned_s"] = float(np.median(t))
    t = []
    for _ in range(20):
        t1 = time.perf_counter()
        int(np.argmax(hp))
        t.append(time.perf_counter() - t1)
    res["logits_argmax_host_s"] = float(np.median(t))
    print(f"HBM copy {res['hbm_copy_bytes_per_s'] / 1e12:.2f} TB/s; LM head {hs * 1e6:.1f} us "
          f"({res['lm_head_bytes_per_s'] / 1e12:.2f} TB/s); logits download pageable "
          f"{res['logits_download_pageable_s'] * 1e6:.0f} us, pinned {res['logits_download_pinned_s'] * 1e6:.0f} us; "
          f"host argmax {res['logits_argmax_host_s'] * 1e6:.0f} us", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_kernels_h200.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
