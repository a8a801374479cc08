"""The one chunk-halving rule: the planner's fixed chunk, its host step-down, a request's loan and a device refusal."""

from __future__ import annotations


def halve(chunk_tokens: int, grid_tokens: int) -> int:
    """The next smaller chunk: half, rounded down to the grid while above it, then plain halves down to 1 token.

    Buffers come in grid multiples (kernel tiles), so a chunk above the grid stays on it; below the grid only a
    device that refuses even a grid chunk's buffers asks for less, and then halves reach 1.
    """
    c, g = int(chunk_tokens), max(1, int(grid_tokens))
    if c > g:
        return max(g, (c // 2) // g * g)
    return max(1, c // 2)


def grid_chunks(grid_tokens: int, upto_tokens: int) -> list[int]:
    """The grid chunks from one grid step up to `upto_tokens`."""
    return list(range(grid_tokens, upto_tokens + 1, grid_tokens))
