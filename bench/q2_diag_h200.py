"""Why the Q4_K_M layer's cold prefill went from 1.076x to 1.655x the link floor (issue 14 item 5; engineer Q, call
q2): one process, the quant bench's layer (bench/quant_layer_h200.py: Qwen3-30B-A3B, gate/up Q4_K, down Q6_K, 4096
tokens), variants timed interleaved round by round (medians), each call's device time (events around it on the
compute stream), the host's enqueue time (perf_counter from the call to its return) and each ring group's host time
(`_group` from _stream_misses); stage timelines (FastMoE.trace, with the host's clock at every mark); cProfile of
three cold and three warm calls; host costs of single steps. Variants, all on a 32-slot ring unless named: "cur",
the working tree's QuantMoE (32-expert scratch halves; copy groups two in flight, RING_GROUPS_IN_FLIGHT) and its
settings by attribute (4fly/3fly: groups in flight, t4/t0: tail sizes, grouped: gemm_mode, r64/r128: rings,
first32/first8: a warm prefill's first group of 32 or 8 experts (the default: a whole half; 8 before); 1lane: gemm_streams=1, no side lanes; g64: scratch
halves of 64 experts, twice the product's budget);
"head", the committed tree before the fix (--old/strata_cuda_head: `git show HEAD:` of strata_cuda's files, named in
its SOURCE.txt) and its settings (split0: split_rows 0, g16: copy groups of 16); "old", 07691a1's
(--old/strata_cuda_old), the cold run of 1.076x; "*f16": FastMoE over the same layer's f16 weights, cold on the same
ring (its own link floor) and warm. Each package's `files("strata_cuda")` is renamed to its own, so its .cu files load.
Writes q2_diag.json, q2_profile.txt under --out.

With --qw (engineer QW, issue 14 item 5's warm prefill): "cur" (the tree's default) and "f16" beside qw_* variants
(QuantMoE attributes: qw_before the settings before QW, the chunk kernel, no speculation, halves in turn;
qw_chunk_whole the chunk kernel in whole-scratch groups; qw_sb_halves the super-block kernel half by half;
qw_spec1_route / qw_spec2_route one or two halves speculated, queued after the routing kernels; qw_spec2 two halves
queued before them; qw_1lane cuBLAS on one stream), warm timelines (trace_warm) and the whole layer's
dequantization by each kernel (dequant_layer).

Run (H200, repository root): python3 bench/q2_diag_h200.py --out $OUT --old .q2_old  (or --qw)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_layer_h200 as qb  # noqa: E402  (the bench's shape, build() and reference)

E, K, H, F, T = qb.E, qb.K, qb.H, qb.F, qb.T
RING_MAX = 128


def groups_of(big: int, tail_sizes: tuple = (4, 2, 2)):
    """miss_groups with copy groups of at most `big` experts (FastMoE's split: head evenly, then the tail)."""
    def sizes(n: int, ring_slots: int, slot_bytes: int = 0) -> list[int]:
        tail = [s for s in tail_sizes if s <= big] if n >= 2 * big else []
        head = n - sum(tail)
        g = -(-head // big) if head > 0 else 0
        return [head // g + (1 if i < head % g else 0) for i in range(g)] + tail
    return sizes


def main() -> int:
    """Every figure of the module docstring into q2_diag.json."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--old", default="", help="directory holding strata_cuda_old (07691a1's strata_cuda)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--templates", type=int, default=4)
    ap.add_argument("--only", default="", help="comma-separated variant names to run (default: all)")
    ap.add_argument("--qw", action="store_true",
                    help="engineer QW's warm-prefill variants (qw_*) beside cur and f16, instead of Q's cold set")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"schema": "strata.bench.q2_diag/1"}
    prof_txt = io.StringIO()
    try:
        run(args, res, prof_txt)
    except Exception:
        res["error"] = traceback.format_exc()
        print(res["error"], flush=True)
    (out / "q2_diag.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "q2_profile.txt").write_text(prof_txt.getvalue())
    return 0 if "error" not in res else 1


def run(args, res: dict, prof_txt: io.StringIO) -> None:
    import cupy as cp

    from strata_core.api.kernels import ExpertPool
    from strata_core.testing import reference64 as r64
    from strata_cuda import fast as new_fast
    from strata_cuda.quant_ffn import QuantMoE, scratch_bytes
    old = head = None
    if args.old:
        sys.path.insert(0, args.old)
        import strata_cuda_head.fast as head_fast
        import strata_cuda_head.quant_ffn as head_q
        import strata_cuda_old.fast as old_fast
        import strata_cuda_old.quant_ffn as old_q
        old, head = (old_fast, old_q), (head_fast, head_q)

    qargs = argparse.Namespace(templates=args.templates)
    fmt, blob, w13, w2 = qb.build(qargs)
    layer_bytes = int(blob.nbytes)
    dev_blob = cp.empty((E + RING_MAX, fmt.nbytes), cp.uint8)
    dev_blob[:E].set(blob)
    pool = ExpertPool("gguf", {"blob": dev_blob}, (fmt,))
    host_mem = cp.cuda.alloc_pinned_memory(layer_bytes)
    host = np.frombuffer(host_mem, np.uint8, layer_bytes).reshape(blob.shape)
    host[:] = blob
    host_pool = ExpertPool("gguf", {"blob": host}, (fmt,))
    ref_pool = ExpertPool("gguf", {"blob": blob}, (fmt,))
    f16_pool = ExpertPool("f16", {"w_gate_up": cp.empty((E + 32, 2 * F, H), cp.float16),
                                  "w_down": cp.empty((E + 32, H, F), cp.float16)})
    f16_pool.arrays["w_gate_up"][:E].set(w13)
    f16_pool.arrays["w_down"][:E].set(w2)
    f16_host_mem = cp.cuda.alloc_pinned_memory(int(w13.nbytes + w2.nbytes))
    h13 = np.frombuffer(f16_host_mem, np.float16, w13.size).reshape(w13.shape)
    h2 = np.frombuffer(f16_host_mem, np.float16, w2.size, offset=w13.nbytes).reshape(w2.shape)
    h13[:], h2[:] = w13, w2
    f16_host = ExpertPool("f16", {"w_gate_up": h13, "w_down": h2})
    rng = np.random.default_rng(1)
    x = rng.standard_normal((T, H)).astype(np.float32)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    xd, ld = cp.asarray(x), cp.asarray(logits)
    want = qb.layer_reference(x, logits, ref_pool, 8)
    warm_map, cold_map = np.arange(E), np.full(E, -1)
    cp.cuda.Device().synchronize()

    copy = cp.cuda.Stream(non_blocking=True)

    def one_copy():
        cp.cuda.runtime.memcpyAsync(dev_blob.data.ptr + E * fmt.nbytes, host.ctypes.data, 32 * fmt.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, copy.ptr)
    lt = qb.time_ms(cp, lambda: [one_copy() for _ in range(4)], copy, 7)
    res["link_bytes_per_s"] = 4 * 32 * fmt.nbytes / (lt["median_ms"] / 1e3)
    res["floor_cold_ms"] = layer_bytes / res["link_bytes_per_s"] * 1e3
    res["f16_floor_cold_ms"] = (w13.nbytes + w2.nbytes) / res["link_bytes_per_s"] * 1e3
    print(f"link {res['link_bytes_per_s'] / 1e9:.1f} GB/s, floor {res['floor_cold_ms']:.3f} ms", flush=True)

    gb = scratch_bytes(H, F, 32)
    variants: dict[str, dict] = {}

    res["variant_errors"] = {}

    only = set(filter(None, args.only.split(",")))

    def add(name, make, p, hp, ring, warm=True, patch=None):
        if only and name not in only:
            return
        if args.qw and name not in ("cur", "f16") and not name.startswith("qw_"):
            return  # --qw: QW's variants, the tree's default and f16 only
        try:
            moe = make()
        except Exception:
            res["variant_errors"][name] = traceback.format_exc()
            print(f"{name} FAILED\n{res['variant_errors'][name]}", flush=True)
            return
        if patch:
            patch(moe)
        variants[name] = {"moe": moe, "pool": p, "host": hp, "ring": ring, "warm": warm}

    def qm(**kw):
        return lambda: QuantMoE(E, K, fmt, group_experts=32, scratch_budget_bytes=gb, **kw)

    def hm(**kw):
        return lambda: head[1].QuantMoE(E, K, fmt, group_experts=32, scratch_budget_bytes=gb, **kw)

    def setter(**kw):
        return lambda m: [setattr(m, k, v) for k, v in kw.items()]

    add("cur", qm(), pool, host_pool, 32)
    if args.qw:
        # QW (issue 14 item 5, warm): "cur" is the tree's default (the super-block kernel, no speculation, groups of
        # the whole scratch); each qw_* changes QuantMoE attributes (call 1 of bench/results/qw_h200/ ran the first
        # set: the speculation on by default, a slower super-block kernel)
        before = dict(dequant_kernel="chunk", warm_spec_halves=0, warm_rest_whole=False)
        add("qw_before", qm(), pool, host_pool, 32, patch=setter(**before))
        add("qw_chunk_whole", qm(), pool, host_pool, 32, patch=setter(dequant_kernel="chunk", warm_spec_halves=0))
        add("qw_sb_halves", qm(), pool, host_pool, 32, patch=setter(warm_spec_halves=0, warm_rest_whole=False))
        add("qw_spec1_route", qm(), pool, host_pool, 32, patch=setter(warm_spec_halves=1, spec_after_route=True))
        add("qw_spec2_route", qm(), pool, host_pool, 32, patch=setter(warm_spec_halves=2, spec_after_route=True))
        add("qw_spec2", qm(), pool, host_pool, 32, patch=setter(warm_spec_halves=2))
        add("qw_1lane", qm(gemm_streams=1), pool, host_pool, 32)
    add("cur_4fly", qm(), pool, host_pool, 32, warm=False, patch=setter(ring_groups_in_flight=4))
    add("cur_3fly", qm(), pool, host_pool, 32, warm=False, patch=setter(ring_groups_in_flight=3))
    add("cur_t4", qm(), pool, host_pool, 32, warm=False, patch=setter(ring_tail=(4,)))
    add("cur_t0", qm(), pool, host_pool, 32, warm=False, patch=setter(ring_tail=()))
    add("cur_grouped", qm(gemm_mode="grouped"), pool, host_pool, 32)
    add("cur_first32", qm(), pool, host_pool, 32, patch=setter(first_group_experts=32))
    add("cur_first8", qm(), pool, host_pool, 32, patch=setter(first_group_experts=8))
    add("cur_1lane", qm(gemm_streams=1), pool, host_pool, 32)
    add("cur_g64", lambda: QuantMoE(E, K, fmt, group_experts=64, scratch_budget_bytes=scratch_bytes(H, F, 64)), pool,
        host_pool, 32)
    add("cur_r64", qm(), pool, host_pool, 64, warm=False)
    add("cur_r128", qm(), pool, host_pool, 128, warm=False)
    add("f16", lambda: new_fast.FastMoE(E, K, H, F), f16_pool, f16_host, 32)
    if head and (not only or only & {"head", "head_split0", "head_g16", "head_f16"}):
        add("head", hm(), pool, host_pool, 32)
        add("head_split0", hm(), pool, host_pool, 32, patch=setter(split_rows=0))
        add("head_g16", hm(), pool, host_pool, 32, warm=False, patch=setter(miss_groups=groups_of(16)))
        add("head_f16", lambda: head[0].FastMoE(E, K, H, F), f16_pool, f16_host, 32)
    if old and (not only or only & {"old", "old_f16"}):
        add("old", lambda: old[1].QuantMoE(E, K, fmt, group_experts=32), pool, host_pool, 32)
        add("old_f16", lambda: old[0].FastMoE(E, K, H, F), f16_pool, f16_host, 32)

    # each ring group's host time, from _stream_misses's self._group calls (an instance attribute over the method;
    # logged only inside cold calls: FastMoE's warm _run_blocks calls self._group too)
    in_cold = {"on": False}
    for name, v in variants.items():
        moe = v["moe"]
        v["group_host_ms"] = []

        def wrapped(*a, _orig=moe._group, _log=v["group_host_ms"], **kw):
            t0 = time.perf_counter()
            _orig(*a, **kw)
            if in_cold["on"]:
                _log.append((time.perf_counter() - t0) * 1e3)
        moe._group = wrapped

    outs = {n: cp.empty((T, H), cp.float32) for n in variants}

    def cold(n):
        v = variants[n]
        in_cold["on"] = True
        try:
            return v["moe"].prefill_layer(xd, ld, v["pool"], cold_map, v["host"], (E, v["ring"]), out=outs[n])
        finally:
            in_cold["on"] = False

    def warm(n):
        v = variants[n]
        y = v["moe"].prefill_layer(xd, ld, v["pool"], warm_map, out=outs[n])
        v["spec"] = dict(getattr(v["moe"], "spec_report", {}))  # QuantMoE's speculation of this call
        return y

    def one(fn, n):
        """(device ms between events on the compute stream, host ms to return, wall ms to done)."""
        st = variants[n]["moe"].compute_stream
        cp.cuda.Device().synchronize()
        a, b = cp.cuda.Event(), cp.cuda.Event()
        t0 = time.perf_counter()
        a.record(st)
        fn(n)
        t1 = time.perf_counter()
        b.record(st)
        b.synchronize()
        t2 = time.perf_counter()
        return cp.cuda.get_elapsed_time(a, b), (t1 - t0) * 1e3, (t2 - t0) * 1e3

    # outputs against the float64 reference, and warm-up (2 calls of each)
    errs = {}
    for n, v in list(variants.items()):
        try:
            for kind, fn in (("cold", cold), ("warm", warm)):
                if kind == "warm" and not v["warm"]:
                    continue
                for _ in range(2):
                    fn(n)
                v["moe"].compute_stream.synchronize()
                cp.cuda.Device().synchronize()
                errs[f"{n}:{kind}"] = r64.relative_error(cp.asnumpy(outs[n])[:8], want)
        except Exception:  # one variant's failure leaves the others to run
            res["variant_errors"][n] = traceback.format_exc()
            print(f"{n} FAILED\n{res['variant_errors'][n]}", flush=True)
            cp.cuda.Device().synchronize()
            del variants[n]
    res["rel_err_vs_float64"] = errs
    print("errors", json.dumps({k: f"{e:.2e}" for k, e in errs.items()}), flush=True)
    for v in variants.values():
        v["group_host_ms"].clear()

    # interleaved rounds
    timing = {f"{n}:{k}": [] for n, v in variants.items() for k in (("cold", "warm") if v["warm"] else ("cold",))}
    for r in range(args.rounds):
        for n, v in variants.items():
            timing[f"{n}:cold"].append(one(cold, n))
            if v["warm"]:
                timing[f"{n}:warm"].append(one(warm, n))
    summary = {}
    for key, ts in timing.items():
        a = np.array(ts)
        n = key.split(":")[0]
        s = {"device_ms": float(np.median(a[:, 0])), "host_enqueue_ms": float(np.median(a[:, 1])),
             "wall_ms": float(np.median(a[:, 2])), "device_min_ms": float(a[:, 0].min()), "runs": ts}
        if key.endswith(":cold"):
            floor = res["f16_floor_cold_ms"] if "f16" in n else res["floor_cold_ms"]
            s["x_floor"] = s["device_ms"] / floor
            g = np.array(variants[n]["group_host_ms"])
            if g.size:
                per = g.size // args.rounds
                s["groups_per_call"] = per
                s["group_host_ms_median"] = float(np.median(g))
                s["group_host_ms_sum_per_call"] = float(g.sum() / args.rounds)
            s["copy_groups"] = int(variants[n]["moe"].stats.copy_groups)
            s["bytes_streamed"] = int(variants[n]["moe"].stats.bytes_streamed)
        else:
            s["spec"] = variants[n].get("spec", {})
        summary[key] = s
        print(f"{key:18s} device {s['device_ms']:7.3f} ms  host {s['host_enqueue_ms']:7.3f} ms"
              + (f"  x{s['x_floor']:.3f} floor, {s.get('groups_per_call')} groups, host/group "
                 f"{s.get('group_host_ms_median', 0):.3f} ms" if "x_floor" in s else ""), flush=True)
    res["timing"] = summary

    # stage timelines: device ms (events) and host ms (perf_counter at the mark) from the first mark
    def timeline(n: str, run) -> list:
        moe = variants[n]["moe"]
        host_t: list = []
        orig_mark = moe._mark

        def mark(name, stream=None):
            host_t.append(time.perf_counter())
            orig_mark(name, stream)
        moe._mark = mark
        moe.trace = []
        cp.cuda.Device().synchronize()
        run(n)
        rep = moe.trace_report()
        moe.trace = None
        del moe._mark
        return [(name, round(d, 4), round((t - host_t[0]) * 1e3, 4)) for (name, d), t in zip(rep, host_t)]

    res["trace"] = {n: timeline(n, cold) for n in ("cur", "head", "old", "cur_4fly") if n in variants}
    # warm timelines (--qw): the same marks, every expert cached
    res["trace_warm"] = {n: timeline(n, warm) for n in ("cur", "qw_before", "qw_spec2_route", "f16")
                         if args.qw and n in variants}
    print("traces", {n: len(t) for n, t in res["trace"].items()}, flush=True)
    # the dequantization of the whole layer alone (--qw), groups of a half on one stream, each kernel
    if args.qw:
        moe = variants["cur"]["moe"]
        res["dequant_kernels"] = {n: {"regs": int(f.num_regs), "local_bytes": int(f.local_size_bytes)}
                                  for n, f in moe._qk.items() if n.startswith("strata_qf_dequant")}
        with moe.compute_stream:
            tab = moe._upload_slots(np.arange(E, dtype=np.int32))
        moe.compute_stream.synchronize()
        g = moe.layout.group_experts
        res["dequant_layer"] = {}
        for kern in ("chunk", "sb"):
            moe.dequant_kernel = kern

            def dq_all():
                with moe.compute_stream:
                    for s0 in range(0, E, g):
                        moe._dequant(pool, tab + 4 * s0, min(g, E - s0), 0)
            t = qb.time_ms(cp, dq_all, moe.compute_stream, 7)
            t["GB_per_s"] = (layer_bytes + w13.nbytes + w2.nbytes) / t["median_ms"] / 1e6  # read + written
            res["dequant_layer"][kern] = t
        moe.dequant_kernel = "sb"
        print("dequant layer", {k: round(v["median_ms"], 3) for k, v in res["dequant_layer"].items()}, flush=True)

    # cProfile of three cold and three warm calls (host side)
    for n, kind, fn in [(k, kind, fn) for k in ("cur", "head", "old", "qw_before") if k in variants
                        for kind, fn in (("cold", cold), ("warm", warm))]:
        cp.cuda.Device().synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(3):
            fn(n)
        variants[n]["moe"].compute_stream.synchronize()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        prof_txt.write(f"===== {n}: 3 {kind} calls, by tottime\n{s.getvalue()}\n")
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(25)
        prof_txt.write(f"===== {n}: 3 {kind} calls, by cumulative\n{s.getvalue()}\n")

    # host cost of single steps on the tree's QuantMoE (no sync inside the loops; the device catches up after)
    moe = variants["cur"]["moe"]
    steps = {}
    cp.cuda.Device().synchronize()
    with moe.compute_stream:
        tab = moe._upload_slots(np.arange(8, dtype=np.int32))
        reps = 50
        t0 = time.perf_counter()
        for _ in range(reps):
            moe._dequant(pool, tab, 8, 0)
        steps["dequant_8_experts_2_launches_us"] = (time.perf_counter() - t0) / reps * 1e6
        t0 = time.perf_counter()
        for _ in range(reps):
            moe._upload_slots(np.arange(8, dtype=np.int32))
        steps["upload_slots_us"] = (time.perf_counter() - t0) / reps * 1e6
        wbuf = cp.empty(3 * H * F, cp.float16)
        abuf = cp.empty(512 * (H + 2 * F), cp.float16)
        ns = np.array([256, 256, 256, 384, 256, 384, 256, 256], np.int64)
        one_ = np.zeros(ns.size, np.int64)
        w13p, w2p = int(wbuf.data.ptr), int(wbuf.data.ptr) + 2 * 2 * F * H
        xs, gu = int(abuf.data.ptr), int(abuf.data.ptr) + 2 * 512 * H
        t0 = time.perf_counter()
        for _ in range(reps):
            moe._gemm_problems(2 * F, H, H, H, 2 * F, one_ + w13p, one_ + xs, one_ + gu, ns)
            moe._ptr_cursor = 0
        steps["gemm_problems_8_experts_2_classes_us"] = (time.perf_counter() - t0) / reps * 1e6
        moe.compute_stream.synchronize()
        from strata_cuda.grouping import gemm_pieces
        cnt = np.array([250, 240, 256, 300, 230, 270, 255, 249], np.int64)
        cap = new_fast.class_rows(cnt)
        t0 = time.perf_counter()
        for _ in range(200):
            gemm_pieces(cnt, cap, 512, new_fast.class_rows)
        steps["gemm_pieces_8_us"] = (time.perf_counter() - t0) / 200 * 1e6
        if head:
            import strata_cuda_head.grouping as hg
            t0 = time.perf_counter()
            for _ in range(200):
                hg.gemm_pieces(cnt, cap, 512, new_fast.class_rows)
            steps["head_gemm_pieces_8_us"] = (time.perf_counter() - t0) / 200 * 1e6
        t0 = time.perf_counter()
        for _ in range(200):
            cp.cuda.Event(disable_timing=True)
        steps["event_create_us"] = (time.perf_counter() - t0) / 200 * 1e6
        ev = cp.cuda.Event(disable_timing=True)
        t0 = time.perf_counter()
        for _ in range(200):
            ev.record(moe.compute_stream)
            moe.copy_stream.wait_event(ev)
        steps["event_record_wait_us"] = (time.perf_counter() - t0) / 200 * 1e6
    cp.cuda.Device().synchronize()
    res["host_steps"] = steps
    print("host steps", json.dumps({k: round(v, 1) for k, v in steps.items()}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
