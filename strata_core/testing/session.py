"""How the kit reaches one backend's device memory, kernels, pinned allocator and layer ops: as the runtime does.

API 2.0: the probe lists Device objects and everything is asked of the device: `device.open(plan)` returns a
DeviceSession (memory, kernels, budget, pinned, layer_ops). The kit plans the built-in tiny model for the device
(core defaults, the backend named) and opens one session per test. (The registry wraps a 1.x plugin's bare
DeviceInfo in a Device answered by the old per-device hooks, so such a plugin is reached the same way.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from strata_core.api.backend import PinnedBudget
from strata_core.api.facts import DeviceInfo, HostInfo, PlatformDefaults

#: The per-device hooks of API 1.x, gone in 2.0: the kit calls them only while the hookspec still declares them.
DEVICE_HOOKS = ("strata_device_memory", "strata_kernels", "strata_pinned_allocator", "strata_platform_defaults")


def info_of(device: Any) -> DeviceInfo:
    """The DeviceInfo of a probe's device entry (a Device object's `info`, or the facts themselves)."""
    return device if isinstance(device, DeviceInfo) else device.info


def is_device_object(device: Any) -> bool:
    """True when a probe's device entry is an API 2.0 Device (it can be opened), not bare facts."""
    return not isinstance(device, DeviceInfo) and callable(getattr(device, "open", None))


def declared_hooks(plugins: Any) -> set[str]:
    """The per-device hooks the plugin host's hookspec still declares."""
    return {h for h in DEVICE_HOOKS if hasattr(plugins.hook, h)}


def platform_defaults(plugins: Any, device: Any, host: HostInfo) -> PlatformDefaults | None:
    """The device's PlatformDefaults: asked of the Device object, or through the hook on the 1.x contract."""
    if is_device_object(device):
        return device.platform_defaults(host)
    if "strata_platform_defaults" in declared_hooks(plugins):
        return plugins.hook.strata_platform_defaults(device=device, host=host)
    return None


def kit_plan(plugins: Any, backend: Any, device: Any, host: HostInfo) -> Any:
    """A proven plan of the built-in tiny model on this device (core defaults, this backend), to open a session."""
    from strata_core.config import settings_from_partial
    from strata_core.models.synthetic import tiny_cache_slots, tiny_model_spec
    from strata_core.planner import plan_for_machine
    spec = tiny_model_spec()
    info = info_of(device)
    settings = settings_from_partial({"backend": {"name": info.backend, "device": info.index},
                                      "memory": {"expert_cache": tiny_cache_slots(spec)}}, where="the kit")
    from strata_core.api.target import Target
    target = Target(backend=backend, device=device, host=host, defaults=device.platform_defaults(host),
                    origin="the conformance kit")
    return plan_for_machine(plugins, target, spec, settings)


@dataclass
class KitSession:
    """What the kit drives on one device: memory, kernels, layer ops (or None) and pinned allocators on a budget."""

    memory: Any
    kernels: Any
    layer_ops: Any
    #: (limit_bytes, floor_bytes) -> (PinnedAllocator or None, the PinnedBudget it charges)
    pinned: Callable[[int, int], tuple[Any, PinnedBudget]]
    contract: str  # "2.0 session"
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        """Close the device session, if the backend opened one."""
        while self.closers:
            self.closers.pop()()


class HeldAside:
    """A PinnedBudget as a test sees it beside what the session holds already (its standing page-locked buffers,
    taken at open from the plan's floor): `used_bytes` counts the test's own bytes; the rest is the budget's."""

    def __init__(self, budget: PinnedBudget, held_bytes: int):
        self._budget, self.held_bytes = budget, int(held_bytes)

    @property
    def used_bytes(self) -> int:
        """Bytes the test's allocations hold now."""
        return self._budget.used_bytes - self.held_bytes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._budget, name)


def _pinned_on_session(session: Any) -> Callable[[int, int], tuple[Any, PinnedBudget]]:
    """The session's own allocator, with its budget set to the test's limits above what the session holds (the
    allocator charges that object): a session may keep standing page-locked buffers from open (say a fused path's
    staging), charged to its budget like any other; the test's limits are room beside them."""

    def pinned(limit_bytes: int, floor_bytes: int = 0) -> tuple[Any, PinnedBudget]:
        budget = session.budget
        held = int(budget.used_bytes)
        # arena allocations may use limit - floor and floor ones the whole limit, each beside the held bytes
        budget.limit_bytes, budget.floor_bytes = held + int(limit_bytes), int(floor_bytes)
        return session.pinned, (HeldAside(budget, held) if held else budget)

    return pinned


def open_kit_session(plugins: Any, backend: Any, device: Any, host: HostInfo) -> KitSession:
    """Open the device the way the runtime does: `device.open(plan)` for a plan of the tiny model."""
    if not is_device_object(device):
        raise AssertionError(f"backend '{info_of(device).backend}' lists a {type(device).__name__}, not a Device with "
                             f"open(plan): API 2.0 asks every device question of the Device object")
    session = device.open(kit_plan(plugins, backend, device, host))
    return KitSession(memory=session.memory, kernels=session.kernels, layer_ops=session.layer_ops,
                      pinned=_pinned_on_session(session), contract="2.0 session", closers=[session.close])
