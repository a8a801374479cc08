"""`strata run`: the main job. Plan, then run prefill and decode of a model on the chosen backend.

With no arguments it picks the best available backend, generates the built-in tiny model and reads a 3000-token
prompt, then decodes 64 tokens. The tiny model's cache holds about half its experts by default (overridable with
--set memory.expert_cache=N) so misses, loans and the ring run every time, even where every expert would fit.
Attention is out of scope: each layer is RMSNorm, router, routed experts and residual.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from strata_core.errors import BadInput, StrataError
from strata_core.models.resolve import model_from_gguf, model_from_name
from strata_core.models.spec import ModelSpec
from strata_core.registry import load_from_settings
from strata_core.config.settings import (MAX_TOKENS, add_settings_arguments, bounded_float, bounded_int, seed_arg,
                                         settings_from_args)

SCHEMA = "strata.run/1"
DEFAULT_PROMPT_TOKENS = 3000
DEFAULT_DECODE_TOKENS = 64
#: The largest --skew: at 8 the coldest of 128 experts sits ~39 logits below the hottest (no routing left to skew).
MAX_SKEW = 8.0
#: Largest preset whose experts `strata run` generates in host memory, as a fraction of the available RAM.
GENERATE_RAM_FRACTION = 0.5
NOTES = ("attention is out of scope for Strata Core: each layer is RMSNorm, router (top-k, renormalized), routed "
         "SwiGLU experts (plus the file's shared expert, dense FFN block or router bias) and the residual; there "
         "is no KV cache",
         "device memory is the plan's: at start the runtime takes one region per plan line (expert cache, dense "
         "weights, workspace, owned prompt buffers, KV) and carves every buffer from them (a chunk's from its "
         "loan's buffer slots); device_bytes_peak_measured is read from the backend (device_bytes_peak_source "
         "says how); device_bytes_peak_estimate is the older shape-based figure",
         "prefill_s and decode_s exclude --check's downloads and comparisons (check_s)",
         "a GGUF model is planned with the device bytes this runtime uses: its dense weights without the embedding "
         "(kept on the host) and no KV cache")


def register(subparsers) -> None:
    """Add the `run` sub-command."""
    p = subparsers.add_parser("run", help="plan, then run prefill and decode of a model (default: a built-in tiny one)",
                              description="Plan for this machine, then read a prompt in chunks and decode greedily "
                                          "on the chosen backend, streaming missed experts through a ring lent from "
                                          "the expert cache.")
    p.add_argument("--model", metavar="NAME|PATH.gguf",
                   help="an MoE GGUF file (qwen3moe, qwen2moe, mixtral, deepseek2, gpt-oss, olmoe; experts in F16, "
                        "BF16, Q8_0, Q4_K, Q5_K, Q6_K or MXFP4 and their mixes, e.g. Q4_K_M, run from their own bytes; "
                        "shared experts, dense FFN blocks and router biases computed; IQ types refused) "
                        "or a preset NAME@QUANT (generated where it fits half the RAM: F16/BF16 as f16, Q8_0, and Q4_K, Q4_K_M, "
                        "Q5_K, Q5_K_M, Q6_K, MXFP4 in their own bytes; other quants as Q8_0, said); default: the "
                        "built-in tiny model")
    p.add_argument("--prompt-tokens", type=bounded_int(1, MAX_TOKENS, "tokens"), default=DEFAULT_PROMPT_TOKENS, metavar="N",
                   help=f"prompt length in tokens (default {DEFAULT_PROMPT_TOKENS})")
    p.add_argument("--decode-tokens", type=bounded_int(0, MAX_TOKENS, "tokens"), default=DEFAULT_DECODE_TOKENS, metavar="N",
                   help=f"tokens to decode greedily (default {DEFAULT_DECODE_TOKENS})")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the prompt and of generated weights (default 0)")
    p.add_argument("--skew", type=bounded_float(0.0, MAX_SKEW, "a popularity skew"), default=0.0, metavar="S",
                   help="generated models: route with the cache sweep's popularity skew (S=1: the expert of popularity "
                        "rank r gets S*ln(1+r) less router logit, ranks a seeded permutation per layer; default 0, "
                        "uniform); refused for a GGUF file, whose routers are its own")
    p.add_argument("--check", action="store_true",
                   help="compare every layer and every greedy token with the numpy reference; a mismatch exits 1")
    p.add_argument("--json", action="store_true", help=f"print one {SCHEMA} object")
    add_settings_arguments(p)
    p.set_defaults(func=run)


# --- progress -----------------------------------------------------------------------------------------------------

class PhaseProgress:
    """A rich progress bar per phase on stderr; silent with --json or when stderr is not a terminal."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self._progress: Progress | None = None
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> "PhaseProgress":
        if self.enabled:
            self._progress = Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), console=Console(stderr=True), transient=False)
            self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()

    def phase(self, name: str, total: int) -> None:
        """Start a phase of `total` steps."""
        if self._progress is not None:
            self._tasks[name] = self._progress.add_task(name, total=max(1, total))

    def advance(self, name: str, steps: int = 1) -> None:
        """Advance a phase."""
        if self._progress is not None and name in self._tasks:
            self._progress.advance(self._tasks[name], steps)

    def done(self, name: str) -> None:
        """Mark a phase complete."""
        if self._progress is not None and name in self._tasks:
            t = self._tasks[name]
            self._progress.update(t, completed=self._progress.tasks[t].total)

    @contextmanager
    def single(self, name: str) -> Iterator[None]:
        """A one-step phase around a block."""
        self.phase(name, 1)
        yield
        self.done(name)


def say(line: str) -> None:
    """One log line of the run on stderr."""
    print(f"strata: {line}", file=sys.stderr)


# --- inputs -------------------------------------------------------------------------------------------------------

def resolve_run_model(name: str | None, loaded, seed: int, skew: float = 0.0) -> tuple[ModelSpec, Any, Any]:
    """(spec, weights loader, settings) of the model to run; the tiny model gets its half-experts cache default;
    `skew`: generated weights' popularity skew (synthetic.generate_weights)."""
    from strata_core.models.synthetic import generate_weights, tiny_model_spec
    from strata_core.models.weights import weights_from_gguf
    settings = loaded.settings
    if not name:
        from strata_core.planner.model_defaults import with_model_defaults
        spec = tiny_model_spec()
        # the model's defaults through the path `strata plan` takes too, so both show the same plan
        return (spec, (lambda: generate_weights(spec, seed, popularity_skew=skew)),
                with_model_defaults(loaded, spec).settings)
    if str(name).lower().endswith(".gguf"):
        if skew:
            raise BadInput(f"--skew {skew:g}: {name} is a GGUF file; its routers route as trained (--skew shapes "
                           f"generated weights only)")
        from strata_core.models.gguf import dense_ffn_device_bytes
        from strata_core.models.synthetic import device_dense_bytes
        spec = model_from_gguf(name)
        # plan what this runtime puts on the device: no KV (it runs no attention) and the dense weights it uploads
        # (routers, norms, LM head, shared experts and dense FFN blocks; the embedding stays on the host), so the
        # plan's figures are the run's
        spec = replace(spec, kv_bytes_per_token=0,
                       dense_bytes=device_dense_bytes(spec.moe_layers, spec.experts_per_layer, spec.hidden,
                                                      max(spec.vocab, 1)) + dense_ffn_device_bytes(name))
        return spec, (lambda: weights_from_gguf(name, spec)), settings
    preset = model_from_name(name)
    from strata_core.models.synthetic import generated_expert_formats, model_spec
    from strata_core.hostinfo import probe_host
    ffn = preset.expert_ffn
    if not ffn:
        raise BadInput(f"--model {name}: the preset gives no expert FFN width to generate weights from")
    # F16/BF16 presets generate f16 experts (the name's quant was dropped before: '@F16' ran Q8_0); K-quant and
    # MXFP4 presets their own bytes ('gguf' experts, a _M mix's types per layer); the others (IQ, Q2_K) Q8_0, said
    quant = str(preset.quant).upper()
    wide = quant in ("F16", "BF16") or preset.hidden % 32 or ffn % 32
    formats, notes = ((), []) if wide else generated_expert_formats(quant, preset.moe_layers, preset.hidden, ffn)
    dtype = "f16" if wide else ("gguf" if formats else "q8_0")
    if not wide and not formats and quant != "Q8_0":
        notes.append(f"generated experts: Q8_0 ({quant} is not computed by the kernels; `strata plan --model "
                     f"{name}` plans its own bytes)")
    for note in notes:
        say(note)
    spec = model_spec(preset.name, preset.moe_layers, preset.experts_per_layer, preset.top_k, preset.hidden, ffn,
                      preset.vocab or 32000, dtype=dtype, source="preset, generated", formats=formats, quant=quant)
    avail = probe_host().ram_available_bytes
    if spec.experts_total_bytes > GENERATE_RAM_FRACTION * avail:
        raise BadInput(f"--model {name}: generating its experts takes {spec.experts_total_bytes / (1 << 30):.1f} GiB, "
                       f"more than {GENERATE_RAM_FRACTION:.0%} of the {avail / (1 << 30):.1f} GiB available; run a "
                       f"GGUF file, or replay it with `strata plan --model {name}` / `strata simulate`")
    return spec, (lambda: generate_weights(spec, seed, dtype=dtype, popularity_skew=skew, formats=formats)), settings


# --- the run ------------------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    """Plan, run, report; 0 ok, 2 bad input, 1 when the engine fails or --check finds a mismatch."""
    if args.prompt_tokens <= 0:
        raise BadInput(f"--prompt-tokens: expected a positive token count, got {args.prompt_tokens}")
    if args.decode_tokens < 0:
        raise BadInput(f"--decode-tokens: expected 0 or more, got {args.decode_tokens}")
    loaded = settings_from_args(args)
    for n in loaded.notices:
        say(n)
    plugins = load_from_settings(loaded.settings)
    target = plugins.resolve_target(loaded.settings)
    spec, load_weights, settings = resolve_run_model(args.model, loaded, args.seed, getattr(args, "skew", 0.0))
    if args.prompt_tokens > settings.kv.max_context:
        raise BadInput(f"--prompt-tokens: a prompt of {args.prompt_tokens} tokens is longer than kv.max_context "
                       f"({settings.kv.max_context}); raise it with --set kv.max_context=N")
    from strata_core.planner import plan_for_machine
    plan = plan_for_machine(plugins, target, spec, settings)
    try:
        report = _execute(args, target, plan, spec, load_weights)
    except (StrataError, KeyboardInterrupt):
        raise
    except Exception as e:  # an engine failure: one line, the traceback only when tracing
        if settings.trace:
            traceback.print_exc()
        raise StrataError(f"the engine failed: {type(e).__name__}: {e}") from None
    if args.json:
        print(json.dumps(report, indent=2, default=_json_default))
    else:
        _print_summary(report)
    return 1 if report["check"] == "failed" else 0


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    return str(o)


def _execute(args: argparse.Namespace, target, plan, spec: ModelSpec, load_weights) -> dict:
    """Load, start the engine, serve one request, check; the strata.run/1 object."""
    from strata_core.runtime.check import ReferenceCheck
    from strata_core.runtime.engine import Engine
    from strata_core.runtime.runlog import RunLog
    log = RunLog(echo=say, trace_enabled=plan.limits.trace)
    for w in plan.warnings:
        say(f"plan: {w}")
    with PhaseProgress(enabled=not args.json) as progress:
        with progress.single("load"):
            weights = load_weights()
        for note in getattr(weights, "notes", ()):
            say(note)
        checker = ReferenceCheck(weights) if args.check else None
        with progress.single("start"):
            engine = Engine.open(target, plan, weights, log, seed=args.seed, observer=checker)
        if checker is not None:
            checker.bind(engine.kernels, getattr(engine.executor, "ops", None))
        progress.phase("prefill", args.prompt_tokens)
        progress.phase("decode", args.decode_tokens)
        engine.executor.progress = progress.advance
        prompt = np.random.default_rng(args.seed).integers(0, weights.vocab, args.prompt_tokens)
        try:
            result = engine.serve(prompt, args.decode_tokens)
            measured_bytes, measured_source = engine.device_bytes_peak_measured()
            if result.refused_reason:
                raise BadInput(f"the request was refused: {result.refused_reason}")
            if checker is not None:
                with progress.single("check"):
                    checker.check_tokens(int(prompt[-1]), result.tokens)
                    engine.cache.check()
        finally:
            engine.close()
    stats = engine.executor.stats
    check = "not run" if checker is None else ("passed" if checker.report.passed else "failed")
    if checker is not None:
        for f in checker.report.failures[:5]:
            say(f"check: {f}")
    planned = engine.device_bytes_planned
    layers = spec.moe_layers
    hm = plan.host_memory
    return {
        "schema": SCHEMA,
        "backend": plan.backend,
        "device": plan.device.to_json(),
        "model": {**spec.to_json(), "popularity_skew": float(getattr(args, "skew", 0.0))},
        "plan": plan.to_json(),
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "prefill_tokens_per_s": args.prompt_tokens / result.prefill_s if result.prefill_s > 0 else None,
        "decode_tokens_per_s": result.decode_steps / result.decode_s if result.decode_s > 0 else None,
        "cache_hit_rate": engine.cache.hit_rate,
        "cache_hits": engine.cache.hits,
        "cache_lookups": engine.cache.lookups,
        "bytes_streamed": stats.bytes_streamed,
        "experts_streamed": stats.experts_streamed,
        "loans": engine.loans.loans,
        "halvings": engine.loans.halvings,
        "chunk": result.chunk,
        "loan_slots": result.loan_slots,
        "ring_batches": stats.ring_batches,
        "cpu_share": {"enabled": engine.share.enabled, "experts": stats.cpu_share_experts,
                      "buffer_bytes": engine.share.buffer_bytes, "off_reason": engine.share.off_reason},
        "pinned": {"expert_bytes_pinned": engine.arena_pinned_bytes, "whole": engine.store.whole,
                   "budget_exhausted": engine.budget.exhausted, "budget_peak_bytes": engine.budget.peak_bytes},
        "fallbacks": [f.to_json() for f in log.fallbacks],
        "check": check,
        "check_report": checker.report.to_json() if checker is not None else None,
        "outputs_sha256": checker.outputs_sha256 if checker is not None else None,
        "tokens": result.tokens,
        "device_bytes_allocated": engine.device_bytes_allocated,
        "device_bytes_planned": planned,
        "cache_pool_bytes": engine.pool_bytes,
        "dense_device_bytes": engine.dense_device_bytes,
        "workspace_bytes_estimate": stats.workspace_peak_bytes,
        "device_bytes_peak_estimate": engine.device_bytes_peak_estimate,
        "device_bytes_peak_measured": measured_bytes,
        "device_bytes_peak_source": measured_source,
        "device_regions": dict(engine.dm.regions),
        "host_bytes_planned": max(hm.resident_bytes, plan.pinned.arena_bytes) + hm.borrow_bytes + hm.kv_pinned_bytes
        + hm.weight_copies_bytes,
        "host_rss_peak_bytes": host_rss_peak_bytes(),
        "pinned_bytes_peak": engine.budget.peak_bytes,
        "prefill_s": result.prefill_s,
        "decode_s": result.decode_s,
        "check_s": engine.executor.observer_s,
        "prefill_cpu_s": result.prefill_cpu_s,
        "decode_cpu_s": result.decode_cpu_s,
        "time_per_layer_us": {
            "prefill": 1e6 * result.prefill_s / (stats.chunks * layers) if stats.chunks else None,
            "decode": 1e6 * result.decode_s / (result.decode_steps * layers) if result.decode_steps else None},
        "link_gb_per_s": (stats.bytes_streamed / stats.copy_s / 1e9) if stats.copy_s > 0 else None,
        "link_time_source": stats.copy_time_source,
        "cache_hit_rate_prefill": result.prefill_hits / result.prefill_lookups if result.prefill_lookups else None,
        "cache_hit_rate_decode": result.decode_hits / result.decode_lookups if result.decode_lookups else None,
        "log": list(log.lines),
        "notes": list(NOTES),
    }


def host_rss_peak_bytes() -> int:
    """This process's peak resident set (getrusage: KiB on Linux, bytes on macOS)."""
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):,.1f} MiB"


def _print_summary(r: dict) -> None:
    """The run's summary table on stdout."""
    c = Console()
    t = Table(title=f"strata run: {r['model']['name']} on {r['backend']} ({r['device']['name']})")
    t.add_column("what")
    t.add_column("value", justify="right")
    rate = lambda v: "-" if v is None else f"{v:,.1f} tok/s"  # noqa: E731
    rows = [
        ("prompt", f"{r['prompt_tokens']} tokens in chunks of {r['chunk']}"),
        ("prefill", rate(r["prefill_tokens_per_s"])),
        ("decode", f"{rate(r['decode_tokens_per_s'])} ({r['decode_tokens']} tokens)"),
        ("expert cache", f"{r['plan']['expert_cache']['slots']} slots, hit rate {r['cache_hit_rate']:.1%}"),
        ("streamed", f"{_mib(r['bytes_streamed'])} ({r['experts_streamed']} experts, {r['ring_batches']} ring batches)"),
        ("loans", f"{r['loans']} ({r['loan_slots']} slots), halvings {r['halvings']}"),
        ("CPU share", f"{'on' if r['cpu_share']['enabled'] else 'off'}, {r['cpu_share']['experts']} experts"),
        ("device memory", f"{_mib(r['device_bytes_peak_measured'])} peak measured, of "
                          f"{_mib(r['device_bytes_planned'])} planned"),
        ("fallbacks", str(len(r["fallbacks"]))),
        ("check", r["check"] + (f" (worst layer rel err {r['check_report']['worst_rel_err']:.2e})"
                                if r.get("check_report") else "")),
    ]
    for k, v in rows:
        t.add_row(k, v)
    c.print(t)
    for f in r["fallbacks"]:
        c.print(f"fallback: {f['what']}: {f['why']}", markup=False)
    c.print(f"tokens: {' '.join(str(x) for x in r['tokens'][:16])}{' ...' if len(r['tokens']) > 16 else ''}",
            markup=False, highlight=False)
    c.print(f"note: {r['notes'][0]}", markup=False, highlight=False)
