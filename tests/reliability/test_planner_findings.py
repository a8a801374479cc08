"""Planner defects the property tests found, each pinned down as one deterministic case.

Both were fixed after they were reported; the cases stay as regression tests.
"""

from __future__ import annotations

import re

import pytest

from strata_core.errors import PlanRefused
from strata_core.api.facts import GIB, MIB, DeviceInfo, HostInfo, PlatformDefaults
from strata_core.models.spec import ModelSpec
from strata_core.planner import make_plan
from strata_core.config.settings import StrataSettings

def engine_0143_ring(chunk_tokens: int, slot_bytes: int, pinned_fraction: float) -> int:
    """The seed's engine rule, spelled out so the case does not move with the shipped defaults: a fixed 384-slot
    ring up to 4096 tokens, a 392 MiB byte-budget ring above (49 slots of 8 MiB)."""
    return 384 if chunk_tokens <= 4096 else max(32, 392 * MIB // slot_bytes)


HOST = HostInfo(os="linux", ram_total_bytes=64 * GIB, ram_available_bytes=60 * GIB)


def test_owned_prompt_buffers_hold_the_largest_layout_of_any_request_chunk():
    """Seed #2090 in the owned-buffers path: loan(c) is not monotonic, so the buffers for the plan's chunk can be
    smaller than those a smaller request chunk needs (here 65 slots owned at 8192 tokens, 392 needed at 4096)."""
    model = ModelSpec(name="big experts", moe_layers=32, experts_per_layer=64, top_k=4, hidden=4096,
                      slot_bytes=8 * MIB, largest_blob_bytes=8 * MIB, prompt_bytes_per_token=16 * 1024)
    s = StrataSettings()
    s.memory.vram_reserve_mib = 0
    device = DeviceInfo(backend="sim", name="8 GiB card", vram_total_bytes=8 * GIB, vram_free_bytes=6 * GIB)
    plan = make_plan(device, HOST, model, s, PlatformDefaults(ring_policy=engine_0143_ring, min_keep_slots=128,
                                                              lend_fraction=0.3))
    assert plan.prompt.owned_buffers  # the cache is too small to lend: the prompt path owns its buffers
    grid = plan.prompt.grid_tokens
    worst = max(range(grid, plan.prompt.chunk + 1, grid), key=lambda c: plan.loan_for(c).loan_slots)
    need_bytes = plan.loan_for(worst).loan_slots * model.slot_bytes
    assert plan.request_chunk(worst) == worst  # a prompt of `worst` tokens really reads with that chunk
    assert plan.vram.owned_prompt_bytes >= need_bytes, (
        f"owned buffers {plan.vram.owned_prompt_bytes // MIB} MiB (sized for chunk {plan.prompt.chunk}) < "
        f"{need_bytes // MIB} MiB that a {worst}-token request chunk needs")


def test_an_expert_cache_setting_below_top_k_is_refused_naming_the_setting_not_a_negative_shortfall():
    """memory.expert_cache=1 with top_k=2 is refused, but the message says 'short by -N MiB' of VRAM."""
    model = ModelSpec(name="m", moe_layers=1, experts_per_layer=4, top_k=2, hidden=256, slot_bytes=4096,
                      largest_blob_bytes=4096, prompt_bytes_per_token=0)
    s = StrataSettings()
    s.memory.expert_cache = 1
    device = DeviceInfo(backend="sim", name="1 GiB card", vram_total_bytes=GIB, vram_free_bytes=GIB // 3)
    with pytest.raises(PlanRefused) as e:
        make_plan(device, HOST, model, s, PlatformDefaults(vram_reserve_mib=0))
    msg = str(e.value)
    assert "short by -" not in msg, msg
    assert "memory.expert_cache" in msg and re.search(r"\btop_k\b|top-k|\b2\b", msg), msg
