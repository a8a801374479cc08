"""The cuda backend on a real NVIDIA GPU: every kernel against the numpy reference, pinned memory through the budget,
device memory round trips with asynchronous copies. Skipped, with the probe's reason, where there is no CUDA device.

Every cupy allocation made during a kernel test starts filled with 0xFF bytes (NaN in f32 and f16, -1 in int32), so
an output element a kernel forgot to write shows up as NaN (relative_error gives inf) or as -1.
Inputs are fresh random data (never zeros); a failure names its seed.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from types import SimpleNamespace

from strata_core.api import DeviceMemory, DeviceSession, KernelSet, PinnedAllocator, PinnedBudget
from strata_core.reference import kernels as ref
from strata_cuda import backend as cuda_backend
from strata_cuda.grouping import group_layouts

PROBE = cuda_backend.BACKEND.probe()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not PROBE.available, reason="no CUDA device")]

FP32 = 1e-5
FP16 = 2e-3
MIB = 1 << 20


@pytest.fixture(scope="module")
def cp():
    """cupy, imported only where a GPU is present."""
    import cupy
    return cupy


@pytest.fixture(scope="module", params=[False, True], ids=["moe.cu", "fast-grouped-ffn"])
def kernels(request):
    """The KernelSet on device 0, with the grouped FFN on moe.cu's path and on strata_cuda.fast's (compiled once)."""
    from strata_cuda.kernels import CupyKernels
    return CupyKernels(0, fast_grouped_ffn=request.param)


@pytest.fixture(scope="module")
def mem():
    """The DeviceMemory of device 0."""
    from strata_cuda.cupy_device import CupyDeviceMemory
    return CupyDeviceMemory(0)


class SeededGenerator:
    """A numpy Generator that remembers its seed, for the failure messages."""

    def __init__(self, seed: int):
        self.seed_value = seed
        self._g = np.random.default_rng(seed)

    def __getattr__(self, name):
        return getattr(self._g, name)


@pytest.fixture
def rng():
    """A fresh generator per test (its seed is named in every assertion message)."""
    return SeededGenerator(secrets.randbits(32))


@pytest.fixture
def poisoned(cp):
    """Route every cupy allocation through a pool whose blocks are filled with 0xFF bytes before use."""
    pool = cp.cuda.MemoryPool()

    def alloc(nbytes):
        """A block of the private pool, every byte set to 0xFF."""
        p = pool.malloc(nbytes)
        if nbytes:
            cp.cuda.runtime.memset(p.ptr, 0xFF, nbytes)
        return p

    cp.cuda.set_allocator(alloc)
    try:
        probe_arr = cp.empty(64, dtype=cp.float32)
        assert bool(cp.isnan(probe_arr).all()), "the poisoning allocator is not in effect"
        del probe_arr
        yield
    finally:
        cp.cuda.Device().synchronize()
        cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
        pool.free_all_blocks()


def close(name, out, want, bound, seed):
    """Shape, dtype and relative error against the reference."""
    out = np.asarray(out)
    assert out.shape == want.shape, f"{name}: shape {out.shape} vs {want.shape} (seed {seed})"
    assert out.dtype == want.dtype, f"{name}: dtype {out.dtype} vs {want.dtype} (seed {seed})"
    err = ref.relative_error(out, want)
    assert err < bound, f"{name}: relative error {err:.3g} >= {bound:g} (seed {seed})"


# ---- kernels ----------------------------------------------------------------------------------------------------

def test_the_backend_objects_satisfy_the_protocols(kernels, mem):
    assert isinstance(kernels, KernelSet) and isinstance(mem, DeviceMemory)


@pytest.mark.parametrize("t,e,k", [(4096, 128, 8), (1, 128, 8), (33, 200, 10), (5, 64, 64)])
def test_route_topk(cp, kernels, rng, poisoned, t, e, k):
    logits = rng.standard_normal((t, e)).astype(np.float32)
    ids, w = kernels.route_topk(cp.asarray(logits), k)
    want_ids, want_w = ref.route_topk(logits, k)
    assert np.array_equal(ids.get(), want_ids), f"ids differ (seed {rng.seed_value})"
    close("route_topk weights", w.get(), want_w, FP32, rng.seed_value)


def test_route_topk_breaks_ties_to_the_lower_id(cp, kernels, rng, poisoned):
    logits = rng.integers(-3, 4, size=(300, 128)).astype(np.float32)
    ids, w = kernels.route_topk(cp.asarray(logits), 8)
    want_ids, want_w = ref.route_topk(logits, 8)
    assert np.array_equal(ids.get(), want_ids), f"seed {rng.seed_value}"
    close("route_topk weights", w.get(), want_w, FP32, rng.seed_value)


def test_gather(cp, kernels, rng, poisoned):
    x = rng.standard_normal((4096, 2048)).astype(np.float32)
    rows = rng.integers(0, 4096, size=5000).astype(np.int32)
    out = kernels.gather(cp.asarray(x), cp.asarray(rows)).get()
    assert out.dtype == np.float32 and np.array_equal(out, ref.gather(x, rows)), f"seed {rng.seed_value}"


def test_gather_of_another_dtype(cp, kernels, rng, poisoned):
    x = rng.standard_normal((100, 64)).astype(np.float16)
    rows = rng.integers(0, 100, size=70).astype(np.int32)
    out = kernels.gather(cp.asarray(x), cp.asarray(rows)).get()
    assert np.array_equal(out.view(np.uint16), ref.gather(x, rows).view(np.uint16)), f"seed {rng.seed_value}"


def test_scatter_add(cp, kernels, rng, poisoned):
    base = rng.standard_normal((512, 2048)).astype(np.float32)
    rows = np.concatenate([rng.integers(0, 512, size=4000), [7] * 50]).astype(np.int32)  # heavy repeats
    y = rng.standard_normal((rows.size, 2048)).astype(np.float32)
    scale = rng.random(rows.size).astype(np.float32)
    out = cp.asarray(base)
    kernels.scatter_add(out, cp.asarray(rows), cp.asarray(y), cp.asarray(scale))
    want = base.copy()
    ref.scatter_add(want, rows, y, scale)
    close("scatter_add", out.get(), want, FP32, rng.seed_value)


def test_dequantize_q8_0_is_bit_exact(cp, kernels, rng, poisoned):
    w = (rng.standard_normal((768, 2048)) * np.logspace(-5, 2, 768)[:, None]).astype(np.float32)
    qs, d = ref.quantize_q8_0(w)
    out = kernels.dequantize_q8_0(cp.asarray(qs), cp.asarray(d)).get()
    want = ref.dequantize_q8_0(qs, d)
    close("dequantize_q8_0", out, want, FP16, rng.seed_value)
    assert np.array_equal(out.view(np.uint16), want.view(np.uint16)), f"not bit-exact (seed {rng.seed_value})"


@pytest.mark.parametrize("t,h", [(64, 2048), (1, 4096), (7, 1000)])
def test_rmsnorm(cp, kernels, rng, poisoned, t, h):
    x = (rng.standard_normal((t, h)) * 4).astype(np.float32)
    w = rng.standard_normal(h).astype(np.float32)
    out = kernels.rmsnorm(cp.asarray(x), cp.asarray(w), 1e-6).get()
    close("rmsnorm", out, ref.rmsnorm(x, w, 1e-6), FP32, rng.seed_value)


@pytest.mark.parametrize("t,o", [(64, 1024), (1, 1003), (3, 4099), (8, 17)])
@pytest.mark.parametrize("wdtype", [np.float32, np.float16])
def test_linear(cp, kernels, rng, poisoned, wdtype, t, o):
    """Few rows against f16 weights take the GEMV kernel (o off its 8-row blocks: the last block's tail), the rest
    the BLAS; both at the f32 bound."""
    x = rng.standard_normal((t, 2048)).astype(np.float32)
    w = (rng.standard_normal((o, 2048)) * 0.05).astype(wdtype)
    out = kernels.linear(cp.asarray(x), cp.asarray(w)).get()
    assert out.shape == (t, o)
    close("linear", out, ref.linear(x, w), FP32, rng.seed_value)


def test_the_lm_head_gemv_at_qwen3_size_matches_float64(cp, kernels, rng, poisoned):
    """The LM head of one token at Qwen3-30B-A3B's size (151936 x 2048 f16: 2374 blocks of 64 rows, the last one
    partial) through strata_gemv_f16w_f32, at the f32 bound against float64 (reference in row chunks)."""
    o, h = 151936 + 5, 2048  # 5 rows past a multiple of 64: the last block's tail
    x = rng.standard_normal((1, h)).astype(np.float32)
    w = (rng.standard_normal((o, h), dtype=np.float32) * 0.05).astype(np.float16)
    out = kernels.linear(cp.asarray(x), cp.asarray(w)).get()
    want = np.concatenate([x.astype(np.float64) @ w[a:a + 16384].astype(np.float64).T for a in range(0, o, 16384)],
                          axis=1)
    assert out.shape == (1, o) and np.isfinite(out).all(), f"unwritten rows (seed {rng.seed_value})"
    err = float(np.abs(out - want).max() / np.abs(want).max())
    assert err < FP32, f"lm head gemv: {err:.3g} (seed {rng.seed_value})"


def expert_pool(rng, dtype, slots, hidden, ffn):
    """A host ExpertPool of random SwiGLU experts."""
    w13 = (rng.standard_normal((slots, 2 * ffn, hidden), dtype=np.float32) / np.sqrt(hidden)).astype(np.float32)
    w2 = (rng.standard_normal((slots, hidden, ffn), dtype=np.float32) / np.sqrt(ffn)).astype(np.float32)
    if dtype == "f16":
        return ref.ExpertPool("f16", {"w_gate_up": w13.astype(np.float16), "w_down": w2.astype(np.float16)})
    gq, gd = ref.quantize_q8_0(w13)
    dq, dd = ref.quantize_q8_0(w2)
    return ref.ExpertPool("q8_0", {"gate_up_q": gq, "gate_up_d": gd, "down_q": dq, "down_d": dd})


def on_device(cp, pool):
    """The same pool with cupy arrays."""
    return ref.ExpertPool(pool.dtype, {k: cp.asarray(v) for k, v in pool.arrays.items()})


def routed_groups(rng, tokens, experts, top_k):
    """Route random logits with the reference, then group the routed rows by expert: (rows, offsets, slots)."""
    ids, _ = ref.route_topk(rng.standard_normal((tokens, experts)).astype(np.float32), top_k)
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    rows = (order // top_k).astype(np.int32)
    counts = np.bincount(flat, minlength=experts)
    return rows, np.concatenate(([0], np.cumsum(counts))).astype(np.int32), np.arange(experts, dtype=np.int32)


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_moe_grouped_ffn_decode_shape(cp, kernels, rng, poisoned, dtype):
    # one token routed to 8 of the cached experts, at Qwen3-30B-A3B's hidden 2048 and expert FFN 768
    pool = expert_pool(rng, dtype, 16, 2048, 768)
    x = rng.standard_normal((8, 2048)).astype(np.float32)
    offsets = np.arange(9, dtype=np.int32)
    slots = rng.choice(16, size=8, replace=False).astype(np.int32)
    out = kernels.moe_grouped_ffn(cp.asarray(x), cp.asarray(offsets), cp.asarray(slots), on_device(cp, pool)).get()
    close(f"moe_grouped_ffn decode ({dtype})", out, ref.moe_grouped_ffn(x, offsets, slots, pool), FP16,
          rng.seed_value)


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("index_arrays", ["numpy", "cupy"])
def test_moe_grouped_ffn_routed_prefill(cp, kernels, rng, poisoned, dtype, index_arrays):
    hidden, ffn, experts, tokens, top_k = 512, 256, 32, 256, 8
    pool = expert_pool(rng, dtype, experts, hidden, ffn)
    rows, offsets, slots = routed_groups(rng, tokens, experts, top_k)
    x_tokens = rng.standard_normal((tokens, hidden)).astype(np.float32)
    x = np.ascontiguousarray(x_tokens[rows])
    want = ref.moe_grouped_ffn(x, offsets, slots, pool)
    idx = (lambda a: cp.asarray(a)) if index_arrays == "cupy" else (lambda a: a)
    out = kernels.moe_grouped_ffn(cp.asarray(x), idx(offsets), idx(slots), on_device(cp, pool)).get()
    close(f"moe_grouped_ffn prefill ({dtype})", out, want, FP16, rng.seed_value)


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_moe_grouped_ffn_skewed_groups_empty_groups_and_rows_outside(cp, kernels, rng, poisoned, dtype):
    hidden, ffn = 256, 128
    pool = expert_pool(rng, dtype, 10, hidden, ffn)
    counts = np.array([300, 0, 1, 17, 2, 0, 64, 5])  # one hot expert, empty groups
    offsets = np.concatenate(([3], 3 + np.cumsum(counts))).astype(np.int32)  # rows 0-2 and the tail belong to none
    slots = np.array([9, 0, 3, 3, 7, 1, 2, 5], dtype=np.int32)  # a slot used twice
    x = rng.standard_normal((int(offsets[-1]) + 4, hidden)).astype(np.float32)
    assert len(group_layouts(offsets, slots, x.shape[0], 10)) > 1  # several padding buckets are exercised
    out = kernels.moe_grouped_ffn(cp.asarray(x), offsets, slots, on_device(cp, pool)).get()
    want = ref.moe_grouped_ffn(x, offsets, slots, pool)
    close(f"moe_grouped_ffn skewed ({dtype})", out, want, FP16, rng.seed_value)
    assert np.all(out[:3] == 0) and np.all(out[-4:] == 0), "rows outside every group must be zero"


# ---- device memory ----------------------------------------------------------------------------------------------

def test_async_upload_from_pinned_memory_on_a_stream_round_trips(mem, rng):
    from strata_cuda.cupy_device import CupyPinnedAllocator, is_page_locked
    budget = PinnedBudget(256 * MIB, floor_bytes=16 * MIB)
    pinned = CupyPinnedAllocator(budget)
    buf = pinned.alloc(64 * MIB)
    assert buf is not None and budget.used_bytes == 64 * MIB
    src = buf.array.view(np.float32).reshape(-1, 4096)
    src[:] = rng.standard_normal(src.shape).astype(np.float32)
    assert is_page_locked(src)
    dst = mem.alloc(src.shape, np.float32)
    copy, compute = mem.new_stream(), mem.new_stream()
    done = mem.new_event()
    mem.upload(dst, src, stream=copy)
    mem.record(done, copy)
    mem.wait(compute, done)
    back = mem.download(dst, stream=compute)
    assert np.array_equal(back, src), f"seed {rng.seed_value}"
    pinned.free(buf)
    assert budget.used_bytes == 0


def test_pageable_upload_and_to_device_round_trip(mem, rng):
    from strata_cuda.cupy_device import is_page_locked
    x = rng.standard_normal((333, 77)).astype(np.float32)
    assert not is_page_locked(x)
    stream = mem.new_stream()
    dst = mem.alloc(x.shape, x.dtype)
    mem.upload(dst, x, stream=stream)
    mem.synchronize(stream)
    assert np.array_equal(mem.download(dst), x)
    q = rng.integers(-127, 128, size=(64, 32)).astype(np.int8)
    assert np.array_equal(mem.download(mem.to_device(q)), q)
    mem.synchronize()


@pytest.mark.parametrize("n", [1 << 16, (1 << 16) + 1, 4096 * 2048 + 3, 100])
def test_f16_upload_into_f32_widens_exactly(cp, mem, rng, n):
    """f16 rows into an f32 array (the executor's embedding): widened on the device in place from n = 2^16 (every
    element equals the host's astype, odd sizes included), on the host below it; on a stream and on the current one."""
    h = (rng.standard_normal(n) * 8).astype(np.float16)
    h[:: max(1, n // 7)] = np.float16(np.inf)  # specials and subnormals keep their meaning
    h[1] = np.float16(6e-8)
    for stream in (mem.new_stream(), None):
        dst = mem.alloc((n,), np.float32)
        dst.fill(np.nan)
        cp.cuda.Device().synchronize()  # the fill ran on the legacy stream, the upload may run on another
        mem.upload(dst, h, stream=stream)
        mem.synchronize(stream)
        got = mem.download(dst)
        assert np.array_equal(got, h.astype(np.float32)), f"n={n} seed {rng.seed_value}"


def test_absurd_device_allocation_returns_none(mem):
    assert mem.alloc((1 << 50,), np.uint8) is None


def test_mem_info_is_free_and_total(mem):
    free, total = mem.mem_info()
    assert 0 < free <= total


# ---- pinned memory ----------------------------------------------------------------------------------------------

def test_pinned_alloc_and_register_go_through_the_budget(rng):
    from strata_cuda.cupy_device import CupyPinnedAllocator, is_page_locked
    budget = PinnedBudget(64 * MIB, floor_bytes=8 * MIB)
    pinned = CupyPinnedAllocator(budget)
    assert isinstance(pinned, PinnedAllocator)
    assert pinned.alloc(60 * MIB) is None and budget.used_bytes == 0  # the arena may not eat the floor
    a = pinned.alloc(32 * MIB)
    arena = rng.standard_normal(4 * MIB // 4).astype(np.float32)
    keep = arena.copy()
    r = pinned.register(arena)
    assert a is not None and r is not None
    assert budget.used_bytes == 36 * MIB
    assert is_page_locked(a.array) and is_page_locked(arena)
    floor = pinned.alloc(8 * MIB, from_floor=True)
    assert floor is not None and budget.used_bytes == 44 * MIB
    for b in (a, r, floor):
        pinned.free(b)
    assert budget.used_bytes == 0
    assert not is_page_locked(arena) and np.array_equal(arena, keep)


# ---- the plugin end to end ----------------------------------------------------------------------------------------

def test_the_backends_device_opens_a_session_with_the_kernels(cp):
    (dev, *_) = PROBE.devices
    info = dev.info
    assert info.arch.startswith("sm_") and info.vendor == "nvidia" and 0 < info.vram_free_bytes <= info.vram_total_bytes
    s = dev.open(SimpleNamespace(pinned=SimpleNamespace(limit_bytes=MIB, floor_bytes=0)))
    try:
        assert isinstance(s, DeviceSession) and s.kernels.name == "cuda-moe.cu"
        assert isinstance(s.memory, DeviceMemory) and isinstance(s.pinned, PinnedAllocator)
        assert s.pinned.kind == "cuda-host"
    finally:
        s.close()
