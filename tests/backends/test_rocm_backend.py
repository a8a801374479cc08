"""The rocm backend imports without cupy-rocm and says so with the install line; its probe never raises."""

from __future__ import annotations

import sys

from strata_core.api.backend import ProbeResult
from strata_core.api.facts import GIB
from strata_core.registry import load_plugins
from strata_rocm import backend as rocm_backend
from strata_rocm import probe as rocm_probe

from cupy_test_helpers import FakeRuntime, assert_imports_without_cupy

HINT = "pip install 'strata-core[rocm]'"


def test_importing_the_backend_does_not_import_cupy():
    assert_imports_without_cupy("strata_rocm.backend")


def test_without_cupy_rocm_the_probe_is_unavailable_with_the_install_line():
    # here cupy is absent or its CUDA build: either way cupy-rocm is not installed
    r = rocm_probe.probe()
    assert isinstance(r, ProbeResult)
    assert r.available is False and "cupy-rocm" in r.reason and HINT in r.reason


def test_without_any_cupy_the_probe_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    r = rocm_probe.probe()
    assert r.available is False and "cupy-rocm is not installed" in r.reason and HINT in r.reason


def test_the_plugin_lists_it_unavailable_with_the_install_hint():
    plugins = load_plugins(autoload=False, extra=[rocm_backend])
    (status,) = plugins.statuses()
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
    r = rocm_probe.probe_with(FakeRuntime(cards=[card]))
    (d,) = r.devices
    assert (d.backend, d.vendor, d.arch, d.name) == ("rocm", "amd", "gfx1201", "AMD Radeon AI PRO R9700")
    assert (d.vram_total_bytes, d.vram_free_bytes, d.drives_display) == (34359738368, 26306674688, False)
    assert r.available and r.score == 100 + 32


def test_gfx_arch_drops_the_feature_flags():
    assert rocm_probe.gfx_arch("gfx942:sramecc+:xnack-") == "gfx942"
    assert rocm_probe.gfx_arch(b"gfx1100") == "gfx1100"
