"""Fault specs: parsing, bad specs as one-line BadInput, each site firing where and when it says, the record."""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.api.backend import PinnedBudget
from strata_core.errors import BadInput
from strata_core.builtin.sim import FaultPlan, PhantomArray, SimDeviceMemory, SimPinnedAllocator, list_fault_sites
from strata_core.builtin.sim.faults import MAX_RECORDED_FAULTS, FaultSpec
from strata_core.builtin.sim.memory import SIM_COPY_BYTES_PER_S

MIB = 1 << 20

REQUIRED_SITES = {"pinned-alloc", "arena-register", "device-alloc", "vram-drop", "slow-copy"}


def test_every_site_is_listed_with_an_example_that_parses():
    sites = list_fault_sites()
    assert REQUIRED_SITES <= {s.name for s in sites}
    assert {"pinned-alloc:nth=2", "pinned-alloc:every"} <= {s.spec_example for s in sites}
    for s in sites:
        spec = FaultSpec.parse(s.spec_example)
        assert spec.site == s.name and s.what


@pytest.mark.parametrize("text, field, value", [
    ("pinned-alloc:nth=3", "nth", 3),
    ("pinned-alloc:every", "every", True),
    ("arena-register:above=1GiB", "above_bytes", 1 << 30),
    ("arena-register:above=1048576", "above_bytes", 1 << 20),
    ("device-alloc:above=64M", "above_bytes", 64 * MIB),
    ("vram-drop:bytes=512MiB", "drop_bytes", 512 * MIB),
    ("vram-drop:bytes=1k,at=3", "at_alloc", 3),
    ("slow-copy:factor=2.5", "factor", 2.5),
    (" Device-Alloc:above=10 ", "above_bytes", 10),
])
def test_specs_parse(text, field, value):
    assert getattr(FaultSpec.parse(text), field) == value


BAD_SPECS = [
    "", "   ", "pinned-alloc", "pinned-alloc:", "pinned-alloc:nth=0", "pinned-alloc:nth=-1", "pinned-alloc:nth=x",
    "pinned-alloc:nth=1.5", "pinned-alloc:sometimes", "pinned-alloc:nth=1,nth=2", "pinned-alloc:above=3",
    "arena-register:every", "arena-register:above=", "arena-register:above=lots", "arena-register:above=-5",
    "device-alloc:below=5", "device-alloc:above=1PB", "vram-drop:at=2", "vram-drop:bytes=1G,at=0",
    "vram-drop:bytes=1G,when=2", "slow-copy:factor=0.5", "slow-copy:factor=nan", "slow-copy:factor=inf",
    "slow-copy:factor=", "disk-full:every", "nth=2", ":every", "pinned-alloc:nth=2,", "pinned-alloc:nth",
]


@pytest.mark.parametrize("text", BAD_SPECS)
def test_bad_specs_raise_one_line_naming_the_spec_and_the_forms(text):
    with pytest.raises(BadInput) as e:
        FaultPlan.parse([text])
    msg = str(e.value)
    assert "\n" not in msg
    assert repr(text.strip()) in msg or repr(text) in msg
    assert "allowed forms" in msg and "pinned-alloc:every" in msg


def test_a_non_string_spec_is_bad_input():
    with pytest.raises(BadInput):
        FaultPlan.parse([3])  # type: ignore[list-item]


def test_nth_pinned_allocation_fails_only_that_one_and_is_recorded():
    faults = FaultPlan.parse(["pinned-alloc:nth=3"])
    budget = PinnedBudget(100 * MIB)
    pa = SimPinnedAllocator(budget, None, faults=faults)
    got = [pa.alloc(MIB) for _ in range(5)]
    assert [b is None for b in got] == [False, False, True, False, False]
    assert budget.used_bytes == 4 * MIB  # the refused one gave its bytes back
    rec = faults.faults_injected()
    assert len(rec) == 1 and rec[0]["site"] == "pinned-alloc" and rec[0]["when"] == "pinned allocation #3"
    assert rec[0]["spec"] == "pinned-alloc:nth=3" and str(MIB) in rec[0]["what"]


def test_every_pinned_allocation_fails_but_registration_is_another_site():
    faults = FaultPlan.parse(["pinned-alloc:every"])
    budget = PinnedBudget(100 * MIB)
    pa = SimPinnedAllocator(budget, None, faults=faults)
    assert all(pa.alloc(16) is None for _ in range(4))
    assert pa.register(np.zeros(16, np.uint8)) is not None
    assert budget.used_bytes == 16 and not budget.exhausted
    assert faults.counts == {"pinned-alloc": 4}


def test_arena_register_above_fails_large_registrations_and_marks_exhausted():
    faults = FaultPlan.parse(["arena-register:above=1MiB"])
    budget = PinnedBudget(100 * MIB)
    pa = SimPinnedAllocator(budget, None, faults=faults)
    assert pa.register(np.zeros(MIB, np.uint8)) is not None  # at the limit: allowed
    assert not budget.exhausted
    assert pa.register(np.zeros(MIB + 1, np.uint8)) is None
    assert budget.exhausted and budget.used_bytes == MIB
    assert pa.alloc(4 * MIB) is not None  # allocations are another site
    assert faults.faults_injected()[0]["site"] == "arena-register"


def test_device_alloc_above_refuses_large_allocations_only():
    faults = FaultPlan.parse(["device-alloc:above=1KiB"])
    mem = SimDeviceMemory(MIB, faults=faults)
    assert mem.alloc((256,), np.float32) is not None  # exactly 1 KiB
    assert mem.alloc((257,), np.float32) is None
    assert mem.mem_info()[0] == MIB - 1024
    assert faults.faults_injected()[0]["when"] == "device allocation #2"


def test_vram_drop_lowers_capacity_before_the_chosen_allocation():
    faults = FaultPlan.parse(["vram-drop:bytes=6MiB,at=2"])
    mem = SimDeviceMemory(10 * MIB, faults=faults)
    a = mem.alloc((3 * MIB,), np.uint8)  # planned against 10 MiB: fits
    assert a is not None and mem.mem_info() == (7 * MIB, 10 * MIB)
    assert mem.alloc((2 * MIB,), np.uint8) is None  # 4 MiB now, 3 taken
    assert mem.mem_info() == (MIB, 4 * MIB)
    assert mem.alloc((MIB,), np.uint8) is not None
    assert len(faults.faults_injected()) == 1  # the drop happens once


def test_vram_drop_defaults_to_the_first_allocation():
    mem = SimDeviceMemory(10 * MIB, faults=FaultPlan.parse(["vram-drop:bytes=9MiB"]))
    assert mem.alloc((2 * MIB,), np.uint8) is None
    assert mem.mem_info() == (MIB, MIB)


@pytest.mark.parametrize("accounting_only", [False, True])
def test_slow_copy_is_simulated_seconds_not_a_result_change(accounting_only):
    nbytes = 4 * MIB
    src = PhantomArray.of((nbytes,), np.uint8) if accounting_only else np.ones(nbytes, np.uint8)
    plain = SimDeviceMemory(16 * MIB, accounting_only=accounting_only)
    slow = SimDeviceMemory(16 * MIB, faults=FaultPlan.parse(["slow-copy:factor=4"]), accounting_only=accounting_only)
    outs = []
    for mem in (plain, slow):
        dst = mem.alloc((nbytes,), np.uint8)
        mem.upload(dst, src)
        outs.append(mem.download(dst))
    assert plain.copy_seconds == pytest.approx(2 * nbytes / SIM_COPY_BYTES_PER_S)
    assert slow.copy_seconds == pytest.approx(4 * plain.copy_seconds)
    if not accounting_only:
        assert np.array_equal(outs[0], outs[1])
    assert slow.faults.counts == {"slow-copy": 2}


def test_several_faults_combine():
    faults = FaultPlan.parse(["pinned-alloc:nth=1", "device-alloc:above=100", "slow-copy:factor=2"])
    mem = SimDeviceMemory(MIB, faults=faults)
    pa = SimPinnedAllocator(PinnedBudget(MIB), None, faults=faults)
    assert pa.alloc(8) is None and pa.alloc(8) is not None
    assert mem.alloc((101,), np.uint8) is None
    assert {f["site"] for f in faults.faults_injected()} == {"pinned-alloc", "device-alloc"}


def test_the_record_is_bounded_while_the_counts_keep_going():
    faults = FaultPlan.parse(["pinned-alloc:every"])
    pa = SimPinnedAllocator(PinnedBudget(MIB), None, faults=faults)
    n = MAX_RECORDED_FAULTS + 50
    for _ in range(n):
        pa.alloc(1)
    assert len(faults.faults_injected()) == MAX_RECORDED_FAULTS
    assert faults.injected_total == n


def test_no_faults_means_nothing_recorded():
    faults = FaultPlan.parse([])
    mem = SimDeviceMemory(MIB, faults=faults)
    pa = SimPinnedAllocator(PinnedBudget(MIB), None, faults=faults)
    dst = mem.alloc((4,), np.float32)
    mem.upload(dst, np.ones(4, np.float32))
    pa.alloc(8)
    pa.register(np.zeros(8, np.uint8))
    assert faults.faults_injected() == [] and faults.injected_total == 0
