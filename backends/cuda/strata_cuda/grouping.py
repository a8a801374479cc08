"""How moe_grouped_ffn lays token groups out for batched GEMMs: pure numpy, so it is tested without a GPU."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GroupLayout:
    """Groups of similar size padded to a common row count for one strided batched GEMM.

    `slots[b]` is the expert slot of batch b; `rows_per_batch` the padded row count (the largest group here);
    `row_of_padded[b * rows_per_batch + i]` the row of x that padded position i of batch b holds, or -1 for padding.
    """

    slots: np.ndarray
    rows_per_batch: int
    row_of_padded: np.ndarray

    @property
    def batches(self) -> int:
        """How many groups this layout runs."""
        return int(self.slots.shape[0])


def _validate(offsets: np.ndarray, slots: np.ndarray, n_rows: int, n_slots: int) -> None:
    if offsets.shape[0] != slots.shape[0] + 1:
        raise ValueError(f"offsets needs one more entry than slots: {offsets.shape[0]} offsets, {slots.shape[0]} slots")
    if offsets[0] < 0 or offsets[-1] > n_rows or np.any(np.diff(offsets) < 0):
        raise ValueError(f"offsets must rise from 0 to at most {n_rows} rows")
    used = slots[np.diff(offsets) > 0]
    if used.size and (used.min() < 0 or used.max() >= n_slots):
        raise ValueError(f"slots must lie in [0, {n_slots})")


def _layout(lo: np.ndarray, counts: np.ndarray, slots: np.ndarray) -> GroupLayout:
    per = int(counts.max())
    total = int(counts.sum())
    before = np.concatenate(([0], np.cumsum(counts)[:-1]))
    within = np.arange(total, dtype=np.int64) - np.repeat(before, counts)
    positions = np.repeat(np.arange(counts.size, dtype=np.int64) * per, counts) + within
    row_of_padded = np.full(counts.size * per, -1, dtype=np.int32)
    row_of_padded[positions] = np.repeat(lo, counts) + within
    return GroupLayout(slots=slots.astype(np.int32), rows_per_batch=per, row_of_padded=row_of_padded)


def group_layouts(offsets, slots, n_rows: int, n_slots: int) -> list[GroupLayout]:
    """Layouts for groups `offsets[g]:offsets[g+1]` -> slot `slots[g]`, bucketed by size; bad input raises ValueError.

    Empty groups are dropped. Groups are bucketed by the power of two at or above their row count, so padding at
    most doubles the rows of any bucket, however skewed the routing (one hot expert does not pad every other group
    to its size).
    """
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
    slots = np.asarray(slots, dtype=np.int64).reshape(-1)
    if offsets.size == 0:
        raise ValueError("offsets needs at least one entry")
    _validate(offsets, slots, n_rows, n_slots)
    counts = np.diff(offsets)
    active = np.nonzero(counts > 0)[0]
    if active.size == 0:
        return []
    bucket = np.ceil(np.log2(counts[active])).astype(np.int64)
    out = []
    for b in np.unique(bucket):
        pick = active[bucket == b]
        out.append(_layout(offsets[pick], counts[pick], slots[pick]))
    return out


def gemm_pieces(count, cap, piece_rows: int, round_rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The GEMM problems that cover groups of `count` rows, each in a stack block of `cap` rows: (block, first row
    within the block, rows) per problem, blocks in order.

    A group of more than piece_rows rows runs as pieces of piece_rows rows (the same expert's weights each) plus
    its remainder rounded by round_rows (a size class, clipped to the block), so one hot expert does not make a
    class of its own whose few large problems leave most of the chip to one GEMM's tail, and its rows are not
    padded to a class; a smaller group is one problem of round_rows(count) rows (clipped to its block).
    piece_rows <= 0 keeps every group whole. Empty groups give no problem.
    """
    count = np.asarray(count, dtype=np.int64).reshape(-1)
    cap = np.asarray(cap, dtype=np.int64).reshape(-1)
    if count.shape != cap.shape or np.any(cap < count):
        raise ValueError("gemm_pieces: every block needs cap >= count")
    live = np.flatnonzero(count > 0)
    # no group to split (a uniform chunk, every ring group): the pieces below would give these same problems, at
    # ~15 numpy calls a group of host time (FastMoE._group runs this per streamed copy group)
    if piece_rows <= 0 or count.max(initial=0) <= piece_rows:
        whole = np.minimum(np.asarray(round_rows(count[live]), dtype=np.int64), cap[live])
        return live, np.zeros(live.size, dtype=np.int64), whole
    full = np.where(count > piece_rows, count // piece_rows, 0)
    rem = count - full * piece_rows
    blk_full = np.repeat(np.arange(count.size, dtype=np.int64), full)
    first = np.concatenate(([0], np.cumsum(full)[:-1])) if count.size else full
    off_full = (np.arange(blk_full.size, dtype=np.int64) - np.repeat(first, full)) * piece_rows
    has_rem = np.flatnonzero(rem > 0)
    rows_rem = np.minimum(np.asarray(round_rows(rem[has_rem]), dtype=np.int64),
                          cap[has_rem] - full[has_rem] * piece_rows)
    blk = np.concatenate([blk_full, has_rem])
    off = np.concatenate([off_full, full[has_rem] * piece_rows])
    rows = np.concatenate([np.full(blk_full.size, piece_rows, dtype=np.int64), rows_rem])
    order = np.lexsort((off, blk))
    return blk[order], off[order], rows[order]
