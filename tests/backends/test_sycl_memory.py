"""The sycl backend's device memory, streams, events and pinned allocator, run for real on the first SYCL device."""

from __future__ import annotations

import os

import numpy as np
import pytest

from strata_core.api import Device, DeviceMemory, DeviceSession, KernelSet, PinnedAllocator, PinnedBudget

pytest.importorskip("dpctl", reason="the [sycl] extra (dpctl) is not installed")

from strata_sycl import backend as sycl  # noqa: E402
from sycl_fixtures import device, mem, plan, session  # noqa: E402,F401 (fixtures)
from strata_sycl import runtime  # noqa: E402

MIB = 1 << 20


def pinned_of(device, budget: PinnedBudget):
    """The pinned allocator a session of `device` gets, charging `budget`."""
    return sycl._pinned(device.open(plan(budget.limit_bytes, budget.floor_bytes)).memory.session, budget)


def test_probe_reports_a_device_with_memory_and_a_score_above_the_cpu_backend(device):
    r = sycl.BACKEND.probe()
    assert r.version.startswith("dpctl ")
    info = device.info
    assert isinstance(device, Device) and info.backend == "sycl" and info.vram_total_bytes > 0
    assert 0 < info.vram_free_bytes <= info.vram_total_bytes
    assert r.score == sycl.score_for(info) and r.score > 10


def test_the_session_satisfies_the_protocols_and_charges_the_plans_budget(session):
    assert isinstance(session, DeviceSession)
    assert isinstance(session.memory, DeviceMemory) and isinstance(session.kernels, KernelSet)
    assert isinstance(session.pinned, PinnedAllocator) and session.pinned.kind == "usm-host"
    assert (session.budget.limit_bytes, session.budget.floor_bytes) == (64 * MIB, 8 * MIB)
    assert session.pinned.budget is session.budget and session.layer_ops is None
    # kernels and memory share one allocation count (the device's one vendor session)
    assert session.kernels.memory is session.memory


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8, np.int32, np.uint8])
def test_upload_download_round_trip(mem, dtype):
    host = (np.random.default_rng(1).standard_normal((7, 9)) * 50).astype(dtype)
    arr = mem.alloc(host.shape, dtype)
    assert arr.shape == (7, 9) and arr.dtype == np.dtype(dtype) and arr.nbytes == host.nbytes
    mem.upload(arr, host)
    np.testing.assert_array_equal(mem.download(arr), host)
    mem.free(arr)


def test_alloc_beyond_the_device_returns_none(mem, device):
    assert mem.alloc((device.info.vram_total_bytes + 1,), np.uint8) is None


def test_mem_info_counts_allocations_and_frees(mem):
    free0, total = mem.mem_info()
    arr = mem.alloc((4 * MIB,), np.uint8)
    assert mem.mem_info() == (free0 - 4 * MIB, total)
    mem.free(arr)
    mem.free(arr)  # idempotent
    assert mem.mem_info() == (free0, total)


def test_dropped_arrays_leave_the_count(mem):
    free0, _ = mem.mem_info()
    arr = mem.alloc((MIB,), np.uint8)
    del arr
    assert mem.mem_info()[0] == free0


def test_upload_size_mismatch_is_refused(mem):
    arr = mem.alloc((4,), np.float32)
    with pytest.raises(ValueError, match="5 elements"):
        mem.upload(arr, np.zeros(5, np.float32))


def test_pinned_upload_on_a_stream_then_event_orders_another_stream(device, mem):
    budget = PinnedBudget(64 * MIB)
    pinned = pinned_of(device, budget)
    n = 1 << 20
    buf = pinned.alloc(n * 4)
    src = buf.array.view(np.float32)
    src[:] = np.arange(n, dtype=np.float32)
    dst = mem.alloc((n,), np.float32)
    copy, compute = mem.new_stream(), mem.new_stream()
    ev = mem.new_event()
    mem.upload(dst, src, stream=copy)
    mem.record(ev, copy)
    mem.wait(compute, ev)
    np.testing.assert_array_equal(mem.download(dst, stream=compute), np.arange(n, dtype=np.float32))
    assert ev.query_done()
    mem.synchronize()
    pinned.free(buf)
    assert budget.used_bytes == 0


def test_waiting_on_an_unrecorded_event_leaves_the_stream_usable(mem):
    s = mem.new_stream()
    ev = mem.new_event()
    assert ev.query_done()  # nothing recorded: nothing to wait for
    mem.wait(s, ev)
    arr = mem.alloc((5,), np.int32)
    mem.upload(arr, np.arange(5, dtype=np.int32), stream=s)
    mem.synchronize(s)
    np.testing.assert_array_equal(mem.download(arr, stream=s), np.arange(5))


def test_pinned_alloc_goes_through_the_budget(device):
    budget = PinnedBudget(limit_bytes=8 * MIB, floor_bytes=2 * MIB)
    p = pinned_of(device, budget)
    assert p.kind == "usm-host"
    a = p.alloc(6 * MIB)
    assert a is not None and a.nbytes == 6 * MIB and a.array.nbytes == 6 * MIB and budget.used_bytes == 6 * MIB
    a.array[:] = 3  # writable host memory
    assert p.alloc(1 * MIB) is None  # the arena may not eat into the floor
    f = p.alloc(2 * MIB, from_floor=True)
    assert f is not None and budget.used_bytes == 8 * MIB
    assert p.alloc(1, from_floor=True) is None
    p.free(a)
    p.free(a)  # idempotent
    p.free(f)
    assert budget.used_bytes == 0


def test_pinned_alloc_the_runtime_refuses_returns_none_and_gives_the_budget_back(device):
    budget = PinnedBudget(limit_bytes=1 << 62)
    p = pinned_of(device, budget)
    assert p.alloc(1 << 55) is None
    assert budget.used_bytes == 0


def test_register_on_a_cpu_device_accounts_in_place(device):
    budget = PinnedBudget(limit_bytes=8 * MIB, floor_bytes=MIB)
    p = pinned_of(device, budget)
    assert p.host_device == (device.info.arch == "cpu")
    host = np.arange(MIB // 4, dtype=np.float32)
    buf = p.register(host)
    if not p.host_device:
        assert buf is None and budget.used_bytes == 0
        return
    assert buf is not None and buf.kind == "register" and budget.used_bytes == host.nbytes
    buf.array.view(np.float32)[0] = -5.0  # in place: the caller's array sees the write
    assert host[0] == -5.0
    assert p.register(np.zeros(8 * MIB, np.uint8)) is None  # over the arena's share of the budget
    assert p.register(host[::2]) is None  # not contiguous: cannot be one registration
    p.free(buf)
    p.free(buf)
    assert budget.used_bytes == 0


def test_register_is_refused_on_a_gpu_device(device, mem):
    # dpctl cannot page-lock memory in place; only the device type decides, so a GPU session is faked by its type.
    from types import SimpleNamespace

    from strata_sycl.memory import UsmPinnedAllocator
    gpu = SimpleNamespace(device_type=SimpleNamespace(name="gpu"), has_aspect_usm_host_allocations=True)
    p = UsmPinnedAllocator(SimpleNamespace(device=gpu, dpctl=mem.session.dpctl, queue=mem.session.queue),
                           PinnedBudget(8 * MIB))
    assert p.register(np.zeros(1024, np.uint8)) is None
    assert p.budget.used_bytes == 0
    buf = p.alloc(MIB)  # USM host allocations still work
    assert buf is not None and p.budget.used_bytes == MIB
    p.free(buf)


def test_runtime_env_is_set_only_when_unset(monkeypatch):
    lib = runtime.find_intel_opencl_runtime()
    assert lib is not None and lib.is_file()  # the [sycl] extra installed intel-opencl-rt
    monkeypatch.delenv("OCL_ICD_FILENAMES", raising=False)
    runtime._prepare_runtime_env()
    assert os.environ["OCL_ICD_FILENAMES"] == str(lib)
    monkeypatch.setenv("OCL_ICD_FILENAMES", "/somewhere/else.so")
    runtime._prepare_runtime_env()
    assert os.environ["OCL_ICD_FILENAMES"] == "/somewhere/else.so"


def test_strata_backends_lists_sycl_available():
    from strata_core.registry import load_plugins
    host = load_plugins()
    status = {s.name: s for s in host.statuses()}["sycl"]
    assert status.available, status.reason
    assert status.devices and status.score > 10


def test_slot_views_upload_into_their_rows_of_the_pool(mem):
    pool = mem.to_device(np.zeros((4, 3, 8), np.float16))
    row = np.arange(24, dtype=np.float16).reshape(3, 8)
    view = pool[2]
    assert view.shape == (3, 8) and view.nbytes == row.nbytes
    mem.upload(view, row)
    mem.upload(pool[-1], row + 1)
    back = mem.download(pool)
    np.testing.assert_array_equal(back[2], row)
    np.testing.assert_array_equal(back[3], row + 1)
    assert not back[:2].any()
    np.testing.assert_array_equal(mem.download(pool[2:4]), back[2:4])
    mem.free(view)  # a view frees nothing: the pool stays readable
    np.testing.assert_array_equal(mem.download(pool[2]), row)


def test_view_indexing_refuses_what_it_cannot_express(mem):
    arr = mem.to_device(np.zeros((4, 2), np.float32))
    with pytest.raises(IndexError):
        arr[4]
    with pytest.raises(IndexError):
        arr[::2]
    with pytest.raises(IndexError):
        arr[1, 1]


def test_kernels_run_on_views(session, mem):
    k = session.kernels
    x = np.random.default_rng(3).standard_normal((5, 16)).astype(np.float32)
    w = np.random.default_rng(4).standard_normal((7, 16)).astype(np.float32)
    xd = mem.to_device(x)
    out = mem.download(k.linear(xd[1:4], mem.to_device(w)))
    np.testing.assert_allclose(out, x[1:4] @ w.T, rtol=1e-5, atol=1e-5)


def test_to_device_without_room_returns_none(mem, device, monkeypatch):
    monkeypatch.setattr(mem, "alloc", lambda shape, dtype: None)
    assert mem.to_device(np.zeros(4, np.float32)) is None


def test_a_device_without_usm_host_memory_pins_nothing(mem):
    from types import SimpleNamespace

    from strata_sycl.memory import UsmPinnedAllocator
    dev = SimpleNamespace(device_type=SimpleNamespace(name="gpu"), has_aspect_usm_host_allocations=False)
    p = UsmPinnedAllocator(SimpleNamespace(device=dev, dpctl=mem.session.dpctl, queue=mem.session.queue),
                           PinnedBudget(8 * MIB))
    assert p.alloc(MIB) is None and p.register(np.zeros(64, np.uint8)) is None
    assert p.budget.used_bytes == 0
