"""ExpertCache: hits and misses add up, eviction follows decayed frequency, slots on loan are never used."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings as hyp_settings, strategies as st

from strata_core.runtime.cache import EMPTY, ExpertCache


def test_hits_and_misses_add_up_to_lookups():
    c = ExpertCache(slots=4, layers=2, experts_per_layer=8)
    c.place(np.array([c.row(0, 1), c.row(0, 2), c.row(1, 3)]))
    s = c.lookup(0, np.array([1, 2, 5]))
    assert (s != EMPTY).tolist() == [True, True, False]
    s = c.lookup(1, np.array([3, 1]))
    assert (s != EMPTY).tolist() == [True, False]
    assert (c.hits, c.misses, c.lookups) == (3, 2, 5)
    assert c.hit_rate == 3 / 5


def test_eviction_picks_the_lowest_decayed_frequency_not_the_lowest_count():
    c = ExpertCache(slots=3, layers=1, experts_per_layer=8, decay=0.9)
    c.place(np.array([0, 1, 2]))
    c.lookup(0, np.array([0]), tokens=np.array([10]))   # hot long ago
    for _ in range(40):                                  # 10 * 0.9**40 ~ 0.15
        c.tick()
    c.lookup(0, np.array([1]), tokens=np.array([3]))
    c.lookup(0, np.array([2]), tokens=np.array([2]))
    slot_of_0 = int(c.slot_of[0])
    got = c.admit(0, np.array([5]))
    assert got.tolist() == [slot_of_0], "expert 0 is the coldest once its count has decayed"
    assert c.slot_of[0] == EMPTY and c.slot_of[5] == slot_of_0
    # next coldest is expert 2 (2 < 3), unless it is kept for the current step
    keep = np.array([int(c.slot_of[2])])
    got = c.admit(0, np.array([6]), keep=keep)
    assert int(got[0]) != int(keep[0]) and c.slot_of[2] == keep[0]
    assert c.evictions == 2
    c.check()


def test_slots_on_loan_are_never_looked_up_admitted_or_evicted():
    c = ExpertCache(slots=6, layers=1, experts_per_layer=16)
    c.place(np.arange(6))
    for e in range(6):
        c.lookup(0, np.array([e]), tokens=np.array([e + 1]))
    lent = c.lend(3)
    assert lent is not None and len(lent) == 3
    # the coldest three (experts 0, 1, 2) were lent out and are misses now
    assert sorted(c.expert_in[lent].tolist()) == [EMPTY] * 3
    assert (c.lookup(0, np.array([0, 1, 2])) == EMPTY).all()
    for e in range(6, 16):
        got = c.admit(0, np.array([e]))
        assert not np.isin(got, lent).any(), "an admission used a slot on loan"
    assert c.available_slots == 3 and c.lend(4) is None
    c.check()
    c.give_back(lent)
    assert c.slots_on_loan == 0 and c.available_slots == 6
    assert len(c.place(np.array([0, 1, 2]))) == 3, "returned slots come back empty and usable"
    c.check()


def test_elastic_trim_empties_idle_slots_and_they_are_lent_first():
    c = ExpertCache(slots=4, layers=1, experts_per_layer=8, decay=0.5)
    c.place(np.arange(4))
    c.lookup(0, np.array([0, 1, 2, 3]), tokens=np.array([100, 100, 1, 1]))
    for _ in range(6):  # experts 2 and 3 decay to ~0.016, 0 and 1 stay at ~1.6
        c.tick()
    trimmed = c.trim_idle(max_slots=3, idle_below=0.05)
    assert sorted(c.expert_in[trimmed].tolist()) == [EMPTY, EMPTY] and len(trimmed) == 2
    assert c.slot_of[0] != EMPTY and c.slot_of[1] != EMPTY
    lent = c.lend(2)
    assert sorted(lent.tolist()) == sorted(trimmed.tolist())


@hyp_settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["lookup", "admit", "lend", "return", "tick"]),
                          st.lists(st.integers(0, 11), min_size=1, max_size=4)), max_size=40))
def test_random_traffic_keeps_the_tables_consistent(ops):
    c = ExpertCache(slots=5, layers=2, experts_per_layer=6)
    loans = []
    for op, arg in ops:
        layer, experts = arg[0] % 2, np.unique(np.array(arg) % 6)
        if op == "lookup":
            h0, m0 = c.hits, c.misses
            c.lookup(layer, experts)
            assert (c.hits - h0) + (c.misses - m0) == len(experts)
        elif op == "admit":
            slots = c.admit(layer, experts)
            assert not c.on_loan[slots[slots != EMPTY]].any()
        elif op == "lend":
            got = c.lend(len(experts))
            if got is not None:
                loans.append(got)
        elif op == "return" and loans:
            c.give_back(loans.pop())
        else:
            c.tick()
        c.check()
    assert c.slots_on_loan == sum(len(x) for x in loans)


def test_admit_picks_the_same_coldest_slots_as_the_full_order():
    rng = np.random.default_rng(3)
    for trial in range(200):
        c = ExpertCache(slots=64, layers=2, experts_per_layer=64)
        c.place(rng.permutation(128)[: rng.integers(0, 64)])
        c.freq[:] = rng.integers(0, 4, 128).astype(float)  # many ties: the slot number must break them
        c.trimmed[rng.integers(0, 64, 3)] = True
        c.on_loan[rng.integers(0, 64, 3)] = True
        c.expert_in[c.on_loan | c.trimmed] = -1
        c.slot_of[:] = -1
        held = np.flatnonzero(c.expert_in != -1)
        c.slot_of[c.expert_in[held]] = held
        mask = c.usable()
        n = int(rng.integers(1, 12))
        assert np.array_equal(c._coldest(mask, n), c._coldness_order(mask)[:n]), trial


def test_a_loans_buffer_slots_are_one_run_of_the_coldest_adjacent_slots():
    c = ExpertCache(slots=10, layers=1, experts_per_layer=10)
    c.place(np.arange(10))
    c.freq[:] = [5, 5, 1, 0, 9, 5, 5, 5, 0, 5]
    c.on_loan[3] = True  # slot 3 is lent already: a run may not cross it
    c.expert_in[3] = -1
    c.slot_of[3] = -1
    run = c.lend_run(2)
    # pairs not crossing slot 3: (1,2) 6, (7,8) 5, (8,9) 5, others more: the first coldest run
    assert run.tolist() == [7, 8]
    assert c.on_loan[[7, 8]].all() and (c.expert_in[[7, 8]] == -1).all(), "lent slots hold no expert"
    c.check()


def test_a_loans_buffer_run_takes_empty_slots_before_evicting_experts():
    # before any lookup every frequency is 0: empty slots must still count colder than held experts, or the run
    # lands on slot 0 and evicts experts while a cache with room for every expert has empty slots at its end
    c = ExpertCache(slots=12, layers=1, experts_per_layer=8)
    c.place(np.arange(8))
    run = c.lend_run(3)
    assert run.tolist() == [8, 9, 10], run
    assert (c.slot_of[np.arange(8)] != -1).all(), "no expert was evicted"
    c.check()


def test_a_reserved_slot_is_the_coldest_held_empty_and_out_of_every_lookup_and_admission_until_filled():
    c = ExpertCache(slots=6, layers=1, experts_per_layer=10)
    c.place(np.arange(6))
    c.freq[:6] = [5, 1, 7, 0.5, 9, 3]
    got = c.reserve(0, np.array([8, 9, 8, 2]))  # 8 twice (one slot), 2 resident (none)
    assert got.tolist() == [3, 1, -1, -1], got  # the two coldest slots, coldest first
    assert c.slot_of[[3, 1]].tolist() == [-1, -1] and c.evictions == 2, "their experts were evicted"
    assert c.slot_of[[8, 9]].tolist() == [-1, -1], "a reserved expert is not resident until filled"
    assert c.on_loan[[3, 1]].all() and (c.expert_in[[3, 1]] == -1).all()
    assert (c.lookup(0, np.array([8, 9])) == -1).all() and c.misses == 2
    # an admission evicts a held expert, never a reserved slot
    c.freq[8] = 100
    slot = c.admit(0, np.array([7]))
    assert int(slot[0]) not in (1, 3), slot
    c.check()
    c.fill(c.row(0, 8), 3)
    assert c.slot_of[8] == 3 and c.expert_in[3] == 8 and not c.on_loan[3]
    c.check()
    with pytest.raises(ValueError):
        c.fill(c.row(0, 9), 3)  # slot 3 is filled now
    c.give_back(np.array([1]))  # the other reservation goes back empty
    assert not c.on_loan.any() and c.expert_in[1] == -1
    c.check()


def test_reserve_stops_when_no_usable_slot_is_left():
    c = ExpertCache(slots=2, layers=1, experts_per_layer=4)
    c.place(np.arange(2))
    assert c.reserve(0, np.array([2, 3]), keep=np.array([0])).tolist() == [1, -1]
    assert c.slot_of[0] == 0, "a kept slot is not taken"
