"""A DeviceMemory wrapper that counts what the runtime asks the device for, so a run can report it beside its plan."""

from __future__ import annotations

from typing import Any


class CountingMemory:
    """Forwards to a backend's DeviceMemory; counts live and peak bytes of the arrays the runtime allocated."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.live_bytes = 0
        self.peak_bytes = 0
        self.bytes_uploaded = 0
        self._sizes: dict[int, int] = {}

    def _count(self, arr: Any) -> Any:
        if arr is not None:
            n = int(arr.nbytes)
            self._sizes[id(arr)] = n
            self.live_bytes += n
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return arr

    def alloc(self, shape, dtype):
        """A device array through the backend, counted; None when the device has no room."""
        return self._count(self.inner.alloc(shape, dtype))

    def to_device(self, src):
        """Allocate and fill through the backend, counted."""
        self.bytes_uploaded += int(src.nbytes)
        return self._count(self.inner.to_device(src))

    def free(self, arr):
        """Release an array this wrapper handed out."""
        n = self._sizes.pop(id(arr), None)
        if n is not None:
            self.live_bytes -= n
            self.inner.free(arr)

    def upload(self, dst, src, stream=None):
        """Copy host -> device."""
        self.bytes_uploaded += int(dst.nbytes)
        self.inner.upload(dst, src, stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
