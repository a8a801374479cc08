"""CudaLayerOps' top-up on the host: the first decode step after a prompt copies the hottest uncached experts into
the slots the prompt's loan gave back empty, in groups whose maps say "host" until their copy has landed, and
decode admits nothing while they are in flight. cupy and FastMoE are the doubles of test_cuda_layer_ops_host.py;
the real copies run in tests/gpu/test_layer_ops.py and bench/strata_run_h200.py's half_skewed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from strata_core.runtime.cache import ExpertCache

_spec = importlib.util.spec_from_file_location(
    "cuda_layer_ops_host_doubles", Path(__file__).resolve().parent / "test_cuda_layer_ops_host.py")
doubles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(doubles)
L, E, K = doubles.L, doubles.E, doubles.K


class Landing:
    """An event double whose copies land when the test says so."""

    def __init__(self):
        self.done = False

    def record(self, stream=None):
        """No-op."""

    def synchronize(self):
        """No-op."""


@pytest.fixture
def top(monkeypatch):
    """(op, the events it made in order) with mapped host reads, copy admission, top-up groups of 2."""
    from strata_cuda import layer_ops
    op = doubles.make_op(monkeypatch)
    made: list = []
    sys.modules["cupy"].cuda.Event = lambda disable_timing=True: made.append(Landing()) or made[-1]
    monkeypatch.setattr(layer_ops.CudaLayerOps, "_hosts", lambda self, works, fast, rows, missing: [(1, 2)] * len(works))
    monkeypatch.setattr(layer_ops, "TOP_UP_GROUP", 2)
    return op, made


def loaned_back_cache() -> ExpertCache:
    """Experts 0..E/2-1 of each layer cached in L*E/2 + 3 slots: three slots empty (a loan came back). The prompt
    routed experts 5, 6, 7 of layer 1 most among the uncached (frequencies 9, 8, 7), layer 2's expert 7 once."""
    cache = ExpertCache(L * E // 2 + 3, L, E)
    cache.place(np.concatenate([np.arange(E // 2) + i * E for i in range(L)]))
    cache.freq[[E + 5, E + 6, E + 7, 2 * E + 7]] = [9.0, 8.0, 7.0, 1.0]
    return cache


def test_the_first_decode_step_after_a_prompt_tops_up_the_empty_slots_hottest_first_and_reads_them_from_host_until_landed(top):
    op, made = top
    cache, uploads = loaned_back_cache(), []
    empty = np.flatnonzero(cache.expert_in < 0)
    route = np.tile(np.array([0, 1]), (L, 1))  # every routed expert cached: the step's own misses admit nothing
    op._test_fast = doubles.LandingFast(route, lands=False)
    works = doubles.landing_works(cache, uploads, budget_rows=4)
    op._top_up_owed = True  # what prefill_layer leaves
    op.decode_step(works)
    rows = [E + 5, E + 6, E + 7]
    assert uploads == list(zip(rows, empty.tolist())), uploads
    assert [int(cache.slot_of[r]) for r in rows] == empty.tolist() and op.counts["decode_topped_up"] == 3
    assert int(cache.slot_of[2 * E + 7]) == -1, "three slots, three hotter experts: the fourth stays out"
    maps = op._maps_dev.a[1, :E]
    assert (maps[[5, 6, 7]] == -1).all(), "not landed: read from host memory"
    groups = [e for e in made if any(e is g for _, g in op._topping)]
    assert len(groups) == 2, "3 rows in groups of 2"
    groups[0].done = True
    op.decode_step(works)
    maps = op._maps_dev.a[1, :E]
    assert maps[5] == empty[0] and maps[6] == empty[1] and maps[7] == -1, maps
    groups[1].done = True
    op.decode_step(works)
    assert np.array_equal(op._maps_dev.a[1, :E], cache.slot_of[E:2 * E]) and not op._topping
    assert len(uploads) == 3, "no second top-up without a prompt"
    cache.check()


def test_decode_admits_nothing_while_the_top_up_is_in_flight(top):
    op, made = top
    cache, uploads = loaned_back_cache(), []
    op._test_fast = doubles.LandingFast(np.tile(np.array([0, 7]), (L, 1)), lands=False)  # layer 0's 7 uncached
    works = doubles.landing_works(cache, uploads, budget_rows=4)
    op._top_up_owed = True
    op.decode_step(works)
    topped = len(uploads)
    assert topped == 3 and "decode_admitted" not in op.counts, op.counts
    for e in made:
        e.done = True
    op.decode_step(works)
    op.decode_step(works)
    assert op.counts.get("decode_admitted", 0) > 0 and len(uploads) > topped, "admission resumes once landed"


def test_top_up_off_copies_nothing(top):
    op, _ = top
    cache, uploads = loaned_back_cache(), []
    op._test_fast = doubles.LandingFast(np.tile(np.array([0, 1]), (L, 1)), lands=False)
    works = doubles.landing_works(cache, uploads, budget_rows=4)
    op.decode_top_up = False
    op._top_up_owed = True
    op.decode_step(works)
    assert uploads == [] and (cache.expert_in < 0).sum() == 3
