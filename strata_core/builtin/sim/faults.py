"""Fault injection for the sim backend: named sites, a parsed `FaultPlan`, and a record of every fault injected.

A spec is `SITE:every` or `SITE:key=value[,key=value]`; byte values take an optional KiB/MiB/GiB (or K/M/G) suffix.
The sites (see `list_fault_sites`) are where a real platform says no: a page-locked allocation, a whole-arena
registration, a device allocation, free VRAM that another process took between planning and allocation, and a
slow copy engine. Slow copies are accounted as simulated seconds, never slept.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

from strata_core.errors import BadInput

#: Injections recorded in full; beyond this only per-site counts grow, so a long soak keeps a bounded record.
MAX_RECORDED_FAULTS = 256


@dataclass(frozen=True)
class FaultSite:
    """One place a fault can be injected: its name, an example spec, and what it simulates."""

    name: str
    spec_example: str
    what: str


FAULT_SITES: tuple[FaultSite, ...] = (
    FaultSite("pinned-alloc", "pinned-alloc:nth=2",
              "fail the Nth page-locked allocation (1-based; registrations are not counted)"),
    FaultSite("pinned-alloc", "pinned-alloc:every",
              "fail every page-locked allocation (the seed's cudaHostAlloc of the CPU share)"),
    FaultSite("arena-register", "arena-register:above=1GiB",
              "fail registering (page-locking in place) more than BYTES at once, and mark the pinned budget "
              "exhausted (the seed's failed whole-arena cudaHostRegister)"),
    FaultSite("device-alloc", "device-alloc:above=64MiB",
              "fail every device allocation larger than BYTES"),
    FaultSite("vram-drop", "vram-drop:bytes=512MiB,at=1",
              "lower the device's capacity by BYTES just before its Nth device allocation (default the first): "
              "another process took VRAM between planning and allocation"),
    FaultSite("slow-copy", "slow-copy:factor=4",
              "every host<->device copy takes F times its simulated time (simulated seconds, no real sleep)"),
)

_SITE_NAMES = tuple(dict.fromkeys(s.name for s in FAULT_SITES))
_ALLOWED = "; ".join(s.spec_example for s in FAULT_SITES)


def list_fault_sites() -> list[FaultSite]:
    """Every fault site with an example spec, for `strata simulate --list-faults`."""
    return list(FAULT_SITES)


_SIZE = re.compile(r"^\s*(\d+)\s*(kib|mib|gib|tib|k|m|g|t|b)?\s*$", re.IGNORECASE)
_UNIT = {None: 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
         "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def _bad(spec: str, why: str) -> BadInput:
    return BadInput(f"fault spec {spec!r}: {why}; allowed forms: {_ALLOWED}")


def _parse_bytes(spec: str, key: str, text: str) -> int:
    m = _SIZE.match(text)
    if not m:
        raise _bad(spec, f"{key}={text!r} is not a byte count (e.g. 1048576, 512MiB, 2GiB)")
    return int(m.group(1)) * _UNIT[m.group(2).lower() if m.group(2) else None]


def _parse_count(spec: str, key: str, text: str) -> int:
    if not text.strip().isdigit() or int(text) <= 0:
        raise _bad(spec, f"{key}={text!r} is not a positive whole number")
    return int(text)


def _parse_factor(spec: str, key: str, text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (v >= 1.0 and v < float("inf")):  # a factor below 1 would make copies faster, which is no fault
        raise _bad(spec, f"{key}={text!r} is not a number >= 1")
    return v


@dataclass(frozen=True)
class FaultSpec:
    """One parsed fault: its site, the spec as written, and its parameters."""

    site: str
    text: str
    every: bool = False
    nth: int | None = None
    above_bytes: int | None = None
    drop_bytes: int | None = None
    at_alloc: int = 1
    factor: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        """Parse one spec, or raise BadInput naming it and the allowed forms."""
        if not isinstance(text, str) or not text.strip():
            raise _bad(str(text), "empty")
        spec = text.strip()
        site, sep, body = spec.partition(":")
        site = site.strip().lower()
        if site not in _SITE_NAMES:
            raise _bad(spec, f"unknown site {site!r} (sites: {', '.join(_SITE_NAMES)})")
        if not sep or not body.strip():
            raise _bad(spec, "missing parameters after the site")
        body = body.strip().lower()
        if body == "every":
            if site != "pinned-alloc":
                raise _bad(spec, "'every' applies to pinned-alloc only")
            return cls(site=site, text=spec, every=True)
        params: dict[str, str] = {}
        for part in body.split(","):
            key, eq, value = part.partition("=")
            key = key.strip()
            if not eq or not key or key in params:
                raise _bad(spec, f"expected key=value, got {part.strip()!r}")
            params[key] = value.strip()
        allowed = {"pinned-alloc": {"nth"}, "arena-register": {"above"}, "device-alloc": {"above"},
                   "vram-drop": {"bytes", "at"}, "slow-copy": {"factor"}}[site]
        required = {"pinned-alloc": {"nth"}, "arena-register": {"above"}, "device-alloc": {"above"},
                    "vram-drop": {"bytes"}, "slow-copy": {"factor"}}[site]
        extra = set(params) - allowed
        if extra:
            raise _bad(spec, f"unknown parameter {sorted(extra)[0]!r} for {site}")
        missing = required - set(params)
        if missing:
            raise _bad(spec, f"missing parameter {sorted(missing)[0]!r} for {site}")
        if site == "pinned-alloc":
            return cls(site=site, text=spec, nth=_parse_count(spec, "nth", params["nth"]))
        if site in ("arena-register", "device-alloc"):
            return cls(site=site, text=spec, above_bytes=_parse_bytes(spec, "above", params["above"]))
        if site == "vram-drop":
            at = _parse_count(spec, "at", params["at"]) if "at" in params else 1
            return cls(site=site, text=spec, drop_bytes=_parse_bytes(spec, "bytes", params["bytes"]), at_alloc=at)
        return cls(site=site, text=spec, factor=_parse_factor(spec, "factor", params["factor"]))


@dataclass(frozen=True)
class InjectedFault:
    """A fault that fired: the site, the spec, what it refused or changed, and when (the sim's operation number)."""

    site: str
    spec: str
    what: str
    when: str
    op: int

    def to_json(self) -> dict:
        """One entry of a report's `faults_injected`."""
        return {"site": self.site, "spec": self.spec, "what": self.what, "when": self.when, "op": self.op}


@dataclass
class FaultPlan:
    """The faults a sim device injects, its operation counters, and the record of what fired.

    One plan is shared by a sim device's memory and its pinned allocator, so operation numbers are one sequence.
    """

    specs: tuple[FaultSpec, ...] = ()
    ops: int = 0
    device_allocs: int = 0
    pinned_allocs: int = 0
    registrations: int = 0
    recorded: list[InjectedFault] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def parse(cls, specs: list[str] | tuple[str, ...] | None) -> "FaultPlan":
        """A plan from spec strings; BadInput (one line, naming the spec and the allowed forms) on a bad one."""
        if specs is None:
            return cls()
        if isinstance(specs, str):
            specs = [specs]
        return cls(specs=tuple(FaultSpec.parse(s) for s in specs))

    def _of(self, site: str) -> list[FaultSpec]:
        return [s for s in self.specs if s.site == site]

    def _record(self, spec: FaultSpec, what: str, when: str) -> None:
        self.counts[spec.site] = self.counts.get(spec.site, 0) + 1
        if len(self.recorded) < MAX_RECORDED_FAULTS:
            self.recorded.append(InjectedFault(site=spec.site, spec=spec.text, what=what, when=when, op=self.ops))

    @property
    def injected_total(self) -> int:
        """How many times any fault fired (recorded or only counted)."""
        return sum(self.counts.values())

    def faults_injected(self) -> list[dict]:
        """The record as JSON, for a report's `faults_injected` (the first MAX_RECORDED_FAULTS in full)."""
        return [f.to_json() for f in self.recorded]

    # -- the sites, called by SimDeviceMemory and SimPinnedAllocator ----------------------------------------------

    def on_device_alloc(self, nbytes: int) -> tuple[bool, int]:
        """Count a device allocation: (refused by a fault?, bytes of capacity a vram-drop takes away now)."""
        with self._lock:
            self.ops += 1
            self.device_allocs += 1
            n = self.device_allocs
            drop = 0
            for s in self._of("vram-drop"):
                if n == s.at_alloc:
                    drop += s.drop_bytes or 0
                    self._record(s, f"device capacity lowered by {s.drop_bytes} bytes",
                                 f"before device allocation #{n}")
            for s in self._of("device-alloc"):
                if s.above_bytes is not None and nbytes > s.above_bytes:
                    self._record(s, f"device allocation of {nbytes} bytes refused (above {s.above_bytes})",
                                 f"device allocation #{n}")
                    return True, drop
            return False, drop

    def on_pinned_alloc(self, nbytes: int) -> bool:
        """Count a page-locked allocation; True when a fault refuses it."""
        with self._lock:
            self.ops += 1
            self.pinned_allocs += 1
            n = self.pinned_allocs
            for s in self._of("pinned-alloc"):
                if s.every or s.nth == n:
                    self._record(s, f"page-locked allocation of {nbytes} bytes refused", f"pinned allocation #{n}")
                    return True
            return False

    def on_register(self, nbytes: int) -> bool:
        """Count a registration; True when a fault refuses it."""
        with self._lock:
            self.ops += 1
            self.registrations += 1
            n = self.registrations
            for s in self._of("arena-register"):
                if s.above_bytes is not None and nbytes > s.above_bytes:
                    self._record(s, f"registration of {nbytes} bytes refused (above {s.above_bytes})",
                                 f"registration #{n}")
                    return True
            return False

    def copy_factor(self, nbytes: int) -> float:
        """The slow-copy factor for one copy (1.0 without the fault); each slowed copy is counted."""
        slow = self._of("slow-copy")
        with self._lock:
            self.ops += 1
            factor = 1.0
            for s in slow:
                factor *= s.factor
                self._record(s, f"copy of {nbytes} bytes slowed x{s.factor:g}", f"operation #{self.ops}")
            return factor
