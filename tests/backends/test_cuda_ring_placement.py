"""fast.ring_placement: where a streamed layer's copy groups sit on the ring (a circular buffer), and which of the
layer's own groups each must wait for (pure python, no GPU). A layer starts where the previous one through the ring
ended, so the next layer's first group (its prefetch) does not reuse the slots the previous layer's last groups read,
and no slot is left idle, so as many groups are in flight wherever a layer starts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from strata_cuda.fast import ring_placement


def replay(sizes, ring, start):
    """Slot -> the group that last used it, checking every group's slots are distinct, inside the ring, and its deps
    exactly the earlier groups that last used them."""
    place, deps, end = ring_placement(sizes, ring, start)
    last = [-1] * ring
    for g, (pos, n) in enumerate(zip(place, sizes)):
        pos = pos.tolist()
        assert len(pos) == n and len(set(pos)) == n and all(0 <= p < ring for p in pos), (g, pos)
        assert deps[g] == sorted({last[p] for p in pos if last[p] >= 0}), f"group {g}: deps {deps[g]}"
        for p in pos:
            last[p] = g
    return place, last, end


def test_the_groups_go_round_the_ring_without_a_gap():
    place, _, end = replay([7] * 8 + [4, 2, 2], 32, 0)
    flat = np.concatenate(place).tolist()
    assert flat == [i % 32 for i in range(len(flat))], "the groups are not laid one after another round the ring"
    assert end == len(flat) % 32


@pytest.mark.parametrize("start", [0, 4, 29])
def test_as_many_groups_are_in_flight_wherever_the_layer_starts(start):
    """A group waits for the earlier groups whose slots it reuses: the copies ahead of the compute are
    ring / group size groups (4 for 8 of 32) from any start (skipping the ring's tail to keep a group contiguous
    left 3 when a layer began mid-ring)."""
    _, deps, _ = ring_placement([8] * 12, 32, start)
    assert [d for d in deps[:4]] == [[]] * 4 and all(d == [g - 4] for g, d in enumerate(deps) if g >= 4), deps


@pytest.mark.parametrize("ring,sizes", [(32, [7] * 8 + [4, 2, 2]), (40, [7] * 8 + [4, 2, 2]),
                                        (32, [8] * 6 + [4, 2, 2]), (48, [6] * 10 + [4, 2, 2])])
def test_the_next_layer_first_group_reuses_none_of_the_previous_layer_tail(ring, sizes):
    start = 0
    for layer in range(6):
        _, last, end = replay(sizes, ring, start)
        nxt = ring_placement(sizes[:1], ring, end)[0][0]
        users = {last[int(p)] for p in nxt}
        tail = set(range(len(sizes) - 3, len(sizes)))  # the 4, 2, 2 groups that compute after the last landing
        assert not users & tail, f"layer {layer}: the prefetch reuses slots of tail groups {sorted(users & tail)}"
        start = end


def test_a_start_outside_the_ring_is_slot_zero_and_a_group_larger_than_the_ring_is_refused():
    for start in (-1, 32, 99):
        assert [p.tolist() for p in ring_placement([4, 4], 32, start)[0]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError):
        ring_placement([9], 8)


def test_every_group_fits_for_many_shapes():
    for ring, big, start in itertools.product((8, 12, 32), (1, 2, 3, 8), range(0, 12, 3)):
        if big > ring:
            continue
        replay([big] * 9 + [s for s in (4, 2, 2) if s <= big], ring, start % ring)
