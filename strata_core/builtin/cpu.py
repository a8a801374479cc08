"""The 'cpu' backend: numpy on the host, the reference every other backend is checked against."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from strata_core import __version__
from strata_core.api import API_VERSION, EXPERT_FORMATS
from strata_core.api.backend import Backend, DeviceSession, PinnedBudget, PinnedBuffer, ProbeResult
from strata_core.api.facts import DeviceCaps, DeviceInfo, DeviceType, HostInfo, PlatformDefaults
from strata_core.api.hookspecs import hookimpl
from strata_core.hostinfo import probe_host
from strata_core.reference.kernels import ReferenceKernels

NAME = "cpu"

#: The host computes with numpy: no copy engine, no mapped memory, no graphs; the reference's expert formats.
CPU_CAPS = DeviceCaps(async_copies=False, host_mapped_memory=False, graph_capture=False, peer_copies=False,
                      fused_layer_ops=False, expert_formats=EXPERT_FORMATS)


@dataclass(frozen=True)
class CpuDevice:
    """The host as a device: numpy arrays in host RAM, the reference kernels, budgeted (not page-locked) buffers."""

    info: DeviceInfo

    def platform_defaults(self, host: HostInfo) -> PlatformDefaults:
        """Host defaults: no VRAM reserve beyond the OS's, chunk ceiling 4096, the share is moot (all of it is CPU)."""
        return PlatformDefaults(chunk_ceiling_tokens=4096, vram_reserve_mib=1024, cpu_share_default=False,
                                cpu_share_reason="the device is the CPU", source="cpu backend")

    def open(self, plan: Any) -> DeviceSession:
        """A session over host memory whose pinned allocator charges the plan's budget."""
        budget = PinnedBudget.for_plan(plan)
        return DeviceSession(memory=HostMemory(), kernels=ReferenceKernels(), budget=budget,
                             pinned=HostPinnedAllocator(budget))


def host_device_info(host: HostInfo) -> DeviceInfo:
    """The DeviceInfo of the host as the cpu backend's device: its RAM stands for VRAM."""
    return DeviceInfo(backend=NAME, vendor="none", name=host.cpu.name, arch="host",
                      vram_total_bytes=host.ram_total_bytes, vram_free_bytes=host.ram_available_bytes,
                      driver_model="host", unified_memory=True, device_type=DeviceType.CPU, caps=CPU_CAPS)


def probe() -> ProbeResult:
    """Always available: the host itself is the device."""
    return ProbeResult(available=True, reason="numpy on the host", devices=(CpuDevice(host_device_info(probe_host())),),
                       score=10, version=f"numpy {np.__version__}")


def describe(info: DeviceInfo) -> CpuDevice:
    """A cpu device from a profile's facts (plans for that host; opening it computes on this one)."""
    return CpuDevice(replace(info, backend=NAME))


class HostMemory:
    """DeviceMemory whose 'device' is host RAM: arrays are numpy arrays, copies are synchronous."""

    def alloc(self, shape, dtype):
        """A numpy array, or None when the host has no room."""
        try:
            return np.empty(shape, dtype=dtype)
        except MemoryError:
            return None

    def free(self, arr):
        """Nothing to do: numpy frees on the last reference."""

    def upload(self, dst, src, stream=None):
        """Copy into dst."""
        np.copyto(dst, np.asarray(src).reshape(dst.shape), casting="same_kind")

    def download(self, src, stream=None):
        """A host copy of src."""
        return np.array(src, copy=True)

    def to_device(self, src):
        """A copy of src."""
        return np.array(src, copy=True)

    def new_stream(self):
        """Streams are nominal on the host."""
        return None

    def new_event(self):
        """Events are nominal on the host."""
        return None

    def record(self, event, stream):
        """Nothing to record: work is synchronous."""

    def wait(self, stream, event):
        """Nothing to wait for: work is synchronous."""

    def synchronize(self, stream=None):
        """Nothing to wait for: work is synchronous."""

    def mem_info(self):
        """(available, total) host RAM."""
        h = probe_host()
        return h.ram_available_bytes, h.ram_total_bytes


class HostPinnedAllocator:
    """Host memory the budget accounts for; the cpu backend has nothing to page-lock for a copy engine."""

    kind = "numpy"

    def __init__(self, budget: PinnedBudget):
        self.budget = budget

    def alloc(self, nbytes, from_floor=False):
        """A budgeted numpy buffer, or None when the budget or the host says no."""
        if not self.budget.take(nbytes, from_floor=from_floor):
            return None
        try:
            return PinnedBuffer(array=np.empty(int(nbytes), dtype=np.uint8), nbytes=int(nbytes), kind="alloc",
                                from_floor=from_floor)
        except MemoryError:
            self.budget.give(nbytes)
            return None

    def register(self, array, from_floor=False):
        """Account for existing memory in the budget, or None when it does not fit."""
        nbytes = int(array.nbytes)
        if not self.budget.take(nbytes, from_floor=from_floor):
            return None
        return PinnedBuffer(array=array.reshape(-1).view(np.uint8), nbytes=nbytes, kind="register",
                            from_floor=from_floor)

    def free(self, buf):
        """Give the buffer's bytes back (idempotent)."""
        if not buf.freed:
            buf.freed = True
            self.budget.give(buf.nbytes)


BACKEND = Backend(name=NAME, vendor="none", probe=probe, version=__version__, api_version=API_VERSION,
                  install_hint="", description="numpy on the host (the reference)", describe=describe)


@hookimpl
def strata_backends():
    """The cpu backend."""
    return [BACKEND]
