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
        assert np.array_equal(op._maps_dev.a[:, :E], cache.slot_of[op._rows].reshape(L, E))
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


class LandingFast(FakeFast):
    """FakeFast whose kernels land misses (the third forms): each replay routes `route[i]` in layer i and, as the
    kernels do, writes a miss whose landing entry is a slot into that slot (recorded in `writes`)."""

    def __init__(self, route: np.ndarray, lands: bool = True):
        super().__init__()
        self.route, self.lands, self.writes = route, lands, []

    def lands_misses(self, pool) -> bool:
        """Whether these 'kernels' land misses."""
        return self.lands

    def decode_stack(self, x, layers, graph=True, key=None):
        """Write the routed ids; land each routed miss that has a landing slot."""
        for i, lay in enumerate(layers):
            lay.ids.a[...] = self.route[i]
            for e in self.route[i].tolist():
                if lay.slot_map.a[e] < 0 and lay.land is not None and lay.land.a[e] >= 0:
                    self.writes.append((i, e, int(lay.land.a[e])))
        self.replays += 1


def landing_works(cache: ExpertCache, uploads: list, budget_rows: int) -> list[LayerWork]:
    """step_works with a host store whose rows the copy admission would upload (recorded in `uploads`)."""
    works = step_works(cache, Dev(np.zeros((1, H), np.float32)))
    store = SimpleNamespace(row_bytes=(64 << 20) // budget_rows, pinned_rows=None, pool=None)
    src = SimpleNamespace(store=store, upload=lambda row, slot, stream: uploads.append((row, slot)))
    for w in works:
        w.source = src
        w.copy_stream = SimpleNamespace(wait_event=lambda e: None)
        w.stats = {"experts_admitted": 0}
    return works


@pytest.fixture
def lop(op, monkeypatch):
    """`op` whose layers read their misses from (fake) mapped host addresses, admitting decode misses by landing."""
    from strata_cuda import layer_ops
    monkeypatch.setattr(layer_ops.CudaLayerOps, "_hosts", lambda self, works, fast, rows, missing: [(1, 2)] * len(works))
    op.decode_landing = True
    return op


def half_cache() -> ExpertCache:
    """L x E experts, half of each layer cached (experts 0..E/2-1)."""
    cache = ExpertCache(L * E // 2, L, E)
    cache.place(np.concatenate([np.arange(E // 2) + i * E for i in range(L)]))
    return cache


def test_decode_admits_its_misses_by_landing_them_with_no_copy_and_counts_them_as_misses_until_landed(lop):
    op = lop
    """Every step routes experts 0 and 7 of each layer (7 is not cached): the first step reserves slots for the
    hottest misses (two, the budget), the second step's kernels land them (the step counts them as misses), and
    from the third step on they are hits in their slots; no copy crosses the link for them."""
    cache, uploads = half_cache(), []
    route = np.tile(np.array([0, 7]), (L, 1))
    fast = op._test_fast = LandingFast(route)
    works = landing_works(cache, uploads, budget_rows=2)
    rows7 = np.arange(L) * E + 7
    op.decode_step(works)  # step 0: L misses; two reserved
    assert len(op._landing) == 2 and int(cache.on_loan.sum()) == 2, op._landing
    reserved = {r: v[0] for r, v in op._landing.items()}
    assert all(cache.slot_of[r] == -1 for r in reserved), "a reserved expert is not resident"
    assert fast.writes == [], "nothing had a landing slot in step 0"
    misses = cache.misses
    op.decode_step(works)  # step 1: the reserved ones land; the third is reserved now
    landed = {(int(i) * E + e): s for i, e, s in fast.writes}
    assert landed == reserved, (landed, reserved)
    assert cache.misses - misses == L, "a landing step reads its experts from host memory: misses"
    for r, s in reserved.items():
        assert cache.slot_of[r] == s and not cache.on_loan[s]
    assert op.counts["decode_landed"] == 2 and works[0].stats["experts_admitted"] == 2
    op.decode_step(works)  # step 2: the third lands
    op.decode_step(works)  # step 3: every routed expert is a hit
    hits, lookups = cache.hits, cache.lookups
    op.decode_step(works)
    assert cache.hits - hits == cache.lookups - lookups == L * K
    assert (cache.slot_of[rows7] >= 0).all() and op.counts["decode_landed"] == L
    # the device maps of the last step name the landed slots; no landing table entry is left
    assert np.array_equal(op._maps_dev.a[:, :E], cache.slot_of[op._rows].reshape(L, E))
    assert (op._maps_dev.a[:, E:] == -1).all() and not op._landing
    assert uploads == [], "landing copies nothing"
    cache.check()


def test_by_default_decode_admits_by_copy_even_where_the_kernels_could_land(lop):
    op = lop
    from strata_cuda import layer_ops
    op.decode_landing = layer_ops.DECODE_LANDING
    cache, uploads = half_cache(), []
    op._test_fast = LandingFast(np.tile(np.array([0, 7]), (L, 1)))
    works = landing_works(cache, uploads, budget_rows=2)
    op.decode_step(works)
    assert len(uploads) == 2 and not op._landing and "decode_reserved" not in op.counts
    assert not cache.on_loan.any() and op.counts["decode_admitted"] == 2, op.counts


def test_without_landing_kernels_decode_admits_by_copy(lop):
    op = lop
    cache, uploads = half_cache(), []
    op._test_fast = LandingFast(np.tile(np.array([0, 7]), (L, 1)), lands=False)
    works = landing_works(cache, uploads, budget_rows=2)
    op.decode_step(works)
    assert len(uploads) == 2 and not op._landing and "decode_reserved" not in op.counts


def test_a_reservation_not_landed_expires_and_a_prompt_gives_every_reservation_back(lop, monkeypatch):
    op = lop
    from strata_cuda import layer_ops
    cache, uploads = half_cache(), []
    fast = op._test_fast = LandingFast(np.tile(np.array([0, 7]), (L, 1)))
    works = landing_works(cache, uploads, budget_rows=1)
    op.decode_step(works)  # reserves one slot for one of the expert 7s
    (row, (slot, _)), = op._landing.items()
    fast.route = np.tile(np.array([0, 1]), (L, 1))  # from now on every routed expert is cached
    for _ in range(layer_ops.LANDING_EXPIRE_STEPS - 1):
        op.decode_step(works)
    assert row in op._landing and cache.on_loan[slot]
    op.decode_step(works)
    assert not op._landing and not cache.on_loan.any() and op.counts["decode_land_expired"] == 1
    assert cache.slot_of[row] == -1 and cache.expert_in[slot] == -1
    # a new reservation, then a prompt: the prompt gets every slot back
    fast.route = np.tile(np.array([0, 6]), (L, 1))
    op.decode_step(works)
    assert op._landing and cache.on_loan.any()
    monkeypatch.setattr(layer_ops.CudaLayerOps, "_fast_for", lambda self, w: None)
    monkeypatch.setattr(layer_ops.CudaLayerOps, "_fallback", lambda self, w: SimpleNamespace(prefill_layer=lambda w: None))
    op.prefill_layer(works[0])
    assert not op._landing and not cache.on_loan.any()
    cache.check()


@pytest.mark.parametrize("reads", [True, False])
def test_gguf_layers_get_the_stores_mapped_rows_only_where_their_quant_moe_reads_host_misses(op, reads):
    """CudaLayerOps._hosts over a 'gguf' store: each layer's host base is (the address of its expert 0's row, the
    store's row bytes), the stride quant_decode.cu reads a miss at, when every layer's QuantMoE says it reads host
    misses (reads_host_misses, asked with that address and stride); otherwise no host rows (the step is refilled or
    composed). The GPU run of the same is tests/gpu/test_quant_cuda.py's decode test at "half"."""
    from strata_core.runtime.store import ExpertStore
    row_bytes = 96
    blob = np.zeros((L * E, row_bytes), np.uint8)
    store = ExpertStore(ExpertPool("gguf", {"blob": blob}, ()), L, E)
    store.pinned_rows[:] = True
    asked = []
    op._test_fast.reads_host_misses = lambda pool, ptr, nbytes: asked.append((ptr, nbytes)) or reads
    op._test_fast.host_mapping_report = lambda ptrs: [{"host_ptr": p, "device_ptr": p} for p in ptrs]
    cache = ExpertCache(L * E // 2, L, E)
    works = step_works(cache, Dev(np.zeros((1, H), np.float32)))
    dev_pool = ExpertPool("gguf", {"blob": Dev(np.zeros((cache.slots, row_bytes), np.uint8))}, ())
    for w in works:
        w.pool, w.source = dev_pool, SimpleNamespace(store=store)
    rows = np.concatenate([cache.row(w.layer, np.arange(E)) for w in works])
    missing = np.zeros((L, E), bool)
    missing[0, 1] = True
    got = op._hosts(works, op._test_fast, rows, missing)
    base = blob.ctypes.data
    assert asked[0] == (base + int(cache.row(0, 0)) * row_bytes, row_bytes)
    if reads:
        assert got == [(base + int(cache.row(w.layer, 0)) * row_bytes, row_bytes) for w in works]
    else:
        assert got is None  # a miss the kernels cannot read from host memory
