"""Plan fidelity against a driver's accounting, on the CPU: a fake device memory that counts what a CUDA driver does
(every allocation rounded up to 2 MiB; page tables of 8 bytes a 4 KiB page-locked page and a 2 MiB device page,
taken in 2 MiB pieces from a pool the context starts with some room in, as measured on the H200 in
bench/results/f_h200/fidelity_diag.json and final_fidelity_diag.json). A runtime allocation outside the plan's
regions, or per-array rounding, shows up in its peak and fails the fidelity bound."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from strata_core.api.backend import PinnedBudget
from strata_core.api.facts import GIB, MIB
from strata_core.builtin.cpu import HostMemory, HostPinnedAllocator
from strata_core.config.settings import settings_from_partial
from strata_core.models.synthetic import generate_weights, tiny_model_spec
from strata_core.planner.driver_memory import pinned_map_bytes
from strata_core.planner.steps import make_plan
from strata_core.reference.kernels import ReferenceKernels
from strata_core.registry import load_plugins
from strata_core.runtime.devmem import PlanMemory
from strata_core.runtime.engine import Engine
from strata_core.runtime.runlog import RunLog

GRANULE = 2 * MIB
TABLES_PER_GIB = 2 * MIB
#: the room the context's table pool starts with (the H200 runs' tables of up to 0.1 granule took none)
TABLE_ROOM = 1 * MIB


class DriverLedger:
    """Host arrays, counted as a CUDA driver counts device memory: sizes rounded up to GRANULE, plus the page tables
    of the page-locked memory its pinned allocator holds. `peak_bytes()` is its high-water."""

    host_arrays = True

    def __init__(self):
        self.inner = HostMemory()
        self.live: dict[int, int] = {}
        self.device_bytes = 0
        self.pinned_bytes = 0
        self.peak = 0
        self.allocations = 0

    def _used(self) -> int:
        tables = self.pinned_bytes * TABLES_PER_GIB // GIB + self.device_bytes * TABLES_PER_GIB * 4096 // (GRANULE * GIB)
        return self.device_bytes + -(-max(0, tables - TABLE_ROOM) // GRANULE) * GRANULE

    def note(self) -> None:
        """Keep the high-water."""
        self.peak = max(self.peak, self._used())

    def alloc(self, shape, dtype):
        """A host array taking its size rounded up to the granule."""
        a = self.inner.alloc(shape, dtype)
        n = -(-max(1, int(a.nbytes)) // GRANULE) * GRANULE
        self.live[id(a)] = n
        self.device_bytes += n
        self.allocations += 1
        self.note()
        return a

    def to_device(self, src):
        """A counted copy of src."""
        a = self.alloc(np.shape(src), np.asarray(src).dtype)
        a[...] = src
        return a

    def free(self, arr):
        """Give an array's rounded bytes back."""
        self.device_bytes -= self.live.pop(id(arr), 0)

    def peak_bytes(self) -> int:
        """The driver's high-water of used memory."""
        return self.peak

    def __getattr__(self, name):
        return getattr(self.inner, name)


class TabledPinned(HostPinnedAllocator):
    """The host's pinned allocator, its page-locked bytes told to the ledger (they cost it page tables)."""

    def __init__(self, budget, ledger: DriverLedger):
        super().__init__(budget)
        self.ledger = ledger

    def _tell(self, n: int) -> None:
        self.ledger.pinned_bytes += n
        self.ledger.note()

    def alloc(self, nbytes, from_floor=False):
        """Page-locked bytes, with their page tables."""
        b = super().alloc(nbytes, from_floor)
        if b is not None:
            self._tell(b.nbytes)
        return b

    def register(self, array, from_floor=False):
        """Page-lock in place, with page tables."""
        b = super().register(array, from_floor)
        if b is not None:
            self._tell(b.nbytes)
        return b

    def free(self, buf):
        """Unlock; the tables go with it."""
        if not buf.freed:
            self._tell(-buf.nbytes)
        super().free(buf)


def _plan(spec, settings: dict, measured: bool = True):
    plugins = load_plugins()
    s = settings_from_partial({"backend": {"name": "sim"}, **settings})
    target = plugins.resolve_target(s)
    device = target.device.info
    if measured:
        device = replace(device, alloc_granularity_bytes=GRANULE, pinned_map_bytes_per_gib=TABLES_PER_GIB)
    return make_plan(device, target.host, spec, s, target.defaults)


@pytest.fixture(scope="module")
def weights():
    return generate_weights(tiny_model_spec(), seed=0, dtype="f16")


def _serve(plan, w, tokens: int | None = None):
    ledger = DriverLedger()
    budget = PinnedBudget(plan.pinned.limit_bytes, plan.pinned.floor_bytes)
    eng = Engine(plan, dm=ledger, allocator=TabledPinned(budget, ledger), kernels=ReferenceKernels(), budget=budget,
                 weights=w, log=RunLog(), strict_memory=True)
    at_seal = ledger.allocations
    res = eng.serve(np.arange(tokens or plan.prompt.chunk) % w.vocab, decode_tokens=3 if tokens is None else 0)
    assert res.completed and (tokens or res.chunk == plan.prompt.chunk)
    measured, source = eng.device_bytes_peak_measured()
    after = ledger.allocations
    eng.close()
    return eng, measured, source, at_seal, after


def test_the_driver_peak_is_within_the_plan_at_its_largest_chunk(weights):
    plan = _plan(weights.spec, {"memory": {"expert_cache": 1024}})
    v = plan.vram
    assert v.alloc_rounding_bytes > 0 and v.pinned_map_bytes > 0
    eng, measured, source, at_seal, after = _serve(plan, weights)
    assert "peak_bytes()" in source
    assert after == at_seal, "the runtime allocated device memory while serving"
    assert at_seal == 1, "start-up took more than the one block"
    planned = eng.device_bytes_planned
    assert planned == v.regions_bytes + v.alloc_rounding_bytes + v.pinned_map_bytes
    assert 0.98 * planned <= measured <= planned, (measured, planned)


def test_the_driver_lines_are_plan_lines_that_free_vram_must_hold(weights):
    with_facts = _plan(weights.spec, {})
    without = _plan(weights.spec, {}, measured=False)
    v, u = with_facts.vram, without.vram
    assert u.alloc_rounding_bytes == 0 and u.pinned_map_bytes == 0
    assert v.left_bytes == (v.free_bytes - v.reserve_bytes - v.regions_bytes - v.alloc_rounding_bytes
                            - v.pinned_map_bytes) >= 0
    pinned = with_facts.pinned.arena_bytes + with_facts.pinned.cpu_share_bytes
    assert v.pinned_map_bytes == pinned_map_bytes(with_facts.device, pinned, v.regions_bytes + v.alloc_rounding_bytes)
    whats = {d.what for d in with_facts.decisions}
    assert {"vram.alloc_rounding_bytes", "vram.pinned_map_bytes"} <= whats
    js = with_facts.to_json()["vram"]
    assert js["alloc_rounding_bytes"] == v.alloc_rounding_bytes and js["pinned_map_bytes"] == v.pinned_map_bytes


def test_without_the_block_each_array_is_rounded_and_the_peak_leaves_the_plan(weights, monkeypatch):
    plan = _plan(weights.spec, {"memory": {"expert_cache": 1024}})
    monkeypatch.setattr(PlanMemory, "reserve", lambda self, nbytes: False)
    eng, measured, _, at_seal, _ = _serve(plan, weights, tokens=1)  # the start-up alone leaves the plan
    assert at_seal > 1
    assert measured > eng.device_bytes_planned


def test_tables_of_a_granule_or_more_are_planned_in_whole_granules():
    dev = replace(_plan(tiny_model_spec(), {}).device, alloc_granularity_bytes=GRANULE,
                  pinned_map_bytes_per_gib=TABLES_PER_GIB)
    # below one granule: as it is (8 bytes a 4 KiB page, 8 a 2 MiB device page)
    assert pinned_map_bytes(dev, 100 * MIB, 64 * MIB) == 100 * MIB // 512 + 64 * MIB // 262144
    # the H200's Qwen3-30B-A3B@Q8_0 run (bench/results/f_h200/final_fidelity_diag.json, q8_4096): arena + CPU share
    # page-locked, the start-up block on the device; the driver took 29 granules of tables
    assert pinned_map_bytes(dev, 30802968576 + 8380416, 33390854144) == 29 * GRANULE == 60817408
    assert pinned_map_bytes(dev, 54 * GIB, 0) == 54 * GRANULE
    assert pinned_map_bytes(replace(dev, pinned_map_bytes_per_gib=0), 54 * GIB, GIB) == 0


def test_the_page_tables_of_the_embedding_greedy_decode_pins_are_planned_where_the_backend_pins_it():
    # the cuda backend's greedy loop page-locks the host's f16 embedding (CudaLayerOps.greedy_table): its page tables
    # are the driver's too (a 622 MB table on Qwen3-30B-A3B, ~1.2 MB of tables)
    spec = tiny_model_spec()
    plugins = load_plugins()
    s = settings_from_partial({"backend": {"name": "sim"}})
    target = plugins.resolve_target(s)
    device = replace(target.device.info, alloc_granularity_bytes=GRANULE, pinned_map_bytes_per_gib=TABLES_PER_GIB)
    plain = make_plan(device, target.host, spec, s, target.defaults)
    pins = make_plan(device, target.host, spec, s, replace(target.defaults, pins_embedding=True))
    embed = 2 * spec.vocab * spec.hidden
    v = pins.vram
    pinned = pins.pinned.arena_bytes + pins.pinned.cpu_share_bytes + embed
    assert v.pinned_map_bytes == pinned_map_bytes(device, pinned, v.regions_bytes + v.alloc_rounding_bytes)
    assert v.pinned_map_bytes > plain.vram.pinned_map_bytes
    assert v.left_bytes == (v.free_bytes - v.reserve_bytes - v.regions_bytes - v.alloc_rounding_bytes
                            - v.pinned_map_bytes) >= 0
    assert "embedding" in next(d.why for d in pins.decisions if d.what == "vram.pinned_map_bytes")
