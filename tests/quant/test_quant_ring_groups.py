"""QuantMoE's copy groups of a streamed layer (quant_ffn.ring_group_sizes, QuantMoE.miss_groups) and the whole-group
answer of grouping.gemm_pieces that every copy group takes: host arithmetic, no GPU (bench/results/q2_h200/ is why)."""

from __future__ import annotations

import numpy as np
import pytest

from strata_cuda.fast import FastMoE, StackLayout, class_rows
from strata_cuda.grouping import gemm_pieces
from strata_cuda.quant_ffn import RING_GROUPS_IN_FLIGHT, RING_TAIL, QuantMoE, ring_group_sizes

#: Qwen3-30B-A3B's expert in Q4_K_M (gate/up Q4_K, down Q6_K), bytes of a slot
Q4KM_SLOT_BYTES = 3_059_712


def fast_moe(group_experts: int) -> FastMoE:
    """A FastMoE with only what miss_groups reads (no device)."""
    moe = object.__new__(FastMoE)
    moe.group_experts = group_experts
    return moe


def quant_moe(group_experts: int = 32) -> QuantMoE:
    """A QuantMoE with only what miss_groups reads (no device), its defaults as __init__ sets them."""
    moe = object.__new__(QuantMoE)
    moe.group_experts = group_experts
    moe.ring_groups_in_flight = RING_GROUPS_IN_FLIGHT
    moe.ring_tail = RING_TAIL
    return moe


@pytest.mark.parametrize("slot_bytes", [0, 2 << 20, Q4KM_SLOT_BYTES, 9_437_184, 100 << 20])
@pytest.mark.parametrize("group_experts", [1, 8, 32])
def test_four_in_flight_are_fast_moes_groups(slot_bytes, group_experts):
    moe = fast_moe(group_experts)
    from strata_cuda.fast import COPY_GROUP_BYTES
    want = max(group_experts, COPY_GROUP_BYTES // slot_bytes if slot_bytes else 0)
    for n in (1, 2, 7, 16, 17, 64, 127, 128, 256):
        for ring in (1, 4, 8, 31, 32, 64, 384):
            assert ring_group_sizes(n, ring, want, 4, (4, 2, 2)) == moe.miss_groups(n, ring, slot_bytes), (n, ring)


@pytest.mark.parametrize("in_flight", [1, 2, 3, 4])
def test_groups_cover_the_misses_and_fit_the_ring_in_flight(in_flight):
    for n in range(1, 300, 7):
        for ring in (1, 2, 5, 32, 33, 64, 384):
            for want in (1, 8, 16, 32):
                sizes = ring_group_sizes(n, ring, want, in_flight)
                assert sum(sizes) == n and min(sizes) >= 1, (n, ring, want)
                assert max(sizes) <= max(1, min(want, ring // in_flight)), (n, ring, want, sizes)


def place(sizes: list[int], ring: int) -> list[list[int]]:
    """_stream_misses' placement: for each group, the earlier groups whose ring slots it reuses."""
    last, cursor, deps = [-1] * ring, 0, []
    for g, size in enumerate(sizes):
        if cursor + size > ring:
            cursor = 0
        deps.append(sorted({u for u in last[cursor:cursor + size] if u >= 0}))
        last[cursor:cursor + size] = [g] * size
        cursor += size
    return deps


def test_the_bench_ring_streams_two_groups_of_fifteen_at_a_time():
    # bench/quant_layer_h200.py: 128 experts through 32 ring slots; FastMoE's rule gave 18 groups of 8 (host-bound)
    sizes = quant_moe().miss_groups(128, 32, Q4KM_SLOT_BYTES)
    assert sizes == [15] * 8 + [4, 2, 2]
    deps = place(sizes, 32)
    # while group g computes, group g + 1 is copying: no group waits on the one just before it
    assert all(not d or max(d) <= g - 2 for g, d in enumerate(deps)), deps
    assert fast_moe(32).miss_groups(128, 32, Q4KM_SLOT_BYTES) == [8] * 15 + [4, 2, 2]


def test_the_product_ring_keeps_groups_of_thirty():
    # the seeds' ring at a 4096-token chunk (384 slots) was never the constraint: groups of group_experts
    assert quant_moe().miss_groups(128, 384, Q4KM_SLOT_BYTES) == [30] * 4 + [4, 2, 2]


def test_gemm_pieces_of_groups_no_larger_than_a_piece_are_the_whole_groups():
    count = np.array([250, 0, 256, 512, 1, 300, 17])
    lay = StackLayout.of(count, "classes")
    blk, off, rows = gemm_pieces(lay.count, lay.cap, 512, class_rows)
    assert blk.tolist() == [0, 2, 3, 4, 5, 6] and off.tolist() == [0] * 6
    assert rows.tolist() == lay.cap[[0, 2, 3, 4, 5, 6]].tolist() == [256, 256, 512, 8, 384, 24]
    assert [a.dtype for a in (blk, off, rows)] == [np.int64] * 3
    # the same counts with a smaller piece size do split (the shortcut is not taken)
    blk, off, rows = gemm_pieces(lay.count, lay.cap, 256, class_rows)
    assert blk.tolist() == [0, 2, 3, 3, 4, 5, 5, 6] and off.tolist() == [0, 0, 0, 256, 0, 0, 256, 0]
