"""The population test (issue 12.6): every preset and quant x real cards x reserves.

Each plan either refuses in one line naming the binding resource and the shortfall, or holds every invariant (re-
derived here from its figures); plans are replayed in the simulator as `strata simulate` does (accounting-only
engine, the card's backend rules) with no engine exit and every request completed. Every plan of the matrix is
planned and checked; the replay takes a rotating sample that covers every preset and quant, every card and every
reserve, so the test stays fast on two cores. `tests/property` covers the space between the cards.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from strata_core.api.facts import DeviceInfo, HostInfo, Profile
from strata_core.commands.simulate import simulate
from strata_core.config import StrataSettings
from strata_core.errors import PlanRefused
from strata_core.models.presets import PRESET_QUANTS, PRESETS
from strata_core.models.presets import model_from_name
from strata_core.planner import Plan, plan_for_machine
from strata_core.registry import load_plugins
from strata_core.scenario import Scenario

CARDS = json.loads((Path(__file__).parent / "cards.json").read_text())["cards"]
MODELS = [f"{p.name}@{q}" for p in PRESETS for q in PRESET_QUANTS]
#: memory.vram_reserve_mib: the backend's default, and a cautious user's.
RESERVES = (None, 2048)
#: A refusal names the resource that binds, then the shortfall in MiB.
REFUSAL = re.compile(r"^(VRAM|host RAM|expert cache|page-locked memory)\b.*\bshort by [\d,.]+ MiB")


@pytest.fixture(scope="module")
def plugins():
    """One plugin host for the whole matrix (loading entry points is the slow part of a plan)."""
    return load_plugins()


def _profile(card: dict) -> Profile:
    device = DeviceInfo(backend=card["backend"], name=card["name"], arch=card["arch"],
                        vram_total_bytes=card["vram_total_bytes"], vram_free_bytes=card["vram_free_bytes"],
                        driver_model=card["driver_model"], drives_display=card["drives_display"])
    host = HostInfo(os=card["os"], ram_total_bytes=card["ram_total_bytes"],
                    ram_available_bytes=card["ram_available_bytes"], virtualization=card["virtualization"])
    return Profile(backend=card["backend"], device=device, host=host)


def _settings(reserve_mib: int | None) -> StrataSettings:
    s = StrataSettings()
    s.memory.vram_reserve_mib = reserve_mib
    return s


def _plan(plugins, card: dict, model_name: str, reserve_mib: int | None) -> Plan:
    settings = _settings(reserve_mib)
    target = plugins.resolve_target(settings, profile=_profile(card))
    return plan_for_machine(plugins, target, model_from_name(model_name), settings)


def _invariants(plan: Plan) -> list[str]:
    """DESIGN.md's invariants from the plan's figures (not through the planner's own check_all)."""
    v, c, p, h, pin, m = plan.vram, plan.expert_cache, plan.prompt, plan.host_memory, plan.pinned, plan.model
    bad = []
    if v.reserve_bytes + v.dense_bytes + v.kv_bytes + v.workspace_bytes + v.expert_cache_bytes \
            + v.owned_prompt_bytes > v.free_bytes or v.expert_cache_bytes != c.slots * m.slot_bytes:
        bad.append("vram")
    # a cache holding every expert may add the slots the plan's chunk borrows (they are lent empty), never more
    grow = 0 if p.owned_buffers else max((r.loan_slots for r in p.loans), default=0)
    if not m.top_k <= c.slots <= m.experts_total + grow:
        bad.append("cache slots")
    if not p.owned_buffers:
        for chunk in range(p.grid_tokens, p.chunk + 1, p.grid_tokens):
            if plan.loan_for(chunk).loan_slots > min(p.lendable_slots, c.slots - p.min_keep_slots):
                bad.append(f"loan({chunk})")
    if max(h.resident_bytes, pin.arena_bytes) + h.borrow_bytes + h.kv_pinned_bytes + h.headroom_bytes \
            > h.available_bytes:
        bad.append("host")
    if pin.arena_bytes + pin.floor_bytes > pin.limit_bytes or (pin.cap_bytes is not None and
                                                               pin.limit_bytes > pin.cap_bytes):
        bad.append("pinned")
    if plan.device.driver_model == "wddm" and pin.limit_bytes > plan.host.ram_total_bytes // 2:
        bad.append("WDDM cap")
    if plan.host.virtualization != "none" and pin.limit_bytes > 3 * (1 << 30) // 4:
        bad.append("WSL2 cap")
    if plan.cpu_share.enabled and pin.cpu_share_bytes > pin.floor_bytes:
        bad.append("CPU share")
    return bad


def _matrix():
    for card in CARDS:
        for model in MODELS:
            for reserve in RESERVES:
                yield card, model, reserve


def test_the_card_table_covers_the_population():
    vendors = {c["backend"] for c in CARDS}
    archs = {c["arch"][:5] for c in CARDS if c["backend"] == "rocm"}
    gib = [c["vram_total_bytes"] >> 30 for c in CARDS if c["backend"] == "cuda"]
    ram_gb = [c["ram_total_bytes"] // 10 ** 9 for c in CARDS]
    assert len(CARDS) >= 20 and vendors == {"cuda", "rocm", "sycl"}
    assert {"gfx11", "gfx12"} <= archs and min(gib) == 8 and max(gib) == 32
    assert {c["driver_model"] for c in CARDS} == {"linux", "wddm", "wsl2"}
    assert "docker-wsl2" in {c["virtualization"] for c in CARDS}
    assert min(ram_gb) == 16 and max(ram_gb) == 128
    assert len(MODELS) == len(PRESETS) * len(PRESET_QUANTS) >= 40


def test_every_plan_refuses_in_one_line_or_holds_every_invariant(plugins):
    failures, planned, refused = [], 0, 0
    for card, model, reserve in _matrix():
        where = f"{model} on {card['name']} ({card['driver_model']}, {card['ram_total_bytes'] // 10 ** 9} GB, " \
                f"reserve {reserve})"
        try:
            plan = _plan(plugins, card, model, reserve)
        except PlanRefused as e:
            refused += 1
            msg = str(e)
            if "\n" in msg or not REFUSAL.search(msg):
                failures.append(f"{where}: refusal without the resource or the shortfall: {msg}")
            continue
        planned += 1
        bad = _invariants(plan)
        if bad:
            failures.append(f"{where}: broken {', '.join(bad)}")
    assert not failures, f"{len(failures)} of {planned + refused} plans:\n" + "\n".join(failures[:15])
    # the matrix reaches both outcomes: big models refused on small cards, everything else planned
    assert planned > refused > 0, (planned, refused)


def _replay_sample():
    """Every preset and quant once, every card once, both reserves: rotating over the matrix."""
    out = []
    for i, model in enumerate(MODELS):
        out.append((CARDS[i % len(CARDS)], model, RESERVES[i % len(RESERVES)]))
    for j, card in enumerate(CARDS):
        out.append((card, MODELS[(7 * j + 3) % len(MODELS)], RESERVES[(j + 1) % len(RESERVES)]))
    return out


def _requests(plan: Plan) -> tuple[int, ...]:
    """A short prompt, one at the stream minimum, one of the plan's chunk and one just over it (two chunks)."""
    ctx, chunk, g = plan.limits.max_context_tokens, max(1, plan.prompt.chunk), plan.prompt.grid_tokens
    wanted = (1, plan.prompt.stream_min_tokens, chunk, chunk + g + 1)
    return tuple(sorted({min(ctx, max(1, n)) for n in wanted}))


def test_sampled_plans_replay_in_the_simulator_with_no_exit_and_every_request_completed(plugins):
    failures, replayed = [], 0
    for card, model, reserve in _replay_sample():
        settings = _settings(reserve)
        try:
            plan = _plan(plugins, card, model, reserve)
        except PlanRefused:
            continue
        requests = _requests(plan)
        sc = Scenario(profile=_profile(card), model=model_from_name(model), settings=settings, requests=requests,
                      path=f"population: {model} on {card['name']}")
        r = simulate(sc, settings, plugins, [], [], decode_tokens=1)
        replayed += 1
        if r["engine_exits"] or r["completed"] != len(requests):
            failures.append(f"{sc.path} (reserve {reserve}): {r['engine_exits']} exits "
                            f"{r['engine_exit_reasons'][:2]}, {r['completed']} of {len(requests)} completed "
                            f"{[q.get('refused_reason') for q in r['requests'] if not q['completed']]}")
    assert not failures, "\n".join(failures)
    assert replayed >= len(MODELS) // 2, f"only {replayed} sampled plans replayed"
