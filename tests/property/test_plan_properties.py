"""Every plan holds every invariant, or start-up is refused with the shortfall.

The invariants are re-derived here from the plan's figures and the platform's ring policy, not only by calling the
planner's own `check_all`, so a wrong invariant function would not hide a wrong plan.
"""

from __future__ import annotations

import re

from hypothesis import HealthCheck, given, settings as hyp_settings
from hypothesis import strategies as st
from prop_strategies import devices, hosts, models, platform_defaults, settings

from strata_core.api.facts import GIB
from strata_core.errors import PlanRefused
from strata_core.planner import Plan, check_all, make_plan

EXAMPLES = 600


def _loan(defaults, model, pinned_fraction: float, chunk: int) -> int:
    """loan(c) in slots from the ring policy and the buffer bytes, as DESIGN.md defines it."""
    ring = defaults.ring_policy(chunk, model.slot_bytes, pinned_fraction)
    return ring + -(-chunk * model.prompt_bytes_per_token // model.slot_bytes)


def _chunks_upto(grid: int, chunk: int) -> list[int]:
    """The grid chunks up to `chunk`, and `chunk` itself when it is off the grid."""
    return sorted(set(range(grid, chunk + 1, grid)) | {chunk})


def _platform_cap(plan: Plan) -> int | None:
    """The page-locked cap of the platform, from the public measurements (not from the planner's table)."""
    virt, dm = plan.host.virtualization, plan.device.driver_model
    if virt == "docker-wsl2":
        return 500 * 1000 * 1000
    if virt == "wsl2" or dm == "wsl2":
        return 3 * GIB // 4
    if dm == "wddm":
        return plan.host.ram_total_bytes // 2
    return None


def _cap_set_explicitly(plan: Plan) -> bool:
    """pinning.wddm_pin_cap_gib replaces the platform's cap where there is one."""
    return plan.settings_json["pinning"]["wddm_pin_cap_gib"] is not None


def _independent_checks(plan: Plan) -> None:
    """The four invariants of DESIGN.md, computed from the plan's figures and the defaults' ring policy."""
    v, c, p, h, pin = plan.vram, plan.expert_cache, plan.prompt, plan.host_memory, plan.pinned
    d, m = plan.defaults, plan.model
    # VRAM
    assert v.expert_cache_bytes == c.slots * c.slot_bytes == c.slots * m.slot_bytes
    assert v.reserve_bytes + v.dense_bytes + v.kv_bytes + v.workspace_bytes + v.expert_cache_bytes \
        + v.owned_prompt_bytes <= v.free_bytes <= plan.device.vram_free_bytes
    # a cache holding every expert may add the slots the plan's chunk borrows (they are lent empty), never more
    grow = 0 if p.owned_buffers else max(_loan(d, m, pin.pinned_fraction, k)
                                         for k in _chunks_upto(p.grid_tokens, p.chunk))
    assert 0 <= c.slots <= m.experts_total + grow
    # Loans: every grid chunk up to the plan's chunk, from the ring policy directly
    if not p.owned_buffers:
        assert p.chunk > 0
        listed = {r.chunk: r for r in p.loans}
        # the grid chunks up to the plan's chunk, and the chunk itself when an explicit one is off the grid
        for chunk in _chunks_upto(p.grid_tokens, p.chunk):
            loan = _loan(d, m, pin.pinned_fraction, chunk)
            assert loan <= c.slots - p.min_keep_slots, f"loan({chunk}) = {loan} breaks the keep"
            assert loan <= p.lendable_slots
            assert listed[chunk].loan_slots == loan
        assert p.lendable_slots <= c.slots - p.min_keep_slots
    else:
        assert not p.loans and p.lendable_slots == 0
        # owned buffers serve every request chunk up to the plan's chunk, and loan(c) is not monotonic (seed #2090):
        # they must hold the largest layout of any such chunk, not only the plan chunk's own
        worst = max(_loan(d, m, pin.pinned_fraction, k) for k in _chunks_upto(p.grid_tokens, p.chunk))
        assert v.owned_prompt_bytes >= worst * m.slot_bytes, (
            f"owned prompt buffers of {v.owned_prompt_bytes} bytes (chunk {p.chunk}) are smaller than a smaller "
            f"request chunk's layout ({worst} slots x {m.slot_bytes} bytes)")
    # Host: the in-RAM store is at least the resident set and at least its page-locked part (issue 12.3)
    assert max(h.resident_bytes, pin.arena_bytes) + h.borrow_bytes + h.kv_pinned_bytes + h.headroom_bytes \
        <= h.available_bytes
    assert h.available_bytes == plan.host.ram_available_bytes
    # Pinned
    pinnable = plan.host.pinnable_bytes if plan.host.pinnable_bytes is not None else plan.host.ram_available_bytes
    assert pin.arena_bytes + pin.floor_bytes <= pin.limit_bytes <= max(0, pinnable)
    if pin.cap_bytes is not None:
        assert pin.limit_bytes <= pin.cap_bytes
    # the platform's cap holds whatever the backend, unless the cap is set explicitly (issue 12.4)
    platform = _platform_cap(plan)
    if platform is not None and plan.limits is not None and not _cap_set_explicitly(plan):
        assert pin.limit_bytes <= platform, f"limit {pin.limit_bytes} above the platform's cap {platform}"
    assert 0 < pin.registration_slice_bytes < 512 * GIB
    assert pin.arena_bytes <= m.host_arena_bytes
    assert pin.exhausted == (pin.arena_bytes < m.host_arena_bytes)
    if plan.cpu_share.enabled:
        assert 0 < pin.cpu_share_bytes <= pin.floor_bytes
        assert plan.cpu_share.max_chunk < plan.limits.cpu_share_max_tokens
        assert pin.cpu_share_bytes == plan.cpu_share.max_chunk * m.hidden * 4
        assert plan.limits.cpu_share_mode != "off"
    else:
        assert pin.cpu_share_bytes == 0 and plan.cpu_share.reason


@hyp_settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(device=devices(), host=hosts(), model=models(), s=settings(), defaults=platform_defaults())
def test_every_plan_holds_every_invariant_or_is_refused_with_the_shortfall(device, host, model, s, defaults):
    try:
        plan = make_plan(device, host, model, s, defaults)
    except PlanRefused as e:
        msg = str(e)
        assert "\n" not in msg
        assert re.search(r"short by [\d,.]+ MiB", msg), f"refusal without a shortfall: {msg}"
        assert re.match(r"(VRAM|host RAM|expert cache|page-locked memory): ", msg), \
            f"refusal that does not name the binding resource first: {msg}"
        return
    check_all(plan)
    _independent_checks(plan)
    # a plan is its JSON's contract: every grid chunk it may read with is listed
    j = plan.to_json()
    assert j["schema"] == "strata.plan/1"
    if not plan.prompt.owned_buffers:
        assert [r["chunk"] for r in j["prompt"]["loans"]][:plan.prompt.chunk // plan.prompt.grid_tokens] == \
            list(range(plan.prompt.grid_tokens, plan.prompt.chunk + 1, plan.prompt.grid_tokens))


@hyp_settings(max_examples=100, deadline=None)
@given(device=devices(), host=hosts(), model=models(), s=settings(), defaults=platform_defaults(),
       requests=st.lists(st.integers(1, 300_000), min_size=1, max_size=8))
def test_every_request_reads_with_a_chunk_whose_loan_the_plan_proved(device, host, model, s, defaults, requests):
    try:
        plan = make_plan(device, host, model, s, defaults)
    except PlanRefused:
        return
    for prompt_tokens in requests:
        chunk = plan.request_chunk(prompt_tokens)
        if plan.prompt.owned_buffers:
            continue
        assert 0 < chunk <= plan.prompt.chunk
        if plan.streams(prompt_tokens):
            assert plan.loan_for(chunk).loan_slots <= plan.prompt.lendable_slots, \
                f"a {prompt_tokens}-token request reads with chunk {chunk} whose loan the plan never proved"
