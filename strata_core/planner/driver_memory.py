"""The device bytes the driver takes beside the plan's regions, as plan lines from the backend's measured facts.

Measured on the H200 (bench/results/f_h200/fidelity_diag.json): every byte a cuda run held beyond its regions was
the driver's, not the runtime's: each allocation rounded up to 2 MiB, and page tables for page-locked host memory
(2 MiB per GiB pinned: 8 bytes per 4 KiB page). Two lines, each 0 where the backend's probe measured no fact:
- `alloc_rounding_bytes`: the runtime takes all its device lines at start as one block (PlanMemory.reserve), which
  the driver rounds up to its granularity; the block also holds each start-up array's alignment.
- `pinned_map_bytes`: the page tables of the page-locked memory the plan pins (the expert arena, the CPU share's
  buffer, copy staging when the arena is not pinned whole, pinned KV).
"""

from __future__ import annotations

from typing import Any

from strata_core.api.facts import GIB

#: Carves from the start-up block begin on this boundary (strata_core.runtime.devmem.ALIGN_BYTES).
ALIGN_BYTES = 256


def start_arrays(model: Any) -> int:
    """A bound on the arrays start-up carves: the regions and pool arrays, and up to four dense tensors a layer."""
    return 16 + 4 * int(getattr(model, "moe_layers", 0) or 0)


def alignment_allowance_bytes(model: Any) -> int:
    """Bytes the start-up block keeps for aligning every array it holds."""
    return ALIGN_BYTES * start_arrays(model)


def alloc_rounding_bytes(device: Any, model: Any, regions_bytes: int) -> int:
    """The start-up block (regions + alignment, rounded up to the driver's granularity) minus the regions."""
    g = int(getattr(device, "alloc_granularity_bytes", 0) or 0)
    if g <= 0:
        return 0
    need = int(regions_bytes) + alignment_allowance_bytes(model)
    return -(-need // g) * g - int(regions_bytes)


def alloc_rounding_bound_bytes(device: Any, model: Any) -> int:
    """The most alloc_rounding_bytes can be for any regions (sizing the cache before the regions are known)."""
    g = int(getattr(device, "alloc_granularity_bytes", 0) or 0)
    return g + alignment_allowance_bytes(model) if g > 0 else 0


def staging_bytes(arena_bytes: int, arena_wanted_bytes: int, loans: Any, slot_bytes: int) -> int:
    """Page-locked copy staging: half the widest ring's slots, only when the arena is not pinned whole."""
    if arena_bytes >= arena_wanted_bytes:
        return 0
    rings = [int(r.ring_slots) for r in loans]
    return ((max(rings) + 1) // 2) * int(slot_bytes) if rings else 0


def pinned_map_bytes(device: Any, pinned_bytes: int) -> int:
    """The driver's page tables for `pinned_bytes` of page-locked host memory (its measured bytes per GiB)."""
    per_gib = int(getattr(device, "pinned_map_bytes_per_gib", 0) or 0)
    return -(-int(pinned_bytes) * per_gib // GIB) if per_gib > 0 and pinned_bytes > 0 else 0
