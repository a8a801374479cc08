"""`strata bench`: time the selected backend's kernels on one MoE layer's shapes, and the planner, on this machine.

A quick look at where a backend stands, not a benchmark suite: the recorded H200 runs live in `bench/`.
Each figure is the median of `--repeat` runs after one warm-up, on random data, checked against the numpy reference.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np
from rich.console import Console
from rich.table import Table

from strata_core.errors import BadInput
from strata_core.reference import kernels as ref
from strata_core.registry import load_from_settings
from strata_core.config.settings import add_settings_arguments, bounded_int, seed_arg, settings_from_args

SCHEMA = "strata.bench/1"


def register(subparsers) -> None:
    """Add the `bench` sub-command."""
    p = subparsers.add_parser("bench", help="time the selected backend's kernels and the planner on this machine")
    p.add_argument("--tokens", type=bounded_int(1, 1 << 17, "tokens"), default=1024, metavar="N", help="rows of the layer's chunk (default 1024)")
    p.add_argument("--experts", type=bounded_int(1, 4096, "experts"), default=32, metavar="E", help="experts in the layer (default 32)")
    p.add_argument("--top-k", type=bounded_int(1, 256, "experts"), default=4, metavar="K", help="experts a token routes to (default 4)")
    p.add_argument("--hidden", type=bounded_int(1, 1 << 15), default=512, metavar="H", help="hidden size (default 512)")
    p.add_argument("--ffn", type=bounded_int(1, 1 << 16), default=512, metavar="F", help="expert FFN width (default 512)")
    p.add_argument("--repeat", type=bounded_int(1, 1000, "runs"), default=5, metavar="R", help="timed runs per figure (default 5)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--json", action="store_true", help=f"print one {SCHEMA} object")
    add_settings_arguments(p)
    p.set_defaults(func=run)


#: The kernels `_bench` times, for the progress lines (route, rmsnorm, gather, the FFN twice, scatter).
KERNELS_TIMED = 6


def _progress(args, what: str) -> None:
    """One progress line on stderr ('strata bench: ...'); none with --json, whose stdout is the object alone."""
    if not args.json:
        print(f"strata bench: {what}", file=sys.stderr, flush=True)


def _median_s(fn: Callable[[], Any], sync: Callable[[], None], repeat: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _validate(args) -> None:
    for name in ("tokens", "experts", "top_k", "hidden", "ffn", "repeat"):
        if getattr(args, name) <= 0:
            raise BadInput(f"--{name.replace('_', '-')}: must be positive, got {getattr(args, name)}")
    if args.top_k > args.experts:
        raise BadInput(f"--top-k: {args.top_k} exceeds --experts {args.experts}")
    if args.hidden % ref.QK8_0 or args.ffn % ref.QK8_0:
        raise BadInput(f"--hidden and --ffn: must be multiples of {ref.QK8_0} (Q8_0 blocks)")


def _layer_inputs(args, rng: np.random.Generator) -> dict[str, Any]:
    t, e, k, h, f = args.tokens, args.experts, args.top_k, args.hidden, args.ffn
    x = rng.standard_normal((t, h), dtype=np.float32)
    logits = rng.standard_normal((t, e), dtype=np.float32)
    ids, w = ref.route_topk(logits, k)
    order = np.argsort(ids.reshape(-1), kind="stable").astype(np.int32)
    rows = (order // k).astype(np.int32)
    counts = np.bincount(ids.reshape(-1), minlength=e)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    w13 = (rng.standard_normal((e, 2 * f, h), dtype=np.float32) / np.sqrt(h)).astype(np.float16)
    w2 = (rng.standard_normal((e, h, f), dtype=np.float32) / np.sqrt(f)).astype(np.float16)
    q13, d13 = ref.quantize_q8_0(w13)
    q2, d2 = ref.quantize_q8_0(w2)
    return {"x": x, "logits": logits, "rows": rows, "scale": w.reshape(-1)[order].astype(np.float32),
            "offsets": offsets, "slots": np.arange(e, dtype=np.int32),
            "f16": {"w_gate_up": w13, "w_down": w2},
            "q8_0": {"gate_up_q": q13, "gate_up_d": d13, "down_q": q2, "down_d": d2},
            "router": (rng.standard_normal((e, h), dtype=np.float32) / np.sqrt(h)).astype(np.float16),
            "norm": rng.standard_normal(h, dtype=np.float32)}


def run(args) -> int:
    """Time route, gather, grouped FFN (f16, Q8_0), scatter and the planner on the selected backend."""
    _validate(args)
    loaded = settings_from_args(args)
    plugins = load_from_settings(loaded.settings)
    target = plugins.resolve_target(loaded.settings)
    _progress(args, f"planning and opening {target.backend.name} device {target.device.info.name}")
    plan = _tiny_plan(plugins, target, loaded.settings)
    # the kernels run in a session of the tiny model's plan, as `strata run` opens one
    session = target.device.open(plan)
    try:
        doc = _bench(args, target, session, _plan_ms(plugins, target, loaded.settings, args.repeat))
    finally:
        session.close()
    backend, device, h = target.backend, target.device.info, args.hidden
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    t = Table(title=f"strata bench: {backend.name} on {device.name} ({args.tokens} tokens, {args.experts} experts, "
                    f"top-{args.top_k}, hidden {h}, FFN {args.ffn})")
    for col in ("kernel", "median ms", "GFLOP/s", "GB/s", "rel err vs numpy"):
        t.add_column(col, justify="left" if col == "kernel" else "right")
    for r in doc["results"]:
        t.add_row(r["kernel"], f"{r['median_ms']:.3f}", "" if r["gflop_per_s"] is None else f"{r['gflop_per_s']:.1f}",
                  "" if r["gb_per_s"] is None else f"{r['gb_per_s']:.2f}",
                  "" if r["rel_err"] is None else f"{r['rel_err']:.1e}")
    t.add_row("planner (tiny model)", f"{doc['plan_median_ms']:.3f}", "", "", "")
    Console().print(t)
    return 0


def _bench(args, target: Any, session: Any, plan_ms: float) -> dict:
    """The `strata.bench/1` object: each kernel of the session timed on the layer's shapes, checked against numpy."""
    backend, device = target.backend, target.device.info
    dm, ks = session.memory, session.kernels
    rng = np.random.default_rng(args.seed)
    inp = _layer_inputs(args, rng)
    dev = {k: dm.to_device(v) for k, v in inp.items() if isinstance(v, np.ndarray)}
    pools = {dt: ref.ExpertPool(dt, {n: dm.to_device(a) for n, a in inp[dt].items()}) for dt in ("f16", "q8_0")}
    host_pools = {dt: ref.ExpertPool(dt, inp[dt]) for dt in ("f16", "q8_0")}
    sync = dm.synchronize
    xs_dev = ks.gather(dev["x"], dev["rows"])
    rows_n = int(inp["rows"].shape[0])
    h, f = args.hidden, args.ffn
    results = []

    def add(name: str, fn: Callable[[], Any], flops: float, nbytes: float, err: float | None) -> None:
        _progress(args, f"{name} ({len(results) + 1} of {KERNELS_TIMED}, {args.repeat} timed runs)")
        s = _median_s(fn, sync, args.repeat)
        results.append({"kernel": name, "median_ms": s * 1e3, "gflop_per_s": flops / s / 1e9 if flops else None,
                        "gb_per_s": nbytes / s / 1e9 if nbytes else None, "rel_err": err})

    ids, _ = ks.route_topk(ks.linear(dev["x"], dev["router"]), args.top_k)
    ref_ids, _ = ref.route_topk(ref.linear(inp["x"], inp["router"]), args.top_k)
    route_ok = float(np.mean(np.asarray(dm.download(ids)) == ref_ids))
    add("linear+route_topk", lambda: ks.route_topk(ks.linear(dev["x"], dev["router"]), args.top_k),
        2.0 * args.tokens * args.experts * h, 0, 1.0 - route_ok)
    add("rmsnorm", lambda: ks.rmsnorm(dev["x"], dev["norm"]), 0, 2 * inp["x"].nbytes,
        ref.relative_error(dm.download(ks.rmsnorm(dev["x"], dev["norm"])), ref.rmsnorm(inp["x"], inp["norm"])))
    add("gather", lambda: ks.gather(dev["x"], dev["rows"]), 0, 2 * rows_n * h * 4,
        ref.relative_error(dm.download(xs_dev), ref.gather(inp["x"], inp["rows"])))
    xs_host = ref.gather(inp["x"], inp["rows"])
    for dt in ("f16", "q8_0"):
        y = ks.moe_grouped_ffn(xs_dev, dev["offsets"], dev["slots"], pools[dt])
        want = ref.moe_grouped_ffn(xs_host, inp["offsets"], inp["slots"], host_pools[dt])
        wbytes = sum(a.nbytes for a in inp[dt].values())
        add(f"moe_grouped_ffn {dt}", lambda dt=dt: ks.moe_grouped_ffn(xs_dev, dev["offsets"], dev["slots"], pools[dt]),
            2.0 * rows_n * 3 * h * f, wbytes, ref.relative_error(dm.download(y), want))
    y_dev = ks.moe_grouped_ffn(xs_dev, dev["offsets"], dev["slots"], pools["f16"])
    out = dm.to_device(np.zeros((args.tokens, h), dtype=np.float32))
    add("scatter_add", lambda: ks.scatter_add(out, dev["rows"], y_dev, dev["scale"]), 0, 3 * rows_n * h * 4, None)
    return {"schema": SCHEMA, "backend": backend.name, "device": device.to_json(), "kernels": ks.name if hasattr(
        ks, "name") else type(ks).__name__, "shape": {"tokens": args.tokens, "experts": args.experts,
                                                      "top_k": args.top_k, "hidden": h, "ffn": f},
           "repeat": args.repeat, "results": results, "plan_median_ms": plan_ms}


def _tiny_plan(plugins: Any, target: Any, settings: Any) -> Any:
    """The built-in tiny model's plan for the target: what the bench's session is opened with."""
    from strata_core.models.synthetic import tiny_model_spec
    from strata_core.planner import plan_for_machine
    return plan_for_machine(plugins, target, tiny_model_spec(), settings)


def _plan_ms(plugins: Any, target: Any, settings: Any, repeat: int) -> float:
    """Median milliseconds of planning the tiny model for the target."""
    return _median_s(lambda: _tiny_plan(plugins, target, settings), lambda: None, max(repeat, 5)) * 1e3
