"""ExpertCache.worth_admitting: decode's admission takes a missed expert only over a colder one."""

from __future__ import annotations

import numpy as np

from strata_core.runtime.cache import ExpertCache


def cache_with(freqs: list[float], slots: int) -> ExpertCache:
    """One layer of len(freqs) experts; the first `slots` experts resident, frequencies as given."""
    c = ExpertCache(slots, 1, len(freqs))
    c.place(np.arange(slots))
    c.freq[:] = freqs
    return c


def test_a_colder_miss_is_not_admitted_over_hotter_residents():
    c = cache_with([5.0, 4.0, 3.0, 1.0, 0.5], slots=3)
    assert c.worth_admitting(np.array([3, 4])).tolist() == []


def test_hotter_misses_go_in_pairing_hottest_with_coldest():
    c = cache_with([5.0, 4.0, 3.0, 6.0, 3.5, 2.0], slots=3)
    # 6 beats the coldest (3), 3.5 beats the next coldest (4)? no: the prefix stops there
    assert c.worth_admitting(np.array([3, 4, 5])).tolist() == [3]
    c = cache_with([5.0, 1.0, 2.0, 6.0, 3.5], slots=3)
    assert c.worth_admitting(np.array([3, 4])).tolist() == [3, 4]


def test_an_empty_slot_takes_any_miss_and_lent_slots_are_not_victims():
    c = cache_with([5.0, 4.0, 3.0, 0.1], slots=3)
    c.slot_of[2], c.expert_in[2] = -1, -1  # slot 2 emptied
    assert c.worth_admitting(np.array([3])).tolist() == [3]
    c = cache_with([5.0, 4.0, 0.0, 1.0], slots=3)
    c.lend(1)  # lends the coldest slot (expert 2's), which is then on loan and no victim
    assert c.worth_admitting(np.array([3])).tolist() == []
