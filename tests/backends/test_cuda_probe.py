"""The cuda backend imports without cupy, and its probe never raises: without cupy, without a device, and with one
(through runtime and NVML doubles, so the mapping of their answers to DeviceInfo is checked on any machine)."""

from __future__ import annotations

import sys

import pytest

from strata_core.api.backend import ProbeResult
from strata_core.api.facts import GIB
from strata_cuda import backend as cuda_backend
from strata_cuda import probe as cuda_probe

from cupy_test_helpers import FakeRuntime, assert_imports_without_cupy


class NoDeviceError(Exception):
    """Like cupy's CUDARuntimeError for cudaErrorNoDevice."""

    status = 100

    def __str__(self):
        return "cudaErrorNoDevice: no CUDA-capable device is detected"


class FakeNvml:
    """pynvml's calls the probe uses, keyed by PCI bus id."""

    def __init__(self, by_bus):
        self.by_bus = by_bus

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        return self.by_bus[bus]

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("Mem", (), {"total": h["total"], "free": h["free"]})()

    def nvmlDeviceGetName(self, h):
        return h["name"]

    def nvmlDeviceGetDisplayActive(self, h):
        return h["display"]

    def nvmlDeviceGetDriverModel(self, h):
        return [h["model"], h["model"]]


def props(major, minor, name=b"NVIDIA Test", total=12 * GIB, watchdog=0, tcc=0):
    """cudaGetDeviceProperties as cupy returns it (a dict, bytes for the name)."""
    return {"name": name, "major": major, "minor": minor, "totalGlobalMem": total,
            "kernelExecTimeoutEnabled": watchdog, "tccDriver": tcc}


def test_importing_the_backend_does_not_import_cupy():
    assert_imports_without_cupy("strata_cuda.backend", "strata_cuda.kernels", "strata_cuda.cupy_device")


def test_the_backend_carries_the_install_line():
    assert cuda_backend.BACKEND.install_hint == "pip install 'strata-core[cuda]'"
    assert cuda_backend.BACKEND.name == "cuda" and cuda_backend.BACKEND.vendor == "nvidia"


def test_without_cupy_the_probe_says_so_with_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy now raises ImportError
    r = cuda_probe.probe()
    assert r.available is False
    assert "cupy is not installed" in r.reason and "pip install 'strata-core[cuda]'" in r.reason


def test_no_device_is_reported_as_a_reason_not_an_exception():
    r = cuda_probe.probe_with(FakeRuntime(fail=NoDeviceError()), nvml=None, os_name="linux", wsl=False)
    assert r.available is False and r.devices == ()
    assert r.reason == "cupy is installed but no CUDA device: cudaErrorNoDevice: no CUDA-capable device is detected"


def test_zero_devices_is_unavailable():
    r = cuda_probe.probe_with(FakeRuntime(cards=[]), os_name="linux", wsl=False)
    assert r.available is False and "no CUDA device" in r.reason


def test_the_real_probe_never_raises_and_is_consistent():
    r = cuda_probe.probe()
    assert isinstance(r, ProbeResult)
    if r.available:  # a GPU machine
        assert r.devices and r.score > 100 and all(d.arch.startswith("sm_") for d in r.devices)
    else:
        assert r.reason and r.devices == () and r.score == 0


def test_nvml_facts_make_the_device_info_without_a_context():
    rt = FakeRuntime(cards=[{"props": props(8, 9, total=12 * GIB), "bus": "0000:01:00.0", "free": 0, "total": 0}])
    nvml = FakeNvml({"0000:01:00.0": {"total": 12877561856, "free": 4101693767, "display": 1,
                                                 "name": "NVIDIA GeForce RTX 4070 Ti", "model": 0}})
    r = cuda_probe.probe_with(rt, nvml=nvml, os_name="windows", wsl=False)
    assert r.available is True
    (d,) = r.devices
    assert (d.backend, d.vendor, d.arch, d.name) == ("cuda", "nvidia", "sm_89", "NVIDIA GeForce RTX 4070 Ti")
    assert (d.vram_total_bytes, d.vram_free_bytes) == (12877561856, 4101693767)
    assert d.driver_model == "wddm" and d.drives_display is True
    assert rt.mem_info_calls == 0  # NVML answered: no context was created for memory facts
    assert r.score == 100 + 12877561856 // GIB


def test_nvml_tcc_model_is_reported():
    rt = FakeRuntime(cards=[{"props": props(8, 6), "bus": "b", "free": 0, "total": 0}])
    nvml = FakeNvml({"b": {"total": 24 * GIB, "free": 20 * GIB, "display": 0, "name": "RTX", "model": 1}})
    (d,) = cuda_probe.probe_with(rt, nvml=nvml, os_name="windows", wsl=False).devices
    assert d.driver_model == "tcc" and d.drives_display is False


def test_without_nvml_the_runtime_answers_for_every_card():
    cards = [{"props": props(9, 0, name=b"NVIDIA H200", total=141 * GIB), "bus": "a", "free": 130 * GIB,
              "total": 141 * GIB},
             {"props": props(8, 6, name=b"RTX 3090", total=24 * GIB, watchdog=1), "bus": "b", "free": 20 * GIB,
              "total": 24 * GIB}]
    rt = FakeRuntime(cards=cards)
    r = cuda_probe.probe_with(rt, nvml=None, os_name="linux", wsl=True)
    h200, rtx = r.devices
    assert (h200.name, h200.arch, h200.index, h200.vram_free_bytes) == ("NVIDIA H200", "sm_90", 0, 130 * GIB)
    assert (rtx.arch, rtx.index, rtx.drives_display) == ("sm_86", 1, True)
    assert h200.driver_model == rtx.driver_model == "wsl2"
    assert rt.current == 0  # the probe put the current device back
    assert r.score == 100 + 141


def test_windows_without_nvml_reads_the_driver_model_from_the_properties():
    rt = FakeRuntime(cards=[{"props": props(8, 6, tcc=0), "bus": "a", "free": 1, "total": 2},
                            {"props": props(8, 0, tcc=1), "bus": "b", "free": 1, "total": 2}])
    wddm, tcc = cuda_probe.probe_with(rt, nvml=None, os_name="windows", wsl=False).devices
    assert (wddm.driver_model, tcc.driver_model) == ("wddm", "tcc")


def test_a_card_that_fails_to_answer_makes_the_probe_unavailable_not_raise():
    class Broken(FakeRuntime):
        """A runtime that counts one card and then cannot read it."""

        def getDeviceProperties(self, i):
            raise RuntimeError("cudaErrorUnknown")

    r = cuda_probe.probe_with(Broken(cards=[{}]), os_name="linux", wsl=False)
    assert r.available is False and "cudaErrorUnknown" in r.reason


@pytest.mark.parametrize("hook", ["strata_pinned_allocator", "strata_device_memory", "strata_kernels"])
def test_runtime_hooks_answer_none_for_other_backends(hook):
    from strata_core.api.backend import PinnedBudget
    from strata_core.api.facts import DeviceInfo
    other = DeviceInfo(backend="rocm", name="x", vram_total_bytes=1, vram_free_bytes=1)
    kwargs = {"device": other}
    if hook == "strata_pinned_allocator":
        kwargs["budget"] = PinnedBudget(1 << 20)
    assert getattr(cuda_backend, hook)(**kwargs) is None
