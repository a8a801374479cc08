"""The half-skewed `strata run` decode's routing, recorded on the H200, for replaying cache policies on the host.

One in-process `strata run --backend cuda --model Qwen3-30B-A3B@<dtype> --skew 1` (4096-token chunk, half the
experts cached, 128 decode tokens: bench/strata_run_h200.py's half_skewed), with CudaLayerOps._count and the
ExpertCache's lookup/admit/tick wrapped to record, without changing what runs:
- the cache at the first decode count (slot table, decayed frequencies, the seeded part, slots on loan or trimmed);
- every decode step's routed experts (the ids the step's graph downloaded: [layers, top k]) and whether it ticked;
- every decode admission (store rows and the slots they got) and the run's own decode hit rate and tok/s.
Routing does not depend on the cache (the cache decides where bytes come from, not the bits), so
bench/decode_cache_policy.py can replay any policy against this trace. Writes decode_trace_<dtype>.npz and .json
under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np

LAYERS, E = 48, 128


def traced_run(dtype: str, decode: int, residuals: dict | None = None) -> tuple[dict, dict]:
    """Run the half-skewed setting in-process; (arrays for the npz, the run's JSON and counts). With `residuals`
    (a dict to fill), decode runs layer by layer through the same kernels (the --check path's observer, without the
    host check) and every layer's input residual is kept, with the routers and router norms, for lookahead studies."""
    from strata_core.runtime import cache as cache_mod
    from strata_cuda import layer_ops as lo
    rec: dict = {"ids": [], "tick": [], "admits": [], "prefill_lookups": []}
    state: dict = {}
    seen: list = []
    in_decode = [False]
    count0 = lo.CudaLayerOps._count
    init0 = lo.CudaLayerOps.__init__
    lookup0, admit0 = cache_mod.ExpertCache.lookup, cache_mod.ExpertCache.admit

    def init(self, *a, **kw):
        init0(self, *a, **kw)
        seen.append(self)

    def count(self, launched):
        works, maps, landed, e_n, which, tick, land = launched
        landed.synchronize()
        cache = works[0].slots
        if not in_decode[0]:
            in_decode[0] = True
            state.update(slot_of=cache.slot_of.copy(), freq=cache.freq.copy(), seeded=cache.seeded.copy(),
                         on_loan=cache.on_loan.copy(), trimmed=cache.trimmed.copy(),
                         layers=np.asarray([w.layer for w in works], dtype=np.int64),
                         hits0=np.int64(cache.hits), misses0=np.int64(cache.misses))
        rec["ids"].append(np.asarray(self._ids_pair[which]).astype(np.int16).copy())
        rec["tick"].append(bool(tick))
        return count0(self, launched)

    def lookup(self, layer, experts, tokens=None):
        if not in_decode[0]:
            rec["prefill_lookups"].append((int(layer), np.asarray(experts).copy(),
                                           None if tokens is None else np.asarray(tokens).copy()))
        return lookup0(self, layer, experts, tokens)

    def admit(self, layer, experts, keep=None):
        got = admit0(self, layer, experts, keep)
        if in_decode[0]:
            rec["admits"].append((len(rec["ids"]), int(layer), np.asarray(experts).copy(), np.asarray(got).copy()))
        return got

    lo.CudaLayerOps.__init__, lo.CudaLayerOps._count = init, count
    if residuals is not None:
        launch0 = lo.CudaLayerOps.decode_launch

        def observe(phase, layer, x_in, x_out):
            residuals.setdefault("x", []).append(np.asarray(x_in, dtype=np.float16).reshape(-1).copy())

        def launch(self, works, defer=False):
            if works and "router" not in residuals:
                import cupy
                residuals["router"] = np.stack([cupy.asnumpy(w.router_w) for w in works]).astype(np.float16)
                residuals["norm"] = np.stack([cupy.asnumpy(w.norm_w) for w in works]).astype(np.float32)
            if works:
                works[0].extras["observer"] = observe
            return launch0(self, works, defer)
        lo.CudaLayerOps.decode_launch = launch
    cache_mod.ExpertCache.lookup, cache_mod.ExpertCache.admit = lookup, admit
    from strata_core.cli import main as cli_main
    sys.argv = ["strata", "run", "--backend", "cuda", "--model", f"Qwen3-30B-A3B@{dtype}", "--prompt-tokens", "4096",
                "--decode-tokens", str(decode), "--json", "--skew", "1", "--set", "prefill.chunk=4096",
                "--set", f"memory.expert_cache={LAYERS * E // 2}"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli_main()
    run = json.loads(buf.getvalue())
    run["_exit"] = rc
    run["_counts"] = [o.counts for o in seen]
    # prefill routed-row counts per store row (what the prompt's lookups added to frequency, before decay)
    pf = np.zeros(LAYERS * E, dtype=np.float64)
    for layer, experts, tokens in rec["prefill_lookups"]:
        np.add.at(pf, layer * E + experts.astype(np.int64), 1.0 if tokens is None else tokens)
    adm = rec["admits"]
    arrays = dict(state, ids=np.stack(rec["ids"]), tick=np.asarray(rec["tick"]), prefill_counts=pf,
                  admit_step=np.asarray([a[0] for a in adm for _ in a[2]], dtype=np.int64),
                  admit_row=np.asarray([a[1] * E + int(e) for a in adm for e in a[2]], dtype=np.int64),
                  admit_slot=np.asarray([int(s) for a in adm for s in a[3]], dtype=np.int64))
    return arrays, run


def main() -> int:
    """Record one dtype's trace (--dtype) into decode_trace_<dtype>.npz/.json under --out."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--dtype", default="Q8_0")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--residuals", action="store_true",
                    help="decode layer by layer, keeping every layer's input (decode_residuals_<dtype>.npz)")
    a = ap.parse_args()
    res: dict | None = {} if a.residuals else None
    arrays, run = traced_run(a.dtype, a.decode, res)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if res:
        x = np.stack(res["x"])
        layers = res["router"].shape[0]
        x = x.reshape(-1, layers, x.shape[-1])
        # in halves: a file that comes back from the device holds at most 16 MiB
        h = layers // 2
        for i, part in enumerate((slice(0, h), slice(h, layers))):
            np.save(out / f"decode_router_{a.dtype}_{i}.npy", res["router"][part])
            np.save(out / f"decode_residuals_{a.dtype}_{i}.npy", x[:, part])
        np.save(out / f"decode_norm_{a.dtype}.npy", res["norm"])
    np.savez_compressed(out / f"decode_trace_{a.dtype}.npz", **arrays)
    keep = ("prefill_tokens_per_s", "decode_tokens_per_s", "cache_hit_rate_decode", "cache_hit_rate_prefill",
            "plan", "_exit", "_counts")
    summary = {"schema": "strata.bench.decode_trace/1", "dtype": a.dtype, "steps": int(arrays["ids"].shape[0]),
               "admitted": int(arrays["admit_row"].size), "run": {k: run.get(k) for k in keep}}
    (out / f"decode_trace_{a.dtype}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return 0 if run["_exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
