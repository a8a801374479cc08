"""How many bytes the process's heap grew between two points, measured from the allocators' own counters.

The soaks used to keep tracemalloc on for 10,000 requests, which made them 3-9x slower than the code they test (it
hooks every allocation). The allocators already count what they hold, read only at the two points:
- glibc's `mallinfo2()`: bytes in use in every malloc arena plus mmap'd chunks (numpy's data, lists' item arrays,
  anything over pymalloc's 512-byte limit, and C extensions' mallocs that tracemalloc never saw);
- pymalloc's blocks in use times their size class (`sys._debugmallocstats`): every small object.
Two caches hold freed memory that malloc still counts as in use: glibc's per-thread tcache (7 chunks a size up to
1 KiB) and numpy's data cache (7 buffers a size under 1 KiB). They fill as new sizes appear, which read as up to
250 KB of growth in a fresh process. Each reading fills both first, so between two readings they can only empty:
what a leak takes from them (at most 7 chunks a size) is missed, everything past that is counted.
Where `mallinfo2` is absent (not glibc, or older than 2.33) or the counters do not see a probe's allocations,
tracemalloc measures instead, as before.
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import sys
import tempfile
import tracemalloc

import numpy as np

#: pymalloc's largest block (SMALL_REQUEST_THRESHOLD): what one block in use may hold at most.
PYMALLOC_BLOCK_MAX_BYTES = 512


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2():
    """glibc's mallinfo2, or None where this C library has none."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


_MALLINFO2 = _mallinfo2()
_LIBC = ctypes.CDLL(None) if _MALLINFO2 is not None else None
if _LIBC is not None:
    _LIBC.malloc.restype, _LIBC.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    _LIBC.free.restype, _LIBC.free.argtypes = None, [ctypes.c_void_p]

#: what each cache keeps a size: glibc's tcache_count default, numpy's NCACHE; and the sizes they cover
CACHED_PER_SIZE = 7
TCACHE_MAX_BYTES = 1032
NUMPY_CACHE_MAX_BYTES = 1023
_CLASS_LINE = re.compile(r"^\s*\d+\s+(\d+)\s+\d+\s+(\d+)\s+\d+\s*$")


def pymalloc_bytes() -> int:
    """Bytes of pymalloc's blocks in use (size class times blocks), from sys._debugmallocstats' table."""
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        text = f.read().decode(errors="replace")
    total, rows = 0, 0
    for line in text.splitlines():
        m = _CLASS_LINE.match(line)
        if m:
            total += int(m.group(1)) * int(m.group(2))
            rows += 1
    if rows == 0:  # a table this parser does not know: every block at the largest size, never less than exact
        return sys.getallocatedblocks() * PYMALLOC_BLOCK_MAX_BYTES
    return total


def _fill_allocator_caches() -> None:
    """Fill glibc's tcache and numpy's data cache for every size they keep, so they cannot grow until the next reading."""
    # numpy's first: its misses are mallocs that would take chunks out of a tcache filled before
    arrays = [np.empty(n, np.uint8) for n in range(1, NUMPY_CACHE_MAX_BYTES + 1) for _ in range(CACHED_PER_SIZE)]
    del arrays
    held = [_LIBC.malloc(n) for n in range(16, TCACHE_MAX_BYTES + 1, 16) for _ in range(CACHED_PER_SIZE)]
    for ptr in held:
        _LIBC.free(ptr)


def allocator_bytes() -> int:
    """malloc's bytes in use (arenas and mmap'd chunks, its and numpy's caches full) plus pymalloc's blocks' bytes."""
    _fill_allocator_caches()
    info = _MALLINFO2()
    return int(info.uordblks) + int(info.hblkhd) + pymalloc_bytes()


#: what the self-check holds while it reads: small objects (pymalloc), one numpy buffer and one bytearray (malloc)
_PROBE_OBJECTS, _PROBE_BUFFER_BYTES = 20_000, 1 << 20


def counters_see_allocations() -> bool:
    """Whether allocator_bytes() grows by at least what a probe holds, in small objects and in big buffers alike.

    False where the counters are blind to where Python puts its objects (e.g. a build whose objects live in
    mimalloc, which mallinfo2 does not count, or pymalloc's table in another format): tracemalloc measures there.
    """
    if _MALLINFO2 is None:
        return False
    gc.collect()
    before = allocator_bytes()
    small = [float(i) + 0.5 for i in range(_PROBE_OBJECTS)]  # 24-byte floats: pymalloc's 32-byte class
    big = (np.ones(_PROBE_BUFFER_BYTES, np.uint8), bytearray(_PROBE_BUFFER_BYTES))
    held = allocator_bytes() - before
    del small, big
    return held >= _PROBE_OBJECTS * 24 + 2 * _PROBE_BUFFER_BYTES


class HeapGrowth:
    """Context: `mark()` at the warm-up point, `grown_bytes()` at the end; garbage is collected before each reading.

    The allocators' counters measure where they see a probe's allocations (counters_see_allocations), tracemalloc
    elsewhere; `how` says which ran, for failure messages.
    """

    def __init__(self):
        self._counters = counters_see_allocations()
        self.how = "allocator counters" if self._counters else "tracemalloc"
        self._mark_bytes: int | None = None

    def __enter__(self) -> "HeapGrowth":
        if not self._counters:
            tracemalloc.start()
        return self

    def __exit__(self, *exc) -> None:
        if not self._counters:
            tracemalloc.stop()

    def _bytes_now(self) -> int:
        gc.collect()
        return allocator_bytes() if self._counters else tracemalloc.get_traced_memory()[0]

    def mark(self) -> None:
        """Take the reading that growth is measured from."""
        self._mark_bytes = self._bytes_now()

    def grown_bytes(self) -> int:
        """Bytes held now beyond the mark (negative when the heap shrank)."""
        if self._mark_bytes is None:
            raise RuntimeError("HeapGrowth.grown_bytes before mark()")
        return self._bytes_now() - self._mark_bytes
