"""The kit's pinned tests beside a session's standing page-locked buffers (a fused path's staging taken at open).

The cuda session charges FastMoE's ~136 KB of staging to its budget when it opens; the kit's pinned tests then ran
against a budget that was not empty and failed on the H200 (bench/results/lead_h200_s4b/gpu_tests.log). Their
limits are now room beside what the session holds, and the budget they read counts their own bytes.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from strata_core.api.backend import PinnedBudget
from strata_core.api.facts import MIB
from strata_core.builtin.cpu import HostPinnedAllocator
from strata_core.testing import conformance
from strata_core.testing.session import KitSession, _pinned_on_session

STAGING_BYTES = 136192


def session_holding(nbytes: int) -> KitSession:
    """A KitSession whose budget already holds `nbytes` of the session's own, from the floor."""
    budget = PinnedBudget(1 << 30, 1 << 20)
    alloc = HostPinnedAllocator(budget)
    standing = alloc.alloc(nbytes, from_floor=True) if nbytes else None
    assert nbytes == 0 or standing is not None
    s = SimpleNamespace(budget=budget, pinned=alloc)
    return KitSession(memory=None, kernels=None, layer_ops=None, pinned=_pinned_on_session(s), contract="2.0 session")


def test_the_kit_pinned_tests_pass_beside_standing_buffers():
    for held in (0, STAGING_BYTES):
        s = session_holding(held)
        conformance.test_alloc_pinned_zero_budget_returns_none(s)
        conformance.test_alloc_pinned_budget_accounting(s)


def test_the_test_budget_is_room_beside_the_held_bytes_not_more():
    s = session_holding(STAGING_BYTES)
    a, budget = s.pinned(2 * MIB, MIB)
    assert budget.used_bytes == 0
    assert a.alloc(MIB + 1) is None, "the arena may use limit - floor beside the held bytes, no more"
    buf = a.alloc(MIB)
    assert buf is not None and budget.used_bytes == MIB
    assert a.alloc(MIB + 1, from_floor=True) is None and a.alloc(MIB, from_floor=True) is not None
    assert budget.used_bytes == 2 * MIB and budget.left_bytes == 0
    a.free(buf)
    assert budget.used_bytes == MIB
    np.testing.assert_equal(budget.held_bytes, STAGING_BYTES)
