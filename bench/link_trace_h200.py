"""Where the half-skewed `strata run` prefill leaves the link idle, and how fast the link moves an expert's bytes.

Two parts, one JSON (link_trace_h200.json under --out):
- `copies`: host->device copy rates on the H200 for the layouts the prefill streams (Qwen3-30B-A3B F16 experts:
  gate/up 6.29 MB and down 3.15 MB per expert, separate host arrays, scattered expert ids into consecutive ring
  slots), on one copy stream and on two, against one large copy (the link floor's rate).
- `run`: `strata run --backend cuda --model Qwen3-30B-A3B@F16 --skew 1` in-process (4096-token chunk, half the
  experts cached, as bench/strata_run_h200.py's half_skewed), with FastMoE's stage marks kept across layers: every
  copy on the copy stream has a begin mark (fires when the stream may start it) and an end mark, so the link's idle
  time is the sum of begin - previous end, split into idle before a layer's prefetch (between layers) and idle
  inside a layer.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

GU, DN = (1536, 2048), (2048, 768)  # Qwen3-30B-A3B expert gate/up and down, f16


def copy_rates(reps: int = 5) -> dict:
    """GB/s of the prefill's copy patterns (median of reps, CUDA events around each pattern)."""
    import cupy as cp
    import numpy as np
    e_n, ring, misses = 128, 87, 64
    rt = cp.cuda.runtime
    mem = cp.cuda.alloc_pinned_memory(e_n * 2 * (GU[0] * GU[1] + DN[0] * DN[1]))
    host = np.frombuffer(mem, dtype=np.float16, count=e_n * (GU[0] * GU[1] + DN[0] * DN[1]))
    hg = host[: e_n * GU[0] * GU[1]].reshape(e_n, *GU)
    hd = host[e_n * GU[0] * GU[1]:].reshape(e_n, *DN)
    hg[:] = 1
    hd[:] = 1
    dg = cp.empty((ring, *GU), dtype=cp.float16)
    dd = cp.empty((ring, *DN), dtype=cp.float16)
    big = cp.empty(misses * (GU[0] * GU[1] + DN[0] * DN[1]), dtype=cp.float16)
    ids = np.sort(np.random.default_rng(0).choice(e_n, misses, replace=False))
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    gb, db = GU[0] * GU[1] * 2, DN[0] * DN[1] * 2
    nbytes = misses * (gb + db)

    def per_expert(streams):
        for i, e in enumerate(ids):
            st = streams[i % len(streams)]
            rt.memcpyAsync(dg.data.ptr + i * gb, hg.ctypes.data + int(e) * gb, gb, 1, st.ptr)
            rt.memcpyAsync(dd.data.ptr + i * db, hd.ctypes.data + int(e) * db, db, 1, st.ptr)

    def per_array(streams):
        for i, e in enumerate(ids):
            rt.memcpyAsync(dg.data.ptr + i * gb, hg.ctypes.data + int(e) * gb, gb, 1, streams[0].ptr)
            rt.memcpyAsync(dd.data.ptr + i * db, hd.ctypes.data + int(e) * db, db, 1, streams[-1].ptr)

    def one_big(streams):
        rt.memcpyAsync(big.data.ptr, host.ctypes.data, nbytes, 1, streams[0].ptr)

    def contiguous_experts(streams):  # one 9.44 MB copy an expert: an interleaved host layout's pattern
        for i, e in enumerate(ids):
            st = streams[i % len(streams)]
            rt.memcpyAsync(big.data.ptr + i * (gb + db), host.ctypes.data + int(e) * (gb + db), gb + db, 1, st.ptr)

    def median_ms(fn, streams) -> float:
        # events on s1 around the pattern, s2 fenced in and joined back; the first of reps + 1 runs is a warm-up
        ts = []
        for _ in range(reps + 1):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(s1)
            s2.wait_event(a)
            fn(streams)
            e2 = cp.cuda.Event()
            e2.record(s2)
            s1.wait_event(e2)
            b.record(s1)
            b.synchronize()
            ts.append(cp.cuda.get_elapsed_time(a, b))
        return sorted(ts[1:])[len(ts[1:]) // 2]

    out = {"host_memory": "cudaHostAlloc"}
    for name, fn, streams in (("one_copy", one_big, [s1]), ("per_expert_1_stream", per_expert, [s1]),
                              ("per_expert_2_streams", per_expert, [s1, s2]),
                              ("gate_up_and_down_on_2_streams", per_array, [s1, s2]),
                              ("contiguous_expert_1_stream", contiguous_experts, [s1]),
                              ("contiguous_expert_2_streams", contiguous_experts, [s1, s2])):
        ms = median_ms(fn, streams)
        out[name] = {"ms": round(ms, 4), "gb_per_s": round(nbytes / ms / 1e6, 2), "bytes": nbytes}
    # the store's arena is a numpy array page-locked in place (cudaHostRegister): the same per-expert pattern from
    # such memory, with the kernel's default pages and with transparent huge pages asked for before the first touch
    import mmap
    for label, huge in (("registered_default_pages", False), ("registered_huge_pages", True)):
        m = mmap.mmap(-1, host.nbytes)
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            m.madvise(mmap.MADV_HUGEPAGE)
        arr = np.frombuffer(m, dtype=np.float16)
        arr[:] = 1
        rt.hostRegister(arr.ctypes.data, arr.nbytes, 0)
        hg = arr[: e_n * GU[0] * GU[1]].reshape(e_n, *GU)
        hd = arr[e_n * GU[0] * GU[1]:].reshape(e_n, *DN)
        ms = median_ms(per_expert, [s1])  # per_expert reads hg, hd: now this registered memory
        out[f"per_expert_1_stream_{label}"] = {"ms": round(ms, 4), "gb_per_s": round(nbytes / ms / 1e6, 2)}
        rt.hostUnregister(arr.ctypes.data)
        del hg, hd, arr
        m.close()
    out["small_table_while_link_busy"] = small_table_latency()
    try:
        out["thp"] = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        pass
    del dg, dd, big
    return out


def small_table_latency(trials: int = 8) -> dict:
    """With 600 MB of host copies queued on one stream, when does a 4 KB table queued on another stream right after
    them land: as cudaMemcpyAsync (a copy engine) and as FastMoE.pull (a kernel reading mapped staging)? ms from
    the big copies' start; the big copies take ~11 ms."""
    import cupy as cp
    import numpy as np
    from strata_cuda.fast import FastMoE
    moe = FastMoE(8, 2, 256, 128)
    n = 600 << 20
    big_h, big_d = cp.cuda.alloc_pinned_memory(n), cp.cuda.alloc(n)
    table = np.frombuffer(moe._page_locked(4096), dtype=np.int64, count=512)
    out = cp.zeros(512, dtype=cp.int64)
    s_copy, s_other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    res = {}
    for how in ("memcpy", "pull"):
        lat, big = [], []
        for _ in range(trials):
            t0, t_big, t_tab = cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event()
            t0.record(s_copy)
            s_other.wait_event(t0)
            for i in range(64):  # the ring's pattern: many ~9 MB copies
                cp.cuda.runtime.memcpyAsync(big_d.ptr + i * (n // 64), big_h.ptr + i * (n // 64), n // 64, 1,
                                            s_copy.ptr)
            t_big.record(s_copy)
            if how == "memcpy":
                cp.cuda.runtime.memcpyAsync(out.data.ptr, table.ctypes.data, 4096, 1, s_other.ptr)
            else:
                moe.pull(int(out.data.ptr), int(table.ctypes.data), 4096, s_other, host_base=int(table.ctypes.data))
            t_tab.record(s_other)
            t_big.synchronize()
            t_tab.synchronize()
            lat.append(cp.cuda.get_elapsed_time(t0, t_tab))
            big.append(cp.cuda.get_elapsed_time(t0, t_big))
        res[how] = {"table_landed_ms": [round(v, 3) for v in lat], "big_copies_ms": [round(v, 3) for v in big]}
    return res


def traced_run(cache: int, decode: int, ahead: str = "default") -> dict:
    """The half-skewed run in-process with every prefill layer's marks kept; the link's idle time split."""
    import cupy
    from strata_cuda import fast
    marks: list = []
    host_copy_s: list[float] = []  # host seconds inside _copy_experts, per prefill layer (its prefetch included)
    orig, orig_copy = fast.FastMoE.prefill_layer, fast.FastMoE._copy_experts
    ahead, _, flag = ahead.partition(":")
    if ahead != "default":
        fast.COPY_GROUPS_AHEAD = None if ahead == "all" else int(ahead)
    if "noguard" in flag:  # decode admits over any slot, as before ExpertCache.worth_admitting
        from strata_cuda import layer_ops
        layer_ops.DECODE_ADMIT_HOTTER = False
    if "nopull" in flag:  # small tables and ring admissions through cudaMemcpyAsync, as before
        fast.PULL_SMALL_COPIES = False
    if "ring0" in flag:  # every layer places its copy groups from ring slot 0, as before fast.ring_placement's start
        fast.FastMoE._ring_start = lambda self, ring: 0
    if "hostembed" in flag:  # the prompt's rows gathered on the host and uploaded, as before CudaLayerOps.embed_rows
        from strata_cuda import layer_ops
        layer_ops.CudaLayerOps.embed_rows = lambda self, table, ids, x: False

    def traced(self, x, *a, **kw):
        if x.shape[0] >= 1024:  # not the session's tiny warm-up layer
            self.trace = marks  # kept: the next layer's prefetch (before its prefill_layer) is marked too
            host_copy_s.append(0.0)
        return orig(self, x, *a, **kw)

    def timed_copy(self, *a, **kw):
        t = time.perf_counter()
        try:
            return orig_copy(self, *a, **kw)
        finally:
            if host_copy_s:
                host_copy_s[-1] += time.perf_counter() - t

    fast.FastMoE.prefill_layer = traced
    fast.FastMoE._copy_experts = timed_copy
    # host time of the prefill's parts outside the layers (ms): the loan, the arena, the embedding, the head
    from strata_core.runtime import executor as ex_mod, loan as loan_mod
    host_ms: dict[str, float] = {}

    def timed(cls, name, label):
        f = getattr(cls, name)

        def w(*a, **kw):
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                host_ms[label] = host_ms.get(label, 0.0) + (time.perf_counter() - t) * 1e3
        setattr(cls, name, w)

    for cls, name, label in ((ex_mod.Executor, "prefill", "executor_prefill"), (ex_mod.Executor, "_arena", "arena"),
                             (ex_mod.Executor, "_embed", "embed"), (ex_mod.Executor, "_head", "head"),
                             (loan_mod.PromptLoan, "lend", "lend"), (loan_mod.PromptLoan, "give_back", "give_back")):
        timed(cls, name, label)
    from strata_core.cli import main as cli_main
    sys.argv = ["strata", "run", "--backend", "cuda", "--model", "Qwen3-30B-A3B@F16", "--prompt-tokens", "4096",
                "--decode-tokens", str(decode), "--json", "--skew", "1", "--set", "prefill.chunk=4096",
                "--set", f"memory.expert_cache={cache}"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli_main()
    cupy.cuda.Device().synchronize()
    fast.FastMoE.prefill_layer = orig
    run = json.loads(buf.getvalue())
    t0 = marks[0][1]
    named = [(n, cupy.cuda.get_elapsed_time(t0, e)) for n, e in marks]
    # the copy stream's marks in queue order: (begin, end) pairs
    copies, begin = [], None
    for n, t in named:
        if n == "prefetch_begin" or n.startswith("copy_begin_"):
            begin = (n, t)
        elif (n == "prefetched" or n.startswith("copied_")) and begin is not None:
            copies.append((begin[0], begin[1], t))
            begin = None
    idle_between = idle_inside = busy = 0.0
    gaps = []
    for i, (n, b, e) in enumerate(copies):
        busy += e - b
        if i:
            gap = max(0.0, b - copies[i - 1][2])
            gaps.append(round(gap, 4))
            if n == "prefetch_begin":
                idle_between += gap
            else:
                idle_inside += gap
    starts = [t for n, t in named if n == "start"]
    ends = [t for n, t in named if n == "end"]
    stalled = 0
    lay: list[dict] = []
    for n, t in named:
        if n == "start":
            lay.append({})
        if lay:
            lay[-1].setdefault(n, t)
    for d in lay:
        landed = [v for k, v in d.items() if k.startswith("copied_")]
        stalled += bool(landed and d.get("hits_done", 0.0) > max(landed))
    from strata_cuda import layer_ops
    return {"argv": sys.argv, "rc": rc, "copy_groups_ahead": fast.COPY_GROUPS_AHEAD,
            "decode_admit_hotter": layer_ops.DECODE_ADMIT_HOTTER, "pull_small_copies": fast.PULL_SMALL_COPIES,
            "layers_hits_after_last_landing": stalled,
            "host_copy_ms_by_layer": [round(v * 1e3, 3) for v in host_copy_s],
            "host_ms_outside_layers": {k: round(v, 3) for k, v in host_ms.items()},
            "run": {k: run.get(k) for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "cache_hit_rate_prefill",
                                           "cache_hit_rate_decode", "bytes_streamed", "prefill_s", "decode_s",
                                           "experts_admitted",
                                           "time_per_layer_us")},
            "layers_traced": len(starts), "span_ms": round(ends[-1] - starts[0], 3) if starts else None,
            "link": {"copies": len(copies), "busy_ms": round(busy, 3),
                     "idle_before_prefetch_ms": round(idle_between, 3),
                     "idle_inside_layers_ms": round(idle_inside, 3),
                     "first_copy_ms": round(copies[0][1], 3) if copies else None,
                     "after_last_copy_ms": round(ends[-1] - copies[-1][2], 3) if copies and ends else None},
            "gaps_ms": gaps, "marks_ms": [(n, round(t, 4)) for n, t in named]}


def main() -> int:
    """Copy rates, then the traced run; writes link_trace_h200.json."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--cache", type=int, default=48 * 128 // 2)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--skip-run", action="store_true")
    ap.add_argument("--ahead", default="default", help="comma-separated COPY_GROUPS_AHEAD variants (int, all, "
                    "default), each with optional :flags (nopull, noguard, ring0, hostembed), each run in its own "
                    "process")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:  # one traced run; its JSON on stdout's last line
        r = traced_run(args.cache, args.decode, args.child)
        print(json.dumps(r, default=str))
        return 0
    res = {"schema": "strata.bench.link_trace/1", "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    res["copies"] = copy_rates()
    print(json.dumps(res["copies"]))
    if not args.skip_run:
        import subprocess
        res["traced"] = {}
        for v in args.ahead.split(","):
            p = subprocess.run([sys.executable, __file__, "--child", v, "--cache", str(args.cache), "--decode",
                                str(args.decode)], capture_output=True, text=True, timeout=240)
            try:
                r = json.loads(p.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                r = {"rc": p.returncode, "stderr_tail": p.stderr[-2000:]}
            res["traced"][v] = r
            keep = ("copy_groups_ahead", "decode_admit_hotter", "pull_small_copies", "layers_hits_after_last_landing",
                    "run", "span_ms", "link", "rc", "stderr_tail")
            print(v, json.dumps({k: r.get(k) for k in keep}, default=str))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "link_trace_h200.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
