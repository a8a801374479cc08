"""NVIDIA platform rules on profiles (no GPU, no cupy): chunk ceiling, WDDM pin cap, reserve, CPU share."""

from __future__ import annotations

import pytest

from strata_core.api.facts import GIB, CpuInfo, DeviceInfo, HostInfo, load_profile
from strata_core.registry import load_plugins
from strata_cuda import backend as cuda_backend
from strata_cuda import rules

from cupy_test_helpers import SCENARIO_DIR, scenario_paths

AVX_ONLY = CpuInfo(name="Intel Xeon E5-2670", cores=8, flags=("avx",))
ZEN3 = CpuInfo(name="AMD Ryzen 9 5900X", cores=12, flags=("avx2", "fma", "f16c"))


def card(total_bytes: int, driver_model: str = "linux", display: bool = False, backend: str = "cuda") -> DeviceInfo:
    """A card as a probe would report it."""
    return DeviceInfo(backend=backend, name="card", vram_total_bytes=total_bytes, vram_free_bytes=total_bytes // 2,
                      arch="sm_89", driver_model=driver_model, drives_display=display)


def host(cpu: CpuInfo = ZEN3, os_name: str = "linux") -> HostInfo:
    """A 64 GiB host."""
    return HostInfo(os=os_name, ram_total_bytes=64 * GIB, ram_available_bytes=40 * GIB, cpu=cpu)


@pytest.mark.parametrize("total,ceiling", [
    (25769803776, 32768),   # RTX 3090, 24 GiB (seed #1756)
    (16 * GIB, 32768),      # the boundary itself is a large card
    (16 * GIB - 1, 8192),
    (12877561856, 8192),    # RTX 4070 Ti, 12 GiB (seed #2090)
])
def test_chunk_ceiling_is_32768_from_16_gib_and_8192_below(total, ceiling):
    assert rules.nvidia_defaults(card(total), host()).chunk_ceiling_tokens == ceiling


@pytest.mark.parametrize("model,capped", [("wddm", True), ("wsl2", True), ("linux", False), ("tcc", False)])
def test_wddm_pin_cap_applies_to_a_single_gpu(model, capped):
    # one card, index 0, no other device anywhere: the seed's single-GPU host
    d = rules.nvidia_defaults(card(24 * GIB, driver_model=model), host(os_name="windows"))
    assert d.pin_cap_bytes == (8 * GIB if capped else None)


def test_reserve_is_larger_on_a_card_that_drives_a_display():
    with_display = rules.nvidia_defaults(card(12 * GIB, display=True), host())
    headless = rules.nvidia_defaults(card(12 * GIB, display=False), host())
    assert (with_display.vram_reserve_mib, headless.vram_reserve_mib) == (700, 512)


def test_cpu_share_is_off_on_an_avx_only_cpu_and_says_why():
    d = rules.nvidia_defaults(card(24 * GIB, "wddm"), host(AVX_ONLY, "windows"))
    assert d.cpu_share_default is False
    assert "avx2" in d.cpu_share_reason and "fma" in d.cpu_share_reason and "Zen 4" in d.cpu_share_reason


def test_cpu_share_is_on_with_avx2_and_fma():
    d = rules.nvidia_defaults(card(12 * GIB), host(ZEN3))
    assert d.cpu_share_default is True


def test_cpu_share_needs_both_flags():
    only_avx2 = CpuInfo(name="x", flags=("avx", "avx2"))
    assert rules.nvidia_defaults(card(12 * GIB), host(only_avx2)).cpu_share_default is False


def test_nvidia_keeps_the_prompt_borrow_off_the_host_and_trusts_free_vram():
    d = rules.nvidia_defaults(card(12 * GIB), host())
    assert d.host_borrow is False
    assert d.free_vram_trust == 1.0
    assert d.source == "cuda backend"


def test_the_registry_describes_cuda_facts_as_a_cuda_device_with_these_rules():
    plugins = load_plugins(autoload=False, extra=[cuda_backend])
    mine = plugins.describe(card(24 * GIB))
    assert isinstance(mine, cuda_backend.CupyDevice)
    assert mine.platform_defaults(host()).chunk_ceiling_tokens == 32768
    # another backend's facts are not this backend's business: the core plans them with its own defaults
    theirs = plugins.describe(card(24 * GIB, backend="rocm"))
    assert not isinstance(theirs, cuda_backend.CupyDevice)
    assert theirs.platform_defaults(host()).source != "cuda backend"
    assert "cuda" in plugins.backends


@pytest.mark.skipif(not scenario_paths("cuda"), reason=f"no cuda scenario files in {SCENARIO_DIR}")
@pytest.mark.parametrize("path", scenario_paths("cuda"), ids=lambda p: p.stem)
def test_seed_profiles_get_the_seed_rules(path):
    prof = load_profile(path)
    d = rules.nvidia_defaults(prof.device, prof.host)
    assert d.chunk_ceiling_tokens == (32768 if prof.device.vram_total_bytes >= 16 * GIB else 8192)
    # every seed host runs Windows under WDDM: the cap applies, single GPU included
    assert prof.device.driver_model == "wddm" and d.pin_cap_bytes == 8 * GIB
    assert d.cpu_share_default == (prof.host.cpu.has("avx2") and prof.host.cpu.has("fma"))
