"""grouping.gemm_pieces: the GEMM problems that cover each expert's rows of the compact stack (pure numpy)."""

from __future__ import annotations

import numpy as np
import pytest

from strata_cuda.fast import StackLayout, class_rows
from strata_cuda.grouping import gemm_pieces


def covered(count, cap, blk, off, rows):
    """Per block, a mask of the stack rows the problems compute; raises if two problems overlap."""
    masks = [np.zeros(int(c), dtype=bool) for c in cap]
    for b, o, n in zip(blk.tolist(), off.tolist(), rows.tolist()):
        m = masks[b]
        assert o >= 0 and o + n <= m.size, f"block {b}: problem [{o}, {o + n}) outside its {m.size} rows"
        assert not m[o:o + n].any(), f"block {b}: problems overlap at [{o}, {o + n})"
        m[o:o + n] = True
    return masks


@pytest.mark.parametrize("piece", [0, 32, 128, 256])
def test_every_row_is_computed_once_and_inside_its_block(piece):
    rng = np.random.default_rng(3)
    # skewed counts (a few hot experts of thousands of rows), small ones, exact multiples and empty groups
    count = np.concatenate([rng.integers(0, 40, 60), rng.integers(200, 4000, 8), [0, 256, 512, 257, 1, 4096]])
    lay = StackLayout.of(count, "classes")
    blk, off, rows = gemm_pieces(lay.count, lay.cap, piece, class_rows)
    masks = covered(lay.count, lay.cap, blk, off, rows)
    for b, c in enumerate(count.tolist()):
        assert masks[b][:c].all(), f"block {b}: rows of its {c} not computed (piece {piece})"
    assert set(blk.tolist()) == set(np.flatnonzero(count > 0).tolist())  # empty groups give no problem
    assert np.all(np.diff(blk) >= 0)  # blocks in order
    if piece:
        assert rows.max() <= max(piece, int(class_rows(np.array([piece]))[0]))
        big = count > piece
        # a split group computes its rows rounded up only in its last piece: fewer rows than its class
        for b in np.flatnonzero(big):
            done = int(rows[blk == b].sum())
            assert done < int(c_cap := lay.cap[b]) or done == count[b] == c_cap, (b, done, lay.cap[b])
            # only the remainder r = count mod piece is padded, to its class: at most max(15, r / 2) rows more
            r = int(count[b] % piece)
            assert done - count[b] <= max(15, r // 2), (b, done, count[b])


def test_whole_groups_without_a_piece_size_are_the_class_rows():
    count = np.array([3900, 1, 7, 250, 0, 2])
    lay = StackLayout.of(count, "classes")
    blk, off, rows = gemm_pieces(lay.count, lay.cap, 0, class_rows)
    assert blk.tolist() == [0, 1, 2, 3, 5] and not off.any()
    assert rows.tolist() == lay.cap[[0, 1, 2, 3, 5]].tolist() == [4096, 8, 8, 256, 8]


def test_a_hot_group_becomes_pieces_of_the_same_block():
    count = np.array([3893, 5, 300])
    lay = StackLayout.of(count, "classes")
    blk, off, rows = gemm_pieces(lay.count, lay.cap, 256, class_rows)
    assert blk.tolist() == [0] * 16 + [1] + [2, 2]
    assert off[:16].tolist() == list(range(0, 3840 + 1, 256))
    assert rows[:15].tolist() == [256] * 15 and rows[15] == 64  # 3893 = 15 x 256 + 53, 53 -> class 64
    assert rows[16] == 8 and off[17:].tolist() == [0, 256] and rows[17:].tolist() == [256, 48]


def test_bad_blocks_raise():
    with pytest.raises(ValueError):
        gemm_pieces(np.array([10]), np.array([8]), 256, class_rows)
    with pytest.raises(ValueError):
        gemm_pieces(np.array([10, 2]), np.array([16]), 256, class_rows)
