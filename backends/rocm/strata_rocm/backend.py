"""The 'rocm' backend plugin: AMD GPUs through cupy's ROCm build. Imports without cupy-rocm; says why not instead.

cupy offers the same runtime API on its CUDA and ROCm builds, so the memory classes and the KernelSet are the ones
in strata_cuda (moe.cu is hipified and compiled by hiprtc through cupy.RawModule; the GEMMs run in hipBLAS).
Nothing here sets environment variables: cupy's ROCm build needs none from us.
"""

from __future__ import annotations

from strata_core import API_VERSION, __version__
from strata_core.backend_api import Backend
from strata_core.hookspecs import hookimpl
from strata_cuda.cupy_device import CupyDeviceMemory, CupyPinnedAllocator
from strata_cuda.kernels import CupyKernels

from .probe import INSTALL_HINT, NAME, probe
from .rules import amd_defaults

PINNED_KIND = "hip-host"

BACKEND = Backend(name=NAME, vendor="amd", probe=probe, version=__version__, api_version=API_VERSION,
                  install_hint=INSTALL_HINT, description="AMD GPUs through cupy's ROCm build; gfx12 rules")


@hookimpl
def strata_backends():
    """The rocm backend."""
    return [BACKEND]


@hookimpl
def strata_platform_defaults(device, host):
    """AMD rules (rules.py: gfx12 16384 with the host borrow, others 8192) for a rocm device; None for any other."""
    if device.backend != NAME:
        return None
    return amd_defaults(device, host)


@hookimpl
def strata_pinned_allocator(device, budget):
    """hipHostMalloc / hipHostRegister (through cupy's runtime) through the budget, for a rocm device."""
    if device.backend != NAME:
        return None
    return CupyPinnedAllocator(budget, kind=PINNED_KIND)


@hookimpl
def strata_device_memory(device):
    """cupy arrays, streams and events on the rocm device."""
    if device.backend != NAME:
        return None
    return CupyDeviceMemory(device.index)


@hookimpl
def strata_kernels(device):
    """moe.cu through hiprtc plus hipBLAS, on the rocm device."""
    if device.backend != NAME:
        return None
    return CupyKernels(device.index, name="rocm-moe.cu")
