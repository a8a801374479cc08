"""The 'cuda' backend plugin: NVIDIA GPUs through cupy. Imports without cupy; says why it is unavailable instead.

Nothing here sets environment variables: cupy and the CUDA runtime need none from us.
"""

from __future__ import annotations

from strata_core import API_VERSION, __version__
from strata_core.backend_api import Backend
from strata_core.hookspecs import hookimpl

from .cupy_device import CupyDeviceMemory, CupyPinnedAllocator
from .kernels import CupyKernels
from .probe import INSTALL_HINT, NAME, probe
from .rules import nvidia_defaults

PINNED_KIND = "cuda-host"

BACKEND = Backend(name=NAME, vendor="nvidia", probe=probe, version=__version__, api_version=API_VERSION,
                  install_hint=INSTALL_HINT, description="NVIDIA GPUs through cupy (CUDA) and nvidia-ml-py")


@hookimpl
def strata_backends():
    """The cuda backend."""
    return [BACKEND]


@hookimpl
def strata_platform_defaults(device, host):
    """NVIDIA rules (rules.py) for a cuda device; None for any other."""
    if device.backend != NAME:
        return None
    return nvidia_defaults(device, host)


@hookimpl
def strata_pinned_allocator(device, budget):
    """cudaHostAlloc / cudaHostRegister through the budget, for a cuda device."""
    if device.backend != NAME:
        return None
    return CupyPinnedAllocator(budget, kind=PINNED_KIND)


@hookimpl
def strata_device_memory(device):
    """cupy arrays, streams and events on the cuda device."""
    if device.backend != NAME:
        return None
    return CupyDeviceMemory(device.index)


@hookimpl
def strata_kernels(device):
    """moe.cu through NVRTC plus cuBLAS, on the cuda device."""
    if device.backend != NAME:
        return None
    return CupyKernels(device.index, name="cuda-moe.cu", fast_grouped_ffn=True)
