"""The host decode path's scalar shortcuts equal the array calls they stand for: the cache's lookup_distinct and
admit_distinct against lookup and admit, the one-row top k by argmaxes against the reference's stable sort (NaN,
infinities and ties included), and the cached f32 form of a weight that becomes writeable again."""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.builtin.cpu import HostKernels
from strata_core.reference.kernels import ReferenceKernels
from strata_core.runtime.cache import EMPTY, ExpertCache

REF = ReferenceKernels()


def _twins(rng: np.random.Generator) -> tuple[ExpertCache, ExpertCache, int]:
    """Two caches in one random state (experts placed, frequencies with ties, some slots lent or trimmed)."""
    slots, layers, experts = int(rng.integers(4, 40)), int(rng.integers(1, 4)), int(rng.integers(8, 48))
    a, b = ExpertCache(slots, layers, experts), ExpertCache(slots, layers, experts)
    warm = rng.permutation(layers * experts)[: int(rng.integers(0, slots + 1))]
    freq = np.round(rng.random(layers * experts) * 4) / 2
    lend, trim = int(rng.integers(0, 3)), int(rng.integers(0, 3)) * (rng.random() < 0.3)
    for c in (a, b):
        c.place(warm)
        c.freq[:] = freq
        c.lend(lend)
        c.trim_idle(trim, idle_below=0.6)
    return a, b, experts


def _same(a: ExpertCache, b: ExpertCache) -> None:
    for name in ("slot_of", "expert_in", "freq", "on_loan", "trimmed"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert (a.hits, a.misses, a.evictions) == (b.hits, b.misses, b.evictions)


@pytest.mark.parametrize("seed", range(60))
def test_lookup_then_admit_distinct_equal_lookup_then_admit(seed):
    rng = np.random.default_rng(seed)
    fast, ref, experts = _twins(rng)
    for step in range(30):
        layer = int(rng.integers(fast.layers))
        k = int(rng.integers(1, min(9, experts)))
        top = sorted(rng.choice(experts, k, replace=False).tolist())
        got = fast.lookup_distinct(layer, top)
        want = ref.lookup(layer, np.array(top), np.ones(k, np.int64))
        assert got == want.tolist()
        _same(fast, ref)
        miss = [i for i, s in enumerate(got) if s == EMPTY]
        if not miss:
            continue
        hits = [s for s in got if s != EMPTY]
        placed = fast.admit_distinct(layer, [top[i] for i in miss], hits)
        if ref.usable_slots() - len(hits) < len(miss):
            assert placed is None, "admit_distinct placed experts where the general path must decide"
        else:
            want = ref.admit(layer, np.array([top[i] for i in miss]), keep=np.array(hits, np.int64))
            assert placed == want.tolist()
        _same(fast, ref)
        fast.check()
        if step % 5 == 4:
            fast.tick()
            ref.tick()


def _topk_case(seed: int) -> tuple[np.ndarray, int]:
    rng = np.random.default_rng(seed)
    E = int(rng.choice([5, 8, 64, 256]))
    k = int(rng.choice([1, 2, 4, 8, E])) if seed % 7 else E - 1
    row = np.round(rng.standard_normal(E) * 2) / 2  # ties
    kind = seed % 6
    if kind == 1:
        row[rng.integers(0, E, 2)] = np.nan
    elif kind == 2:
        row[rng.integers(0, E, max(1, E - k + 1))] = -np.inf  # fewer finite values than k, sometimes
    elif kind == 3:
        row[rng.integers(0, E, 3)] = np.inf
    elif kind == 4:
        row[:] = -0.0
        row[rng.integers(0, E, E // 2)] = 0.0
    return row.astype(np.float32)[None, :], min(k, E)


@pytest.mark.parametrize("seed", range(120))
def test_one_row_top_k_is_the_reference_with_nan_infinities_and_ties(seed):
    logits, k = _topk_case(seed)
    want = (np.empty((1, k), np.int32), np.empty((1, k), np.float32))
    got = (np.full((1, k), -7, np.int32), np.full((1, k), -7.0, np.float32))
    with np.errstate(invalid="ignore"):
        REF.route_topk(logits, k, out=want)
        HostKernels().route_topk(logits, k, out=got)
    assert np.array_equal(want[0], got[0]), (logits, want[0], got[0])
    assert np.array_equal(want[1].view(np.uint32), got[1].view(np.uint32))


def test_a_cached_weight_made_writeable_again_is_converted_again():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((32, 16)).astype(np.float16)
    w.flags.writeable = False
    x = rng.standard_normal((1, 16)).astype(np.float32)
    host = HostKernels()
    out = np.empty((1, 32), np.float32)
    host.linear(x, w, out=out)
    w.flags.writeable = True
    w[:] = 0
    assert not host.linear(x, w, out=out).any(), "a weight that can change was served from its old f32 copy"


@pytest.mark.parametrize("seed", range(80))
def test_one_row_scatter_add_is_the_reference_for_every_row_count(seed):
    rng = np.random.default_rng(seed)
    n, H = int(rng.integers(1, 13)), int(rng.choice([1, 7, 16, 128, 130]))
    base = (rng.standard_normal((1, H)) * rng.choice([1e-3, 1.0, 1e4])).astype(np.float32)
    y = (rng.standard_normal((n, H)) * rng.choice([1e-3, 1.0, 1e4], (n, 1))).astype(np.float32)
    if seed % 4 == 0:  # signed zeros: -0.0 + -0.0 keeps the sign, a +0.0 anywhere drops it
        y[rng.random((n, H)) < 0.5] = -0.0
        base[:, rng.random(H) < 0.5] = -0.0
    scale = rng.random(n).astype(np.float32)
    a, b = base.copy(), base.copy()
    REF.scatter_add(a, np.zeros(n, np.int32), y, scale)
    HostKernels().scatter_add(b, np.zeros(n, np.int32), y, scale)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("replaced", [False, True])
def test_admission_heat_reads_empty_slots_as_minus_one_also_when_freq_is_replaced(replaced):
    fast, ref = ExpertCache(6, 1, 12), ExpertCache(6, 1, 12)
    for c in (fast, ref):
        c.place(np.array([0, 1, 2, 3]))  # slots 4 and 5 empty: colder than any held expert
        c.freq[:] = np.arange(12, dtype=np.float64) / 4
        c.freq[0] = -3.0  # a held expert colder than an empty slot (-1), warmer than -5
    if replaced:
        fast.freq = fast.freq.copy()  # a plain array now, not the view with the empty slots' value beside it
        fast.freq[-1] = -5.0  # the value an EMPTY index would read without the empty-slot rule
    got = fast.admit_distinct(0, [7, 8, 9], [1])
    want = ref.admit(0, np.array([7, 8, 9]), keep=np.array([1]))
    assert got == want.tolist() == [0, 4, 5]
    if replaced:
        fast.freq[-1] = ref.freq[-1]
    _same(fast, ref)
