"""Rule tests of the sycl backend's platform defaults and selection score, on profiles: no hardware or dpctl needed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from strata_core.api.facts import GIB, CpuInfo, DeviceInfo, HostInfo, PlatformDefaults
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


@pytest.mark.parametrize("device", [DISCRETE, INTEGRATED, CPU_DEVICE], ids=["discrete", "integrated", "cpu"])
def test_chunk_ceiling_is_8192_on_every_sycl_device(device):
    assert sycl.strata_platform_defaults(device=device, host=HOST).chunk_ceiling_tokens == 8192


@pytest.mark.parametrize("device", [DISCRETE, INTEGRATED, CPU_DEVICE], ids=["discrete", "integrated", "cpu"])
def test_free_vram_is_read_with_a_margin(device):
    trust = sycl.strata_platform_defaults(device=device, host=HOST).free_vram_trust
    assert 0.5 <= trust < 1.0
    assert trust < PlatformDefaults().free_vram_trust


def test_usm_host_pinning_has_no_driver_cap():
    d = sycl.strata_platform_defaults(device=DISCRETE, host=HOST)
    assert d.pin_cap_bytes is None


def test_cpu_share_is_off_when_the_device_is_the_cpu_and_on_for_a_gpu():
    on_cpu = sycl.strata_platform_defaults(device=CPU_DEVICE, host=HOST)
    on_gpu = sycl.strata_platform_defaults(device=DISCRETE, host=HOST)
    assert on_cpu.cpu_share_default is False and "CPU" in on_cpu.cpu_share_reason
    assert on_gpu.cpu_share_default is True


def test_defaults_name_their_source():
    assert sycl.strata_platform_defaults(device=DISCRETE, host=HOST).source == "sycl backend"


@pytest.mark.parametrize("other", ["cpu", "cuda", "rocm", "opencl", "sim"])
def test_hooks_answer_only_for_sycl_devices(other):
    dev = _device("gpu", backend=other)
    assert sycl.strata_platform_defaults(device=dev, host=HOST) is None
    assert sycl.strata_pinned_allocator(device=dev, budget=None) is None
    assert sycl.strata_device_memory(device=dev) is None
    assert sycl.strata_kernels(device=dev) is None


def test_scores_rank_discrete_over_integrated_over_cpu_device_over_the_cpu_backend():
    from strata_core.builtin.cpu import probe as cpu_probe
    discrete, integrated, cpu_dev = (sycl.score_for(d) for d in (DISCRETE, INTEGRATED, CPU_DEVICE))
    assert discrete > integrated > cpu_dev > cpu_probe().score
    assert discrete >= 100 and cpu_dev < 100


def test_backend_declares_its_install_line_and_api_version():
    from strata_core.api import API_VERSION
    (b,) = sycl.strata_backends()
    assert b.name == "sycl" and "strata-core[sycl]" in b.install_hint
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
    assert "dpctl" in reason
    assert hint == "pip install 'strata-core[sycl]'"


def test_device_hooks_without_dpctl_fail_with_the_install_line():
    code = textwrap.dedent("""
        import sys
        sys.modules["dpctl"] = None
        from strata_core.errors import StrataError
        from strata_core.api.facts import DeviceInfo
        import strata_sycl.backend as b
        dev = DeviceInfo(backend="sycl", name="x", vram_total_bytes=1, vram_free_bytes=1)
        try:
            b.strata_device_memory(device=dev)
        except StrataError as e:
            print("refused:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused:") and "strata-core[sycl]" in out.stdout


def test_pocl_devices_are_kept_out_of_sycl():
    from types import SimpleNamespace

    from strata_sycl.runtime import excluded

    def dev(platform):
        return SimpleNamespace(sycl_platform=SimpleNamespace(name=platform))

    assert excluded(dev("Portable Computing Language"))
    assert not excluded(dev("Intel(R) OpenCL"))
    assert not excluded(dev("Intel(R) OpenCL Graphics"))
    assert excluded(SimpleNamespace())  # a device whose platform cannot be named is not opened
