"""The plan's invariants, each a function of the plan alone. A plan that breaks one is a planner bug."""

from __future__ import annotations

from strata_core.errors import InvariantBroken
from strata_core.planner.pin_caps import REGISTRATION_LIMIT_BYTES


def check_vram(plan) -> None:
    """reserve + dense + KV + workspace + cache (+ owned prompt buffers) + the driver's lines <= free; cache = slots x
    slot bytes."""
    v, c = plan.vram, plan.expert_cache
    if v.expert_cache_bytes != c.slots * c.slot_bytes:
        raise InvariantBroken(f"vram: cache bytes {v.expert_cache_bytes} != {c.slots} slots x {c.slot_bytes}")
    total = v.reserve_bytes + v.dense_bytes + v.kv_bytes + v.workspace_bytes + v.expert_cache_bytes \
        + v.owned_prompt_bytes + getattr(v, "alloc_rounding_bytes", 0) + getattr(v, "pinned_map_bytes", 0)
    if total > v.free_bytes or v.left_bytes < 0:
        raise InvariantBroken(f"vram: planned {total} bytes > free {v.free_bytes}")


def check_loans(plan) -> None:
    """For every grid chunk c <= the plan's chunk, loan(c) <= lendable <= slots - min_keep; the JSON lists each c."""
    p, slots = plan.prompt, plan.expert_cache.slots
    if p.owned_buffers:
        if p.loans or p.lendable_slots:
            raise InvariantBroken("loan: a prompt path with owned buffers lends nothing")
        return
    if p.lendable_slots > slots - p.min_keep_slots:
        raise InvariantBroken(f"loan: lendable {p.lendable_slots} > {slots} slots - {p.min_keep_slots} kept")
    listed = {r.chunk for r in p.loans}
    for c in range(p.grid_tokens, p.chunk + 1, p.grid_tokens):
        if c not in listed:
            raise InvariantBroken(f"loan: chunk {c} is not in the plan's loan table")
    for r in p.loans:
        if r.chunk > p.chunk:
            raise InvariantBroken(f"loan: the table lists chunk {r.chunk} above the plan's chunk {p.chunk}")
        if r != plan.loan_for(r.chunk):
            raise InvariantBroken(f"loan: the table's row for {r.chunk} differs from loan({r.chunk})")
        if r.loan_slots > p.lendable_slots:
            raise InvariantBroken(f"loan: chunk {r.chunk} needs {r.loan_slots} slots > {p.lendable_slots} lendable")


def check_host(plan) -> None:
    """max(resident, pinned arena) + borrow + pinned KV + kernel weight copies + headroom <= available host RAM."""
    h, p = plan.host_memory, plan.pinned
    store = max(h.resident_bytes, p.arena_bytes)
    need = store + h.borrow_bytes + h.kv_pinned_bytes + h.weight_copies_bytes + h.headroom_bytes
    if need > h.available_bytes:
        raise InvariantBroken(f"host: in-RAM store {store} (max of resident {h.resident_bytes}, arena "
                              f"{p.arena_bytes}) + borrow {h.borrow_bytes} + pinned KV {h.kv_pinned_bytes} + kernel "
                              f"weight copies {h.weight_copies_bytes} + headroom {h.headroom_bytes} = {need} bytes > "
                              f"available {h.available_bytes}")


def check_pinned(plan) -> None:
    """arena + floor <= limit <= cap; the slices the arena registers in stay below the per-call limit; CPU share <= floor."""
    p = plan.pinned
    if p.arena_bytes + p.floor_bytes > p.limit_bytes:
        raise InvariantBroken(f"pinned: arena {p.arena_bytes} + floor {p.floor_bytes} > limit {p.limit_bytes}")
    if p.cap_bytes is not None and p.limit_bytes > p.cap_bytes:
        raise InvariantBroken(f"pinned: limit {p.limit_bytes} > the platform's cap {p.cap_bytes}")
    if not 0 < p.registration_slice_bytes < REGISTRATION_LIMIT_BYTES:
        raise InvariantBroken(f"pinned: registration slices of {p.registration_slice_bytes} bytes are not below the "
                              f"per-call limit {REGISTRATION_LIMIT_BYTES}")
    if plan.cpu_share.enabled and p.cpu_share_bytes > p.floor_bytes:
        raise InvariantBroken(f"pinned: CPU share {p.cpu_share_bytes} > floor {p.floor_bytes}")
    if not plan.cpu_share.enabled and p.cpu_share_bytes:
        raise InvariantBroken("pinned: the CPU share is off but still holds bytes")


INVARIANTS = (check_vram, check_loans, check_host, check_pinned)


def check_all(plan) -> None:
    """Run every invariant; raises InvariantBroken on the first broken one."""
    for inv in INVARIANTS:
        inv(plan)
