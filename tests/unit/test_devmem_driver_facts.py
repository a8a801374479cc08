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
