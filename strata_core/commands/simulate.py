"""`strata simulate`: replay a scenario's requests through the real runtime on the sim backend, with fault injection.

The plan is made with the profile's own backend rules (its platform defaults, through the plugins); the run uses
the same runtime objects as `strata run` (ExpertStore, ExpertCache, PromptLoan, PinnedPool, the CPU share) over
`strata_core.builtin.sim.memory` objects sized from the profile, in accounting-only mode: capacities, page-locked limits
and loans are real, weights and kernels are not. An engine exit is any request the runtime failed to finish or
refuse: there must be none.
"""

from __future__ import annotations

import argparse
import json
import traceback

import numpy as np
from rich.console import Console
from rich.table import Table

from strata_core.api.backend import PinnedBudget
from strata_core.errors import BadInput, StrataError
from strata_core.registry import load_from_settings
from strata_core.scenario import load_scenario
from strata_core.config import add_settings_arguments, bounded_int, seed_arg, settings_from_args
from strata_core.config.schema import MAX_TOKENS
from strata_core.commands.run import PhaseProgress, say

SCHEMA = "strata.simulation/1"

#: The most random requests one replay adds (each is a full prompt through the runtime).
MAX_EXTRA_REQUESTS = 1_000_000


def register(subparsers) -> None:
    """Add the `simulate` sub-command."""
    p = subparsers.add_parser("simulate", help="replay a scenario's requests through the runtime on the sim backend",
                              description="Plan a scenario's machine with its backend's rules, then run its requests "
                                          "through the runtime on a simulated device (accounting only), with faults.")
    p.add_argument("--scenario", metavar="FILE", help="a strata.scenario/1 file (required unless --list-faults)")
    p.add_argument("--inject", metavar="SPEC", action="append", default=[],
                   help="inject a fault, e.g. pinned-alloc:every or arena-register:above=1GiB (repeatable; "
                        "`--list-faults` lists them)")
    p.add_argument("--list-faults", action="store_true", help="list the fault sites and exit")
    p.add_argument("--requests", type=bounded_int(0, MAX_EXTRA_REQUESTS, "requests"), default=0, metavar="N",
                   help="add N random requests after the scenario's")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the random requests and the simulated routing")
    p.add_argument("--decode-tokens", type=bounded_int(0, MAX_TOKENS, "tokens"), default=0, metavar="N",
                   help="decode steps after each prompt")
    p.add_argument("--json", action="store_true", help=f"print one {SCHEMA} object")
    add_settings_arguments(p)
    p.set_defaults(func=run)


def random_requests(n: int, seed: int, max_context: int) -> list[int]:
    """n prompt lengths, log-uniform between 1 token and the context limit."""
    if n <= 0:
        return []
    rng = np.random.default_rng(seed)
    hi = np.log(max(2, max_context))
    return [int(min(max_context, max(1, round(float(np.exp(v)))))) for v in rng.uniform(0.0, hi, n)]


def simulate(scenario, settings, plugins, inject: list[str], extra_requests: list[int], seed: int = 0,
             decode_tokens: int = 0, progress: PhaseProgress | None = None, echo=None) -> dict:
    """Plan and replay; the strata.simulation/1 object."""
    from strata_core.planner import plan_for_machine
    from strata_core.runtime.engine import Engine
    from strata_core.runtime.runlog import RunLog
    from strata_core.builtin.sim.faults import FaultPlan
    from strata_core.builtin.sim.memory import SimDeviceMemory, SimPinnedAllocator
    target = plugins.resolve_target(settings, profile=scenario.profile, origin=f"scenario {scenario.path}")
    device, host = target.device.info, target.host
    plan = plan_for_machine(plugins, target, scenario.model, settings)
    faults = FaultPlan.parse(list(inject))
    log = RunLog(echo=echo, trace_enabled=bool(settings.trace))
    for w in plan.warnings:
        log.say(f"plan: {w}")
    budget = PinnedBudget(plan.pinned.limit_bytes, plan.pinned.floor_bytes)
    dm = SimDeviceMemory(device.vram_free_bytes, faults=faults, accounting_only=True)
    allocator = SimPinnedAllocator(budget, host.pinnable_bytes, faults=faults, accounting_only=True)
    requests = list(scenario.requests) + list(extra_requests)
    rows: list[dict] = []
    engine_exits = 0
    exits: list[str] = []
    try:
        engine = Engine(plan, dm=dm, allocator=allocator, kernels=None, budget=budget, weights=None, log=log,
                        accounting_only=True, seed=seed)
    except StrataError as e:
        engine = None
        engine_exits += 1
        exits.append(f"start-up: {e}")
    if progress is not None:
        progress.phase("requests", len(requests))
    for n in requests:
        if engine is None:
            rows.append({"prompt_tokens": n, "chunk": 0, "loan_slots": 0, "halvings": 0, "completed": False,
                         "refused_reason": "the engine did not start", "fallbacks": []})
            continue
        before = len(log.fallbacks)
        try:
            res = engine.serve(n, decode_tokens)
            rows.append(res.to_json())
        except Exception as e:  # what the runtime must never do: counted, reported, and the replay goes on
            engine_exits += 1
            exits.append(f"request of {n} tokens: {type(e).__name__}: {e}")
            if settings.trace:
                traceback.print_exc()
            if engine.loans.outstanding is not None:
                engine.loans.give_back(engine.loans.outstanding)
            rows.append({"prompt_tokens": n, "chunk": 0, "loan_slots": 0, "halvings": 0, "completed": False,
                         "refused_reason": None, "engine_exit": f"{type(e).__name__}: {e}",
                         "fallbacks": [f.to_json() for f in log.fallbacks[before:]]})
        if progress is not None:
            progress.advance("requests")
    if engine is not None:
        engine.close()
    out = {
        "schema": SCHEMA,
        "scenario": {"path": scenario.path, "name": scenario.name, "source": scenario.source,
                     "expect": scenario.expect},
        "plan": plan.to_json(),
        "requests": rows,
        "engine_exits": engine_exits,
        "engine_exit_reasons": exits,
        "completed": sum(1 for r in rows if r["completed"]),
        "refused": sum(1 for r in rows if r.get("refused_reason")),
        "fallbacks": [f.to_json() for f in log.fallbacks],
        "faults_injected": faults.faults_injected(),
        "inject": list(inject),
        "loans": engine.loans.loans if engine else 0,
        "halvings": engine.loans.halvings if engine else 0,
        "pinned": {"arena_pinned_bytes": engine.arena_pinned_bytes if engine else 0,
                   "arena_whole": engine.store.whole if engine else False,
                   "budget_exhausted": budget.exhausted, "budget_exhausted_reason": budget.exhausted_reason,
                   "budget_peak_bytes": budget.peak_bytes, "os_peak_locked_bytes": allocator.peak_locked_bytes},
        "cpu_share": {"enabled": engine.share.enabled if engine else False,
                      "off_reason": engine.share.off_reason if engine else "",
                      "buffer_bytes": engine.share.buffer_bytes if engine else 0,
                      "allocations": engine.share_pool.allocations if engine else [],
                      "experts": engine.executor.stats.cpu_share_experts if engine else 0},
        "cache": {"slots": engine.cache.slots if engine else 0, "hit_rate": engine.cache.hit_rate if engine else 0.0},
        "device": dm.counters(),
        "log": list(log.lines),
    }
    return out


def run(args: argparse.Namespace) -> int:
    """Replay and report: 0 when no request made the engine exit, 1 otherwise, 2 on bad input."""
    if args.list_faults:
        from strata_core.builtin.sim.faults import list_fault_sites
        sites = [{"name": s.name, "example": s.spec_example, "what": s.what} for s in list_fault_sites()]
        print(json.dumps({"schema": "strata.faults/1", "sites": sites}) if args.json else
              "\n".join(f"{s['example']:<32} {s['what']}" for s in sites))
        return 0
    if not args.scenario:
        raise BadInput("--scenario: give the strata.scenario/1 file to replay (or --list-faults)")
    if args.requests < 0:
        raise BadInput(f"--requests: expected 0 or more, got {args.requests}")
    if args.decode_tokens < 0:
        raise BadInput(f"--decode-tokens: expected 0 or more, got {args.decode_tokens}")
    scenario = load_scenario(args.scenario)
    from strata_core.commands.plan import merge_scenario_settings
    loaded = merge_scenario_settings(settings_from_args(args), scenario)
    for n in loaded.notices:  # legacy names, unknown STRATA_* variables: said on stderr, as `strata run` does
        say(n)
    settings = loaded.settings
    inject = list(settings.sim.inject) + list(args.inject)
    plugins = load_from_settings(settings)
    extra = random_requests(args.requests, args.seed, settings.kv.max_context)
    echo = None if args.json else (lambda line: say(line))
    with PhaseProgress(enabled=not args.json) as progress:
        report = simulate(scenario, settings, plugins, inject, extra, seed=args.seed,
                          decode_tokens=args.decode_tokens, progress=progress, echo=echo)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print(report)
    return 1 if report["engine_exits"] else 0


def _print(r: dict) -> None:
    """The per-request table and the totals."""
    c = Console()
    t = Table(title=f"strata simulate: {r['scenario']['name']} ({r['plan']['backend']}, {r['plan']['device']['name']})")
    for col in ("prompt", "chunk", "loan slots", "halvings", "completed", "refused", "fallbacks"):
        t.add_column(col, justify="right" if col in ("prompt", "chunk", "loan slots", "halvings") else "left")
    for q in r["requests"]:
        t.add_row(str(q["prompt_tokens"]), str(q["chunk"]), str(q["loan_slots"]), str(q["halvings"]),
                  "yes" if q["completed"] else "no", q.get("refused_reason") or "-",
                  "; ".join(f["what"] for f in q["fallbacks"]) or "-")
    c.print(t)
    c.print(f"engine exits: {r['engine_exits']}   completed: {r['completed']}   refused: {r['refused']}   "
            f"loans: {r['loans']}   halvings: {r['halvings']}   faults injected: {len(r['faults_injected'])}",
            markup=False)
    for e in r["engine_exit_reasons"]:
        c.print(f"engine exit: {e}", markup=False)
    for f in r["fallbacks"]:
        c.print(f"fallback: {f['what']}: {f['why']}", markup=False)
