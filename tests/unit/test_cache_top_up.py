"""ExpertCache.top_up: the slots a prompt's loan gave back take the hottest experts not cached, evicting none."""

from __future__ import annotations

import numpy as np

from strata_core.runtime.cache import ExpertCache


def test_top_up_fills_only_empty_usable_slots_with_the_hottest_used_uncached_rows():
    c = ExpertCache(7, 2, 5)  # 10 experts, 7 slots: 4 empty
    c.place(np.array([0, 1, 5]))
    c.freq[:] = [9, 8, 0, 3, 4, 9, 0, 6, 0.5, 2]
    lent = c.lend(1)  # one empty slot on loan: not filled
    assert c.expert_in[lent[0]] == -1
    c.trimmed[6 if lent[0] != 6 else 5] = True  # a trimmed slot: not filled
    before = c.expert_in.copy()
    rows, slots = c.top_up(np.arange(10))
    assert rows.tolist() == [7, 4] and len(slots) == 2, (rows, slots)
    assert all(before[s] == -1 and not c.on_loan[s] and not c.trimmed[s] for s in slots)
    assert [int(c.slot_of[r]) for r in rows] == slots.tolist()
    assert (c.slot_of[[0, 1, 5]] >= 0).all() and c.evictions == 0
    c.check()


def test_top_up_skips_rows_never_used_and_rows_outside_the_set():
    c = ExpertCache(4, 1, 6)
    c.place(np.array([0]))
    c.freq[:] = [1, 0, 0, 5, 2, 0]
    rows, _ = c.top_up(np.array([1, 2, 4, 5]))
    assert rows.tolist() == [4], "3 is hotter but outside the rows given; 1, 2, 5 were never used"
    assert c.top_up(np.arange(6))[0].tolist() == [3]
    assert c.top_up(np.arange(6))[0].size == 0
