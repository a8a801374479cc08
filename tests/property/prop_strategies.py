"""Hypothesis strategies for machines, models, settings and platform defaults, shared by the property tests."""

from __future__ import annotations

from functools import partial

from hypothesis import strategies as st

from strata_core.api.facts import GIB, MIB, CpuInfo, DeviceInfo, HostInfo, PlatformDefaults, seed_ring_policy
from strata_core.models.spec import ModelSpec
from strata_core.config.settings import StrataSettings

KIB = 1 << 10


@st.composite
def devices(draw) -> DeviceInfo:
    """A device from a 1 GiB card to an 80 GiB one, free VRAM anywhere up to its total."""
    total = draw(st.integers(1 * GIB, 80 * GIB))
    # mostly a card with its weights loaded and room left, sometimes one that is nearly full
    free = draw(st.one_of(st.integers(total // 3, total), st.integers(0, total)))
    return DeviceInfo(backend="sim", name="prop device", vram_total_bytes=total, vram_free_bytes=free, vendor="sim",
                      driver_model=draw(st.sampled_from(["linux", "wddm", "wsl2", "tcc"])),
                      drives_display=draw(st.booleans()))


@st.composite
def hosts(draw) -> HostInfo:
    """A host from 4 GiB to 512 GiB, with or without a known page-locked limit."""
    total = draw(st.integers(4 * GIB, 512 * GIB))
    avail = draw(st.one_of(st.integers(total // 2, total), st.integers(0, total)))
    pin = draw(st.one_of(st.none(), st.integers(0, total)))
    return HostInfo(os=draw(st.sampled_from(["linux", "windows"])), ram_total_bytes=total, ram_available_bytes=avail,
                    pinnable_bytes=pin, cpu=CpuInfo(name="prop cpu", cores=8, flags=("avx2",)),
                    virtualization=draw(st.sampled_from(["none", "none", "wsl2", "docker-wsl2"])))


@st.composite
def models(draw) -> ModelSpec:
    """A valid MoE model: layers, experts, top-k, blob sizes and per-token byte rates over wide ranges."""
    experts = draw(st.integers(4, 512))
    slot = draw(st.one_of(st.integers(4 * KIB, 8 * MIB), st.integers(4 * KIB, 64 * MIB)))
    return ModelSpec(
        name="prop model", moe_layers=draw(st.integers(1, 96)), experts_per_layer=experts,
        top_k=draw(st.integers(1, min(16, experts))), hidden=draw(st.sampled_from([256, 1024, 2048, 4096, 7168])),
        slot_bytes=slot, largest_blob_bytes=slot + draw(st.integers(0, slot)),
        prompt_bytes_per_token=draw(st.one_of(st.integers(0, 64 * KIB), st.integers(0, 1 * MIB))),
        dense_bytes=draw(st.one_of(st.integers(0, 2 * GIB), st.integers(0, 20 * GIB))),
        kv_bytes_per_token=draw(st.one_of(st.integers(0, 8 * KIB), st.integers(0, 256 * KIB))),
        arena_bytes=draw(st.one_of(st.just(0), st.integers(1, 512 * GIB))),
    )


@st.composite
def platform_defaults(draw) -> PlatformDefaults:
    """Platform rules as a backend might report them, ring policy parameters included."""
    grid = draw(st.sampled_from([128, 256, 512]))
    small = draw(st.sampled_from([0, 1024, 2048, 4096, 8192]))
    ring = partial(seed_ring_policy, small_chunk_tokens=small, fixed_ring_slots=draw(st.integers(0, 1024)),
                   ring_budget_bytes=draw(st.integers(0, 2 * GIB)), min_ring_slots=draw(st.integers(0, 256)))
    ring.__name__ = "prop_ring"  # PlatformDefaults.to_json names the policy
    return PlatformDefaults(
        chunk_ceiling_tokens=draw(st.sampled_from([512, 1024, 4096, 8192, 16384, 32768])),
        chunk_grid_tokens=grid, small_chunk_tokens=small, stream_min_tokens=draw(st.sampled_from([0, 256, 1024, 4096])),
        ring_policy=ring, min_keep_slots=draw(st.integers(0, 512)),
        lend_fraction=draw(st.floats(0.05, 1.0)), vram_reserve_mib=draw(st.integers(0, 4096)),
        context_overhead_bytes=draw(st.one_of(st.integers(0, 256 * MIB), st.integers(0, 1 * GIB))), host_borrow=draw(st.booleans()),
        resident_headroom_bytes=draw(st.integers(0, 8 * GIB)),
        pin_cap_bytes=draw(st.one_of(st.none(), st.integers(0, 64 * GIB))),
        pin_floor_bytes=draw(st.integers(0, 2 * GIB)), pin_reserve_bytes=draw(st.integers(0, 16 * GIB)),
        cpu_share_default=draw(st.booleans()), free_vram_trust=draw(st.floats(0.5, 1.0)), source="property test",
    )


@st.composite
def settings(draw) -> StrataSettings:
    """Settings over every group the planner reads (validated by the settings model itself)."""
    s = StrataSettings()
    s.memory.vram_reserve_mib = draw(st.one_of(st.none(), st.integers(0, 2048), st.integers(0, 8192)))
    explicit_cache = draw(st.sampled_from([False, False, False, True]))
    s.memory.expert_cache = draw(st.integers(1, 50_000)) if explicit_cache else "auto"
    s.memory.resident_experts = draw(st.booleans())
    s.memory.resident_headroom_gib = draw(st.one_of(st.none(), st.floats(0, 16)))
    n = draw(st.integers(1, 65536))
    s.prefill.chunk = draw(st.sampled_from(["auto", f"auto:{n}", str(n)]))
    s.prefill.cpu_share = draw(st.sampled_from(["auto", "on", "off"]))
    s.prefill.cpu_share_max_tokens = draw(st.integers(0, 8192))
    s.prefill.lend_fraction = draw(st.one_of(st.none(), st.floats(0.01, 1.0)))
    s.prefill.stream_min_tokens = draw(st.one_of(st.none(), st.integers(0, 8192)))
    s.kv.dtype = draw(st.sampled_from(["f16", "bf16", "int8", "q8_0", "f32"]))
    s.kv.max_context = draw(st.one_of(st.integers(256, 32768), st.integers(256, 262144)))
    s.kv.resident_cells = draw(st.one_of(st.none(), st.integers(0, 262144)))
    if draw(st.booleans()):
        s.kv.resident_cells = None  # most runs keep every KV cell on the device
    s.pinning.arena_pin_gib = draw(st.one_of(st.none(), st.floats(0, 64)))
    s.pinning.pin_guard = draw(st.booleans())
    s.pinning.pin_reserve_gib = draw(st.one_of(st.none(), st.floats(0, 16)))
    s.pinning.wddm_pin_cap_gib = draw(st.one_of(st.none(), st.floats(0, 32)))
    s.pinning.pin_floor_mib = draw(st.one_of(st.none(), st.integers(0, 4096)))
    return s


def prompt_lengths(max_tokens: int = 200_000):
    """Prompt lengths of a request stream: short ones, around the chunk grid, and long ones."""
    return st.one_of(st.integers(1, 1100), st.integers(1, 9000), st.integers(1, max_tokens),
                     st.sampled_from([255, 256, 257, 1023, 1024, 3080, 4000, 4096, 6000, 8197, 41838]))
