"""How QuantMoE's prefill groups its cached experts (quant_ffn.hit_groups, pure numpy): the runs of blocks whose f16
was speculated before the routing (the first cached experts, one scratch half each), then groups dequantized into
the scratch, whole or half by half; and which formats the super-block kernel takes (quant_ffn.sb_takes)."""

from __future__ import annotations

import numpy as np
import pytest

strata_cuda_quant = pytest.importorskip("strata_cuda.quant_ffn")
hit_groups, sb_takes = strata_cuda_quant.hit_groups, strata_cuda_quant.sb_takes


def _covers(groups, n):
    """The groups cover blocks 0..n-1 once each, in order."""
    at = 0
    for start, m, _, _ in groups:
        assert start == at and m > 0
        at += m
    assert at == n


def test_no_speculation_alternates_halves_or_fills_the_scratch():
    slots = np.arange(100, 110)
    halves = hit_groups(slots, 4, (), rest_whole=False)
    assert [(s, m, h) for s, m, h, _ in halves] == [(0, 4, (0,)), (4, 4, (1,)), (8, 2, (0,))]
    whole = hit_groups(slots, 4, (), rest_whole=True)
    assert [(s, m, h) for s, m, h, _ in whole] == [(0, 8, (0, 1)), (8, 2, (0, 1))]
    assert not any(a for *_, a in halves + whole)


def test_a_first_group_of_first_experts_where_nothing_was_speculated():
    g = hit_groups(np.arange(10), 4, (), rest_whole=False, first=1)
    assert [(s, m) for s, m, _, _ in g] == [(0, 1), (1, 4), (5, 4), (9, 1)]
    _covers(g, 10)


def test_speculated_runs_come_first_merged_or_not():
    # 12 cached experts in slots 50.., halves of 4; the routing left out experts 1 and 6 (blocks skip them)
    slots = np.array([50, 52, 53, 54, 55, 57, 58, 59, 60, 61])
    spec = (np.array([50, 51, 52, 53]), np.array([54, 55, 56, 57]))
    split = hit_groups(slots, 4, spec, merge_spec=False, rest_whole=False)
    assert split == [(0, 3, (0,), True), (3, 3, (1,), True), (6, 4, (0,), False)]
    merged = hit_groups(slots, 4, spec, merge_spec=True, rest_whole=True)
    assert merged == [(0, 6, (0, 1), True), (6, 4, (0, 1), False)]
    # the half used least recently takes the next group: half 0 after (0, 1), then half 1
    merged_halves = hit_groups(np.arange(50, 62), 4, spec, merge_spec=True, rest_whole=False)
    assert [(s, m, h, a) for s, m, h, a in merged_halves] == [(0, 8, (0, 1), True), (8, 4, (0,), False)]
    for g, n in ((split, 10), (merged, 10), (merged_halves, 12)):
        _covers(g, n)


def test_a_block_not_speculated_ends_the_run_and_is_dequantized():
    # slot 52 was forgotten (an admission gave it another expert): the run in half 0 stops before it
    slots = np.array([50, 51, 52, 53, 54])
    spec = (np.array([50, 51, 53]), np.array([54]))
    g = hit_groups(slots, 4, spec, merge_spec=False, rest_whole=False)
    assert g[0] == (0, 2, (0,), True)
    assert all(not a for _, _, _, a in g[1:])  # 52 and what follows it: no second run starts after a gap
    _covers(g, 5)
    assert hit_groups(slots, 4, (np.array([], np.int64), np.array([54])))[0][3] is False


def test_blocks_of_one_half_only():
    g = hit_groups(np.array([7, 8]), 4, (np.array([7, 8, 9]),), merge_spec=True)
    assert g == [(0, 2, (0,), True)]


@pytest.mark.parametrize("gate_up,down,h,f,takes", [
    ("q4_k", "q6_k", 2048, 768, True), ("q5_k", "q8_0", 256, 512, True), ("q4_k", "q6_k", 2048, 96, False),
    ("mxfp4", "q6_k", 256, 256, False), ("q8_0", "f16", 256, 256, False)])
def test_the_super_block_kernel_takes_whole_super_block_rows(gate_up, down, h, f, takes):
    from strata_core.api.kernels import ExpertFormat
    assert sb_takes(ExpertFormat(gate_up, down, h, f)) is takes
