"""CudaLayerOps' decode bookkeeping on the host: decode_launch / decode_done, the routed ids' copy through a
page-locked buffer, one cache lookup for all layers, and the reuse of a step's layers while the cache is unchanged.

cupy is replaced by a double whose device arrays are numpy arrays (their `data.ptr` the numpy buffer's address, the
runtime's memcpyAsync a memmove) and FastMoE by one whose "graph" writes known routed ids: no GPU, no kernels. The
kernels and the real cupy calls are tested in tests/gpu (test_layer_ops.py).
"""

from __future__ import annotations

import ctypes
import sys
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest

from strata_core.api.kernels import ExpertPool, LayerWork
from strata_core.runtime.cache import ExpertCache

L, E, K, H = 3, 8, 2, 32


class Dev:
    """A device array double over a numpy array."""

    def __init__(self, a: np.ndarray):
        self.a = a
        self.data = SimpleNamespace(ptr=int(a.ctypes.data))
        self.shape, self.dtype, self.size, self.nbytes = a.shape, a.dtype, a.size, a.nbytes

    def __getitem__(self, i):
        return Dev(self.a[i])

    def set(self, host, stream=None):
        """Upload (a copy)."""
        self.a[...] = host


class Event:
    """Recorded on a stream; the double's copies are done when made."""

    def record(self, stream=None):
        """No-op."""

    def synchronize(self):
        """No-op."""

    done = True


def fake_cupy() -> ModuleType:
    cp = ModuleType("cupy")
    stream = SimpleNamespace(ptr=0, wait_event=lambda e: None)
    cp.cuda = SimpleNamespace(get_current_stream=lambda: stream, Event=lambda disable_timing=True: Event(),
                              Stream=lambda non_blocking=True: SimpleNamespace(ptr=1, wait_event=lambda e: None),
                              alloc_pinned_memory=lambda n: bytearray(n))
    cp.empty = lambda shape, dtype=np.float32: Dev(np.zeros(shape, dtype=dtype))
    cp.int32, cp.float32 = np.int32, np.float32
    return cp


class FakeFast:
    """FastMoE's decode surface: the 'replay' writes each layer's routed ids (layer + step + k, mod E)."""

    experts, top_k = E, K

    def __init__(self):
        self.step, self.replays, self.compute_stream = 0, 0, None

    def decode_stack(self, x, layers, graph=True, key=None):
        """Write the routed ids the way the graph does (into each layer's ids view)."""
        for i, lay in enumerate(layers):
            lay.ids.a[...] = (i + self.step + np.arange(K)) % E
        self.replays += 1


def make_op(monkeypatch):
    """CudaLayerOps over the fake cupy, its fused paths one FakeFast (o._test_fast)."""
    cp = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cp.cuda)
    cp.cuda.runtime = SimpleNamespace(memcpyDeviceToHost=2,
                                      memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n))
    from strata_cuda import fast, layer_ops
    monkeypatch.setattr(fast, "warm_up", lambda: None)
    o = layer_ops.CudaLayerOps(memory=None, kernels=None)
    o._test_fast = FakeFast()
    monkeypatch.setattr(layer_ops.CudaLayerOps, "_fast_for", lambda self, w: self._test_fast)
    return o


@pytest.fixture
def op(monkeypatch):
    return make_op(monkeypatch)


def step_works(cache: ExpertCache, x: Dev) -> list[LayerWork]:
    pool = ExpertPool("f16", {"w_gate_up": Dev(np.zeros((cache.slots, 2, H), np.float16)),
                              "w_down": Dev(np.zeros((cache.slots, H, 2), np.float16))})
    ws = SimpleNamespace(reset=lambda: None)
    return [LayerWork(phase="decode", layer=i, tokens=1, x=x, norm_w=Dev(np.ones(H, np.float32)),
                      router_w=Dev(np.zeros((E, H), np.float32)), top_k=K, pool=pool, slots=cache,
                      source=SimpleNamespace(store=None), workspace=ws, ring=np.zeros(0, np.int32),
                      copy_stream=None, stats={}) for i in range(L)]


def test_steps_are_counted_at_decode_done_from_the_copied_ids_and_layers_are_reused_until_the_cache_changes(op):
    cache = ExpertCache(L * E, L, E)
    cache.place(np.arange(L * E))  # every expert cached: no host reads, no admissions
    works = step_works(cache, Dev(np.zeros((1, H), np.float32)))
    fast = op._test_fast
    for step in range(4):
        fast.step = step
        if step == 2:  # two experts of layer 1 swap slots: the maps change, the layers must be rebuilt
            r = cache.row(1, np.array([0, 1]))
            cache.slot_of[r] = cache.slot_of[r[::-1]]
        hits = cache.hits
        op.decode_launch(works)
        assert cache.hits == hits, "nothing counted before decode_done"
        op.decode_done()
        op.decode_done()  # a second call counts nothing
        want = np.stack([(i + step + np.arange(K)) % E for i in range(L)])
        assert np.array_equal(op._ids_host, want)
        assert cache.hits - hits == L * K
        # the device maps the step's layers read are the cache's table now
        assert np.array_equal(op._maps_dev.a, cache.slot_of[op._rows].reshape(L, E))
    assert fast.replays == 4 and op.counts["decode_graph_steps"] == 4
    assert op.counts["decode_layers_reused"] == 2, op.counts  # steps 1 and 3
    # the freshest step's experts are the warmest: the lookups landed on the routed rows
    routed = (np.arange(L)[:, None] * E + (np.arange(L)[:, None] + 3 + np.arange(K)) % E).ravel()
    assert np.all(cache.freq[routed] > 0)


def test_decode_step_counts_before_it_returns(op):
    cache = ExpertCache(L * E, L, E)
    cache.place(np.arange(L * E))
    works = step_works(cache, Dev(np.zeros((1, H), np.float32)))
    op.decode_step(works)
    assert cache.lookups == L * K and not op._launched


class PinnedDouble:
    """The session's page-locked allocator: records what it lends (host memory standing in for page-locked)."""

    def __init__(self, refuse: bool = False):
        self.refuse, self.asked, self.freed = refuse, [], []

    def alloc(self, nbytes, from_floor=False):
        """A buffer of nbytes, or None when refusing."""
        from strata_core.api import PinnedBuffer
        self.asked.append((int(nbytes), bool(from_floor)))
        if self.refuse:
            return None
        return PinnedBuffer(array=np.zeros(int(nbytes), np.uint8), nbytes=int(nbytes), kind="alloc",
                            from_floor=from_floor)

    def free(self, buf):
        """Record the release."""
        self.freed.append(buf)


@pytest.mark.parametrize("refuse", [False, True], ids=["lent", "refused"])
def test_the_routed_ids_buffer_comes_from_the_sessions_pinned_allocator(op, refuse):
    """The decode step's page-locked ids buffer is charged to the plan's pinned budget (its runtime floor); when
    the allocator refuses, a pageable buffer serves (counted), and the step is counted all the same."""
    pinned = PinnedDouble(refuse)
    op._pinned = pinned
    cache = ExpertCache(L * E, L, E)
    cache.place(np.arange(L * E))
    works = step_works(cache, Dev(np.zeros((1, H), np.float32)))
    for _ in range(2):
        op.decode_step(works)
    # one allocation for the session, from the floor: two ids buffers (steps alternate between them)
    assert pinned.asked == [(2 * L * K * 4, True)], pinned.asked
    assert cache.lookups == 2 * L * K
    if refuse:
        assert op.counts.get("ids_pageable") == 1 and op._ids_buf is None
    else:
        assert "ids_pageable" not in op.counts and np.shares_memory(op._ids_host, op._ids_buf.array)
