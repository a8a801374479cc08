"""sim: a simulated device with capacities, page-locked limits and fault injection."""

from .faults import FaultPlan, FaultSite, FaultSpec, InjectedFault, list_fault_sites
from .memory import PhantomArray, SimDeviceMemory, SimPinnedAllocator

__all__ = ["FaultPlan", "FaultSite", "FaultSpec", "InjectedFault", "list_fault_sites", "PhantomArray",
           "SimDeviceMemory", "SimPinnedAllocator"]
