"""The four planning steps of DESIGN.md as pure functions: facts + model + settings + defaults -> Plan.

Each step records a Decision (what, value, why, source). Nothing here allocates or reads the machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from strata_core.errors import PlanRefused
from strata_core.api.facts import GIB, MIB, DeviceInfo, HostInfo, PlatformDefaults
from strata_core.models.spec import ModelSpec, kv_bytes_per_token
from strata_core.api.plan_draft import PlanDraft
from strata_core.planner.buffers import dequant_scratch_bytes, weight_copies_bytes
from strata_core.planner.chunks import grid_chunks, halve
from strata_core.planner.driver_memory import (alignment_allowance_bytes, alloc_rounding_bound_bytes,
                                               alloc_rounding_bytes, pinned_map_bytes, staging_bytes)
from strata_core.planner.invariants import check_all
from strata_core.planner.pin_caps import REGISTRATION_SLICE_BYTES, platform_pin_cap
from strata_core.planner.plan import (CachePlan, CpuSharePlan, Decision, HostPlan, LoanModel, LoanRow, PinnedPlan,
                                     Plan, PromptPlan, RuntimeLimits, VramPlan)

def _mib(n: int | float) -> str:
    return f"{n / MIB:,.0f} MiB" if abs(n) >= 10 * MIB else f"{n / MIB:.3f} MiB"


@dataclass
class _Ledger:
    decisions: list[Decision] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def note(self, what: str, value: Any, why: str, source: str) -> Any:
        self.decisions.append(Decision(what=what, value=value, why=why, source=source))
        return value


def _pick(setting: Any, default: Any, key: str, backend_source: str) -> tuple[Any, str]:
    """A setting when it is set, else the backend's default, with the source to record."""
    return (setting, f"setting {key}") if setting is not None else (default, backend_source)


def initial_knobs(device: DeviceInfo, settings: Any, defaults: PlatformDefaults) -> dict[str, Any]:
    """The tightenable inputs as settings and platform defaults give them."""
    mode, cap = settings.prefill.chunk_request()
    ec = settings.memory.expert_cache
    reserve_mib = settings.memory.vram_reserve_mib
    headroom_gib = settings.memory.resident_headroom_gib
    return {
        "prompt.chunk_cap_tokens": cap if mode == "auto" else None,
        "expert_cache.slots_cap": None if ec == "auto" else int(ec),
        "prompt.lend_fraction": settings.prefill.lend_fraction or defaults.lend_fraction,
        "vram.reserve_bytes": (reserve_mib if reserve_mib is not None else defaults.vram_reserve_mib) * MIB,
        "host_memory.headroom_bytes": int(headroom_gib * GIB) if headroom_gib is not None
        else defaults.resident_headroom_bytes,
        "cpu_share.enabled": None,
    }


def _grid_chunks(grid: int, upto: int) -> list[int]:
    return grid_chunks(grid, upto)


def _max_loan_upto(loans: LoanModel, grid: int, chunk: int) -> tuple[int, list[LoanRow]]:
    rows = [loans.loan(c) for c in _grid_chunks(grid, chunk)]
    if chunk % grid:
        rows.append(loans.loan(chunk))
    return max((r.loan_slots for r in rows), default=0), rows


def _pin_cap(device: DeviceInfo, host: HostInfo, settings: Any, defaults: PlatformDefaults,
             bsrc: str) -> tuple[int | None, str, str]:
    """(cap, why, source): the platform's page-locked cap, lowered by the backend's, or the explicit setting."""
    p = settings.pinning
    fact = platform_pin_cap(device, host)
    capped_platform = device.is_wddm or getattr(host, "virtualization", "none") != "none"
    if capped_platform and p.wddm_pin_cap_gib is not None:
        return int(p.wddm_pin_cap_gib * GIB), "the page-locked cap set explicitly", "setting pinning.wddm_pin_cap_gib"
    cap, why, src = fact.cap_bytes, fact.why, "core (platform fact)"
    if defaults.pin_cap_bytes is not None and (cap is None or defaults.pin_cap_bytes < cap):
        # a backend's defaults may only lower the platform's cap
        cap, why, src = defaults.pin_cap_bytes, "the backend's page-locked cap (below the platform's)", bsrc
    return cap, why, src


@dataclass(frozen=True)
class _Pinned:
    limit: int
    cap: int | None
    floor: int
    arena: int
    exhausted: bool


def _pinned_step(device: DeviceInfo, host: HostInfo, model: ModelSpec, settings: Any, defaults: PlatformDefaults,
                 led: _Ledger, bsrc: str, borrow: int = 0, room: int | None = None) -> _Pinned:
    """Step 4: the page-locked limit (leaving room for the borrow), the cap, the floor and the arena.

    `room` is what host RAM leaves the in-RAM store beside the borrow, pinned KV and headroom: the arena never
    takes more (DESIGN.md's host invariant counts max(resident, arena)).
    """
    p = settings.pinning
    avail = host.ram_available_bytes
    pinnable = host.pinnable_bytes if host.pinnable_bytes is not None else avail
    cap, cap_why, cap_src = _pin_cap(device, host, settings, defaults, bsrc)
    reserve, rsrc = _pick(None if p.pin_reserve_gib is None else int(p.pin_reserve_gib * GIB),
                          defaults.pin_reserve_bytes, "pinning.pin_reserve_gib", bsrc)
    limit = max(0, min(pinnable, cap if cap is not None else pinnable, avail - reserve - borrow))
    led.note("pinned.cap_bytes", cap, cap_why, cap_src)
    led.note("pinned.limit_bytes", limit,
             f"min(pinnable {_mib(pinnable)}, cap {'none' if cap is None else _mib(cap)}, "
             f"available {_mib(avail)} - reserve {_mib(reserve)} - the prompt path's host borrow {_mib(borrow)})",
             cap_src if cap is not None and cap == limit else rsrc)
    floor, fsrc = _pick(None if p.pin_floor_mib is None else p.pin_floor_mib * MIB, defaults.pin_floor_bytes,
                        "pinning.pin_floor_mib", bsrc)
    if not p.pin_guard:
        floor, fsrc = 0, "setting pinning.pin_guard=false"
    floor = min(floor, limit)
    led.note("pinned.floor_bytes", floor, "page-locked memory kept out of the arena for runtime allocations "
             "(CPU share, staging): a later allocation must never find every page taken (seed #1756)", fsrc)
    wanted = model.host_arena_bytes
    arena = min(wanted, limit - floor)
    src, why = "core", f"the expert arena ({_mib(wanted)}) pins at most limit - floor"
    if room is not None and max(0, room) < arena:
        arena = max(0, room)
        why = (f"the expert arena ({_mib(wanted)}) shrinks to the {_mib(arena)} host RAM leaves beside the prompt "
               f"path's host borrow ({_mib(borrow)}), pinned KV and headroom")
    if p.arena_pin_gib is not None and p.arena_pin_gib * GIB < arena:
        arena, src = int(p.arena_pin_gib * GIB), "setting pinning.arena_pin_gib"
        why = f"the expert arena ({_mib(wanted)}) pins at most pinning.arena_pin_gib ({p.arena_pin_gib:g} GiB)"
    exhausted = arena < wanted
    led.note("pinned.arena_bytes", arena,
             why + ("; it cannot be pinned whole, so the pinned budget counts as exhausted for optional users"
                    if exhausted else ""), src)
    if exhausted:
        led.warnings.append(f"the expert arena ({_mib(wanted)}) cannot be page-locked whole: {_mib(arena)} pinned, "
                            f"the rest is copied from pageable memory")
    return _Pinned(limit=limit, cap=cap, floor=floor, arena=arena, exhausted=exhausted)


def _cache_step(device: DeviceInfo, model: ModelSpec, settings: Any, defaults: PlatformDefaults, knobs: dict,
                led: _Ledger, bsrc: str, driver_bytes: int = 0) -> tuple[int, int, int, int, int, int]:
    """Step 1: VRAM -> (free, reserve, kv, workspace, usable, slots); `driver_bytes` bounds the driver's lines."""
    free = int(device.vram_free_bytes * defaults.free_vram_trust) - defaults.context_overhead_bytes
    if defaults.free_vram_trust < 1.0:
        led.note("vram.free_bytes", free, f"the driver's free figure trusted at {defaults.free_vram_trust:.0%} "
                 "(drivers that spill into host memory over-report)", bsrc)
    reserve = knobs["vram.reserve_bytes"]
    led.note("vram.reserve_bytes", reserve, "kept free for the driver, the display and fragmentation",
             "setting memory.vram_reserve_mib" if settings.memory.vram_reserve_mib is not None else bsrc)
    cells = settings.kv.max_context
    if settings.kv.resident_cells is not None:
        cells = min(cells, settings.kv.resident_cells)
    kv = kv_bytes_per_token(model, settings.kv.dtype) * cells
    if kv:
        led.note("vram.kv_bytes", kv, f"{cells} resident cells of {kv_bytes_per_token(model, settings.kv.dtype)} "
                 f"bytes ({settings.kv.dtype})", "setting kv.resident_cells" if cells != settings.kv.max_context
                 else "setting kv.max_context")
    stream_min = settings.prefill.stream_min_tokens if settings.prefill.stream_min_tokens is not None \
        else defaults.stream_min_tokens
    scratch = dequant_scratch_bytes(model, defaults)
    workspace = stream_min * model.prompt_bytes_per_token + scratch
    led.note("vram.workspace_bytes", workspace, f"owned buffers of prompts shorter than {stream_min} tokens and of "
             "decode: never lent" + (f"; {_mib(scratch)} of it the prefill's dequantization scratch of "
                                     f"{model.quant} experts" if scratch else ""),
             "setting prefill.stream_min_tokens" if settings.prefill.stream_min_tokens is not None else bsrc)
    usable = free - reserve - model.dense_bytes - kv - workspace - driver_bytes
    per_slot = model.slot_bytes
    fit = max(0, usable // per_slot)
    slots = min(fit, model.experts_total)
    why = f"{_mib(usable)} usable / {per_slot} bytes a slot" + (", capped at every expert" if
                                                                 fit > model.experts_total else "")
    src = "core"
    cap = knobs["expert_cache.slots_cap"]
    if cap is not None and cap < slots:
        from_setting = settings.memory.expert_cache != "auto" and int(settings.memory.expert_cache) == cap
        slots, why = cap, f"capped at {cap} slots"
        src = "setting memory.expert_cache" if from_setting else "plugin"
    elif cap is not None and cap > fit:
        need = (cap * per_slot - usable)
        raise PlanRefused(f"VRAM: memory.expert_cache={cap} slots need {_mib(cap * per_slot)} but only "
                          f"{_mib(max(usable, 0))} is usable: short by {_mib(need)}; lower memory.expert_cache to "
                          f"{fit} or memory.vram_reserve_mib")
    led.note("expert_cache.slots", slots, why, src)
    return free, reserve, kv, workspace, usable, slots


def make_plan(device: DeviceInfo, host: HostInfo, model: ModelSpec, settings: Any, defaults: PlatformDefaults,
              adjust: Callable[[PlanDraft], None] | None = None) -> Plan:
    """Plan this model on this machine; every invariant is checked before the plan is returned.

    `adjust` (site plugins) receives a draft with the first-pass plan and may tighten its knobs; the plan is then
    computed again from the tightened knobs. Raises PlanRefused when no plan exists, with the shortfall.
    """
    knobs = initial_knobs(device, settings, defaults)
    plan = _compute(device, host, model, settings, defaults, knobs, ())
    if adjust is not None:
        draft = PlanDraft(knobs=dict(knobs), plan=plan)
        adjust(draft)
        if draft.decisions:
            plan = _compute(device, host, model, settings, defaults, draft.knobs, tuple(draft.decisions))
    check_all(plan)
    return plan


def _compute(device: DeviceInfo, host: HostInfo, model: ModelSpec, settings: Any, defaults: PlatformDefaults,
             knobs: dict, plugin_decisions: tuple[Decision, ...]) -> Plan:
    led = _Ledger(decisions=list(plugin_decisions))
    bsrc = f"backend {defaults.source}" if not defaults.source.startswith("backend") else defaults.source
    model.validate()
    avail = host.ram_available_bytes

    # Step 4's chunk-independent part first, unrecorded: the ring's depth depends on how much of the arena is
    # pinned. The recorded step 4 comes after the host step, with the borrow known.
    first_pin = _pinned_step(device, host, model, settings, defaults, _Ledger(), bsrc)
    pinned_fraction = first_pin.arena / model.host_arena_bytes if model.host_arena_bytes else 1.0

    # Step 1: VRAM and the expert cache.
    # the driver's lines are known once the cache is: the cache is sized beside their bound
    kv_pinned_bound = 0
    if settings.kv.resident_cells is not None and settings.kv.resident_cells < settings.kv.max_context:
        kv_pinned_bound = kv_bytes_per_token(model, settings.kv.dtype) * (settings.kv.max_context
                                                                          - settings.kv.resident_cells)
    embed_pinned = 2 * int(model.vocab or 0) * int(model.hidden) if defaults.pins_embedding else 0
    driver_bound = alloc_rounding_bound_bytes(device, model) + pinned_map_bytes(
        device, first_pin.arena + first_pin.floor + kv_pinned_bound + embed_pinned, device.vram_total_bytes)
    free, reserve, kv, workspace, usable, slots = _cache_step(device, model, settings, defaults, knobs, led, bsrc,
                                                              driver_bound)
    slots_cap = knobs["expert_cache.slots_cap"]
    if slots_cap is not None and slots_cap < model.top_k:
        raise PlanRefused(f"expert cache: memory.expert_cache={slots_cap} slots cannot hold the {model.top_k} experts (top_k) one "
                          f"token routes to: short by {_mib((model.top_k - slots_cap) * model.slot_bytes)} of cache; set "
                          f"memory.expert_cache to at least {model.top_k}, or 'auto'")
    if usable <= 0 or slots < model.top_k:
        short = model.top_k * model.slot_bytes - usable
        raise PlanRefused(f"VRAM: {device.name}: {_mib(max(free, 0))} free leaves {_mib(max(usable, 0))} after the "
                          f"reserve ({_mib(reserve)}), dense weights, KV and workspace: short by {_mib(short)} for "
                          f"even {model.top_k} expert slots; lower memory.vram_reserve_mib (now "
                          f"{reserve // MIB}) or kv.max_context, or use a smaller model")

    # Step 2: the prompt path. min_keep: decode keeps this many slots; a small cache keeps a quarter of itself.
    grid = defaults.chunk_grid_tokens
    min_keep = min(defaults.min_keep_slots, max(model.top_k, slots // 4))
    lend_fraction = knobs["prompt.lend_fraction"]
    lendable = max(0, min(int(lend_fraction * slots), slots - min_keep))
    led.note("prompt.lendable_slots", lendable, f"min({lend_fraction:g} x {slots} slots, {slots} - {min_keep} "
             "kept for decode)", "setting prefill.lend_fraction" if settings.prefill.lend_fraction else bsrc)

    def loan_model(fraction: float) -> LoanModel:
        return LoanModel(prompt_bytes_per_token=model.prompt_bytes_per_token, slot_bytes=model.slot_bytes,
                         pinned_fraction=fraction, defaults=defaults)

    loans = loan_model(pinned_fraction)
    ceiling = defaults.chunk_ceiling_tokens
    led.note("prompt.ceiling", ceiling, "the platform's largest auto chunk", bsrc)
    mode, set_cap = settings.prefill.chunk_request()
    cap_tokens = knobs["prompt.chunk_cap_tokens"]
    ceiling_eff = ceiling if cap_tokens is None else min(ceiling, cap_tokens)
    # which input bounds the auto chunk, so --explain can name it
    bound_src = bsrc
    if cap_tokens is not None and cap_tokens < ceiling:
        bound_src = "setting prefill.chunk" if cap_tokens == set_cap else "plugin"
    if settings.kv.max_context < ceiling_eff:
        bound_src = "setting kv.max_context"
    ceiling_eff = max(grid, (min(ceiling_eff, settings.kv.max_context) // grid) * grid)
    owned = False
    if mode == "fixed":
        chunk = set_cap
        chunk_src = "setting prefill.chunk"
        if cap_tokens is not None and chunk > cap_tokens:
            chunk = led.note("prompt.chunk", cap_tokens, "capped by a site plugin", "plugin")
            chunk_src = "plugin"
        source = "setting"
        while chunk > 1 and _max_loan_upto(loans, grid, chunk)[0] > lendable:
            new = halve(chunk, grid)
            led.note("prompt.chunk", new, f"a chunk of {chunk} tokens needs a loan larger than the {lendable} slots "
                     "that can be lent: halved", chunk_src)
            chunk = new
            source = "setting, halved"
        if _max_loan_upto(loans, grid, chunk)[0] > lendable:
            chunk, owned = 0, True
    else:
        chunk, running = 0, 0
        for c in _grid_chunks(grid, ceiling_eff):
            running = max(running, loans.loan(c).loan_slots)
            if running > lendable:
                break
            chunk = c
        source = "auto" if cap_tokens is None else f"auto (capped at {cap_tokens})"
        chunk_src = bound_src if chunk == ceiling_eff else "core"
        if chunk == 0:
            owned = True
    owned_bytes = 0
    if owned:
        chunk, slots, owned_bytes = _owned_buffers(model, loans, grid, ceiling_eff, usable, min_keep, led,
                                                   knobs["expert_cache.slots_cap"])
        lendable = 0
        source = "owned buffers"
    else:
        why = (f"the largest chunk whose loan, and every smaller chunk's, fits the {lendable} lendable slots (loan(c) "
               "is not monotonic: the maximum over the grid counts)")
        if mode != "fixed" and chunk == ceiling_eff:
            why = f"the auto chunk's bound ({ceiling_eff} tokens), and its loan and every smaller chunk's fit"
        led.note("prompt.chunk", chunk, why, chunk_src)

    # Step 3: host RAM. max(resident, pinned arena) + the prompt path's host borrow + pinned KV + headroom <= available.
    headroom = knobs["host_memory.headroom_bytes"]
    resident_experts = (model.experts_total - slots) if settings.memory.resident_experts else 0
    kv_pinned = 0
    if settings.kv.resident_cells is not None and settings.kv.resident_cells < settings.kv.max_context:
        kv_pinned = kv_bytes_per_token(model, settings.kv.dtype) * (settings.kv.max_context - settings.kv.resident_cells)
    # the f32 copies the backend's kernels keep of read-only dense weights (cpu: routers, LM head): host RAM too
    copies = weight_copies_bytes(model, defaults)

    def borrow(c: int) -> int:
        if not defaults.host_borrow or owned or c <= 0:
            return 0
        return _max_loan_upto(loans, grid, c)[0] * model.slot_bytes

    while (chunk > grid and resident_experts * model.slot_bytes + borrow(chunk) + kv_pinned + copies + headroom
           > avail):
        new = halve(chunk, grid)
        led.note("prompt.chunk", new, f"resident experts ({_mib(resident_experts * model.slot_bytes)}) + the prompt "
                 f"path's host borrow at {chunk} tokens ({_mib(borrow(chunk))}) + headroom do not fit the "
                 f"{_mib(avail)} of available RAM: stepped down (seed #2090, gfx12)", "core")
        chunk = new
        source = f"{source}, stepped down for host RAM"
    if resident_experts * model.slot_bytes + borrow(chunk) + kv_pinned + copies + headroom > avail:
        room = max(0, avail - borrow(chunk) - kv_pinned - copies - headroom)
        keep = min(resident_experts, room // model.slot_bytes)
        led.warnings.append(f"only {keep} of {resident_experts} experts can stay resident in host RAM "
                            f"({_mib(avail)} available); the hottest are kept, the rest are read from storage")
        led.note("host_memory.resident_experts", keep, "the hottest experts that fit beside the borrow and headroom",
                 "core")
        resident_experts = keep
        if borrow(chunk) + kv_pinned + copies + headroom > avail:
            short = borrow(chunk) + kv_pinned + copies + headroom - avail
            raise PlanRefused(f"host RAM: the prompt path's borrow, pinned KV and headroom need "
                              f"{_mib(borrow(chunk) + kv_pinned + copies + headroom)} but {_mib(avail)} is "
                              f"available: short by {_mib(short)} (kernel weight copies {_mib(copies)} "
                              f"included); lower "
                              f"memory.resident_headroom_gib or kv.resident_cells")

    # Step 4: the page-locked arena leaves room for the borrow, and host RAM holds max(resident, arena). A smaller
    # arena may change the ring (the pinned fraction): then the loans are re-derived and the chunk halved to fit.
    pin = first_pin
    for _ in range(4):
        step_led = _Ledger()
        pin = _pinned_step(device, host, model, settings, defaults, step_led, bsrc, borrow=borrow(chunk),
                           room=avail - borrow(chunk) - kv_pinned - copies - headroom)
        fraction = pin.arena / model.host_arena_bytes if model.host_arena_bytes else 1.0
        if fraction == loans.pinned_fraction:
            break
        loans = loan_model(fraction)
        while not owned and chunk > 1 and _max_loan_upto(loans, grid, chunk)[0] > lendable:
            new = halve(chunk, grid)
            led.note("prompt.chunk", new, f"the arena pinned for host RAM changes the ring: a chunk of {chunk} "
                     f"tokens needs a loan above the {lendable} lendable slots: halved", "core")
            chunk = new
    led.decisions.extend(step_led.decisions)
    led.warnings.extend(step_led.warnings)
    if not owned and chunk:
        slots, min_keep, lendable = _room_for_the_loan(model, loans, grid, chunk, usable, slots, lend_fraction,
                                                       defaults, knobs["expert_cache.slots_cap"], settings, led, bsrc)
    limit, pin_cap, floor, arena, exhausted = pin.limit, pin.cap, pin.floor, pin.arena, pin.exhausted
    if arena < first_pin.arena:
        led.note("host_memory.in_ram_store_bytes", max(resident_experts * model.slot_bytes, arena),
                 f"the pinned arena shrinks from {_mib(first_pin.arena)} to {_mib(arena)} so that max(resident, "
                 f"arena) + the borrow ({_mib(borrow(chunk))}) + pinned KV + headroom ({_mib(headroom)}) fit the "
                 f"{_mib(avail)} available", "core")

    # Step 4 (the chunk-dependent part): the CPU share's buffer comes out of the pinned floor, sized once.
    share_setting = settings.prefill.cpu_share
    max_share_chunk = max(0, min(chunk, settings.prefill.cpu_share_max_tokens - 1)) if chunk else 0
    share_bytes = max_share_chunk * model.hidden * 4
    if knobs["cpu_share.enabled"] is False:
        enabled, reason = False, "a site plugin turned it off"
    elif share_setting == "off":
        enabled, reason = False, "prefill.cpu_share=off"
    elif share_setting == "auto" and not defaults.cpu_share_default:
        enabled, reason = False, f"auto: {defaults.cpu_share_reason}"
    elif max_share_chunk == 0:
        enabled, reason = False, "no chunk is small enough to arm it"
    elif share_bytes > floor:
        enabled, reason = False, (f"its buffer ({_mib(share_bytes)}) does not fit the kept page-locked floor "
                                  f"({_mib(floor)})")
    else:
        enabled = True
        reason = (f"on ({share_setting}); its {_mib(share_bytes)} buffer comes from the kept page-locked floor"
                  + (" (the arena could not be pinned whole)" if exhausted else ""))
    if not enabled:
        share_bytes = 0
    led.note("cpu_share.enabled", enabled, reason, "setting prefill.cpu_share" if share_setting != "auto" else bsrc)

    _, rows = _max_loan_upto(loans, grid, chunk) if not owned else (0, [])
    cache_bytes = slots * model.slot_bytes
    regions = model.dense_bytes + kv + workspace + cache_bytes + owned_bytes
    rounding = alloc_rounding_bytes(device, model, regions)
    staging = min(max(0, floor - share_bytes), staging_bytes(arena, model.host_arena_bytes, rows, model.slot_bytes))
    pinned_total = arena + share_bytes + staging + kv_pinned + embed_pinned
    pin_map = pinned_map_bytes(device, pinned_total, regions + rounding)
    probe_src = f"backend {device.backend} probe (measured)"
    if rounding:
        led.note("vram.alloc_rounding_bytes", rounding, f"the one start-up block of {_mib(regions)} of lines and "
                 f"{alignment_allowance_bytes(model)} bytes of alignment, rounded up to the driver's "
                 f"{_mib(device.alloc_granularity_bytes)} allocation granularity", probe_src)
    if pin_map:
        led.note("vram.pinned_map_bytes", pin_map, f"the driver's page tables for {_mib(pinned_total)} of page-locked "
                 f"host memory (arena, CPU share, staging, pinned KV"
                 + (", the embedding greedy decode pins" if embed_pinned else "")
                 + f") at {device.pinned_map_bytes_per_gib:,} bytes a "
                 "GiB, and for the start-up block; whole allocation granules from one up", probe_src)
    left = free - reserve - regions - rounding - pin_map
    stream_min = (settings.prefill.stream_min_tokens if settings.prefill.stream_min_tokens is not None
                  else defaults.stream_min_tokens)
    settings_json = settings.model_dump(mode="json") if hasattr(settings, "model_dump") else dict(settings or {})
    return Plan(
        backend=device.backend, device=device, host=host, model=model, settings_json=settings_json,
        limits=RuntimeLimits.from_settings(settings, stream_min), defaults=defaults,
        vram=VramPlan(free_bytes=free, reserve_bytes=reserve, dense_bytes=model.dense_bytes, kv_bytes=kv,
                      workspace_bytes=workspace, expert_cache_bytes=cache_bytes, owned_prompt_bytes=owned_bytes,
                      left_bytes=left, alloc_rounding_bytes=rounding, pinned_map_bytes=pin_map),
        expert_cache=CachePlan(slots=slots, slot_bytes=model.slot_bytes),
        prompt=PromptPlan(chunk=chunk, chunk_source=source, ceiling=ceiling, min_keep_slots=min_keep,
                          lendable_slots=lendable, owned_buffers=owned, grid_tokens=grid,
                          stream_min_tokens=stream_min, loans=tuple(rows)),
        host_memory=HostPlan(available_bytes=avail, headroom_bytes=headroom,
                             resident_bytes=resident_experts * model.slot_bytes, resident_experts=resident_experts,
                             borrow_bytes=borrow(chunk), kv_pinned_bytes=kv_pinned,
                             weight_copies_bytes=copies),
        pinned=PinnedPlan(limit_bytes=limit, cap_bytes=pin_cap, arena_bytes=arena,
                          arena_wanted_bytes=model.host_arena_bytes, floor_bytes=floor, cpu_share_bytes=share_bytes,
                          exhausted=exhausted, registration_slice_bytes=REGISTRATION_SLICE_BYTES),
        cpu_share=CpuSharePlan(enabled=enabled, max_chunk=max_share_chunk if enabled else 0, reason=reason),
        loan_model=loans, decisions=tuple(led.decisions), warnings=tuple(led.warnings),
    )


def _room_for_the_loan(model: ModelSpec, loans: LoanModel, grid: int, chunk: int, usable: int, slots: int,
                       lend_fraction: float, defaults: PlatformDefaults, slots_cap: int | None, settings: Any,
                       led: _Ledger, bsrc: str) -> tuple[int, int, int]:
    """(slots, min_keep, lendable): a cache that holds every expert grows by the chunk's largest loan when VRAM
    allows, so the slots a prompt borrows are empty ones and lending evicts no expert."""
    min_keep = min(defaults.min_keep_slots, max(model.top_k, slots // 4))
    lendable = max(0, min(int(lend_fraction * slots), slots - min_keep))
    if slots < model.experts_total or (slots_cap is not None and slots_cap <= model.experts_total):
        return slots, min_keep, lendable
    loan = _max_loan_upto(loans, grid, chunk)[0]
    grown = min(model.experts_total + loan, max(0, usable // model.slot_bytes),
                slots_cap if slots_cap is not None else model.experts_total + loan)
    if grown <= slots:
        return slots, min_keep, lendable
    from_setting = slots_cap is not None and settings.memory.expert_cache != "auto"
    led.note("expert_cache.slots", grown, f"every expert ({model.experts_total}) + the {loan} slots a {chunk}-token "
             f"chunk borrows{', as much as VRAM leaves' if grown < model.experts_total + loan else ''}: the loan takes "
             "empty slots and evicts no expert", "setting memory.expert_cache" if from_setting else "core")
    min_keep = min(defaults.min_keep_slots, max(model.top_k, grown // 4))
    lendable = max(0, min(int(lend_fraction * grown), grown - min_keep))
    led.note("prompt.lendable_slots", lendable, f"min({lend_fraction:g} x {grown} slots, {grown} - {min_keep} kept "
             "for decode)", "setting prefill.lend_fraction" if settings.prefill.lend_fraction else bsrc)
    return grown, min_keep, lendable


def _owned_buffers(model: ModelSpec, loans: LoanModel, grid: int, ceiling: int, usable: int, min_keep: int,
                   led: _Ledger, slots_cap: int | None) -> tuple[int, int, int]:
    """No chunk can be lent: give the prompt path its own buffers at the largest chunk that still leaves a cache."""
    most = model.experts_total if slots_cap is None else min(model.experts_total, slots_cap)
    for c in reversed(_grid_chunks(grid, ceiling)):
        # Owned buffers serve every request chunk up to c, and loan(c) is not monotonic: size for the largest.
        need = _max_loan_upto(loans, grid, c)[0] * model.slot_bytes
        slots = min(most, max(0, (usable - need) // model.slot_bytes))
        if slots >= max(min_keep, model.top_k):
            led.note("prompt.chunk", c, f"no chunk can be lent from a cache this small: the prompt path owns "
                     f"{_mib(need)} of buffers and the cache shrinks to {slots} slots", "core")
            return c, slots, need
    need = _max_loan_upto(loans, grid, grid)[0] * model.slot_bytes + max(min_keep, model.top_k) * model.slot_bytes
    raise PlanRefused(f"VRAM: the prompt path cannot be lent a chunk and owned buffers for {grid} tokens do not fit: "
                      f"short by {_mib(need - usable)}; lower memory.vram_reserve_mib or kv.max_context")
