"""The moe.cl kit on a real device (sycl through dpctl, opencl through pyopencl, both on Intel's CPU runtime here):
arrays carved from one byte region with DeviceMemory.view, at offsets off any base-address alignment, are kernel
inputs and `out=` buffers as they are, the kernels match the numpy reference there, and a call given its outputs
allocates no device memory (the kit's own ledger of its USM / cl allocations does not move)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from strata_core.api import DeviceMemoryViews
from strata_core.reference import kernels as ref
from strata_core.reference.kernels import ExpertPool

MIB = 1 << 20
BACKENDS = [("sycl", "dpctl", "strata_sycl.backend"), ("opencl", "pyopencl", "strata_opencl.backend")]


@pytest.fixture(scope="module", params=BACKENDS, ids=[b[0] for b in BACKENDS])
def session(request):
    """A session of the backend's first device (with its vendor library installed, no device is a failure)."""
    name, module, backend_module = request.param
    pytest.importorskip(module)
    import importlib
    r = importlib.import_module(backend_module).PLUGIN.probe()  # the kit's MoeClBackend of that backend
    assert r.available, r.reason
    plan = SimpleNamespace(pinned=SimpleNamespace(limit_bytes=8 * MIB, floor_bytes=MIB))
    s = r.devices[0].open(plan)
    yield s
    s.close()


class Carver:
    """Carves typed views from one flat byte region at deliberately odd (4-byte, not 128-byte aligned) offsets."""

    def __init__(self, mem, nbytes: int):
        self.mem = mem
        self.region = mem.alloc((nbytes,), np.uint8)
        self.at = 36  # off every CL_DEVICE_MEM_BASE_ADDR_ALIGN a device reports (>= 8 bytes)

    def __call__(self, shape, dtype, host=None):
        v = self.mem.view(self.region, self.at, shape, dtype)
        self.at += v.nbytes + 4 * (1 + v.nbytes % 3)  # gaps of 4, 8 or 12 bytes: every kind of misalignment
        self.at += -self.at % 4
        if host is not None:
            self.mem.upload(v, np.ascontiguousarray(host, dtype=dtype))
        return v


def test_the_kit_memory_has_views(session):
    assert isinstance(session.memory, DeviceMemoryViews)


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_kernels_on_carved_views_match_the_reference_and_allocate_nothing(session, dtype):
    mem, k = session.memory, session.kernels
    rng = np.random.default_rng(7)
    t, h, f, e, top, slots = 21, 64, 32, 6, 2, 4
    c = Carver(mem, 4 * MIB)
    x = rng.standard_normal((t, h)).astype(np.float32)
    norm_w = (1 + 0.1 * rng.standard_normal(h)).astype(np.float16)
    router = (0.2 * rng.standard_normal((e, h))).astype(np.float16)
    if dtype == "f16":
        arrays = {"w_gate_up": (0.1 * rng.standard_normal((slots, 2 * f, h))).astype(np.float16),
                  "w_down": (0.1 * rng.standard_normal((slots, h, f))).astype(np.float16)}
    else:
        arrays = {"gate_up_q": rng.integers(-127, 128, (slots, 2 * f, h), dtype=np.int8),
                  "gate_up_d": (0.002 * rng.random((slots, 2 * f, h // 32)) + 1e-4).astype(np.float16),
                  "down_q": rng.integers(-127, 128, (slots, h, f), dtype=np.int8),
                  "down_d": (0.002 * rng.random((slots, h, f // 32)) + 1e-4).astype(np.float16)}
    host_pool = ExpertPool(dtype, arrays)
    dev_pool = ExpertPool(dtype, {n: c(a.shape, a.dtype, a) for n, a in arrays.items()})
    xd, nwd, rwd = c(x.shape, np.float32, x), c(norm_w.shape, np.float16, norm_w), c(router.shape, np.float16, router)

    peak = mem.peak_bytes()
    xn = k.rmsnorm(xd, nwd, out=c((t, h), np.float32))
    logits = k.linear(xn, rwd, out=c((t, e), np.float32))
    ids_d, w_d = k.route_topk(logits, top, out=(c((t, top), np.int32), c((t, top), np.float32)))
    ids, wts = mem.download(ids_d).reshape(-1), mem.download(w_d).reshape(-1)
    order = np.argsort(ids, kind="stable")
    experts, counts = np.unique(ids[order], return_counts=True)
    rows = (order // top).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    slot_of = (experts % slots).astype(np.int32)
    rows_d, offs_d, slots_d = c(rows.shape, np.int32, rows), c(offsets.shape, np.int32, offsets), \
        c(slot_of.shape, np.int32, slot_of)
    xg = k.gather(xn, rows_d, out=c((len(rows), h), np.float32))
    y = k.moe_grouped_ffn(xg, offs_d, slots_d, dev_pool, out=c((len(rows), h), np.float32))
    resid = c((t, h), np.float32, x)
    k.scatter_add(resid, rows_d, y, c(wts.shape, np.float32, wts[order]))
    got = mem.download(resid)
    assert mem.peak_bytes() == peak, "a kernel given its outputs allocated device memory"

    xn_ref = ref.rmsnorm(x, norm_w)
    lg_ref = ref.linear(xn_ref, router)
    np.testing.assert_allclose(mem.download(xn), xn_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mem.download(logits), lg_ref, rtol=1e-4, atol=1e-5)
    ids_ref, w_ref = ref.route_topk(mem.download(logits), top)
    np.testing.assert_array_equal(ids.reshape(t, top), ids_ref)
    y_ref = ref.moe_grouped_ffn(xn_ref[rows], offsets, slot_of, host_pool)
    np.testing.assert_allclose(mem.download(y), y_ref, rtol=2e-3, atol=2e-4)
    expect = x.copy()
    ref.scatter_add(expect, rows, y_ref, wts[order])
    np.testing.assert_allclose(got, expect, rtol=2e-3, atol=2e-4)
    if dtype == "q8_0":
        q = k.dequantize_q8_0(dev_pool.arrays["down_q"][1], dev_pool.arrays["down_d"][1], out=c((h, f), np.float16))
        np.testing.assert_array_equal(mem.download(q), ref.dequantize_q8_0(arrays["down_q"][1], arrays["down_d"][1]))
    assert mem.peak_bytes() == peak


def test_a_view_outside_its_base_or_off_its_dtype_is_refused(session):
    mem = session.memory
    base = mem.alloc((256,), np.uint8)
    for off, shape, dt in [(200, (16,), np.float32), (-4, (1,), np.float32), (6, (2,), np.float32)]:
        with pytest.raises(ValueError):
            mem.view(base, off, shape, dt)
    v = mem.view(base, 8, (4, 2), np.float32)
    mem.upload(v, np.arange(8, dtype=np.float32).reshape(4, 2))
    np.testing.assert_array_equal(mem.download(mem.as_bytes(v[1:3])).view(np.float32), np.arange(2, 6))
