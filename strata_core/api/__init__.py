"""The Strata Core contract: the one package a backend or plugin author imports.

Everything a plugin needs is named in `__all__`; nothing here imports the runtime, the planner or a command.
"""

#: The contract's version. A backend must declare it; one of another major version is refused.
API_VERSION = "2.0"

from strata_core.api.backend import (  # noqa: E402
    Backend, Device, DeviceMemory, DeviceMemoryViews, DeviceSession, FactsOnlyDevice, PinnedAllocator, PinnedBudget,
    PinnedBuffer, ProbeResult,
)
from strata_core.api.facts import (  # noqa: E402
    CpuInfo, DeviceCaps, DeviceInfo, DeviceType, HostInfo, PlatformDefaults, Profile,
)
from strata_core.api.hookspecs import hookimpl, hookspec  # noqa: E402
from strata_core.api.kernels import (  # noqa: E402
    EXPERT_FORMATS, QK8_0, ExpertPool, ExpertSource, KernelSet, LayerOps, LayerWork, SlotTable, Workspace,
)
from strata_core.api.plan_draft import PlanDraft  # noqa: E402
from strata_core.api.settings import SettingsGroup  # noqa: E402
from strata_core.api.target import Target  # noqa: E402

__all__ = [
    "API_VERSION", "EXPERT_FORMATS", "Backend", "CpuInfo", "Device", "DeviceCaps", "DeviceInfo", "DeviceMemory",
    "DeviceMemoryViews", "DeviceSession", "DeviceType", "ExpertPool", "ExpertSource", "FactsOnlyDevice", "HostInfo",
    "KernelSet", "LayerOps", "LayerWork",
    "PinnedAllocator", "PinnedBudget", "PinnedBuffer", "PlanDraft", "PlatformDefaults", "ProbeResult", "Profile",
    "QK8_0", "SettingsGroup", "SlotTable", "Target", "Workspace", "hookimpl", "hookspec",
]
