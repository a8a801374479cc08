"""Planner rules the scenario and property tests do not pin down one by one."""

from __future__ import annotations

from strata_core.api.facts import GIB, DeviceInfo, HostInfo, PlatformDefaults
from strata_core.planner import make_plan
from strata_core.models.synthetic import tiny_model_spec
from strata_core.config.settings import StrataSettings

DEVICE = DeviceInfo(backend="sim", name="8 GiB card", vram_total_bytes=8 * GIB, vram_free_bytes=8 * GIB)
HOST = HostInfo(os="linux", ram_total_bytes=16 * GIB, ram_available_bytes=16 * GIB)


def _settings(**memory) -> StrataSettings:
    s = StrataSettings()
    for k, v in memory.items():
        setattr(s.memory, k, v)
    return s


def test_owned_prompt_buffers_keep_an_explicit_expert_cache_setting():
    plan = make_plan(DEVICE, HOST, tiny_model_spec(), _settings(expert_cache=40), PlatformDefaults())
    assert plan.prompt.owned_buffers, "a 40-slot cache is too small to lend the tiny model's prompt path"
    assert plan.expert_cache.slots == 40


def test_request_chunks_round_up_to_the_grid_and_never_pass_the_plan_chunk():
    plan = make_plan(DEVICE, HOST, tiny_model_spec(), _settings(), PlatformDefaults())
    g, c = plan.prompt.grid_tokens, plan.prompt.chunk
    assert plan.request_chunk(1) == g
    assert plan.request_chunk(g + 1) == min(2 * g, c)
    assert plan.request_chunk(10 * c) == c


def test_the_auto_chunk_covers_the_largest_loan_below_it_not_only_its_own():
    # the seed's shape: the fixed ring at or below the small limit makes a smaller chunk need a larger loan
    plan = make_plan(DEVICE, HOST, tiny_model_spec(), _settings(), PlatformDefaults())
    rows = plan.prompt.loans
    assert max(r.loan_slots for r in rows) <= plan.prompt.lendable_slots
    assert all(plan.loan_for(r.chunk) == r for r in rows)
