"""The cuda session's layer ops (strata_cuda.layer_ops.CudaLayerOps) on the runtime's own cache, store and source,
against a float64 numpy reference: a prefill chunk with half the experts cached and the misses streamed through
lent ring slots, a chunk without a ring (misses admitted), and decode steps as one graph replay across the layers
with misses read from mapped page-locked memory. Skipped with "no CUDA device" where there is none.
"""

from __future__ import annotations

import secrets
from types import SimpleNamespace

import numpy as np
import pytest

from strata_core.api.kernels import ExpertPool, LayerWork
from strata_core.reference import kernels as ref

from .test_fast_paths import SeededGenerator, _cuda_device_count, dense_f64, pinned, rel, workspace

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_device_count() == 0, reason="no CUDA device")]

L, E, K, H, F = 3, 64, 4, 256, 128
BOUND = 2e-3  # the f16 path: f16 activations and intermediates, f32 accumulation, over three layers


@pytest.fixture
def rng():
    """A fresh generator per test; its seed is in every assertion message."""
    return SeededGenerator(secrets.randbits(32))


def model(cp, rng, dtype: str = "f16"):
    """Host experts (page-locked) of L layers in `dtype` (f16 or Q8_0), routers and norms; the runtime's cache,
    store and source."""
    from strata_core.runtime.cache import ExpertCache
    from strata_core.runtime.layer_ops import StoreSource, new_counters
    from strata_core.runtime.store import ExpertStore
    from strata_cuda.cupy_device import CupyDeviceMemory
    w13 = pinned(cp, (L * E, 2 * F, H), np.float16)
    w2 = pinned(cp, (L * E, H, F), np.float16)
    w13[...] = (rng.standard_normal((L * E, 2 * F, H), dtype=np.float32) / np.sqrt(H)).astype(np.float16)
    w2[...] = (rng.standard_normal((L * E, H, F), dtype=np.float32) / np.sqrt(F)).astype(np.float16)
    host = ExpertPool("f16", {"w_gate_up": w13, "w_down": w2})
    if dtype == "q8_0":
        arrays = {}
        for (nq, nd), w in ((("gate_up_q", "gate_up_d"), w13), (("down_q", "down_d"), w2)):
            for name, a in zip((nq, nd), ref.quantize_q8_0(w)):
                arrays[name] = pinned(cp, a.shape, a.dtype)
                arrays[name][...] = a
        host = ExpertPool("q8_0", arrays)
    routers = [(rng.standard_normal((E, H)) / np.sqrt(H)).astype(np.float32) for _ in range(L)]
    norms = [(1 + 0.1 * rng.standard_normal(H)).astype(np.float32) for _ in range(L)]
    slots = L * E // 2 + 16
    cache = ExpertCache(slots, L, E)
    # unwritten slots read as NaN (f16 weights, Q8_0 scales), so a read of a wrong slot fails the comparison
    dev = ExpertPool(dtype, {n: cp.full((slots, *a.shape[1:]), np.nan if a.dtype == np.float16 else 0, a.dtype)
                             for n, a in host.arrays.items()})
    placed_rows = rng.permutation(L * E)[: L * E // 2]
    got = cache.place(placed_rows)
    for name, a in host.arrays.items():
        dev.arrays[name][cp.asarray(got)] = cp.asarray(a[placed_rows[: got.size]])
    store = ExpertStore(host, L, E)
    store.pinned_rows[:] = True  # the arrays are cudaHostAlloc memory: page-locked and mapped
    dm = CupyDeviceMemory(0)
    stats = new_counters()
    source = StoreSource(dm, dev, store, None, stats, False)
    return SimpleNamespace(host=host, routers=routers, norms=norms, cache=cache, dev=dev, store=store, dm=dm,
                           stats=stats, source=source)


def margin(m, layer: int, x: np.ndarray) -> float:
    """The smallest gap between a token's k-th and (k+1)-th router logits: below the path's rounding, the device
    and the reference may route that token differently (a near-tie, not an error)."""
    lg = np.sort(ref.linear(ref.rmsnorm(x, m.norms[layer]), m.routers[layer]), axis=1)[:, ::-1]
    return float((lg[:, K - 1] - lg[:, K]).min())


def untied_token(m, rng) -> tuple[np.ndarray, np.ndarray]:
    """A [1, H] f32 token without a near-tie in any layer (50 draws at most) and its float64 residual after all
    layers: the reference's f32 drift could flip a near-tied token's routing, which is no error of the device's."""
    for _ in range(50):
        x0 = rng.standard_normal((1, H)).astype(np.float32)
        want, ok = x0.astype(np.float64), True
        for layer in range(L):
            ok = ok and margin(m, layer, want.astype(np.float32)) > 1e-2
            want = reference_layer(m, layer, want.astype(np.float32))
        if ok:
            return x0, want
    raise AssertionError(f"no token without near-ties in 50 draws (seed {rng.seed_value})")


def reference_layer(m, layer: int, x: np.ndarray) -> np.ndarray:
    """float64 x + MoE(rmsnorm(x)) of one layer."""
    xn = ref.rmsnorm(x, m.norms[layer])
    logits = ref.linear(xn, m.routers[layer])
    ids, w = ref.route_topk(logits, K)
    y = np.zeros((x.shape[0], H))
    x64 = xn.astype(np.float64)
    for e in np.unique(ids):
        rows, ks = np.nonzero(ids == e)
        w13, w2 = dense_f64(m.host, layer * E + int(e))
        gu = x64[rows] @ w13.T
        y_e = (gu[:, :F] / (1 + np.exp(-gu[:, :F])) * gu[:, F:]) @ w2.T
        np.add.at(y, rows, w[rows, ks, None].astype(np.float64) * y_e)
    return x.astype(np.float64) + y


def works(cp, m, phase: str, x, ring: np.ndarray, copy_stream) -> list[LayerWork]:
    """The LayerWork of every layer, as the executor builds them (dense weights on the device once, as it keeps them)."""
    ws = workspace(cp)
    if not hasattr(m, "norms_d"):
        m.norms_d = [cp.asarray(v) for v in m.norms]
        m.routers_d = [cp.asarray(v) for v in m.routers]
    return [LayerWork(phase=phase, layer=i, tokens=int(x.shape[0]), x=x, norm_w=m.norms_d[i],
                      router_w=m.routers_d[i], top_k=K, pool=m.dev, slots=m.cache, source=m.source,
                      workspace=ws, ring=ring, copy_stream=copy_stream, stats=m.stats) for i in range(L)]


def ops(m):
    """The layer ops a cuda session gets."""
    from strata_cuda.kernels import CupyKernels
    from strata_cuda.layer_ops import CudaLayerOps
    return CudaLayerOps(m.dm, CupyKernels(0))


@pytest.mark.parametrize("with_ring", [True, False], ids=["ring", "admit"])
def test_prefill_chunk_through_the_layer_ops(cp, rng, with_ring):
    m = model(cp, rng)
    op = ops(m)
    t = 200
    x0 = rng.standard_normal((t, H)).astype(np.float32)
    ring = m.cache.lend(12) if with_ring else np.zeros(0, np.int32)
    assert ring is not None
    x = cp.asarray(x0)
    for w in works(cp, m, "prefill", x, np.asarray(ring), cp.cuda.Stream(non_blocking=True)):
        # each layer against the reference of the same input (the device's), so an f16 drift in one layer cannot
        # move a near-tied token's routing in the next
        cp.cuda.Device().synchronize()
        x_in = x.get()
        op.prefill_layer(w)
        cp.cuda.Device().synchronize()
        err = rel(x.get() - x_in, reference_layer(m, w.layer, x_in) - x_in)
        assert err < BOUND, f"layer {w.layer}: {err:.2e} (seed {rng.seed_value})"
    assert m.cache.misses > 0 and m.cache.hits > 0
    assert op.counts["prefill_fused"] == L and op.counts["prefill_composed"] == 0
    if with_ring:
        assert m.stats["experts_streamed"] > 0 and m.stats["ring_batches"] > 0
        # the hottest streamed experts stay: copied from the ring into the cache (its 4 unlent empty slots first)
        assert op.counts.get("ring_admitted", 0) >= 4, op.counts
    else:
        # without a ring the misses are admitted into the cache (it can take a layer's uncached experts)
        assert m.stats["experts_admitted"] > 0
    # every expert the cache says it holds is byte for byte the host's (admitted copies landed in their slots)
    cp.cuda.Device().synchronize()
    rows = np.flatnonzero(m.cache.slot_of >= 0)
    for name, a in m.host.arrays.items():
        held = m.dev.arrays[name][cp.asarray(m.cache.slot_of[rows])].get()
        assert np.array_equal(held, a[rows]), f"{name}: a cached slot does not hold its expert (seed {rng.seed_value})"
    if with_ring:
        m.cache.give_back(ring)


@pytest.mark.parametrize("landing", [False, True], ids=["copy", "landing"])
@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_decode_steps_replay_one_graph_with_mapped_misses(cp, rng, dtype, landing):
    m = model(cp, rng, dtype)
    op = ops(m)
    op.decode_landing = landing
    x0, want = untied_token(m, rng)
    x = cp.empty((1, H), cp.float32)
    for step in range(3):
        x.set(x0)
        lookups = m.cache.lookups
        op.decode_step(works(cp, m, "decode", x, np.zeros(0, np.int32), cp.cuda.Stream(non_blocking=True)))
        cp.cuda.Device().synchronize()
        err = rel(x.get() - x0, want - x0)
        assert err < BOUND, f"step {step}: {err:.2e} (seed {rng.seed_value})"
        # every layer's K distinct routed experts counted once a step (the layers' lookups are made in one call)
        assert m.cache.lookups - lookups == L * K, (m.cache.lookups - lookups, rng.seed_value)
    assert op.counts["decode_graph_steps"] == 3, op.counts
    assert len([k for k in op._fast.values()][0]._graphs) == 1, "one graph for the whole stack, replayed"
    assert m.cache.misses > 0, "half the experts are not cached: some decode reads came from host memory"
    if landing:
        # step 0 reserved slots for its misses, step 1's kernels wrote them there as they read them, step 2 read
        # them from those slots (its output checked above)
        assert op.counts.get("decode_landed", 0) > 0 and "decode_admitted" not in op.counts, op.counts
    else:
        assert op.counts.get("decode_admitted", 0) > 0 and "decode_reserved" not in op.counts, op.counts
    # every expert the cache holds is the host's bytes (landed or copied)
    rows = np.flatnonzero(m.cache.slot_of >= 0)
    for name, a in m.host.arrays.items():
        held = m.dev.arrays[name][cp.asarray(m.cache.slot_of[rows])].get()
        assert np.array_equal(held, a[rows]), f"{name}: a cached slot does not hold its expert (seed {rng.seed_value})"


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_the_first_decode_step_after_a_prompt_tops_up_the_empty_slots_with_the_hosts_bytes(cp, rng, dtype):
    """Slots emptied as a prompt's loan leaves them, the top-up owed as prefill_layer leaves it: the first step
    copies the hottest uncached experts into them while it runs (reading them from host memory until landed), every
    step's output is right, and afterwards each topped-up slot holds its expert's host bytes."""
    m = model(cp, rng, dtype)
    op = ops(m)
    held = np.flatnonzero(m.cache.expert_in >= 0)[:4]
    gone = m.cache.expert_in[held].copy()
    m.cache.slot_of[gone], m.cache.expert_in[held] = -1, -1  # four slots come back empty
    m.cache.freq[:] = np.arange(1, m.cache.freq.size + 1, dtype=np.float64)  # every expert used, the last hottest
    empty = int(((m.cache.expert_in < 0) & m.cache.usable()).sum())
    uncached = int((m.cache.slot_of < 0).sum())
    assert 4 <= empty < uncached, (empty, uncached)
    op._top_up_owed = True
    x0, want = untied_token(m, rng)
    x = cp.empty((1, H), cp.float32)
    for step in range(3):
        x.set(x0)
        op.decode_step(works(cp, m, "decode", x, np.zeros(0, np.int32), cp.cuda.Stream(non_blocking=True)))
        cp.cuda.Device().synchronize()
        err = rel(x.get() - x0, want - x0)
        assert err < BOUND, f"step {step}: {err:.2e} (seed {rng.seed_value})"
    assert op.counts.get("decode_topped_up") == empty, op.counts
    assert not ((m.cache.expert_in < 0) & m.cache.usable()).any(), "every empty slot was topped up"
    rows = np.flatnonzero(m.cache.slot_of >= 0)
    for name, a in m.host.arrays.items():
        got = m.dev.arrays[name][cp.asarray(m.cache.slot_of[rows])].get()
        assert np.array_equal(got, a[rows]), f"{name}: a cached slot does not hold its expert (seed {rng.seed_value})"


def test_decode_over_reused_works_reuses_its_layers_until_the_cache_changes(cp, rng):
    """The executor hands a session's ops the same works every step: the step's layers come back unchanged
    (decode_layers_reused) while the cache is, and are rebuilt from the slot table when it changes (every cached
    expert lent away, the lent slots overwritten with NaN: a stale slot map reads NaN). decode_launch leaves the
    step uncounted until decode_done (the executor queues the LM head in between)."""
    m = model(cp, rng, "f16")
    op = ops(m)
    op.decode_admit_bytes = 0  # no admissions: the cache changes only where this test changes it
    x0, want = untied_token(m, rng)
    x = cp.empty((1, H), cp.float32)
    ws = works(cp, m, "decode", x, np.zeros(0, np.int32), cp.cuda.Stream(non_blocking=True))
    lent = None
    for step in range(4):
        if step == 2:
            lent = m.cache.lend(m.cache.available_slots)
            assert lent is not None
            for a in m.dev.arrays.values():
                a[cp.asarray(lent)] = np.nan if a.dtype == np.float16 else 0
        x.set(x0)
        lookups = m.cache.lookups
        op.decode_launch(ws)
        assert m.cache.lookups == lookups, "decode_launch counts nothing before decode_done"
        op.decode_done()
        assert m.cache.lookups - lookups == L * K, (step, m.cache.lookups - lookups, rng.seed_value)
        cp.cuda.Device().synchronize()
        err = rel(x.get() - x0, want - x0)
        assert err < BOUND, f"step {step}: {err:.2e} (seed {rng.seed_value})"
    assert op.counts["decode_layers_reused"] == 2, op.counts  # steps 1 and 3; 0 and 2 built them
    assert op.counts["decode_graph_steps"] == 4, op.counts
    m.cache.give_back(lent)


@pytest.fixture(scope="module")
def cp():
    """cupy, imported only where a GPU is present."""
    import cupy
    return cupy
