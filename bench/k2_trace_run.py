"""Where the half-skewed `strata run` prefill spends its time: the run command in-process (Qwen3-30B-A3B@F16, 48
layers, a 4096-token chunk, half the experts cached, the synthetic generator's popularity skew as
bench/strata_run_h200.py's half_skewed setting), with FastMoE's stage marks (CUDA events on the compute and copy
streams) recorded in every prefill layer. Writes k2_trace_run.json: the run's own figures and, per layer, the
marks (ms from the first layer's start) and the misses, copy groups, ring slots and bytes; a summary splits the
prefill's device time into the link's busy time (first copy to last landing), the time before the first copy of a
layer (routing, the host's one sync and planning), the compute after the last landing, and the time between
layers (attention, norms, router, host).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import sys
from pathlib import Path


def main() -> int:
    """One traced in-process run; the JSON and a short table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--cache", type=int, default=48 * 128 // 2)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--split-rows", type=int, default=-1, help="FastMoE.split_rows (-1: the default)")
    args = ap.parse_args()
    import cupy
    from strata_core.models import synthetic
    from strata_cuda import fast
    synthetic.generate_weights = functools.partial(synthetic.generate_weights, popularity_skew=1.0)
    layers: list[dict] = []
    orig = fast.FastMoE.prefill_layer

    def traced(self, x, logits, pool, slot_of_expert, host_pool=None, ring=None, *a, **kw):
        if args.split_rows >= 0:
            self.split_rows = args.split_rows
        if x.shape[0] < 1024:  # the session's tiny warm-up layer
            return orig(self, x, logits, pool, slot_of_expert, host_pool, ring, *a, **kw)
        self.trace = []
        try:
            return orig(self, x, logits, pool, slot_of_expert, host_pool, ring, *a, **kw)
        finally:
            st = self.stats
            ring_n = 0 if ring is None else (int(ring[1]) if isinstance(ring, tuple) else len(ring))
            layers.append({"marks": self.trace, "misses": st.misses, "hits": st.hits, "bytes": st.bytes_streamed,
                           "groups": st.copy_groups, "ring_slots": ring_n, "gemm_problems": st.gemm_problems,
                           "routed_rows_hit": st.routed_rows_hit})
            self.trace = None

    fast.FastMoE.prefill_layer = traced
    from strata_core.cli import main as cli_main
    sys.argv = ["strata", "run", "--backend", "cuda", "--model", "Qwen3-30B-A3B@F16", "--prompt-tokens", "4096",
                "--decode-tokens", str(args.decode), "--json", "--set", "prefill.chunk=4096",
                "--set", f"memory.expert_cache={args.cache}"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli_main()
    cupy.cuda.Device().synchronize()
    run = json.loads(buf.getvalue())
    t0 = layers[0]["marks"][0][1]
    ms = lambda ev: cupy.cuda.get_elapsed_time(t0, ev)  # noqa: E731
    out_layers, prev_end = [], None
    tot = {"link_busy_ms": 0.0, "before_first_copy_ms": 0.0, "after_last_landing_ms": 0.0, "between_layers_ms": 0.0,
           "bytes": 0}
    for lay in layers:
        m = {n: ms(e) for n, e in lay.pop("marks")}
        lay["marks_ms"] = m
        copied = [v for k, v in m.items() if k.startswith("copied_")]
        if "copy_start" in m and copied:
            lay["link_busy_ms"] = max(copied) - m["copy_start"]
            lay["link_gb_per_s"] = lay["bytes"] / lay["link_busy_ms"] / 1e6
            tot["link_busy_ms"] += lay["link_busy_ms"]
            tot["before_first_copy_ms"] += m["copy_start"] - m["start"]
            tot["after_last_landing_ms"] += m["end"] - max(copied)
        if prev_end is not None:
            tot["between_layers_ms"] += m["start"] - prev_end
        prev_end = m["end"]
        tot["bytes"] += lay["bytes"]
        out_layers.append(lay)
    span = prev_end - 0.0
    res = {"schema": "strata.bench.k2_trace_run/1", "argv": sys.argv, "rc": rc, "split_rows": args.split_rows,
           "run": {k: run.get(k) for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "cache_hit_rate_prefill",
                                          "cache_hit_rate_decode", "bytes_streamed", "experts_streamed",
                                          "experts_admitted", "prefill_s", "time_per_layer_us", "loan_slots",
                                          "ring_batches", "plan")},
           "prefill_span_ms": span, "totals": tot, "layers": out_layers}
    if tot["link_busy_ms"]:
        res["link_gb_per_s_while_busy"] = tot["bytes"] / tot["link_busy_ms"] / 1e6
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "k2_trace_run.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({k: res[k] for k in ("run", "prefill_span_ms", "totals")}, default=str))
    print("link GB/s while busy:", res.get("link_gb_per_s_while_busy"))
    for i in (0, 1, 24, 47):
        if i < len(out_layers):
            lay = out_layers[i]
            print(i, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in lay.items() if k != "marks_ms"},
                  {k: round(v, 3) for k, v in lay["marks_ms"].items()})
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
