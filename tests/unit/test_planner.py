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


# --- issue 12: host RAM, page-locked caps, bytes not slots; issue 11.8: one halving rule, resolved limits --------

import dataclasses
from pathlib import Path

import pytest

from strata_core.api.facts import MIB, Profile, seed_ring_policy
from strata_core.errors import InvariantBroken
from strata_core.hostinfo import virtualization
from strata_core.models.resolve import model_from_name
from strata_core.planner import check_all, plan_for_machine
from strata_core.planner.chunks import halve
from strata_core.planner.invariants import check_host, check_pinned
from strata_core.planner.pin_caps import REGISTRATION_LIMIT_BYTES, registration_slices
from strata_core.registry import load_plugins
from strata_core.scenario import load_scenario

_REPO = Path(__file__).resolve().parents[2]


def _scenario(name: str) -> Path:
    """A seed scenario: the project's own copy (tests/data/scenarios) or the shared one beside the checkout."""
    for d in (_REPO / "tests" / "data" / "scenarios", _REPO / ".." / "shared" / "scenarios"):
        if (d / name).is_file():
            return (d / name).resolve()
    pytest.skip(f"scenario {name} is in neither tests/data/scenarios nor ../shared/scenarios")


def _plan_for(plugins, backend: str, device: DeviceInfo, host: HostInfo, model, settings):
    """Plan through the registry's one resolution, as the commands do (the backend's own platform defaults)."""
    target = plugins.resolve_target(settings, profile=Profile(backend=backend, device=device, host=host))
    return plan_for_machine(plugins, target, model, settings)


def test_gfx12_low_ram_resident_arena_leaves_room_for_the_borrow_and_headroom():
    """Seed #2090 on gfx12 with 30 GB of RAM: a 24 GiB arena + 3.8 GiB borrow left 0.68 GiB against a 4 GiB headroom."""
    sc = load_scenario(_scenario("seed2090-gfx12-r9700-lowram-resident.json"))
    plan = _plan_for(load_plugins(), sc.profile.backend, sc.profile.device, sc.profile.host, sc.model, sc.settings)
    h, pin = plan.host_memory, plan.pinned
    assert h.borrow_bytes > 0 and h.resident_bytes > 0
    assert max(h.resident_bytes, pin.arena_bytes) + h.borrow_bytes + h.kv_pinned_bytes + h.headroom_bytes \
        <= h.available_bytes
    assert 8192 <= plan.prompt.chunk < 16384, "the scenario expects the chunk stepped down, not collapsed"
    assert any(d.what == "host_memory.in_ram_store_bytes" and "arena shrinks" in d.why for d in plan.decisions)
    # the plan the seed ran (the arena at limit - floor, blind to the borrow) breaks the invariant
    seed_arena = min(plan.model.host_arena_bytes, h.available_bytes - 4 * GIB - pin.floor_bytes)
    broken = dataclasses.replace(plan, pinned=dataclasses.replace(pin, arena_bytes=seed_arena,
                                                                  limit_bytes=seed_arena + pin.floor_bytes))
    with pytest.raises(InvariantBroken, match="host: in-RAM store"):
        check_host(broken)


@pytest.mark.parametrize("backend", ["cuda", "rocm", "sycl", "opencl", "sim", "cpu"])
@pytest.mark.parametrize("index", [0, 1])  # WDDM's cap is half of RAM with one GPU or several
@pytest.mark.parametrize("driver_model,virt,cap", [
    ("wddm", "none", 32 * GIB),                     # half of 64 GiB of RAM
    ("wsl2", "none", 3 * GIB // 4),                 # WSL2's cumulative limit
    ("linux", "wsl2", 3 * GIB // 4),                # a Linux driver inside WSL2
    ("linux", "docker-wsl2", 500 * 1000 * 1000),    # Docker Desktop on WSL2
])
def test_page_locked_caps_are_platform_facts_on_every_backend(backend, driver_model, virt, cap, index):
    host = HostInfo(os="windows" if driver_model == "wddm" else "linux", ram_total_bytes=64 * GIB,
                    ram_available_bytes=60 * GIB, virtualization=virt)
    device = DeviceInfo(backend=backend, name="16 GiB card", vram_total_bytes=16 * GIB, vram_free_bytes=15 * GIB,
                        driver_model=driver_model, index=index)
    plan = _plan_for(load_plugins(), backend, device, host, model_from_name("Qwen3-30B-A3B"), StrataSettings())
    assert plan.pinned.cap_bytes is not None and plan.pinned.cap_bytes <= cap
    assert plan.pinned.arena_bytes + plan.pinned.floor_bytes <= plan.pinned.limit_bytes <= cap


def test_a_backends_pin_cap_may_only_lower_the_platforms():
    host = HostInfo(os="windows", ram_total_bytes=64 * GIB, ram_available_bytes=60 * GIB)
    device = DeviceInfo(backend="sim", name="c", vram_total_bytes=16 * GIB, vram_free_bytes=15 * GIB,
                        driver_model="wddm")
    model = model_from_name("Qwen3-30B-A3B")
    high = make_plan(device, host, model, StrataSettings(), PlatformDefaults(pin_cap_bytes=100 * GIB))
    low = make_plan(device, host, model, StrataSettings(), PlatformDefaults(pin_cap_bytes=8 * GIB))
    assert high.pinned.cap_bytes == 32 * GIB and high.pinned.limit_bytes <= 32 * GIB
    assert low.pinned.cap_bytes == 8 * GIB


def test_limit_above_the_cap_is_an_invariant_broken():
    plan = make_plan(DEVICE, HOST, tiny_model_spec(), _settings(), PlatformDefaults(pin_cap_bytes=GIB))
    check_pinned(plan)
    bad = dataclasses.replace(plan, pinned=dataclasses.replace(plan.pinned, limit_bytes=2 * GIB))
    with pytest.raises(InvariantBroken, match="cap"):
        check_pinned(bad)


def test_the_arena_registers_in_slices_below_the_per_call_limit():
    sizes = registration_slices(1300 * GIB)
    assert sum(sizes) == 1300 * GIB and max(sizes) < REGISTRATION_LIMIT_BYTES
    plan = make_plan(DEVICE, HOST, tiny_model_spec(), _settings(), PlatformDefaults())
    assert 0 < plan.pinned.registration_slice_bytes < REGISTRATION_LIMIT_BYTES


def test_virtualization_is_read_from_proc_version_and_dockerenv(tmp_path):
    ver, env = tmp_path / "version", tmp_path / ".dockerenv"
    ver.write_text("Linux version 5.15.153.1-microsoft-standard-WSL2 (root@x) #1 SMP")
    assert virtualization(ver, env) == "wsl2"
    env.write_text("")
    assert virtualization(ver, env) == "docker-wsl2"
    ver.write_text("Linux version 6.8.0-45-generic (buildd@lcy02) #45-Ubuntu SMP")
    assert virtualization(ver, env) == "none"
    assert virtualization(tmp_path / "absent", env) == "none"
    assert HostInfo.from_json({"os": "linux", "ram_total_bytes": 1, "ram_available_bytes": 1,
                               "virtualization": "WSL2"}).virtualization == "wsl2"


@pytest.mark.parametrize("slot_bytes", [1 * MIB, 2 * MIB, 100 * 1000 * 1000])
def test_the_ring_is_bounded_in_bytes_for_small_and_large_experts(slot_bytes):
    for chunk in (256, 4096, 8192, 32768):
        for fraction in (0.0, 1.0):
            ring = seed_ring_policy(chunk, slot_bytes, fraction)
            assert ring >= 2, "double buffering needs two slots"
            assert ring * slot_bytes <= max(2 * 392 * MIB, 2 * slot_bytes), \
                f"ring of {ring} x {slot_bytes} bytes at chunk {chunk}"


def test_mixtral_q4k_on_an_8_gb_card_plans_with_a_few_slots_and_lends_the_prompt_path():
    """llama.cpp users run this every day; the slot-counted rules refused it (short by 2,943 MiB)."""
    device = DeviceInfo(backend="cuda", name="RTX 4060 8 GB", vram_total_bytes=8 * GIB, vram_free_bytes=7800 * MIB)
    host = HostInfo(os="linux", ram_total_bytes=32 * GIB, ram_available_bytes=28 * GIB)
    model = model_from_name("Mixtral-8x7B@Q4_K")
    assert model.slot_bytes > 90 * 1000 * 1000
    plan = _plan_for(load_plugins(), "cuda", device, host, model, StrataSettings())
    check_all(plan)
    assert plan.expert_cache.slots >= model.top_k and not plan.prompt.owned_buffers
    assert plan.prompt.chunk >= plan.prompt.grid_tokens
    assert plan.prompt.max_loan_slots <= plan.prompt.lendable_slots


def test_one_halving_rule_on_the_grid_then_down_to_one_token():
    assert [halve(c, 256) for c in (8192, 4096, 3000, 768, 512, 300, 256, 100, 2, 1)] == \
        [4096, 2048, 1280, 256, 256, 256, 128, 50, 1, 1]
    c, seen = 8192, []
    while c > 1:
        c = halve(c, 256)
        seen.append(c)
    assert seen == [4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1]


def test_the_plan_carries_resolved_limits_not_the_settings_object():
    s = _settings(elastic_slots_gib=0.5)
    s.kv.max_context = 2048
    s.trace = True
    plan = make_plan(DEVICE, HOST, tiny_model_spec(), s, PlatformDefaults(stream_min_tokens=512))
    assert not hasattr(plan, "settings")
    lim = plan.limits
    assert (lim.max_context_tokens, lim.elastic_slots_bytes, lim.stream_min_tokens, lim.trace) == \
        (2048, GIB // 2, 512, True)
    assert plan.refuse_reason(2048) is None
    assert "kv.max_context (2048)" in plan.refuse_reason(2049)
    assert plan.to_json()["settings"]["kv"]["max_context"] == 2048
    assert plan.prompt_buffer_bytes(100) == 100 * plan.model.prompt_bytes_per_token


@pytest.mark.parametrize("hidden,experts,top_k,ffn", [(64, 8, 2, 128), (2048, 128, 8, 768), (4096, 8, 2, 14336)])
def test_one_per_token_buffer_formula_for_planner_and_runtime(hidden, experts, top_k, ffn):
    from strata_core.models.spec import prompt_bytes_for
    from strata_core.planner.buffers import chunk_buffer_bytes, prompt_bytes_per_token, routed_row_bytes, \
        token_buffer_bytes
    per_token = prompt_bytes_per_token(hidden, experts, top_k, ffn)
    assert per_token == prompt_bytes_for(hidden, experts, top_k, ffn)
    assert per_token == token_buffer_bytes(hidden, experts, top_k) + top_k * routed_row_bytes(hidden, ffn)
    assert chunk_buffer_bytes(300, hidden, experts, top_k, ffn) == 300 * per_token
    spec = tiny_model_spec()
    plan = make_plan(DEVICE, HOST, spec, _settings(), PlatformDefaults())
    assert plan.prompt_buffer_bytes(256) == chunk_buffer_bytes(256, spec.hidden, spec.experts_per_layer, spec.top_k,
                                                               spec.expert_ffn)


def test_the_store_registers_a_huge_arena_in_calls_below_the_per_call_limit():
    """One registration call of 512 GiB or more fails: a 600 GiB arena is pinned whole, in slices of the plan's size."""
    from strata_core.api.backend import PinnedBudget, PinnedBuffer
    from strata_core.runtime.runlog import RunLog
    from strata_core.runtime.store import ExpertStore, phantom_pool_of_bytes

    class PerCallLimited:
        calls: list[int] = []

        def register(self, array, from_floor=False):
            n = int(array.nbytes)
            self.calls.append(n)
            return None if n >= REGISTRATION_LIMIT_BYTES else PinnedBuffer(array=None, nbytes=n, kind="register")

        def free(self, buf):
            pass

    rows, slot = 600 * 64, 16 * MIB  # 600 GiB of experts
    store = ExpertStore(phantom_pool_of_bytes(rows, slot), 600, 64)
    alloc = PerCallLimited()
    store.pin(alloc, PinnedBudget(1 << 50, 0), rows * slot, RunLog(), max_call_bytes=256 * GIB)
    assert store.whole and store.pinned_bytes == rows * slot
    assert max(alloc.calls) < REGISTRATION_LIMIT_BYTES and sum(alloc.calls) == rows * slot
