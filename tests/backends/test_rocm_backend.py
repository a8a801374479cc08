"""The rocm backend imports without cupy-rocm and says why it is unavailable; its probe never raises, even when
cupy-rocm's own import fails without ROCm's libraries. Its devices are strata_cuda's CupyDevice under rocm's caps."""

from __future__ import annotations

import sys

import pytest

from strata_core.api import Device, DeviceType, ProbeResult
from strata_core.api.facts import GIB
from strata_core.registry import load_plugins
from strata_rocm import backend as rocm_backend
from strata_rocm import probe as rocm_probe
from strata_rocm import rules as rocm_rules

from cupy_test_helpers import FakeRuntime, assert_imports_without_cupy

HINT = rocm_probe.install_line("rocm", rocm_probe.Path(rocm_probe.__file__).parent)


def test_importing_the_backend_does_not_import_cupy():
    assert_imports_without_cupy("strata_rocm.backend")


def test_without_cupy_rocm_the_probe_is_unavailable_with_the_reason():
    # here cupy is absent or its CUDA build: either way cupy-rocm is not installed
    r = rocm_backend.BACKEND.probe()
    assert isinstance(r, ProbeResult)
    assert r.available is False and "cupy-rocm" in r.reason and "pip install" not in r.reason


def test_without_any_cupy_the_probe_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    r = rocm_backend.BACKEND.probe()
    assert r.available is False and "cupy-rocm is not installed" in r.reason


class _CupyWithoutRocm:
    """A finder for 'cupy' whose import fails as cupy-rocm's does on a machine without ROCm's libraries."""

    def __init__(self, error):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        if name == "cupy" or name.startswith("cupy."):
            raise self.error
        return None


@pytest.mark.parametrize("error", [OSError("libamdhip64.so.6: cannot open shared object file: No such file"),
                                   RuntimeError("hipErrorNoBinaryForGpu"), ImportError("libhiprtc.so.6")])
def test_cupy_rocm_that_cannot_load_without_rocm_is_unavailable_not_a_crash(monkeypatch, error):
    for m in [m for m in sys.modules if m == "cupy" or m.startswith("cupy.")]:
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.setattr(sys, "meta_path", [_CupyWithoutRocm(error)] + sys.meta_path)
    r = rocm_backend.BACKEND.probe()
    assert r.available is False and r.devices == ()
    assert "cupy-rocm is not installed or does not load" in r.reason and str(error) in r.reason


def test_the_plugin_lists_it_unavailable_with_the_install_hint():
    plugins = load_plugins(autoload=False, extra=[rocm_backend])
    (status,) = [s for s in plugins.statuses() if s.name == "rocm"]
    assert (status.name, status.vendor, status.available) == ("rocm", "amd", False)
    assert status.install_hint == HINT and status.reason


def test_no_device_is_a_reason_not_an_exception():
    r = rocm_probe.probe_with(FakeRuntime(fail=RuntimeError("hipErrorNoDevice: no ROCm-capable device")))
    assert r.available is False
    assert r.reason == "cupy-rocm is installed but no ROCm device: hipErrorNoDevice: no ROCm-capable device"


def test_a_gfx1201_card_is_read_with_its_arch():
    card = {"props": {"name": b"AMD Radeon AI PRO R9700", "gcnArchName": b"gfx1201:sramecc-:xnack-",
                      "kernelExecTimeoutEnabled": 0},
            "free": 26306674688, "total": 34359738368}
    r = rocm_probe.probe_with(FakeRuntime(cards=[card]), os_name="linux", wsl=False)
    (d,) = r.devices
    assert (d.backend, d.vendor, d.arch, d.name) == ("rocm", "amd", "gfx1201", "AMD Radeon AI PRO R9700")
    assert (d.vram_total_bytes, d.vram_free_bytes, d.drives_display) == (34359738368, 26306674688, False)
    assert d.driver_model == "linux" and d.device_type is DeviceType.GPU
    assert r.available and r.score == 100 + 32


R9700 = {"props": {"name": b"AMD Radeon AI PRO R9700", "gcnArchName": b"gfx1201", "kernelExecTimeoutEnabled": 1},
         "free": 26306674688, "total": 34359738368}


@pytest.mark.parametrize("os_name,wsl,model", [("windows", False, "wddm"), ("linux", True, "wsl2")])
def test_a_card_under_windows_or_wsl2_reports_that_driver_model(os_name, wsl, model):
    (d,) = rocm_probe.probe_with(FakeRuntime(cards=[R9700]), os_name=os_name, wsl=wsl).devices
    assert d.driver_model == model and d.is_wddm


def test_the_backend_wraps_its_cards_into_devices_with_the_rocm_caps():
    plugin = rocm_backend.CupyBackendPlugin(
        name="rocm", vendor="amd", install_hint=HINT, description="test", defaults=rocm_backend.amd_defaults,
        probe=lambda: rocm_probe.probe_with(FakeRuntime(cards=[R9700]), os_name="linux", wsl=False),
        pinned_kind="hip-host", kernel_name="rocm-moe.cu", caps=rocm_backend.ROCM_CAPS)
    (d,) = plugin.probe().devices
    assert isinstance(d, Device) and d.info.arch == "gfx1201"
    assert (d.info.caps.async_copies, d.info.caps.graph_capture, d.info.caps.fused_layer_ops) == (True, False, False)
    assert d.platform_defaults(rocm_rules.HostInfo(os="linux", ram_total_bytes=64 * GIB,
                                                   ram_available_bytes=48 * GIB)).source == "rocm backend (gfx12 rules)"


def test_rocm_and_cuda_share_one_plugin_class():
    from strata_cuda import backend as cuda_backend
    assert type(rocm_backend.PLUGIN) is type(cuda_backend.PLUGIN) is cuda_backend.CupyBackendPlugin
    assert sorted(n for n in dir(rocm_backend) if n.startswith("strata_")) == ["strata_backends"]


def test_gfx_arch_drops_the_feature_flags():
    assert rocm_probe.gfx_arch("gfx942:sramecc+:xnack-") == "gfx942"
    assert rocm_probe.gfx_arch(b"gfx1100") == "gfx1100"
