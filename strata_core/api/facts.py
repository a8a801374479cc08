"""Frozen facts about a machine: the device, the host and a backend's platform defaults, with JSON in and out."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, Callable

from strata_core.errors import BadInput

GIB = 1 << 30
MIB = 1 << 20

#: Which vendor each in-tree backend name stands for (a third-party backend reports its own).
VENDOR_OF_BACKEND = {
    "cpu": "none",
    "sim": "sim",
    "cuda": "nvidia",
    "rocm": "amd",
    "sycl": "intel",
    "opencl": "opencl",
}


#: The most bytes a fact may state (64 TiB of VRAM or RAM): beyond it a profile is a typo or an overflow.
MAX_FACT_BYTES = 1 << 46


def _bytes(d: dict, key: str, where: str, required: bool = True, hi: int = MAX_FACT_BYTES) -> int | None:
    """d[key] as a whole byte count from 0 to `hi` (no fraction, boolean or text), or BadInput naming the bound."""
    v = _require(d, key, where) if required else (d.get(key) if isinstance(d, dict) else None)
    if v is None and not required:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
        raise BadInput(f"{where}: '{key}' must be a whole number from 0 to {hi:,}, got {v!r}")
    return v


def _require(d: dict, key: str, where: str) -> Any:
    """Return d[key] or raise BadInput naming the missing field."""
    if not isinstance(d, dict):
        raise BadInput(f"{where}: expected an object, got {type(d).__name__}")
    if key not in d:
        raise BadInput(f"{where}: missing field '{key}'")
    return d[key]


@dataclass(frozen=True)
class CpuInfo:
    """The host CPU as the planner needs it: a name, a core count and ISA flags."""

    name: str = "unknown"
    cores: int = 1
    flags: tuple[str, ...] = ()

    def has(self, flag: str) -> bool:
        """True if the CPU reports this ISA flag."""
        return flag.lower() in self.flags

    @classmethod
    def from_json(cls, d: dict, where: str = "cpu") -> "CpuInfo":
        """Build from the JSON object of a profile."""
        if d is None:
            return cls()
        return cls(
            name=str(d.get("name", "unknown")),
            cores=int(d.get("cores", 1)),
            flags=tuple(str(f).lower() for f in d.get("flags", ())),
        )


class DeviceType(str, Enum):
    """What kind of device a backend found (versionadded 2.0)."""

    CPU = "cpu"
    GPU = "gpu"
    INTEGRATED_GPU = "integrated_gpu"
    ACCELERATOR = "accelerator"
    SIMULATED = "simulated"


@dataclass(frozen=True)
class DeviceCaps:
    """Optional abilities of a device; the runtime uses a path only where its cap is true (versionadded 2.0)."""

    #: Copies on their own stream overlap kernels (a copy engine).
    async_copies: bool = False
    #: Kernels can read page-locked host memory in place (mapped / zero-copy).
    host_mapped_memory: bool = False
    #: A sequence of launches can be captured once and replayed (CUDA graphs).
    graph_capture: bool = False
    #: Direct copies between two devices of the backend.
    peer_copies: bool = False
    #: The session's layer ops are the backend's own (fused), not the core's composition of primitives.
    fused_layer_ops: bool = False
    #: Expert formats the kernels compute from their own bytes.
    expert_formats: tuple[str, ...] = ("f16", "q8_0")

    def to_json(self) -> dict:
        """The caps record as JSON."""
        d = asdict(self)
        d["expert_formats"] = list(self.expert_formats)
        return d

    @classmethod
    def from_json(cls, d: Any) -> "DeviceCaps":
        """Build from JSON (unknown keys ignored, so older profiles and newer ones both read)."""
        if not isinstance(d, dict):
            return cls()
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if "expert_formats" in kw:
            kw["expert_formats"] = tuple(str(x) for x in kw["expert_formats"])
        return cls(**{k: (bool(v) if k != "expert_formats" else v) for k, v in kw.items()})


@dataclass(frozen=True)
class DeviceInfo:
    """One accelerator as its backend reports it. Bytes are ints; driver_model is 'linux', 'wddm', 'tcc', 'wsl2', 'host'."""

    backend: str
    name: str
    vram_total_bytes: int
    vram_free_bytes: int
    vendor: str = ""
    arch: str = ""
    driver_model: str = "linux"
    drives_display: bool = False
    index: int = 0
    unified_memory: bool = False
    #: versionadded 2.0
    device_type: DeviceType = DeviceType.GPU
    #: versionadded 2.0
    caps: DeviceCaps = field(default_factory=DeviceCaps)
    #: The driver's device-allocation granularity, measured by the backend's probe (an allocation of n bytes takes
    #: n rounded up to it); 0: not measured, the plan adds no rounding line. versionadded 2.1
    alloc_granularity_bytes: int = 0
    #: Device bytes the driver takes per GiB of page-locked host memory (the page tables that map it for the
    #: device), measured by the backend's probe; 0: not measured (or none). versionadded 2.1
    pinned_map_bytes_per_gib: int = 0

    def to_json(self) -> dict:
        """The DeviceInfo JSON of profiles and plans."""
        d = asdict(self)
        d["device_type"] = self.device_type.value
        d["caps"] = self.caps.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict, backend: str | None = None, where: str = "device") -> "DeviceInfo":
        """Build from JSON; `backend` fills the field when the object (as in a scenario) does not carry it."""
        be = d.get("backend", backend) if isinstance(d, dict) else backend
        if not be:
            raise BadInput(f"{where}: missing field 'backend'")
        try:
            return cls(
                backend=str(be),
                name=str(_require(d, "name", where)),
                vram_total_bytes=_bytes(d, "vram_total_bytes", where),
                vram_free_bytes=_bytes(d, "vram_free_bytes", where),
                vendor=str(d.get("vendor") or VENDOR_OF_BACKEND.get(str(be), str(be))),
                arch=str(d.get("arch", "")),
                driver_model=str(d.get("driver_model", "linux")).lower(),
                drives_display=bool(d.get("drives_display", False)),
                index=_bytes(d, "index", where, required=False, hi=1023) or 0,
                unified_memory=bool(d.get("unified_memory", False)),
                device_type=DeviceType(str(d.get("device_type", "simulated" if be == "sim" else "gpu"))),
                caps=DeviceCaps.from_json(d.get("caps")),
                alloc_granularity_bytes=_bytes(d, "alloc_granularity_bytes", where, required=False, hi=GIB) or 0,
                pinned_map_bytes_per_gib=_bytes(d, "pinned_map_bytes_per_gib", where, required=False, hi=GIB) or 0,
            )
        except (TypeError, ValueError) as e:
            raise BadInput(f"{where}: {e}") from None

    @property
    def is_wddm(self) -> bool:
        """True under Windows' WDDM driver model (also WSL2), where page-locked memory is capped."""
        return self.driver_model in ("wddm", "wsl2")


@dataclass(frozen=True)
class HostInfo:
    """The host: OS, RAM in bytes, the page-locked limit if known, and the CPU."""

    os: str
    ram_total_bytes: int
    ram_available_bytes: int
    pinnable_bytes: int | None = None
    cpu: CpuInfo = field(default_factory=CpuInfo)
    #: 'none', 'wsl2' or 'docker-wsl2': virtualization that caps page-locked memory (versionadded 2.0)
    virtualization: str = "none"

    def to_json(self) -> dict:
        """The HostInfo JSON of profiles and plans."""
        d = asdict(self)
        d["cpu"]["flags"] = list(self.cpu.flags)
        return d

    @classmethod
    def from_json(cls, d: dict, where: str = "host") -> "HostInfo":
        """Build from JSON, naming the missing field on bad input."""
        try:
            pin = d.get("pinnable_bytes") if isinstance(d, dict) else None
            return cls(
                os=str(_require(d, "os", where)).lower(),
                ram_total_bytes=_bytes(d, "ram_total_bytes", where),
                ram_available_bytes=_bytes(d, "ram_available_bytes", where),
                pinnable_bytes=None if pin is None else _bytes(d, "pinnable_bytes", where),
                cpu=CpuInfo.from_json(d.get("cpu"), where=f"{where}.cpu"),
                virtualization=_virtualization(d.get("virtualization", "none"), where),
            )
        except (TypeError, ValueError) as e:
            raise BadInput(f"{where}: {e}") from None


VIRTUALIZATIONS = ("none", "wsl2", "docker-wsl2")


def _virtualization(v: Any, where: str) -> str:
    """A HostInfo.virtualization value, or BadInput naming what is allowed."""
    v = "none" if v is None else str(v).lower()
    if v not in VIRTUALIZATIONS:
        raise BadInput(f"{where}.virtualization: '{v}' is not one of {', '.join(VIRTUALIZATIONS)}")
    return v


RingPolicy = Callable[[int, int, float], int]
"""(chunk_tokens, slot_bytes, pinned_fraction) -> ring slots the prompt path streams misses through."""


def seed_ring_policy(chunk_tokens: int, slot_bytes: int, pinned_fraction: float,
                     small_chunk_tokens: int = 4096, fixed_ring_slots: int = 384,
                     ring_budget_bytes: int = 392 * MIB, min_ring_slots: int = 64,
                     min_ring_bytes: int = 128 * MIB) -> int:
    """The engine's rule from the seeds: a fixed, larger ring at or below the small-chunk limit, a byte-budget ring above.

    With no page-locked experts at all (pinned_fraction 0) copies run at pageable speed, several times slower, so a
    deep byte-budget ring would only hold idle bytes: it is halved. The two branches are why loan(c) is not monotonic.
    """
    # The floor is 64 slots of the seeds' 2 MiB experts: in bytes, so 100 MB experts get a ring of a few slots (two
    # at least, one copying while one computes), not 6 GiB (issue 12.5).
    floor = min(min_ring_slots, max(2, min_ring_bytes // max(1, slot_bytes)))
    if chunk_tokens <= small_chunk_tokens:
        # The fixed ring is counted in slots; with large experts it would hold gigabytes, so bound it in bytes too.
        return max(floor, min(fixed_ring_slots, 2 * ring_budget_bytes // max(1, slot_bytes)))
    budget = ring_budget_bytes if pinned_fraction > 0 else ring_budget_bytes // 2
    return max(floor, budget // max(1, slot_bytes))


@dataclass(frozen=True)
class PlatformDefaults:
    """A backend's platform rules for one device. Each field is a default of ours; settings and site plugins override."""

    #: Largest prompt chunk the auto choice may take, in tokens (larger chunks read prompts faster, borrow more).
    chunk_ceiling_tokens: int = 8192
    #: Chunks are multiples of this many tokens (kernel tiles and the engine's scan step).
    chunk_grid_tokens: int = 256
    #: At or below this chunk the ring policy gives the fixed, larger ring (the seed's "small" limit).
    small_chunk_tokens: int = 4096
    #: Prompts shorter than this are read without streaming misses through the ring.
    stream_min_tokens: int = 1024
    #: (chunk_tokens, slot_bytes, pinned_fraction) -> ring slots.
    ring_policy: RingPolicy = seed_ring_policy
    #: Expert-cache slots the prompt path must always leave to decode.
    min_keep_slots: int = 128
    #: Largest fraction of the expert cache the prompt path may borrow.
    lend_fraction: float = 0.95
    #: VRAM kept free for the driver, the display and fragmentation, in MiB.
    vram_reserve_mib: int = 700
    #: Bytes a device context and its libraries take before any allocation of ours.
    context_overhead_bytes: int = 0
    #: Does the prompt path also hold its lent experts in host RAM (as resident mode does)?
    host_borrow: bool = False
    #: Host RAM kept free beside resident experts, in bytes (seed #2090 swapped with 3.4 GiB left: 4 GiB is the floor).
    resident_headroom_bytes: int = 4 * GIB
    #: Page-locked memory cap of the driver model (WDDM), in bytes; None when there is none.
    pin_cap_bytes: int | None = None
    #: Page-locked memory kept out of the arena for runtime allocations (CPU share, staging), in bytes.
    pin_floor_bytes: int = 512 * MIB
    #: Host RAM never page-locked, so the OS keeps room to work, in bytes.
    pin_reserve_bytes: int = 4 * GIB
    #: Is the CPU share on when the setting is 'auto'?
    cpu_share_default: bool = True
    #: Why cpu_share_default is what it is (one line for the plan).
    cpu_share_reason: str = "the platform default"
    #: Fraction of the reported free VRAM trusted (drivers that over-report free memory get < 1.0).
    free_vram_trust: float = 1.0
    #: Device bytes a prefill may dequantize K-quant / MXFP4 expert weights into (f16 scratch, whole experts or
    #: pieces of one); the workspace line counts it for such models (planner.buffers.dequant_scratch_bytes).
    #: 0: the backend's kernels read those quants directly.
    dequant_scratch_bytes: int = 0
    #: The backend's kernels keep an f32 copy of each read-only non-f32 weight they multiply (the routers, the LM
    #: head) whose copy takes at most this many bytes; the host plan counts those copies (0: no such copies).
    kernel_f32_copy_limit_bytes: int = 0
    #: The backend's greedy decode on the device page-locks the host's embedding table (f16, vocab x hidden) so its
    #: kernel reads a row a step: the driver's page tables for it are planned with the rest (an upper bound: the
    #: runtime pins it only where the pinned budget has room).
    pins_embedding: bool = False
    #: Where these defaults came from, for the plan's decisions.
    source: str = "core"

    def to_json(self) -> dict:
        """JSON of the scalar fields (the ring policy is named, not serialized)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = getattr(v, "__name__", repr(v)) if callable(v) else v
        return out

    def ring_slots(self, chunk_tokens: int, slot_bytes: int, pinned_fraction: float) -> int:
        """Ring slots for a chunk, from the policy."""
        return int(self.ring_policy(chunk_tokens, slot_bytes, pinned_fraction))


@dataclass(frozen=True)
class Profile:
    """A machine as JSON (`strata.profile/1`): the backend name, its device and the host."""

    backend: str
    device: DeviceInfo
    host: HostInfo

    SCHEMA = "strata.profile/1"

    def to_json(self) -> dict:
        """The `strata.profile/1` object."""
        return {"schema": self.SCHEMA, "backend": self.backend,
                "device": self.device.to_json(), "host": self.host.to_json()}

    @classmethod
    def from_json(cls, d: dict, where: str = "profile") -> "Profile":
        """Build from a profile object (or a scenario's `profile` block)."""
        backend = str(_require(d, "backend", where))
        return cls(
            backend=backend,
            device=DeviceInfo.from_json(_require(d, "device", where), backend=backend, where=f"{where}.device"),
            host=HostInfo.from_json(_require(d, "host", where), where=f"{where}.host"),
        )


def load_json_file(path: str | Path) -> dict:
    """Read a JSON object from a file, or raise BadInput naming the file (and line) on any problem."""
    p = Path(path)
    if p.is_dir():
        raise BadInput(f"{p}: is a directory, not a JSON file")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise BadInput(f"{p}: cannot read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"{p}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"{p}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(d, dict):
        raise BadInput(f"{p}: expected a JSON object at the top level")
    return d


def load_profile(path: str | Path) -> Profile:
    """Load a `strata.profile/1` file, or the profile block of a `strata.scenario/1` file."""
    d = load_json_file(path)
    if d.get("schema", "").startswith("strata.scenario"):
        d = _require(d, "profile", str(path))
    return Profile.from_json(d, where=str(path))
