"""fast.ring_placement: where a streamed layer's copy groups sit on the ring, and which of the layer's own groups each
must wait for (pure python, no GPU). A layer starts where the previous one through the ring ended, so the next
layer's first group (its prefetch) does not reuse the slots the previous layer's last groups read."""

from __future__ import annotations

import itertools

import pytest

from strata_cuda.fast import ring_placement


def replay(sizes, ring, start):
    """Slot -> the group that last used it, checking no group runs past the ring and deps are exact."""
    place, deps, end = ring_placement(sizes, ring, start)
    last = [-1] * ring
    for g, (p, n) in enumerate(zip(place, sizes)):
        assert 0 <= p and p + n <= ring, f"group {g} at [{p}, {p + n}) outside a ring of {ring}"
        assert deps[g] == sorted({u for u in last[p:p + n] if u >= 0}), f"group {g}: deps {deps[g]}"
        last[p:p + n] = [g] * n
    assert end == (place[-1] + sizes[-1]) % ring if sizes else end == 0
    return place, last, end


def test_from_slot_zero_the_groups_fill_the_ring_and_wrap():
    place, _, end = replay([7] * 8 + [4, 2, 2], 32, 0)
    assert place == [0, 7, 14, 21, 0, 7, 14, 21, 28, 0, 2] and end == 4


@pytest.mark.parametrize("ring,sizes", [(32, [7] * 8 + [4, 2, 2]), (40, [7] * 8 + [4, 2, 2]),
                                        (32, [8] * 6 + [4, 2, 2]), (48, [6] * 10 + [4, 2, 2])])
def test_the_next_layer_first_group_reuses_none_of_the_previous_layer_tail(ring, sizes):
    start = 0
    for layer in range(6):
        _, last, end = replay(sizes, ring, start)
        nxt, _, _ = ring_placement(sizes[:1], ring, end)
        users = {last[i] for i in range(nxt[0], nxt[0] + sizes[0])}
        tail = set(range(len(sizes) - 3, len(sizes)))  # the 4, 2, 2 groups that compute after the last landing
        assert not users & tail, f"layer {layer}: the prefetch reuses slots of tail groups {sorted(users & tail)}"
        start = end


def test_a_start_outside_the_ring_is_slot_zero():
    for start in (-1, 32, 99):
        assert ring_placement([4, 4], 32, start)[0] == [0, 4]


def test_every_group_fits_for_many_shapes():
    for ring, big, start in itertools.product((8, 12, 32), (1, 2, 3, 8), range(0, 12, 3)):
        if big > ring:
            continue
        replay([big] * 9 + [s for s in (4, 2, 2) if s <= big], ring, start % ring)
