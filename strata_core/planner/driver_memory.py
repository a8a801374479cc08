"""The device bytes the driver takes beside the plan's regions, as plan lines from the backend's measured facts.

Measured on the H200 (bench/results/f_h200/fidelity_diag.json): every byte a cuda run held beyond its regions was
the driver's, not the runtime's: each allocation rounded up to 2 MiB, and page tables for page-locked host memory
(2 MiB per GiB pinned: 8 bytes per 4 KiB page), which the driver takes in 2 MiB pieces from a pool the context
starts with some room in. Two lines, each 0 where the backend's probe measured no fact:
- `alloc_rounding_bytes`: the runtime takes all its device lines at start as one block (PlanMemory.reserve), which
  the driver rounds up to its granularity; the block also holds each start-up array's alignment.
- `pinned_map_bytes`: the page tables of the page-locked memory the plan pins (the expert arena, the CPU share's
  buffer, copy staging when the arena is not pinned whole, pinned KV) and of the start-up block (8 bytes per
  device page of one granule). Tables of a granule or more are planned in whole granules, the most the driver
  takes for them (bench/results/f_h200/final_fidelity_diag.json: a Qwen3 Q8_0 run's 28.8 granules of tables took
  29); less than one granule is planned as it is: the room the context's pool starts with held it in every run
  measured (the tiny model's 0.2 MB took no new granule in three runs).
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


#: The host page size the measured table cost is per (8 bytes of table a 4 KiB page: 2 MiB a GiB).
HOST_PAGE_BYTES = 4096


def pinned_map_bytes(device: Any, pinned_bytes: int, device_bytes: int = 0) -> int:
    """The driver's page tables for `pinned_bytes` of page-locked host memory (its measured bytes per GiB) and for
    `device_bytes` of device memory mapped in pages of its granularity; whole granules from one granule up."""
    per_gib = int(getattr(device, "pinned_map_bytes_per_gib", 0) or 0)
    if per_gib <= 0:
        return 0
    tables = -(-max(0, int(pinned_bytes)) * per_gib // GIB)
    g = int(getattr(device, "alloc_granularity_bytes", 0) or 0)
    if g > 0:
        tables += -(-max(0, int(device_bytes)) * per_gib * HOST_PAGE_BYTES // (g * GIB))
        if tables >= g:
            tables = -(-tables // g) * g
    return tables
