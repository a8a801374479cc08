"""`strata plan`: the memory plan for this machine, a profile or a scenario, as tables, JSON, an explanation or a plot."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from strata_core.errors import BadInput
from strata_core.api.facts import MIB, DeviceInfo, HostInfo, Profile, load_profile
from strata_core.api.target import Target
from strata_core.models.resolve import model_from_name, resolve_model
from strata_core.models.spec import ModelSpec
from strata_core.registry import PluginHost, load_from_settings
from strata_core.planner.model_defaults import with_model_defaults
from strata_core.scenario import Scenario, load_scenario
from strata_core.config.settings import LoadedSettings, Provenance, StrataSettings, add_settings_arguments, output_path, settings_from_args

#: The model a bare `strata plan` plans for until the runtime's built-in tiny model exists.
FALLBACK_MODEL = "Qwen3-30B-A3B@Q4_K"
#: Loan rows the table shows at most (the first, the last, the largest and every step down are always shown).
LOAN_SAMPLE_ROWS = 12
PLOT_INSTALL = "pip install 'strata-core[plot]'"


def register(subparsers) -> None:
    """Add the `plan` sub-command."""
    p = subparsers.add_parser("plan", help="plan memory for this machine, a profile or a scenario",
                              description="Compute and prove the memory plan: VRAM, expert cache, prompt chunk and "
                                          "its loans, host RAM, page-locked memory and the CPU share.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--profile", metavar="FILE", help="plan for the machine in a strata.profile/1 file")
    src.add_argument("--scenario", metavar="FILE", help="plan for a strata.scenario/1 file (its model and settings "
                                                        "apply below flags)")
    p.add_argument("--model", metavar="NAME|PATH.gguf",
                   help="a preset (see --list-models) or an MoE GGUF file (default: the built-in tiny model)")
    p.add_argument("--quant", metavar="TYPE", help="quant type of a preset model, e.g. Q4_K, IQ3_S")
    p.add_argument("--list-models", action="store_true", help="list the preset models and exit")
    p.add_argument("--json", action="store_true", help="print one strata.plan/1 object")
    p.add_argument("--explain", action="store_true", help="print every decision with its reason")
    p.add_argument("--plot", metavar="FILE.png", type=output_path((".png", ".svg", ".pdf")), help="draw the memory budgets and the loans into a PNG "
                                                      f"(needs matplotlib: {PLOT_INSTALL})")
    p.add_argument("--save-profile", metavar="FILE.json", type=output_path((".json",)),
                   help="write this machine's facts (backend, device, host) as a strata.profile/1 file, for "
                        "`strata plan --profile FILE` elsewhere")
    add_settings_arguments(p)
    p.set_defaults(func=run)


@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan is made from, and where it came from."""

    device: DeviceInfo
    host: HostInfo
    model: ModelSpec
    loaded: LoadedSettings
    plugins: PluginHost
    origin: str                      # 'this machine', 'profile FILE' or 'scenario FILE'
    requests: tuple[int, ...] = ()
    target: Target | None = None     # what the plan is made for (registry.resolve_target)


def merge_scenario_settings(loaded: LoadedSettings, scenario: Scenario) -> LoadedSettings:
    """The scenario's settings block over env, TOML and defaults, but below flags."""
    values = loaded.settings.model_dump()
    origins = dict(loaded.origins)
    for key in scenario.settings_keys:
        if origins.get(key, Provenance("default", "core")).source == "flag":
            continue
        group, leaf = key.split(".", 1)
        values[group][leaf] = getattr(getattr(scenario.settings, group), leaf)
        origins[key] = Provenance("scenario", f"{scenario.path}: settings.{key}")
    return replace(loaded, settings=type(loaded.settings)(**values), origins=origins)  # plugin groups kept


def default_model() -> ModelSpec:
    """The runtime's built-in tiny model, or a public preset while the runtime does not provide one."""
    try:
        from strata_core.models.synthetic import tiny_model_spec
    except ImportError:
        return model_from_name(FALLBACK_MODEL)
    return tiny_model_spec()


def gather_inputs(args: argparse.Namespace) -> PlanInputs:
    """Read the machine (probed, a profile or a scenario), the model and the settings the flags name."""
    loaded = settings_from_args(args)
    scenario = load_scenario(args.scenario) if getattr(args, "scenario", None) else None
    if scenario is not None:
        loaded = merge_scenario_settings(loaded, scenario)
    if args.quant and not args.model:
        raise BadInput("--quant: give the preset it applies to with --model NAME")
    settings = loaded.settings
    plugins = load_from_settings(settings)
    if scenario is not None:
        profile, origin, requests = scenario.profile, f"scenario {args.scenario}", scenario.requests
    elif getattr(args, "profile", None):
        profile, origin, requests = load_profile(args.profile), f"profile {args.profile}", ()
    else:
        profile, origin, requests = None, "this machine", ()
    target = plugins.resolve_target(settings, profile=profile, origin=origin)
    device, host = target.device.info, target.host
    if args.model is not None:  # an empty --model is refused by name, not read as absent
        model = resolve_model(args.model, args.quant)
    elif scenario is not None:
        model = scenario.model
    else:
        model = default_model()
    # the model's own defaults (the tiny model's cache) through the one path `strata run` takes too
    loaded = with_model_defaults(loaded, model)
    return PlanInputs(device=device, host=host, model=model, loaded=loaded, plugins=plugins, origin=origin,
                      requests=requests, target=target)


def build_plan(inputs: PlanInputs):
    """The proven plan for these inputs (platform defaults and plan adjustments through the plugins)."""
    from strata_core.planner import plan_for_machine
    return plan_for_machine(inputs.plugins, inputs.target, inputs.model, inputs.loaded.settings)


def request_rows(plan, requests: tuple[int, ...]) -> list[dict]:
    """Each request's chunk and the loan that chunk needs, against what the plan can lend."""
    rows = []
    for n in requests:
        refused = plan.refuse_reason(n)  # the runtime's own rule (kv.max_context)
        chunk = 0 if refused else plan.request_chunk(n)
        streams = not refused and bool(plan.streams(n))
        loan = plan.loan_for(chunk).loan_slots if streams else 0
        rows.append({"prompt_tokens": n, "chunk": chunk, "loan_slots": loan, "streams": streams,
                     "fits": refused is None and (not streams or loan <= plan.prompt.lendable_slots),
                     "refused_reason": refused})
    return rows


def decision_origin(source: str, loaded: LoadedSettings) -> str:
    """A decision's source with where its setting came from ('setting prefill.chunk' -> '... (flag --set ...)')."""
    if not source.startswith("setting "):
        return source
    key = source[len("setting "):].split("=", 1)[0].strip()
    prov = loaded.origins.get(key)
    return source if prov is None else f"{source} ({prov.source}: {prov.origin})"


def save_machine_profile(path: Path, inputs: PlanInputs) -> None:
    """Write the machine the plan was made for as `strata.profile/1` (what `--profile FILE` reads back)."""
    backend = inputs.target.backend.name if inputs.target is not None else inputs.device.backend
    text = json.dumps(Profile(backend=backend, device=inputs.device, host=inputs.host).to_json(), indent=2) + "\n"
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise BadInput(f"--save-profile {path}: cannot write ({e.strerror or e})") from None


def plan_report(plan, inputs: PlanInputs) -> dict:
    """The `strata.plan/1` object, with where the inputs came from and the scenario's requests (added fields)."""
    out = plan.to_json()
    for dec in out["decisions"]:
        dec["origin"] = decision_origin(str(dec["source"]), inputs.loaded)
    out["origin"] = inputs.origin
    out["settings_notices"] = list(inputs.loaded.notices)
    if inputs.requests:
        out["requests"] = request_rows(plan, inputs.requests)
    return out


def run(args: argparse.Namespace) -> int:
    """Plan, then print the tables, the JSON, the explanation, and draw the plot as asked."""
    if args.list_models:
        return list_models(args.json)
    if args.plot:
        _require_matplotlib()
    if args.save_profile and (args.profile or args.scenario):
        raise BadInput("--save-profile: saves this machine's facts; leave out --profile and --scenario")
    inputs = gather_inputs(args)
    plan = build_plan(inputs)
    report = plan_report(plan, inputs)
    if args.save_profile:  # after the plan held, so a refused plan writes nothing
        save_machine_profile(Path(args.save_profile), inputs)
        report["profile_saved"] = args.save_profile
    if args.plot:
        plot_plan(plan, inputs.requests, Path(args.plot))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    console = Console()
    print_plan(console, plan, inputs, report)
    if args.explain:
        print_explain(console, plan, inputs.loaded)
    if args.plot:
        console.print(f"plot written to {args.plot}", markup=False)
    if args.save_profile:
        console.print(f"profile of this machine written to {args.save_profile}", markup=False)
    return 0


def list_models(as_json: bool) -> int:
    """Print the presets (name, default quant, experts, expert and dense bytes) as JSON or one line each."""
    from strata_core.models.presets import PRESET_QUANTS, PRESETS
    rows = []
    for p in PRESETS:
        spec = model_from_name(p.name)
        rows.append({"name": p.name, "default_quant": p.default_quant, "moe_layers": p.moe_layers,
                     "experts_per_layer": p.experts, "top_k": p.top_k, "experts_total_bytes": spec.experts_total_bytes,
                     "dense_bytes": spec.dense_bytes, "config_url": p.config_url})
    if as_json:
        print(json.dumps({"schema": "strata.models/1", "presets": [r["name"] for r in rows], "models": rows,
                          "quants": list(PRESET_QUANTS)}, indent=2))
        return 0
    for r in rows:
        print(f"{r['name']:18} {r['default_quant']:6} {r['moe_layers']:3} x {r['experts_per_layer']:3} experts, "
              f"top-{r['top_k']}: experts {r['experts_total_bytes'] / (1 << 30):6.1f} GiB, "
              f"dense {r['dense_bytes'] / (1 << 30):5.2f} GiB")
    print(f"quants: {', '.join(PRESET_QUANTS)} (--quant, or NAME@QUANT)")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# People's view


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:,.0f} MiB"


def _value(what: str, value: object) -> str:
    """A decision's value for people: byte counts in MiB."""
    if what.endswith("_bytes") and isinstance(value, int) and not isinstance(value, bool):
        return _mib(value)
    return str(value)


def loan_sample(loans, limit: int = LOAN_SAMPLE_ROWS) -> list[tuple[object, bool]]:
    """(row, is_a_step_down) for a compact view: first, last, the largest, every non-monotonic step, then evenly spaced."""
    if not loans:
        return []
    down = {i for i in range(1, len(loans)) if loans[i].loan_slots < loans[i - 1].loan_slots}
    peak = max(range(len(loans)), key=lambda i: loans[i].loan_slots)
    keep = {0, len(loans) - 1, peak} | down | {i - 1 for i in down}
    step = max(1, -(-len(loans) // limit))
    keep |= set(range(0, len(loans), step)) if len(keep) < limit else set()
    return [(loans[i], i in down) for i in sorted(keep)]


def print_plan(console: Console, plan, inputs: PlanInputs, report: dict) -> None:
    """Rich tables of the plan: VRAM, cache, prompt path and loans, host, pinned, CPU share, decisions, warnings."""
    m, d = plan.model, plan.device
    console.print(f"Plan for {m.name} ({m.quant}, {m.moe_layers} MoE layers x {m.experts_per_layer} experts, "
                  f"top-{m.top_k}) on {d.name} [{plan.backend}], from {inputs.origin}", markup=False, style="bold")

    v = plan.vram
    t = Table(title="VRAM", show_header=False)
    t.add_column("item"), t.add_column("value", justify="right")
    for label, n in (("free", v.free_bytes), ("reserve", v.reserve_bytes), ("dense weights", v.dense_bytes),
                     ("KV cache", v.kv_bytes), ("workspace", v.workspace_bytes),
                     ("owned prompt buffers", getattr(v, "owned_prompt_bytes", 0)),
                     ("expert cache", v.expert_cache_bytes),
                     *((label, n) for label, n in (("driver: allocation rounding", v.alloc_rounding_bytes),
                                                   ("driver: page tables of pinned memory", v.pinned_map_bytes))
                       if n),
                     ("left", v.left_bytes)):
        t.add_row(label, _mib(n))
    t.add_row("expert cache slots", f"{plan.expert_cache.slots:,} x {plan.expert_cache.slot_bytes / MIB:.2f} MiB "
                                    f"(of {m.experts_total:,} experts)")
    console.print(t)

    p = plan.prompt
    t = Table(title=f"Prompt path: chunk {p.chunk} ({p.chunk_source}), ceiling {p.ceiling}, "
                    f"lendable {p.lendable_slots:,} slots, keep {p.min_keep_slots}"
                    + (", own buffers" if p.owned_buffers else ""))
    for col in ("chunk", "ring", "buffers", "loan", "of lendable"):
        t.add_column(col, justify="right")
    sample = loan_sample(p.loans)
    for row, down in sample:
        style = "yellow" if down else ("bold" if row.loan_slots == p.max_loan_slots else None)
        t.add_row(str(row.chunk), str(row.ring_slots), str(row.buffer_slots),
                  str(row.loan_slots) + (" (step down)" if down else ""),
                  f"{row.loan_slots / max(1, p.lendable_slots):.0%}", style=style)
    t.caption = (f"{len(sample)} of {len(p.loans)} chunks up to {p.chunk} shown; max loan {p.max_loan_slots:,} slots"
                 + ("; yellow: a larger chunk's loan is smaller than the one before (loan(c) is not monotonic)"
                    if any(down for _, down in sample) else ""))
    console.print(t)

    if report.get("requests"):
        t = Table(title="Requests")
        for col in ("prompt tokens", "chunk", "loan", "streams", "fits"):
            t.add_column(col, justify="right")
        for r in report["requests"]:
            t.add_row(f"{r['prompt_tokens']:,}", str(r["chunk"]), f"{r['loan_slots']:,}",
                      "yes" if r["streams"] else "no",
                      "yes" if r["fits"] else ("NO: " + r["refused_reason"] if r["refused_reason"] else "NO"),
                      style=None if r["fits"] else "red")
        console.print(t)

    h, pin, cs = plan.host_memory, plan.pinned, plan.cpu_share
    t = Table(title="Host memory and page-locked memory", show_header=False)
    t.add_column("item"), t.add_column("value", justify="right")
    for label, n in (("RAM available", h.available_bytes), ("resident experts", h.resident_bytes),
                     ("prompt-path borrow", h.borrow_bytes), ("pinned KV", h.kv_pinned_bytes),
                     ("kernel weight copies", h.weight_copies_bytes),
                     ("headroom", h.headroom_bytes), ("page-locked limit", pin.limit_bytes),
                     ("page-locked cap", pin.cap_bytes), ("pinned arena", pin.arena_bytes),
                     ("kept floor", pin.floor_bytes), ("CPU-share buffer", pin.cpu_share_bytes)):
        t.add_row(label, _mib(n))
    t.add_row("arena pinned whole", "no (budget exhausted)" if pin.exhausted else "yes")
    console.print(t)
    console.print("CPU share: " + (f"on for chunks up to {cs.max_chunk}" if cs.enabled else "off") + f" ({cs.reason})",
                  markup=False)

    t = Table(title="Decisions (--explain gives the reasons)")
    for col in ("what", "value", "source"):
        t.add_column(col, overflow="fold")
    for dec in plan.decisions:
        t.add_row(str(dec.what), _value(dec.what, dec.value), str(dec.source))
    console.print(t)
    if plan.backend not in inputs.plugins.backends:
        console.print(f"note: no installed plugin provides backend '{plan.backend}'; its platform rules are the "
                      f"core's defaults ({plan.defaults.source})", markup=False)
    for w in plan.warnings:
        console.print(f"warning: {w}", markup=False, style="yellow")
    for n in inputs.loaded.notices:
        console.print(f"note: {n}", markup=False)


def print_explain(console: Console, plan, loaded: LoadedSettings | None = None) -> None:
    """Every decision with its reason and its source (a setting with where it came from), one paragraph each."""
    console.print("Why:", style="bold")
    for i, dec in enumerate(plan.decisions, 1):
        src = decision_origin(str(dec.source), loaded) if loaded is not None else dec.source
        console.print(f"{i:3}. {dec.what} = {_value(dec.what, dec.value)}  [{src}]\n     {dec.why}", markup=False)


# ---------------------------------------------------------------------------------------------------------------
# Plot


def _require_matplotlib():
    """matplotlib's pyplot on a file-only backend, or BadInput with the install line."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInput(f"--plot needs matplotlib, which is not installed: {PLOT_INSTALL}") from None
    return plt


def plot_plan(plan, requests: tuple[int, ...], path: Path) -> None:
    """Stacked bars of VRAM, host RAM and page-locked memory, and every chunk's loan against what can be lent."""
    plt = _require_matplotlib()
    gib = float(1 << 30)
    v, h, pin, p = plan.vram, plan.host_memory, plan.pinned, plan.prompt
    lent = min(v.expert_cache_bytes, p.max_loan_slots * plan.expert_cache.slot_bytes)
    owned = getattr(v, "owned_prompt_bytes", 0)
    bars = {
        "VRAM": [("reserve", v.reserve_bytes), ("dense", v.dense_bytes), ("KV", v.kv_bytes),
                 ("workspace", v.workspace_bytes), ("prompt buffers", owned),
                 ("cache", v.expert_cache_bytes - lent), ("lent region", lent), ("left", max(0, v.left_bytes))],
        "host RAM": [("resident", h.resident_bytes), ("borrow", h.borrow_bytes), ("pinned KV", h.kv_pinned_bytes),
                     ("weight copies", h.weight_copies_bytes), ("headroom", h.headroom_bytes),
                     ("left", max(0, h.available_bytes - h.resident_bytes - h.borrow_bytes - h.kv_pinned_bytes
                                  - h.weight_copies_bytes - h.headroom_bytes))],
        "page-locked": [("pinned arena", pin.arena_bytes), ("floor", pin.floor_bytes),
                        ("left", max(0, pin.limit_bytes - pin.arena_bytes - pin.floor_bytes))],
    }
    colors = {"reserve": "#999999", "dense": "#4c72b0", "KV": "#55a868", "workspace": "#8172b2",
              "prompt buffers": "#ccb974", "cache": "#64b5cd", "lent region": "#dd8452", "left": "#eeeeee",
              "resident": "#c44e52", "borrow": "#dd8452", "pinned KV": "#55a868", "headroom": "#bbbbbb",
              "pinned arena": "#937860", "floor": "#da8bc3"}
    fig, (ax_mem, ax_loan) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [1, 1.6]})
    seen = set()
    for x, (name, parts) in enumerate(bars.items()):
        bottom = 0.0
        for label, n in parts:
            if n <= 0:
                continue
            ax_mem.bar(x, n / gib, bottom=bottom, color=colors[label], edgecolor="white",
                       label=None if label in seen else label)
            seen.add(label)
            bottom += n / gib
    ax_mem.set_xticks(range(len(bars)), list(bars))
    ax_mem.set_ylabel("GiB")
    ax_mem.set_title("Budgets")
    ax_mem.legend(fontsize=8, loc="upper right")

    grid = p.grid_tokens
    beyond = [plan.loan_for(c) for c in range(grid, max(p.ceiling, p.chunk) + 1, grid)]
    ax_loan.plot([r.chunk for r in beyond], [r.loan_slots for r in beyond], color="#bbbbbb", marker=".",
                 label="loan above the plan's chunk" if p.chunk < p.ceiling else "loan")
    ax_loan.plot([r.chunk for r in p.loans], [r.loan_slots for r in p.loans], color="#dd8452", marker=".",
                 label="loan up to the plan's chunk")
    ax_loan.axhline(p.lendable_slots, color="#c44e52", linestyle="--", label=f"lendable ({p.lendable_slots:,} slots)")
    ax_loan.axvline(p.chunk, color="#4c72b0", linestyle=":", label=f"plan chunk {p.chunk}")
    if requests:
        chunks = [plan.request_chunk(n) for n in requests]
        ax_loan.scatter(chunks, [plan.loan_for(c).loan_slots for c in chunks], color="black", zorder=3,
                        label="the scenario's requests")
    ax_loan.set_xlabel("chunk (tokens)")
    ax_loan.set_ylabel("slots")
    ax_loan.set_title("Prompt loan per chunk")
    ax_loan.legend(fontsize=8)
    fig.suptitle(f"{plan.model.name} on {plan.device.name} [{plan.backend}]")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise BadInput(f"--plot: cannot write {path} ({e.strerror or e})") from None
    finally:
        plt.close(fig)
