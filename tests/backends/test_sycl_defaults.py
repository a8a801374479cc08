"""Rule tests of the sycl backend's platform defaults and selection score, on profiles: no hardware or dpctl needed.

A profile's facts become a device through `BACKEND.describe(info)` (API 2.0); the rules are that device's
`platform_defaults(host)`."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from strata_core.api import Device, DeviceType
from strata_core.api.facts import GIB, CpuInfo, DeviceInfo, HostInfo, PlatformDefaults
from strata_core.errors import BadInput
from strata_core.kits.opencl import EXPERT_FORMATS
from strata_sycl import backend as sycl

HOST = HostInfo(os="linux", ram_total_bytes=64 * GIB, ram_available_bytes=48 * GIB,
                cpu=CpuInfo(name="Test CPU", cores=8, flags=("avx2",)))


def _device(arch: str, unified: bool = False, name: str = "Intel(R) Arc(TM) A770 Graphics",
            backend: str = "sycl", driver_model: str = "linux") -> DeviceInfo:
    return DeviceInfo(backend=backend, name=name, vram_total_bytes=16 * GIB, vram_free_bytes=15 * GIB,
                      vendor="intel", arch=arch, driver_model=driver_model, unified_memory=unified)


DISCRETE = _device("gpu")
INTEGRATED = _device("gpu", unified=True, name="Intel(R) UHD Graphics 770")
CPU_DEVICE = _device("cpu", unified=True, name="Intel(R) Xeon(R)", driver_model="host")


def defaults(device: DeviceInfo, host: HostInfo = HOST) -> PlatformDefaults:
    """The platform defaults of the device the backend describes for these facts."""
    return sycl.BACKEND.describe(device).platform_defaults(host)


@pytest.mark.parametrize("device", [DISCRETE, INTEGRATED, CPU_DEVICE], ids=["discrete", "integrated", "cpu"])
def test_chunk_ceiling_is_8192_on_every_sycl_device(device):
    assert defaults(device).chunk_ceiling_tokens == 8192


@pytest.mark.parametrize("device", [DISCRETE, INTEGRATED, CPU_DEVICE], ids=["discrete", "integrated", "cpu"])
def test_free_vram_is_read_with_a_margin(device):
    trust = defaults(device).free_vram_trust
    assert 0.5 <= trust < 1.0
    assert trust < PlatformDefaults().free_vram_trust


def test_usm_host_pinning_has_no_driver_cap():
    d = defaults(DISCRETE)
    assert d.pin_cap_bytes is None


def test_cpu_share_is_off_when_the_device_is_the_cpu_and_on_for_a_gpu():
    on_cpu = defaults(CPU_DEVICE)
    on_gpu = defaults(DISCRETE)
    assert on_cpu.cpu_share_default is False and "CPU" in on_cpu.cpu_share_reason
    assert on_gpu.cpu_share_default is True


def test_defaults_name_their_source():
    assert defaults(DISCRETE).source == "sycl backend"


def test_a_described_device_plans_but_refuses_to_open_in_one_line():
    d = sycl.BACKEND.describe(DISCRETE)
    assert isinstance(d, Device) and d.info == DISCRETE
    with pytest.raises(BadInput) as e:
        d.open(plan=None)
    assert "\n" not in str(e.value) and "A770" in str(e.value)


def test_the_only_hook_is_discovery():
    assert sorted(n for n in dir(sycl) if n.startswith("strata_")) == ["strata_backends"]


@pytest.mark.parametrize("kind,unified,want", [("gpu", False, DeviceType.GPU), ("gpu", True, DeviceType.INTEGRATED_GPU),
                                               ("cpu", True, DeviceType.CPU),
                                               ("accelerator", False, DeviceType.ACCELERATOR)])
def test_device_types_follow_the_kind_and_memory_model(kind, unified, want):
    from types import SimpleNamespace
    name = "Intel(R) UHD Graphics 770" if unified and kind == "gpu" else "Intel(R) Arc(TM) A770 Graphics"
    dev = SimpleNamespace(device_type=SimpleNamespace(name=kind), global_mem_size=8 * GIB, name=name,
                          vendor="Intel(R) Corporation", has_aspect_usm_host_allocations=True)
    info = sycl.device_info(dev, 0)
    assert info.device_type is want
    # copies overlap kernels on a GPU or accelerator with USM host memory; a CPU device's are host threads alike
    assert info.caps.async_copies is (kind != "cpu")
    assert (info.caps.graph_capture, info.caps.peer_copies, info.caps.fused_layer_ops,
            info.caps.host_mapped_memory) == (False, False, False, False)
    assert info.caps.expert_formats == EXPERT_FORMATS  # what the kit's moe.cl computes


def test_scores_rank_discrete_over_integrated_over_cpu_device_over_the_cpu_backend():
    from strata_core.builtin.cpu import probe as cpu_probe
    discrete, integrated, cpu_dev = (sycl.score_for(d) for d in (DISCRETE, INTEGRATED, CPU_DEVICE))
    assert discrete > integrated > cpu_dev > cpu_probe().score
    assert discrete >= 100 and cpu_dev < 100


def test_backend_declares_its_install_line_and_api_version():
    from strata_core.api import API_VERSION
    (b,) = sycl.strata_backends()
    assert b.name == "sycl" and b.install_hint.startswith("pip install -e ") and "[sycl]'" in b.install_hint
    assert b.api_version.split(".")[0] == API_VERSION.split(".")[0]


def test_module_imports_and_reports_unavailable_without_dpctl():
    # A fresh interpreter where `import dpctl` fails, as on a machine without the [sycl] extra.
    code = textwrap.dedent("""
        import sys
        sys.modules["dpctl"] = None
        import strata_sycl.backend as b
        r = b.probe()
        print(r.available, "|", r.reason, "|", b.BACKEND.install_hint)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    available, reason, hint = (s.strip() for s in out.stdout.strip().split("|"))
    assert available == "False"
    assert "dpctl" in reason and "pip install" not in reason  # the hint is said once, by the backend
    assert hint == sycl.INSTALL_HINT


def test_opening_a_device_without_dpctl_fails_with_the_install_line():
    code = textwrap.dedent("""
        import sys
        sys.modules["dpctl"] = None
        from types import SimpleNamespace
        from strata_core.errors import StrataError
        from strata_core.api.facts import DeviceInfo
        from strata_core.kits.opencl import MoeClDevice
        import strata_sycl.backend as b
        dev = MoeClDevice(DeviceInfo(backend="sycl", name="x", vram_total_bytes=1, vram_free_bytes=1), b.PLUGIN)
        try:
            dev.open(SimpleNamespace(pinned=SimpleNamespace(limit_bytes=0, floor_bytes=0)))
        except StrataError as e:
            print("refused:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused:") and sycl.INSTALL_HINT in out.stdout


def test_pocl_devices_are_kept_out_of_sycl():
    from types import SimpleNamespace

    from strata_sycl.runtime import excluded

    def dev(platform):
        return SimpleNamespace(sycl_platform=SimpleNamespace(name=platform))

    assert excluded(dev("Portable Computing Language"))
    assert not excluded(dev("Intel(R) OpenCL"))
    assert not excluded(dev("Intel(R) OpenCL Graphics"))
    assert excluded(SimpleNamespace())  # a device whose platform cannot be named is not opened
