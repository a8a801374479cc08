"""triton_moe's tile arithmetic on the CPU: the programs' expert look-up, the grid's bound, the tile configs.

The kernels themselves run in tests/gpu/test_device_gemm.py (a GPU and Triton needed); here the look-up each program
does (expert_of_tile, the kernels' prefix sum in numpy) must give tile_table's tiles, in order, for any routing, and
the grid (max_row_tiles) must hold every tile of any routing of the rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_cuda import triton_moe as tm


def _routings(rng, experts: int, rows: int):
    yield np.full(experts, rows // experts)  # uniform
    yield np.bincount(rng.integers(0, experts, rows), minlength=experts)  # random
    c = np.zeros(experts, np.int64)
    c[3] = rows  # every row on one expert
    yield c
    yield np.ones(experts, np.int64) * 0  # nothing routed
    skew = rng.zipf(1.3, rows) % experts
    yield np.bincount(skew, minlength=experts)


@pytest.mark.parametrize("bm", [16, 64, 128])
def test_each_program_finds_its_tile_in_expert_order(bm):
    rng = np.random.default_rng(7)
    for counts in _routings(rng, 37, 1000):
        expert, start = tm.tile_table(counts, bm)
        total = int(expert.size)
        for tile in range(total):
            e, r0, tot = tm.expert_of_tile(counts, bm, tile)
            assert (e, r0, tot) == (expert[tile], start[tile], total), (counts.tolist(), tile)
            assert 0 <= r0 < counts[e]  # a tile starts inside its expert's rows
        # programs past the last tile see tile >= total and return
        assert tm.expert_of_tile(counts, bm, total)[2] == total


def test_tile_table_covers_every_row_once():
    rng = np.random.default_rng(3)
    for counts in _routings(rng, 16, 777):
        expert, start = tm.tile_table(counts, 64)
        covered = np.zeros(16, np.int64)
        for e, r0 in zip(expert, start):
            covered[e] += min(64, counts[e] - r0)
        assert covered.tolist() == counts.tolist()


@pytest.mark.parametrize("bm", [64, 128])
def test_the_grid_holds_every_routing(bm):
    rng = np.random.default_rng(11)
    experts, top_k = 128, 8
    for tokens in (1, 5, 333, 4096):
        rows = tokens * top_k
        bound = tm.max_row_tiles(rows, experts, bm)
        for counts in _routings(rng, experts, rows):
            assert int(tm.tile_table(counts, bm)[0].size) <= bound
        # the worst case: as many experts as possible one row past a whole tile
        worst = np.zeros(experts, np.int64)
        n = min(experts, rows // (bm + 1)) if rows > bm else min(experts, rows)
        worst[:n] = bm + 1 if rows > bm else 1
        worst[0] += rows - int(worst.sum())
        assert int(worst.sum()) == rows
        assert int(tm.tile_table(worst, bm)[0].size) <= bound


def test_tile_configs_parse_and_refuse():
    assert tm.TileConfig.parse(None, tm.DEFAULT_CONFIG) == tm.TileConfig(*tm.DEFAULT_CONFIG)
    assert tm.TileConfig.parse("64:128:32:4:3", tm.DEFAULT_CONFIG) == tm.TileConfig(64, 128, 32, 4, 3)
    for bad in ("64:128:32:4", "64:0:32:4:3", "a:b:c:d:e"):
        with pytest.raises(ValueError):
            tm.TileConfig.parse(bad, tm.DEFAULT_CONFIG)


def test_shapes_that_do_not_tile_are_refused():
    assert tm.DeviceGroupedGEMM.takes(2048, 768)
    assert not tm.DeviceGroupedGEMM.takes(2048, 96)  # ffn not a multiple of the gate|up column tile
    assert not tm.DeviceGroupedGEMM.takes(2000, 768)  # hidden not a multiple of the K step


def test_available_answers_without_a_gpu():
    assert tm.available() in (True, False)  # never raises, with or without Triton and a GPU


def test_the_defaults_narrow_to_tile_small_shapes():
    gu, dn = tm.fitted(2048, 768)
    assert (gu, dn) == (tm.TileConfig(*tm.DEFAULT_CONFIG), tm.TileConfig(*tm.DOWN_CONFIG))
    for h, f in ((128, 64), (256, 128), (2048, 1408), (4096, 14336), (80, 48)):
        gu, dn = tm.fitted(h, f)
        assert tm.DeviceGroupedGEMM.takes(h, f, gu, dn), (h, f, gu, dn)
        assert gu.bn <= tm.DEFAULT_CONFIG[1] and dn.bn <= tm.DOWN_CONFIG[1]
    assert tm.fitted(2048, 40) is None  # 40 is no multiple of 16


def test_a_launch_over_a_range_of_experts_finds_only_theirs():
    rng = np.random.default_rng(5)
    for counts in _routings(rng, 40, 900):
        for lo, hi in ((0, 40), (0, 13), (13, 26), (26, 40), (39, 40)):
            sub = np.where((np.arange(40) >= lo) & (np.arange(40) < hi), counts, 0)
            expert, start = tm.tile_table(sub, 64)
            assert int(expert.size) <= tm.max_row_tiles(int(counts[lo:hi].sum()), hi - lo, 64)
            for tile in range(int(expert.size)):
                e, r0, tot = tm.expert_of_tile(counts, 64, tile, (lo, hi))
                assert lo <= e < hi and (e, r0, tot) == (expert[tile], start[tile], expert.size)


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k", "q8_0"])
def test_the_k_loop_decode_is_the_oracles_dequantization_bit_for_bit(fmt):
    """step_weights, the quant kernels' decode op for op, over every K step of random rows (any bytes: scales and
    halves of every sign and size, NaN and inf included) equals quants.dequantize's float32 bits."""
    from strata_core.reference import quants
    rng = np.random.default_rng(13)
    k = 768 if fmt != "q8_0" else 512  # 3 super-blocks (6 steps), or 16 q8_0 blocks (4 steps)
    rb = quants.row_bytes(fmt, k)
    rows = rng.integers(0, 256, (16, rb), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 and the like: the format's own values
        want = quants.dequantize(fmt, rows, k).reshape(16, k)
        got = np.concatenate([tm.step_weights(fmt, rows, s) for s in range(k // tm.QUANT_BK)], axis=1)
    assert got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_the_k_loop_decode_refuses_other_types():
    with pytest.raises(ValueError, match="mxfp4"):
        tm.step_weights("mxfp4", np.zeros((1, 17), np.uint8), 0)
