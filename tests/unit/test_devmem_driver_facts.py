"""The cuda probe's driver facts (allocation granularity, page tables per page-locked GiB) from memGetInfo deltas."""

from __future__ import annotations

from strata_cuda import probe as cuda_probe

from strata_core.api.facts import GIB, MIB


class DriverRuntime:
    """cupy's runtime calls the measurement makes, over a driver that rounds allocations up to `granule` and takes
    `tables` bytes per page-locked GiB once `headroom` bytes of tables the context already has are used."""

    def __init__(self, granule=2 * MIB, tables=2 * MIB, headroom=0, fail_host=False):
        self.granule, self.tables, self.headroom, self.fail_host = granule, tables, headroom, fail_host
        self.used = 0
        self.table_bytes = 0
        self.live = {}
        self.current = 0
        self.next_ptr = 1

    def getDevice(self):
        return self.current

    def setDevice(self, i):
        self.current = i

    def memGetInfo(self):
        used = self.used + max(0, self.table_bytes - self.headroom)
        return 80 * GIB - used, 80 * GIB

    def malloc(self, n):
        self.next_ptr += 1
        self.live[self.next_ptr] = -(-n // self.granule) * self.granule
        self.used += self.live[self.next_ptr]
        return self.next_ptr

    def free(self, ptr):
        self.used -= self.live.pop(ptr)

    def hostAlloc(self, n, flags):
        if self.fail_host:
            raise MemoryError("no page-locked memory")
        self.next_ptr += 1
        self.live[self.next_ptr] = 0
        self.table_bytes += n * self.tables // GIB
        return self.next_ptr

    def freeHost(self, ptr):
        self.live.pop(ptr)


def test_the_granularity_and_the_page_tables_per_gib_are_measured():
    assert cuda_probe.driver_memory_facts(DriverRuntime(), 0) == (2 * MIB, 2 * MIB)
    assert cuda_probe.driver_memory_facts(DriverRuntime(granule=64 << 10, tables=4 * MIB), 0) == (64 << 10, 4 * MIB)


def test_tables_the_context_already_has_do_not_hide_the_cost_of_a_gib():
    # the first GiB fits the context's own tables: the second shows what a GiB costs
    assert cuda_probe.driver_memory_facts(DriverRuntime(headroom=2 * MIB), 0) == (2 * MIB, 2 * MIB)


def test_a_runtime_that_cannot_say_gives_no_facts():
    assert cuda_probe.driver_memory_facts(DriverRuntime(fail_host=True), 0) == (2 * MIB, 0)
    assert cuda_probe.driver_memory_facts(object(), 0) == (0, 0)


def test_no_page_locking_where_its_memory_is_capped():
    rt = DriverRuntime()
    assert cuda_probe.driver_memory_facts(rt, 0, page_lock=False) == (2 * MIB, 0)
    assert rt.table_bytes == 0


class KeyedRuntime(DriverRuntime):
    """DriverRuntime that names its card and driver (what the kept facts are keyed by) and counts page-locks."""

    def __init__(self, driver=12080, bus="0000:3b:00.0", **kw):
        super().__init__(**kw)
        self.driver, self.bus, self.page_locks = driver, bus, 0

    def deviceGetPCIBusId(self, i):
        return self.bus

    def getDeviceProperties(self, i):
        return {"name": b"NVIDIA H200"}

    def driverGetVersion(self):
        return self.driver

    def hostAlloc(self, n, flags):
        self.page_locks += 1
        return super().hostAlloc(n, flags)


def test_measured_facts_are_kept_for_the_next_process_of_the_same_card_and_driver(tmp_path):
    kept = tmp_path / "cache" / cuda_probe.DRIVER_FACTS_FILE
    first = KeyedRuntime(granule=64 << 10, tables=4 * MIB)
    assert cuda_probe.driver_memory_facts(first, 0, kept=kept) == (64 << 10, 4 * MIB)
    assert first.page_locks == cuda_probe.PINNED_PROBE_GIB and kept.is_file()
    # a new process (a new runtime object): read from the file, nothing page-locked, no allocation made
    later = KeyedRuntime()
    assert cuda_probe.driver_memory_facts(later, 0, kept=kept) == (64 << 10, 4 * MIB)
    assert later.page_locks == 0 and not later.live and later.next_ptr == 1
    # another driver, or another card: measured again, and both kept
    updated = KeyedRuntime(driver=12090)
    assert cuda_probe.driver_memory_facts(updated, 0, kept=kept) == (2 * MIB, 2 * MIB)
    assert updated.page_locks == cuda_probe.PINNED_PROBE_GIB
    other = KeyedRuntime(bus="0000:5e:00.0", tables=8 * MIB)
    assert cuda_probe.driver_memory_facts(other, 0, kept=kept) == (2 * MIB, 8 * MIB)
    again = KeyedRuntime(driver=12090)
    assert cuda_probe.driver_memory_facts(again, 0, kept=kept) == (2 * MIB, 2 * MIB) and again.page_locks == 0


def test_a_failed_measurement_or_a_bad_file_keeps_nothing_and_never_raises(tmp_path):
    kept = tmp_path / cuda_probe.DRIVER_FACTS_FILE
    assert cuda_probe.driver_memory_facts(KeyedRuntime(fail_host=True), 0, kept=kept) == (2 * MIB, 0)
    assert not kept.exists(), "a measurement without its page tables is tried again next time"
    kept.write_text("{not json")
    rt = KeyedRuntime()
    assert cuda_probe.driver_memory_facts(rt, 0, kept=kept) == (2 * MIB, 2 * MIB) and rt.page_locks > 0
    kept.write_text('{"0000:3b:00.0|NVIDIA H200|driver 12080|page_lock 1": ["x", -1]}')
    rt = KeyedRuntime()
    assert cuda_probe.driver_memory_facts(rt, 0, kept=kept) == (2 * MIB, 2 * MIB) and rt.page_locks > 0
    # an unwritable folder: measured, nothing kept, no error
    blocked = tmp_path / "file_not_folder"
    blocked.write_text("")
    rt = KeyedRuntime()
    assert cuda_probe.driver_memory_facts(rt, 0, kept=blocked / "facts.json") == (2 * MIB, 2 * MIB)


def test_without_a_kept_file_every_process_measures():
    rt = KeyedRuntime()
    assert cuda_probe.driver_memory_facts(rt, 0) == (2 * MIB, 2 * MIB) and rt.page_locks > 0
