"""sim: a simulated device with capacities, page-locked limits and fault injection."""

from strata_core.builtin.sim.faults import FaultPlan, FaultSite, FaultSpec, InjectedFault, list_fault_sites
from strata_core.builtin.sim.memory import PhantomArray, SimDeviceMemory, SimPinnedAllocator

__all__ = ["FaultPlan", "FaultSite", "FaultSpec", "InjectedFault", "list_fault_sites", "PhantomArray",
           "SimDeviceMemory", "SimPinnedAllocator"]
