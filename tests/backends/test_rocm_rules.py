"""AMD platform rules on profiles (no GPU, no cupy-rocm): gfx12 16384 with the host borrow, other archs 8192."""

from __future__ import annotations

import pytest

from strata_core.api.facts import GIB, CpuInfo, DeviceInfo, HostInfo, load_profile
from strata_core.registry import load_plugins
from strata_rocm import backend as rocm_backend
from strata_rocm import rules

from cupy_test_helpers import SCENARIO_DIR, scenario_paths


def card(arch: str, backend: str = "rocm", display: bool = False) -> DeviceInfo:
    """A 32 GiB AMD card as a probe would report it."""
    return DeviceInfo(backend=backend, name="AMD card", arch=arch, vram_total_bytes=32 * GIB,
                      vram_free_bytes=24 * GIB, driver_model="linux", drives_display=display)


HOST = HostInfo(os="linux", ram_total_bytes=30 * GIB, ram_available_bytes=28 * GIB,
                cpu=CpuInfo(name="x86-64", cores=16, flags=("avx2", "fma")))


@pytest.mark.parametrize("arch", ["gfx1200", "gfx1201"])
def test_gfx12_takes_16384_and_borrows_host_ram(arch):
    d = rules.amd_defaults(card(arch), HOST)
    assert d.chunk_ceiling_tokens == 16384
    assert d.host_borrow is True
    # seed #2090: 3390 MiB left available at chunk 16384 thrashed; about 3 GiB more (chunk 8192) ran stable
    assert 3390 * (1 << 20) < d.resident_headroom_bytes <= 3390 * (1 << 20) + 3 * GIB


@pytest.mark.parametrize("arch", ["gfx1100", "gfx942", "gfx90a", "gfx1030", ""])
def test_other_amd_archs_take_8192_without_the_borrow(arch):
    d = rules.amd_defaults(card(arch), HOST)
    assert d.chunk_ceiling_tokens == 8192
    assert d.host_borrow is False


def test_cpu_share_follows_the_host_cpu():
    avx_only = HostInfo(os="linux", ram_total_bytes=30 * GIB, ram_available_bytes=28 * GIB,
                        cpu=CpuInfo(name="old", flags=("avx",)))
    assert rules.amd_defaults(card("gfx1201"), HOST).cpu_share_default is True
    off = rules.amd_defaults(card("gfx1201"), avx_only)
    assert off.cpu_share_default is False and "avx2" in off.cpu_share_reason


def test_reserve_is_larger_on_a_card_that_drives_a_display():
    assert rules.amd_defaults(card("gfx1201", display=True), HOST).vram_reserve_mib == 700
    assert rules.amd_defaults(card("gfx1201"), HOST).vram_reserve_mib == 512


def test_the_registry_describes_rocm_facts_as_a_rocm_device_with_these_rules():
    plugins = load_plugins(autoload=False, extra=[rocm_backend])
    mine = plugins.describe(card("gfx1201"))
    assert mine.platform_defaults(HOST).chunk_ceiling_tokens == 16384
    assert mine.platform_defaults(HOST).source == "rocm backend (gfx12 rules)"
    assert plugins.describe(card("gfx1201", backend="cuda")).platform_defaults(HOST).source != \
        "rocm backend (gfx12 rules)"


@pytest.mark.skipif(not scenario_paths("rocm"), reason=f"no rocm scenario files in {SCENARIO_DIR}")
@pytest.mark.parametrize("path", scenario_paths("rocm"), ids=lambda p: p.stem)
def test_seed_gfx12_profiles_get_the_gfx12_rules(path):
    prof = load_profile(path)
    d = rules.amd_defaults(prof.device, prof.host)
    assert prof.device.arch == "gfx1201"
    assert (d.chunk_ceiling_tokens, d.host_borrow) == (16384, True)
