"""strata_core.kits.opencl.driver without any vendor library: a numpy-backed fake backend supplies the primitives."""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from strata_core.api import (Device, DeviceInfo, DeviceSession, DeviceType, HostInfo, PinnedBudget, PlatformDefaults,
                             ProbeResult)
from strata_core.errors import BadInput
from strata_core.kits.opencl import driver as drv

MIB = 1 << 20


class FakeArray(drv.DeviceArray):
    """A device array whose handle is a flat numpy byte buffer; a view keeps an offset into it."""

    __slots__ = ("offset",)

    def __init__(self, shape, dtype, handle, offset=0, owner=None):
        super().__init__(shape, dtype, handle, owner=owner)
        self.offset = offset

    def _view(self, shape, offset_bytes, nbytes, dtype):
        return FakeArray(shape, dtype, self.handle, self.offset + offset_bytes, owner=self)


class FakeEvent(drv.EventSlot):
    """Done as soon as recorded."""

    __slots__ = ()

    def _complete(self, event):
        return event == "done"


class FakeSession(drv.QueueSession):
    """Queues are lists of what waited on them."""

    def _new_queue(self):
        return []

    def wait_queue(self, queue):
        """Record the wait."""
        queue.append("waited")


class FakeMemory(drv.OpenClDeviceMemory):
    """Copies are numpy byte copies."""

    array_type = FakeArray
    event_type = FakeEvent

    def _allocate(self, nbytes):
        return np.zeros(nbytes, np.uint8)

    def _copy_in(self, queue, dst, host):
        dst.handle[dst.offset:dst.offset + dst.nbytes] = host.reshape(-1).view(np.uint8)

    def _copy_out(self, queue, out, src):
        out.reshape(-1).view(np.uint8)[:] = src.handle[src.offset:src.offset + src.nbytes]

    def _marker(self, queue):
        return "done"

    def _barrier(self, queue, event):
        queue.append(("barrier", event))


class FakeKernels(drv.OpenClKernels):
    """Records every launch instead of running it."""

    label = "fake"
    memory_type = FakeMemory

    def __init__(self, session, memory=None):
        self.launches = []
        super().__init__(session, memory)

    def _build(self, session, source):
        assert "__kernel" in source
        return "program"

    def _get_kernel(self, name):
        return name

    def _buffer_arg(self, a):
        return ("buf", a.shape)

    def _offset_arg(self, a):
        return ("offset", a.offset // a.dtype.itemsize)

    def _local_arg(self, floats):
        return ("local", floats)

    def _submit(self, name, global_size, local_size, args, keep):
        self.launches.append((self._kernel(name), tuple(global_size), local_size, args))


def _session(wg=256, mem=64 * MIB):
    dev = SimpleNamespace(max_mem_alloc_size=mem, global_mem_size=mem, max_work_group_size=wg)
    return FakeSession(device=dev, context=None, queue=[])


def test_the_module_imports_no_vendor_library_and_reads_no_environment():
    tree = ast.parse(Path(drv.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"dpctl", "pyopencl", "os", "cupy"}
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not names & {"environ", "getenv", "environb"}


def test_alloc_counts_bytes_and_dropping_or_freeing_gives_them_back():
    s = _session()
    m = FakeMemory(s)
    a = m.alloc((4, 8), np.float32)
    assert isinstance(a, FakeArray) and s.allocated_bytes == 128
    m.free(a[1:3])  # a view frees nothing
    assert s.allocated_bytes == 128 and a.handle is not None
    m.free(a)
    m.free(a)
    assert s.allocated_bytes == 0 and a.handle is None
    b = m.alloc(16, np.int32)
    del b
    assert s.allocated_bytes == 0
    full = m.alloc((64 * MIB,), np.uint8)
    assert full is not None and m.alloc((1,), np.uint8) is None  # over the device total: None, never an exception


def test_view_carves_typed_arrays_from_a_byte_region_and_refuses_what_is_outside_it():
    m = FakeMemory(_session())
    region = m.alloc((1024,), np.uint8)
    v = m.view(region, 256, (4, 8), np.float32)
    assert (v.shape, v.dtype, v.offset, v.owner) == ((4, 8), np.float32, 256, region) and v.nbytes == 128
    m.upload(v, np.arange(32, dtype=np.float32).reshape(4, 8))
    np.testing.assert_array_equal(m.download(m.view(region, 256 + 32, (8,), np.float32)), np.arange(8, 16))
    np.testing.assert_array_equal(m.download(v[1]), np.arange(8, 16))  # a view of a view: its rows
    b = m.as_bytes(v[2:4])
    assert (b.shape, b.dtype, b.offset) == ((64,), np.uint8, 256 + 64)
    for off, shape, dt in [(1000, (8,), np.float32), (-4, (1,), np.float32), (2, (1,), np.float32)]:
        with pytest.raises(ValueError):
            m.view(region, off, shape, dt)
    m.free(v)  # a view frees nothing
    assert region.handle is not None and m.peak_bytes() == 1024


def test_the_ledger_peak_sees_every_allocation_kernel_temporaries_included():
    s = _session()
    m = FakeMemory(s)
    a = m.alloc((100,), np.uint8)
    b = m.alloc((50,), np.uint8)
    m.free(b)
    assert (m.ledger.live_bytes, m.peak_bytes()) == (100, 150)
    k = FakeKernels(s, m)
    r = k.linear(np.ones((3, 5), np.float32), np.ones((7, 5), np.float32))  # its uploads and result: allocated
    assert m.peak_bytes() == 100 + 60 + 140 + 84
    del a  # dropped without free(): it leaves the ledger as the uploads did after the call
    assert m.ledger.live_bytes == r.nbytes == 84


@pytest.mark.parametrize("tiled", [True, False])
def test_kernels_given_out_write_there_and_allocate_nothing(tiled):
    from strata_core.reference.kernels import ExpertPool
    k = FakeKernels(_session(wg=256 if tiled else 64))
    m = k.memory
    x, rows = m.to_device(np.ones((4, 32), np.float32)), m.to_device(np.array([1, 0, 3], np.int32))
    w = m.to_device(np.ones((6, 32), np.float16))
    pool = ExpertPool("f16", {"w_gate_up": m.to_device(np.ones((2, 64, 32), np.float16)),
                              "w_down": m.to_device(np.ones((2, 32, 32), np.float16))})
    offs, slots = m.to_device(np.array([0, 2, 3], np.int32)), m.to_device(np.array([1, 0], np.int32))
    qs, d = m.to_device(np.ones((2, 32), np.int8)), m.to_device(np.ones((2, 1), np.float16))
    region = m.alloc((4096,), np.uint8)
    carve = iter(range(0, 4096, 256))

    def out(shape, dtype):
        return m.view(region, next(carve), shape, dtype)

    peak = m.peak_bytes()
    results = [k.rmsnorm(x, w[0], out=(o1 := out((4, 32), np.float32))) is o1,
               k.linear(x, w, out=(o2 := out((4, 6), np.float32))) is o2,
               k.route_topk(o2, 2, out=(o3 := (out((4, 2), np.int32), out((4, 2), np.float32)))) == o3,
               k.gather(x, rows, out=(o4 := out((3, 32), np.float32))) is o4,
               k.dequantize_q8_0(qs, d, out=(o5 := out((2, 32), np.float16))) is o5]
    if tiled:
        results.append(k.moe_grouped_ffn(o4, offs, slots, pool, out=(o6 := out((3, 32), np.float32))) is o6)
        name, gs, ls, args = k.launches[-1]
        # 1 tile of rows + 2 groups: an upper bound on the tiles; no act buffer among the arguments
        assert (name, gs, ls) == ("ffn_f16_tiled", (16, 48), (16, 16)) and args[-2:] == [("buf", (3, 32)),
                                                                                       ("offset", o6.offset // 4)]
    assert all(results) and m.peak_bytes() == peak, "a kernel given its outputs allocated device memory"
    with pytest.raises(ValueError):
        k.linear(x, w, out=out((4, 7), np.float32))
    with pytest.raises(TypeError):
        k.linear(x, w, out=np.zeros((4, 6), np.float32))


def test_views_upload_download_and_mem_info():
    s = _session()
    m = FakeMemory(s)
    a = m.to_device(np.arange(12, dtype=np.float32).reshape(4, 3))
    np.testing.assert_array_equal(m.download(a[2]), [6, 7, 8])
    m.upload(a[1:3], np.full((2, 3), 5, np.float32))
    np.testing.assert_array_equal(m.download(a)[1:3], 5)
    assert a[-1].shape == (3,) and a[3:1].shape == (0, 3) and len(a) == 4
    with pytest.raises(IndexError):
        a[::2]
    with pytest.raises(ValueError):
        m.upload(a, np.zeros(5, np.float32))
    assert m.mem_info() == (64 * MIB - 48, 64 * MIB)
    assert "view" in repr(a[0]) and "FakeArray" in repr(a)


def test_events_streams_and_synchronize():
    s = _session()
    m = FakeMemory(s)
    ev = m.new_event()
    assert ev.query_done()  # nothing recorded
    st = m.new_stream()
    m.record(ev, st)
    m.wait(None, ev)
    assert ev.query_done() and ("barrier", "done") in s.queue
    m.synchronize()
    assert s.queue[-1] == "waited" and st.queue[-1] == "waited"


def test_pinned_allocator_charges_the_budget_and_refuses_without_raising():
    class Pinned(drv.OpenClPinnedAllocator):
        def _allocate_pinned(self, nbytes):
            if nbytes > MIB:
                raise RuntimeError("the runtime says no")
            return np.zeros(nbytes, np.uint8), "handle"

    budget = PinnedBudget(8 * MIB)
    p = Pinned(_session(), budget, allocates=True, registers=False)
    buf = p.alloc(MIB)
    assert buf is not None and budget.used_bytes == MIB
    assert p.alloc(2 * MIB) is None and budget.used_bytes == MIB
    assert p.register(np.zeros(64, np.uint8)) is None
    p.free(buf)
    p.free(buf)
    assert budget.used_bytes == 0 and buf.handle is None
    r = Pinned(_session(), budget, allocates=False, registers=True)
    reg = r.register(np.zeros(64, np.uint8))
    assert r.alloc(64) is None and reg is not None and budget.used_bytes == 64
    r.free(reg)
    assert budget.used_bytes == 0


@pytest.mark.parametrize("wg, tiled", [(256, True), (64, False)])
def test_launch_geometry_follows_the_work_group_size(wg, tiled):
    k = FakeKernels(_session(wg=wg))
    assert k._tiled is tiled and k._reduce_local == min(64, wg)
    out = k.linear(np.ones((3, 5), np.float32), np.ones((7, 5), np.float32))
    name, gs, ls, _ = k.launches[-1]
    if tiled:
        assert (name, gs, ls) == ("linear_w_f32", (16, 16), (16, 16))
    else:
        assert (name, gs, ls) == ("linear_plain_w_f32", (7, 3), None)
    assert out.shape == (3, 7)
    k.rmsnorm(np.ones((2, 4), np.float32), np.ones(4, np.float16))
    name, gs, ls, args = k.launches[-1]
    assert name == "rmsnorm_w_f16" and gs == (2 * k._reduce_local,) and args[-1] == ("local", k._reduce_local)


def test_scatter_add_is_one_pass_without_scratch_and_arguments_are_checked():
    k = FakeKernels(_session())
    m = k.memory
    out, rows, y, scale = (m.to_device(np.zeros((4, 2), np.float32)), m.to_device(np.array([0, 2], np.int32)),
                           m.to_device(np.ones((2, 2), np.float32)), m.to_device(np.ones(2, np.float32)))
    peak = m.peak_bytes()
    k.scatter_add(out, rows, y, scale)
    assert [(n, gs) for n, gs, *_ in k.launches] == [("scatter_add_cols", (2, 4))]  # 2 columns x 4 row classes
    assert m.peak_bytes() == peak, "scatter_add allocated device memory"
    with pytest.raises(ValueError):
        k.route_topk(np.zeros((2, 3), np.float32), 4)
    with pytest.raises(TypeError):
        k.gather(np.zeros((2, 3), np.float64), np.zeros(1, np.int32))
    with pytest.raises(TypeError):
        k._launch("x", (1,), None, ["not an argument"])


def test_the_program_is_built_once_per_session():
    s = _session()
    FakeKernels(s)
    s.program = "prebuilt"
    assert FakeKernels(s)._program == "prebuilt"


def test_find_intel_opencl_runtime_looks_under_the_prefix_it_is_given(tmp_path, monkeypatch):
    monkeypatch.setattr(drv.md, "files", lambda name: (_ for _ in ()).throw(drv.md.PackageNotFoundError(name)))
    assert drv.find_intel_opencl_runtime(tmp_path) is None
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libintelocl.so").write_bytes(b"")
    assert drv.find_intel_opencl_runtime(tmp_path) == tmp_path / "lib" / "libintelocl.so"


def test_device_score_and_types():
    dev = DeviceInfo(backend="fake", name="d", vram_total_bytes=1, vram_free_bytes=1, vendor="v", arch="gpu",
                     driver_model="linux", index=0, unified_memory=False)
    assert drv.device_score(dev, 4, 3, 2, 1) == 4
    assert drv.device_type_of("gpu", False) is DeviceType.GPU
    assert drv.device_type_of("gpu", True) is DeviceType.INTEGRATED_GPU
    assert drv.device_type_of("cpu", True) is DeviceType.CPU
    assert drv.device_type_of("accelerator", False) is DeviceType.ACCELERATOR


FAKE_INFO = DeviceInfo(backend="fake", name="d", vram_total_bytes=1 << 30, vram_free_bytes=1 << 30, arch="gpu")


def _fake_backend(probe=None, pinned=lambda session, budget: None, sessions=None):
    """A MoeClBackend over the numpy fakes above: one device, FakeMemory and FakeKernels."""
    sessions = [] if sessions is None else sessions
    return drv.MoeClBackend(
        name="fake", vendor="v", version="1", api_version="2.0", install_hint="pip install fake",
        description="a fake", probe=probe or (lambda: ProbeResult(available=True, reason="one", devices=(FAKE_INFO,),
                                                                    score=5)),
        defaults=lambda device, host: PlatformDefaults(chunk_ceiling_tokens=1024 if device.present else 512,
                                                       source="fake"),
        session_of=lambda info: sessions.append(info) or _session(), package=__name__,
        device_memory=f"{__name__}:FakeMemory", kernels=f"{__name__}:FakeKernels", pinned=pinned)


def _plan(limit_bytes=8 * MIB, floor_bytes=MIB):
    return SimpleNamespace(pinned=SimpleNamespace(limit_bytes=limit_bytes, floor_bytes=floor_bytes))


HOST = HostInfo(os="linux", ram_total_bytes=1 << 34, ram_available_bytes=1 << 33)


def test_the_backend_probe_wraps_each_fact_into_a_device():
    kit = _fake_backend()
    assert kit.strata_backends() == [kit.backend] and kit.backend.api_version == "2.0"
    r = kit.backend.probe()
    (d,) = r.devices
    assert isinstance(d, Device) and d.info == FAKE_INFO and (r.score, r.reason) == (5, "one")
    assert d.platform_defaults(HOST).chunk_ceiling_tokens == 1024


def test_a_probe_that_raises_is_unavailable_with_the_error():
    kit = _fake_backend(probe=lambda: 1 / 0)
    r = kit.backend.probe()
    assert r.available is False and "ZeroDivisionError" in r.reason


def test_open_builds_memory_and_kernels_on_one_session_charging_the_plans_budget():
    sessions, budgets = [], []
    kit = _fake_backend(pinned=lambda session, budget: budgets.append(budget) or "allocator", sessions=sessions)
    (d,) = kit.backend.probe().devices
    s = d.open(_plan(8 * MIB, MIB))
    assert isinstance(s, DeviceSession) and sessions == [FAKE_INFO]
    assert isinstance(s.memory, FakeMemory) and isinstance(s.kernels, FakeKernels)
    assert s.kernels.memory is s.memory and s.memory.session is s.kernels.session
    assert (s.budget.limit_bytes, s.budget.floor_bytes) == (8 * MIB, MIB) and budgets == [s.budget]
    assert s.pinned == "allocator" and s.layer_ops is None
    s.close()
    assert s.memory.session.queue == ["waited"]  # closing waits for the session's queues


def test_a_device_without_page_locked_memory_opens_with_pinned_none():
    (d,) = _fake_backend().backend.probe().devices
    assert d.open(_plan()).pinned is None


def test_a_described_device_plans_with_the_backends_rules_and_refuses_to_open():
    kit = _fake_backend()
    d = kit.backend.describe(FAKE_INFO)
    assert d.platform_defaults(HOST).chunk_ceiling_tokens == 512  # the rules see it is not present
    with pytest.raises(BadInput) as e:
        d.open(_plan())
    assert "\n" not in str(e.value) and "profile" in str(e.value)


def test_session_lock_and_fields_are_per_session():
    a, b = _session(), _session()
    assert a.lock is not b.lock and isinstance(a.lock, type(threading.Lock()))
