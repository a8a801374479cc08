"""Page-locked caps are platform facts on every backend: a WDDM, WSL2 or Docker-on-WSL2 profile of any GPU backend
plans a page-locked limit no higher than the platform's cap (about half of RAM under WDDM, 0.75 GiB under WSL2,
500 MB under Docker on WSL2), whatever the backend; a backend's defaults may only lower it (cuda's 8 GiB). And the
probes report the driver model that triggers the rule when they run under Windows."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from strata_core.api.facts import GIB, MIB, CpuInfo, DeviceInfo, HostInfo
from strata_core.config.settings import settings_from_partial
from strata_core.models.spec import ModelSpec
from strata_core.planner import check_all, plan_for_machine
from strata_core.registry import load_plugins
from strata_cuda import backend as cuda_backend
from strata_opencl import backend as opencl_backend
from strata_rocm import backend as rocm_backend
from strata_sycl import backend as sycl_backend

#: A host with RAM to spare: without the platform's cap the limit would be ~56 GiB of its 60 GiB available.
RAM_BYTES = 64 * GIB
#: An expert arena larger than any cap here, so the limit is the cap's to decide.
MODEL = ModelSpec(name="pin-cap-test", moe_layers=48, experts_per_layer=512, top_k=8, hidden=4096,
                  slot_bytes=2 * MIB, largest_blob_bytes=2 * MIB, prompt_bytes_per_token=64 * 1024)

#: case -> (backend, module, the card a probe of it reports)
CARDS = {
    "cuda": ("cuda", cuda_backend, dict(name="NVIDIA GeForce RTX 3090", arch="sm_86")),
    "rocm": ("rocm", rocm_backend, dict(name="AMD Radeon AI PRO R9700", arch="gfx1201")),
    "sycl": ("sycl", sycl_backend, dict(name="Intel(R) Arc(TM) B580 Graphics", arch="gpu")),
    # a profile's integrated GPU is assumed to offer host-visible memory: page-locked memory under the platform's cap
    "opencl-igpu": ("opencl", opencl_backend, dict(name="Intel(R) UHD Graphics 770", arch="gpu", unified_memory=True)),
    # a discrete card's profile is not: the plugin's own cap of 0 lowers the platform's
    "opencl-dgpu": ("opencl", opencl_backend, dict(name="Intel(R) Arc(TM) B580 Graphics", arch="gpu")),
}

#: (driver model, host virtualization) -> the platform's cap in bytes on the 64 GiB host
PLATFORMS = {
    ("wddm", "none"): RAM_BYTES // 2,
    ("wsl2", "wsl2"): 3 * GIB // 4,
    ("wsl2", "docker-wsl2"): 500 * 1000 * 1000,
}


def _plan(case: str, driver_model: str, virtualization: str):
    backend, module, card = CARDS[case]
    plugins = load_plugins(autoload=False, extra=[module])
    info = DeviceInfo(backend=backend, vram_total_bytes=16 * GIB, vram_free_bytes=15 * GIB,
                      driver_model=driver_model, **card)
    host = HostInfo(os="windows" if driver_model == "wddm" else "linux", ram_total_bytes=RAM_BYTES,
                    ram_available_bytes=60 * GIB, cpu=CpuInfo(name="x86-64", cores=16, flags=("avx2", "fma")),
                    virtualization=virtualization)
    target = plugins.target_for(info, host)
    assert target.defaults.source.startswith(backend), target.defaults.source  # the backend's rules, not the core's
    return target, plan_for_machine(plugins, target, MODEL, settings_from_partial({}))


@pytest.mark.parametrize("platform", list(PLATFORMS), ids=["-".join(p) for p in PLATFORMS])
@pytest.mark.parametrize("case", list(CARDS))
def test_the_page_locked_limit_stays_under_the_platforms_cap(case, platform):
    target, plan = _plan(case, *platform)
    cap = PLATFORMS[platform]
    own = target.defaults.pin_cap_bytes
    assert own == {"cuda": 8 * GIB, "opencl-dgpu": 0}.get(case), f"{case}'s own cap is {own}"
    assert plan.pinned.cap_bytes == (cap if own is None else min(cap, own))
    assert plan.pinned.limit_bytes <= plan.pinned.cap_bytes
    check_all(plan)


@pytest.mark.parametrize("case", ["rocm", "sycl", "opencl-igpu"])
def test_no_backend_plans_30_gib_page_locked_under_wddm(case):
    _, plan = _plan(case, "wddm", "none")
    assert plan.pinned.limit_bytes <= RAM_BYTES // 2 < 33 * GIB


def test_a_sycl_gpu_under_windows_reports_wddm(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    dev = SimpleNamespace(device_type=SimpleNamespace(name="gpu"), global_mem_size=12 * GIB,
                          name="Intel(R) Arc(TM) B580 Graphics", vendor="Intel(R) Corporation",
                          has_aspect_usm_host_allocations=True)
    info = sycl_backend.device_info(dev, 0)
    assert info.driver_model == "wddm" and info.is_wddm


def test_an_opencl_gpu_under_windows_reports_wddm(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr("strata_opencl.runtime.device_kind", lambda cl, dev: "gpu")
    dev = SimpleNamespace(global_mem_size=12 * GIB, name="Intel(R) Arc(TM) B580 Graphics", type=4,
                          vendor="Intel(R) Corporation", host_unified_memory=False)
    info = opencl_backend.device_info(None, dev, 0, host_visible=True)
    assert info.driver_model == "wddm" and info.is_wddm and info.caps.async_copies
