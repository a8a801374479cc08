"""FastMoE.pull: small tables and device-to-device admissions copied by the SMs, not a copy engine.

The bytes land exactly (host staging mapped for the device, device to device, whole words and 16-byte units), and a
pulled table lands while the copy engine is still busy with a large host copy queued before it on another stream,
which is what the prefill needs (its GEMM pointer tables must not wait for the ring's copies). Skipped with "no CUDA
device" where there is none.
"""

from __future__ import annotations

import numpy as np
import pytest

from .test_fast_paths import _cuda_device_count, cp, fast_moes  # noqa: F401 (cp is a fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_device_count() == 0, reason="no CUDA device")]


@pytest.fixture(scope="module")
def moe(cp):
    """One FastMoE (its pull kernels and page-locked staging)."""
    return next(iter(fast_moes(["classes", "loop"]).values()))


@pytest.mark.parametrize("nbytes", [4, 12, 16, 4096 + 4, 1 << 20])
def test_pull_from_mapped_host_staging_lands_the_bytes(cp, moe, nbytes):
    mem = moe._page_locked(nbytes + 16)
    host = np.frombuffer(mem, dtype=np.uint8, count=nbytes + 16)
    host[:] = np.random.default_rng(nbytes).integers(0, 256, host.size, dtype=np.uint8)
    dst = cp.zeros(nbytes + 16, dtype=cp.uint8)
    base = int(host.ctypes.data)
    off = 4 if nbytes % 16 else 0  # an unaligned source takes the word kernel
    assert moe.pull(int(dst.data.ptr), base + off, nbytes, host_base=base)
    cp.cuda.Device().synchronize()
    got = dst.get()
    assert np.array_equal(got[:nbytes], host[off:off + nbytes])
    assert not got[nbytes:].any(), "the pull wrote past its bytes"


def test_pull_device_to_device_and_refusals(cp, moe):
    src = cp.arange(1 << 18, dtype=cp.int32)
    dst = cp.zeros_like(src)
    assert moe.pull(int(dst.data.ptr), int(src.data.ptr), src.nbytes)
    cp.cuda.Device().synchronize()
    assert bool((dst == src).all())
    assert not moe.pull(int(dst.data.ptr), int(src.data.ptr), 6), "not whole words: the caller copies instead"
    pageable = np.ones(16, dtype=np.int32)
    assert not moe.pull(int(dst.data.ptr), int(pageable.ctypes.data), 64, host_base=int(pageable.ctypes.data)), \
        "pageable memory is not mapped for the device: refused, nothing queued"


def test_a_pulled_table_does_not_wait_for_the_copy_engine(cp, moe):
    n = 1 << 30  # ~19 ms over the link: long enough that the table's kernel runs inside it
    big_host = cp.cuda.alloc_pinned_memory(n)
    big_dev = cp.cuda.alloc(n)
    table = np.frombuffer(moe._page_locked(4096), dtype=np.int64, count=512)
    table[:] = np.arange(512)
    out = cp.zeros(512, dtype=cp.int64)
    copy_stream, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    cp.cuda.runtime.memcpyAsync(big_dev.ptr, big_host.ptr, n, 1, copy_stream.ptr)
    copied = cp.cuda.Event()
    copied.record(copy_stream)
    assert moe.pull(int(out.data.ptr), int(table.ctypes.data), table.nbytes, other, host_base=int(table.ctypes.data))
    pulled = cp.cuda.Event()
    pulled.record(other)
    pulled.synchronize()
    assert not copied.done, "the large copy had already landed: this test shows nothing (make it larger)"
    copied.synchronize()
    assert bool((out == cp.arange(512)).all())
