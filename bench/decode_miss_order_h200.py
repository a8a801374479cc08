"""A decode layer with missed experts at Qwen3-30B-A3B shape (E 128, K 8, H 2048, F 768) on the H200, f16 and Q8_0
pools: the third-form gate/up and down kernels (FastMoE's default form) reading the misses from mapped page-locked
memory, with the gate/up blocks in rank order (STRATA_MISSES_FIRST=0) and with the misses first (the default).
(bench/results/lead_h200_s11/call1_decode_miss_order_h200.json also has `miss_hint`, a variant of commit ac292c4 that
hinted a miss's down matrix into L2 from the gate/up kernel: no effect, removed.)

Each timed graph is 16 layers on the same buffers, each routing its own 8 experts (16 x 8 = all 128, so L2 holds
none of them from the layer before), the misses at the same ranks in every layer; time per layer is CUDA events
around `reps` replays over 16. The link figure is one expert's bytes copied host to device (cudaMemcpyAsync from
the same page-locked pool), and `serial_bound_us` is the layer without misses plus that many copies: a layer under
it overlaps its misses' reads with the cached experts' work. Every variant must give the same bits (the blocks write
act at their expert's rank). `mapped_read_ceiling`: how fast a plain kernel (G blocks of 256
threads, U 16-byte loads a lane in flight) reads one expert's bytes, and 64 MiB, from the same mapped page-locked
pool: the rate the miss reads could reach. Writes decode_miss_order_h200.json under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

E, K, H, F = 128, 8, 2048, 768
LAYERS_IN_GRAPH = E // K
PATTERNS = {"none": [], "rank0": [0], "rank7": [7], "ranks3,7": [3, 7], "ranks5,6,7": [5, 6, 7]}
#: variant -> DECODE_MISSES_FIRST
VARIANTS = {"rank_order": False, "misses_first": True}
READ_SRC = r"""
extern "C" __global__ void mapped_read(const uint4* __restrict__ src, long long n16, int unroll,
                                       unsigned int* __restrict__ sink) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    unsigned int acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n16; i += stride * unroll) {
        uint4 v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const long long k = i + j * stride;
            v[j] = (j < unroll && k < n16) ? src[k] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads; practically never written
}
"""


def read_ceiling(cp, host_ptr: int, expert_bytes: int, reps: int) -> dict:
    """GB/s of mapped_read over one expert's bytes and over 64 MiB at host_ptr, per (blocks, loads a lane)."""
    from decode_kernels_h200 import events_seconds
    ker = cp.RawKernel(READ_SRC, "mapped_read")
    sink = cp.zeros(1, cp.uint32)
    stream = cp.cuda.Stream(non_blocking=True)
    rows = {}
    for nbytes in (expert_bytes, 64 << 20):
        n16 = nbytes // 16
        for blocks in (32, 66, 132, 264, 528):
            for unroll in (1, 4, 8):
                args = (np.uint64(host_ptr), np.int64(n16), np.int32(unroll), sink)
                sec = float(np.median([events_seconds(cp, stream, lambda: ker((blocks,), (256,), args), reps)
                                       for _ in range(5)]))
                rows[f"{nbytes}B_{blocks}x256_u{unroll}"] = {"bytes": nbytes, "blocks": blocks, "loads_a_lane": unroll,
                                                              "us": sec * 1e6, "GB_per_s": nbytes / sec / 1e9}
    best = {}
    for r in rows.values():
        b = best.get(r["bytes"])
        if b is None or r["GB_per_s"] > b["GB_per_s"]:
            best[r["bytes"]] = r
    return {"runs": rows, "best": {str(k): v for k, v in best.items()}}


def host_pool(cp, dtype: str, rng):
    """All E experts page-locked, one random block tiled over each array (values never matter to the time)."""
    from strata_core.api.kernels import ExpertPool
    shapes = ({"w_gate_up": ((E, 2 * F, H), np.float16), "w_down": ((E, H, F), np.float16)} if dtype == "f16" else
              {"gate_up_q": ((E, 2 * F, H), np.int8), "gate_up_d": ((E, 2 * F, H // 32), np.float16),
               "down_q": ((E, H, F), np.int8), "down_d": ((E, H, F // 32), np.float16)})
    arrays, keep = {}, []
    for name, (shape, dt) in shapes.items():
        n = int(np.prod(shape))
        mem = cp.cuda.alloc_pinned_memory(n * np.dtype(dt).itemsize)
        keep.append(mem)
        a = np.frombuffer(mem, dtype=dt, count=n)
        if dt == np.int8:
            blk = rng.integers(-127, 128, 1 << 22, dtype=np.int8)
        else:
            scale = 0.02 if dtype == "f16" else 1e-3
            blk = (rng.standard_normal(1 << 22, dtype=np.float32) * scale).astype(np.float16)
        for s in range(0, n, blk.size):
            a[s:s + blk.size] = blk[:min(blk.size, n - s)]
        arrays[name] = a.reshape(shape)
    return ExpertPool(dtype, arrays), keep


def main() -> int:
    """Time the patterns in both block orders for f16 and Q8_0; print a table and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--dtypes", default="q8_0,f16")
    args = ap.parse_args()
    import cupy as cp
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from decode_kernels_h200 import graph_seconds
    from strata_core.api.kernels import ExpertPool
    from strata_cuda import fast

    rng = np.random.default_rng(7)
    result = {"schema": "strata.bench.decode_miss_order/1", "shape": {"experts": E, "top_k": K, "hidden": H, "ffn": F},
              "layers_in_graph": LAYERS_IN_GRAPH, "reps": args.reps, "decode_form": fast.DECODE_FORM,
              "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "dtypes": {}}
    moes = {}
    for name, mf in VARIANTS.items():
        fast.DECODE_MISSES_FIRST = mf
        moes[name] = fast.FastMoE(E, K, H, F)
    fast.DECODE_MISSES_FIRST = True
    x = cp.asarray(rng.standard_normal((1, H)).astype(np.float32))
    # layer j routes experts j*K .. j*K+K-1, rank r = expert j*K + r (descending logits)
    logits = []
    for j in range(LAYERS_IN_GRAPH):
        lg = np.full((1, E), -10.0, np.float32)
        lg[0, j * K:(j + 1) * K] = np.arange(K, 0, -1, dtype=np.float32)
        logits.append(cp.asarray(lg))
    for dtype in args.dtypes.split(","):
        hp, keep = host_pool(cp, dtype, rng)
        pool = ExpertPool(dtype, {n: cp.asarray(a) for n, a in hp.arrays.items()})  # slot e holds expert e
        cp.cuda.Device().synchronize()
        expert_bytes = sum(a[0].nbytes for a in hp.arrays.values())
        # the link: one expert's arrays copied host -> device, as one stream's copies
        stream = cp.cuda.Stream(non_blocking=True)
        dst = {n: cp.empty(a.shape[1:], a.dtype) for n, a in hp.arrays.items()}

        def copy_one(e=5):
            for n, a in hp.arrays.items():
                cp.cuda.runtime.memcpyAsync(dst[n].data.ptr, a[e].ctypes.data, a[e].nbytes, 1, stream.ptr)
        times = []
        for _ in range(7):
            s, t = cp.cuda.Event(), cp.cuda.Event()
            s.record(stream)
            for e in range(E):
                copy_one(e)
            t.record(stream)
            t.synchronize()
            times.append(cp.cuda.get_elapsed_time(s, t) * 1e3 / E)
        link_us = float(np.median(times))
        row = {"expert_bytes": expert_bytes, "link_us_per_expert": link_us,
               "link_GB_per_s": expert_bytes / link_us / 1e3, "patterns": {}}
        base = {}
        for name, ranks in PATTERNS.items():
            slot_map = np.arange(E, dtype=np.int32)
            for j in range(LAYERS_IN_GRAPH):
                for r in ranks:
                    slot_map[j * K + r] = -1
            sm = cp.asarray(slot_map)
            per = {}
            outs = {}
            for vname, moe in moes.items():
                host = moe.host_device_ptrs(hp)
                out = cp.full((1, H), np.nan, np.float32)

                def body(moe=moe, host=host, out=out):
                    for j in range(LAYERS_IN_GRAPH):
                        moe._decode_pair(x, logits[j], pool, sm, out, host)
                sec = [graph_seconds(cp, moe.compute_stream, body, args.reps) for _ in range(3)]
                per[vname] = float(np.median(sec)) / LAYERS_IN_GRAPH * 1e6
                moe.compute_stream.synchronize()
                outs[vname] = out.get()
            ref = outs["rank_order"].view(np.uint32)
            same = all(np.array_equal(ref, o.view(np.uint32)) for o in outs.values())
            finite = all(bool(np.isfinite(o).all()) for o in outs.values())
            if name == "none":
                base = per
            bound = base["rank_order"] + len(ranks) * link_us
            row["patterns"][name] = {"miss_ranks": ranks, "us_per_layer": per, "serial_bound_us": bound,
                                     "same_bits": same, "finite": finite}
            print(f"{dtype} {name:>11}: " + ", ".join(f"{v} {t:7.1f} us" for v, t in per.items())
                  + f", serial bound {bound:7.1f} us, same bits {same}", flush=True)
        print(f"{dtype}: link {link_us:.1f} us an expert ({row['link_GB_per_s']:.1f} GB/s)", flush=True)
        # the device's address of the first host array (the gate/up weights of every expert: over 64 MiB)
        dev_ptr = moes["misses_first"].host_device_ptrs(hp)[0]
        row["mapped_read_ceiling"] = read_ceiling(cp, int(dev_ptr), expert_bytes, args.reps)
        for nb, r in row["mapped_read_ceiling"]["best"].items():
            print(f"{dtype}: mapped read of {nb} bytes at best {r['GB_per_s']:.1f} GB/s ({r['blocks']} blocks, "
                  f"{r['loads_a_lane']} loads a lane, {r['us']:.1f} us)", flush=True)
        result["dtypes"][dtype] = row
        del pool, hp, keep
        cp.get_default_memory_pool().free_all_blocks()
    out = Path(args.out) / "decode_miss_order_h200.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    ok = all(p["same_bits"] and p["finite"] for r in result["dtypes"].values() for p in r["patterns"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
