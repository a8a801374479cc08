"""The cuda backend imports without cupy, and its probe never raises: without cupy, without a device, and with one
(through runtime and NVML doubles, so the mapping of their answers to DeviceInfo is checked on any machine).
The backend wraps those facts into Device objects (API 2.0) with their caps, platform rules and sessions."""

from __future__ import annotations

import sys

import pytest

from strata_core.api import Device, DeviceInfo, DeviceType, HostInfo, ProbeResult
from strata_core.api.facts import GIB
from strata_core.errors import BadInput
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


def test_the_backend_carries_the_install_line_of_where_it_is_installed():
    # this test suite runs from the source checkout (an editable install): the line installs from it
    assert cuda_backend.BACKEND.install_hint == cuda_probe.install_line("cuda", cuda_probe.Path(cuda_probe.__file__).parent)
    assert cuda_backend.BACKEND.install_hint.startswith("pip install -e ") and "[cuda]'" in cuda_backend.BACKEND.install_hint
    assert cuda_backend.BACKEND.name == "cuda" and cuda_backend.BACKEND.vendor == "nvidia"


def _package_in(root, pyproject: str | None):
    """backends/cuda/strata_cuda under `root`, with strata-core's pyproject.toml (or another, or none) at the root."""
    pkg = root / "backends" / "cuda" / "strata_cuda"
    pkg.mkdir(parents=True)
    if pyproject is not None:
        (root / "pyproject.toml").write_text(pyproject)
    return pkg


def test_install_line_from_inside_a_checkout_says_dot(tmp_path, monkeypatch):
    pkg = _package_in(tmp_path, '[project]\nname = "strata-core"\n')
    monkeypatch.chdir(tmp_path)
    assert cuda_probe.install_line("cuda", pkg) == "pip install -e '.[cuda]'"


def test_install_line_from_elsewhere_names_the_checkout(tmp_path, monkeypatch):
    pkg = _package_in(tmp_path / "src", '[project]\nname = "strata-core"\n')
    monkeypatch.chdir(tmp_path)
    assert cuda_probe.install_line("rocm", pkg) == f"pip install -e '{(tmp_path / 'src').resolve()}[rocm]'"


@pytest.mark.parametrize("pyproject", [None, '[project]\nname = "someone-else"\n'])
def test_install_line_outside_a_checkout_is_the_pypi_one(tmp_path, monkeypatch, pyproject):
    pkg = _package_in(tmp_path, pyproject)
    monkeypatch.chdir(tmp_path)
    assert cuda_probe.install_line("cuda", pkg) == "pip install 'strata-core[cuda]'"


def test_without_cupy_the_probe_says_so_and_leaves_the_install_line_to_the_backend(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy now raises ImportError
    r = cuda_probe.probe()
    assert r.available is False
    assert "cupy is not installed" in r.reason
    # said once: the registry shows the backend's install_hint beside the reason
    assert "pip install" not in r.reason
    assert cuda_backend.BACKEND.probe() == r


def test_no_device_is_reported_as_a_reason_not_an_exception():
    r = cuda_probe.probe_with(FakeRuntime(fail=NoDeviceError()), nvml=None, os_name="linux", wsl=False)
    assert r.available is False and r.devices == ()
    assert r.reason == "cupy is installed but no CUDA device: cudaErrorNoDevice: no CUDA-capable device is detected"


def test_zero_devices_is_unavailable():
    r = cuda_probe.probe_with(FakeRuntime(cards=[]), os_name="linux", wsl=False)
    assert r.available is False and "no CUDA device" in r.reason


def test_the_real_probe_never_raises_and_is_consistent():
    r = cuda_backend.BACKEND.probe()
    assert isinstance(r, ProbeResult)
    if r.available:  # a GPU machine
        assert r.devices and r.score > 100 and all(d.info.arch.startswith("sm_") for d in r.devices)
        assert all(isinstance(d, Device) for d in r.devices)
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


def _plugin_over(runtime, nvml=None, os_name="linux"):
    """The cuda backend's plugin with its probe's facts read through runtime and NVML doubles."""
    return cuda_backend.CupyBackendPlugin(
        name="cuda", vendor="nvidia", install_hint="hint", description="test", defaults=cuda_backend.nvidia_defaults,
        probe=lambda: cuda_probe.probe_with(runtime, nvml=nvml, os_name=os_name, wsl=False), pinned_kind="cuda-host",
        kernel_name="cuda-moe.cu", caps=cuda_backend.CUDA_CAPS, layer_ops=cuda_backend.cuda_layer_ops)


class PeerRuntime(FakeRuntime):
    """A runtime double whose cards can all reach each other (cudaDeviceCanAccessPeer)."""

    def deviceCanAccessPeer(self, i, j):
        return 1


def test_the_backend_probe_gives_device_objects_with_the_cuda_caps():
    cards = [{"props": props(9, 0, name=b"NVIDIA H200", total=141 * GIB), "bus": "a", "free": 130 * GIB,
              "total": 141 * GIB}] * 2
    r = _plugin_over(PeerRuntime(cards=cards)).probe()
    assert r.available and len(r.devices) == 2
    for i, d in enumerate(r.devices):
        assert isinstance(d, Device) and isinstance(d.info, DeviceInfo) and d.info.index == i
        assert d.info.device_type is DeviceType.GPU
        caps = d.info.caps
        # the plugin has its own (fused) layer ops: the cap says so
        assert (caps.async_copies, caps.graph_capture, caps.host_mapped_memory, caps.fused_layer_ops) == \
            (True, True, False, True)
        assert caps.peer_copies is True and {"f16", "q8_0", "q4_k", "mxfp4"} <= set(caps.expert_formats)


def test_a_single_card_claims_no_peer_copies_and_an_integrated_one_says_so():
    card = {"props": {**props(8, 7, name=b"Orin"), "integrated": 1}, "bus": "a", "free": 8 * GIB,
            "total": 16 * GIB}
    (d,) = _plugin_over(PeerRuntime(cards=[card])).probe().devices
    assert d.info.caps.peer_copies is False
    assert d.info.device_type is DeviceType.INTEGRATED_GPU and d.info.unified_memory is True


def test_a_probed_device_answers_its_own_platform_defaults():
    card = {"props": props(8, 6, total=24 * GIB), "bus": "a", "free": 20 * GIB, "total": 24 * GIB}
    (d,) = _plugin_over(FakeRuntime(cards=[card]), os_name="windows").probe().devices
    host = HostInfo(os="windows", ram_total_bytes=64 * GIB, ram_available_bytes=40 * GIB)
    pd = d.platform_defaults(host)
    assert pd.source == "cuda backend" and pd.chunk_ceiling_tokens == 32768
    assert d.info.driver_model == "wddm" and pd.pin_cap_bytes == 8 * GIB


def test_describe_plans_from_a_profile_and_open_refuses_in_one_line():
    info = DeviceInfo(backend="cuda", name="NVIDIA GeForce RTX 3090", vram_total_bytes=24 * GIB,
                      vram_free_bytes=22 * GIB, driver_model="wddm")
    d = cuda_backend.BACKEND.describe(info)
    assert isinstance(d, Device) and d.info == info
    assert d.platform_defaults(HostInfo(os="windows", ram_total_bytes=32 * GIB,
                                        ram_available_bytes=20 * GIB)).pin_cap_bytes == 8 * GIB
    with pytest.raises(BadInput) as e:
        d.open(plan=None)
    assert "\n" not in str(e.value) and "RTX 3090" in str(e.value) and "profile" in str(e.value)


def test_the_real_cuda_plugin_has_fused_layer_ops_and_rocm_has_none():
    from strata_rocm import backend as rocm_backend
    assert cuda_backend.PLUGIN.caps.fused_layer_ops is True and cuda_backend.PLUGIN.layer_ops is not None
    assert rocm_backend.PLUGIN.caps.fused_layer_ops is False and rocm_backend.PLUGIN.layer_ops is None


def test_the_only_hook_is_discovery():
    hooks = sorted(n for n in dir(cuda_backend) if n.startswith("strata_"))
    assert hooks == ["strata_backends"]
    assert cuda_backend.strata_backends() == [cuda_backend.BACKEND]


def _registry_over(plugin):
    from strata_core.registry import load_plugins
    return load_plugins(autoload=False, extra=[plugin])


def test_no_device_shows_no_install_line_since_installing_would_not_help():
    plugin = _plugin_over(FakeRuntime(fail=NoDeviceError()))
    r = plugin.probe()
    assert r.available is False and r.install_hint == ""
    host = _registry_over(plugin)
    (status,) = [s for s in host.statuses() if s.name == "cuda"]
    assert status.install_hint == "" and "no CUDA device" in status.reason
    with pytest.raises(BadInput) as e:
        host.resolve("cuda")
    assert "pip install" not in str(e.value) and "(install:" not in str(e.value) and "no CUDA device" in str(e.value)


def test_a_missing_cupy_shows_the_install_line_once(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    host = _registry_over(cuda_backend.PLUGIN)
    (status,) = [s for s in host.statuses() if s.name == "cuda"]
    assert status.install_hint == cuda_backend.INSTALL_HINT
    with pytest.raises(BadInput) as e:
        host.resolve("cuda")
    assert str(e.value).count(cuda_backend.INSTALL_HINT) == 1 and str(e.value).count("pip install") == 1
