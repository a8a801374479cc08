"""The plan: an immutable record of every budget, the decisions behind it, and its `strata.plan/1` JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from strata_core.api.facts import DeviceInfo, HostInfo, PlatformDefaults
from strata_core.api.plan_draft import Decision  # noqa: F401  (part of the contract; re-exported)
from strata_core.models.spec import ModelSpec

SCHEMA = "strata.plan/1"


@dataclass(frozen=True)
class LoanRow:
    """The prompt path's loan for one chunk: ring slots + buffer slots = loan slots."""

    chunk: int
    ring_slots: int
    buffer_slots: int
    loan_slots: int


@dataclass(frozen=True)
class LoanModel:
    """What loan(c) depends on, so the runtime computes a request's loan exactly as the planner did."""

    prompt_bytes_per_token: int
    slot_bytes: int
    pinned_fraction: float
    defaults: PlatformDefaults

    def loan(self, chunk_tokens: int) -> LoanRow:
        """ring(c) + ceil(c * prompt bytes per token / slot bytes)."""
        ring = self.defaults.ring_slots(chunk_tokens, self.slot_bytes, self.pinned_fraction)
        buf = -(-chunk_tokens * self.prompt_bytes_per_token // self.slot_bytes)
        return LoanRow(chunk=chunk_tokens, ring_slots=ring, buffer_slots=buf, loan_slots=ring + buf)


@dataclass(frozen=True)
class VramPlan:
    """Device memory, in bytes: left_bytes is what stays free after everything planned."""

    free_bytes: int
    reserve_bytes: int
    dense_bytes: int
    kv_bytes: int
    workspace_bytes: int
    expert_cache_bytes: int
    owned_prompt_bytes: int
    left_bytes: int
    #: the driver's rounding of the one start-up block that holds every line above (planner.driver_memory)
    alloc_rounding_bytes: int = 0
    #: the driver's page tables for the page-locked host memory the plan pins (planner.driver_memory)
    pinned_map_bytes: int = 0

    @property
    def regions_bytes(self) -> int:
        """The lines the runtime takes as regions: dense weights, KV, workspace, expert cache, owned buffers."""
        return self.dense_bytes + self.kv_bytes + self.workspace_bytes + self.expert_cache_bytes \
            + self.owned_prompt_bytes

    @property
    def device_bytes(self) -> int:
        """Every device byte of the plan: the regions and the driver's lines (the reserve is kept free)."""
        return self.regions_bytes + self.alloc_rounding_bytes + self.pinned_map_bytes


@dataclass(frozen=True)
class CachePlan:
    """The expert cache: slots of slot_bytes each."""

    slots: int
    slot_bytes: int


@dataclass(frozen=True)
class PromptPlan:
    """The prompt path: the chunk, how it was chosen, and the loan of every grid chunk up to it."""

    chunk: int
    chunk_source: str
    ceiling: int
    min_keep_slots: int
    lendable_slots: int
    owned_buffers: bool
    grid_tokens: int
    stream_min_tokens: int
    loans: tuple[LoanRow, ...]

    @property
    def max_loan_slots(self) -> int:
        """The largest loan of any chunk up to the plan's chunk (0 with owned buffers)."""
        return max((r.loan_slots for r in self.loans), default=0)


@dataclass(frozen=True)
class HostPlan:
    """Host RAM, in bytes."""

    available_bytes: int
    headroom_bytes: int
    resident_bytes: int
    resident_experts: int
    borrow_bytes: int
    kv_pinned_bytes: int
    #: f32 copies the backend's kernels keep of read-only dense weights (cpu: the routers and the LM head)
    weight_copies_bytes: int = 0


@dataclass(frozen=True)
class PinnedPlan:
    """Page-locked host memory, in bytes; `exhausted` when the arena cannot be pinned whole."""

    limit_bytes: int
    cap_bytes: int | None
    arena_bytes: int
    arena_wanted_bytes: int
    floor_bytes: int
    cpu_share_bytes: int
    exhausted: bool
    #: The arena registers in calls of at most this many bytes (one call of 512 GiB or more fails).
    registration_slice_bytes: int = 256 << 30

    @property
    def pinned_fraction(self) -> float:
        """Share of the expert arena that is page-locked."""
        return self.arena_bytes / self.arena_wanted_bytes if self.arena_wanted_bytes else 1.0


@dataclass(frozen=True)
class CpuSharePlan:
    """Whether the CPU share runs, for chunks up to max_chunk, and why."""

    enabled: bool
    max_chunk: int
    reason: str


@dataclass(frozen=True)
class RuntimeLimits:
    """The settings the runtime acts on, resolved once by the planner: the runtime never reads settings back."""

    max_context_tokens: int
    kv_dtype: str
    elastic_slots_bytes: int
    cpu_share_mode: str
    cpu_share_max_tokens: int
    stream_min_tokens: int
    trace: bool

    @classmethod
    def from_settings(cls, settings: Any, stream_min_tokens: int) -> "RuntimeLimits":
        """The limits of a StrataSettings object (stream_min_tokens already resolved against the platform)."""
        return cls(max_context_tokens=int(settings.kv.max_context), kv_dtype=str(settings.kv.dtype),
                   elastic_slots_bytes=int(float(settings.memory.elastic_slots_gib or 0) * (1 << 30)),
                   cpu_share_mode=str(settings.prefill.cpu_share),
                   cpu_share_max_tokens=int(settings.prefill.cpu_share_max_tokens),
                   stream_min_tokens=int(stream_min_tokens), trace=bool(settings.trace))


@dataclass(frozen=True)
class Plan:
    """A proven plan: built only by `make_plan`, which checks every invariant before returning it."""

    backend: str
    device: DeviceInfo
    host: HostInfo
    model: ModelSpec
    settings_json: dict
    limits: RuntimeLimits
    defaults: PlatformDefaults
    vram: VramPlan
    expert_cache: CachePlan
    prompt: PromptPlan
    host_memory: HostPlan
    pinned: PinnedPlan
    cpu_share: CpuSharePlan
    loan_model: LoanModel
    decisions: tuple[Decision, ...] = ()
    warnings: tuple[str, ...] = field(default=())

    def loan_for(self, chunk_tokens: int) -> LoanRow:
        """The loan a chunk of this many tokens needs, on or off the grid."""
        return self.loan_model.loan(int(chunk_tokens))

    def request_chunk(self, prompt_tokens: int) -> int:
        """The chunk a request reads with: the plan's chunk, or the prompt rounded up to the grid when smaller.

        Buffers come in grid multiples (kernel tiles), so a 4000-token prompt reads as one 4096-token chunk, and its
        loan is loan(4096), which may be larger than the auto chunk's (seed #2090).
        """
        g = self.prompt.grid_tokens
        own = -(-max(1, prompt_tokens) // g) * g
        return max(1, min(self.prompt.chunk, own)) if self.prompt.chunk else 0

    def refuse_reason(self, prompt_tokens: int) -> str | None:
        """Why a request of this many prompt tokens cannot run at all under this plan, or None (the runtime's rule)."""
        if prompt_tokens <= 0:
            return "an empty prompt"
        if prompt_tokens > self.limits.max_context_tokens:
            return (f"a prompt of {prompt_tokens} tokens is longer than kv.max_context "
                    f"({self.limits.max_context_tokens})")
        return None

    def prompt_buffer_bytes(self, chunk_tokens: int) -> int:
        """Device bytes of a chunk's prompt buffers: tokens x the model's per-token formula (models.spec.prompt_bytes_for)."""
        return int(chunk_tokens) * self.model.prompt_bytes_per_token

    def streams(self, prompt_tokens: int) -> bool:
        """True when a prompt this long streams misses through a ring lent from the cache."""
        return prompt_tokens >= self.prompt.stream_min_tokens and not self.prompt.owned_buffers

    def to_json(self) -> dict:
        """The `strata.plan/1` object."""
        settings = self.settings_json
        return {
            "schema": SCHEMA,
            "backend": self.backend,
            "device": self.device.to_json(),
            "host": self.host.to_json(),
            "model": self.model.to_json(),
            "settings": settings,
            "defaults": self.defaults.to_json(),
            "vram": asdict(self.vram),
            "expert_cache": asdict(self.expert_cache),
            "prompt": {**{k: v for k, v in asdict(self.prompt).items() if k != "loans"},
                       "max_loan_slots": self.prompt.max_loan_slots,
                       "loans": [asdict(r) for r in self.prompt.loans]},
            "host_memory": asdict(self.host_memory),
            "pinned": {**asdict(self.pinned), "pinned_fraction": round(self.pinned.pinned_fraction, 6)},
            "cpu_share": asdict(self.cpu_share),
            "limits": asdict(self.limits),
            "decisions": [asdict(d) for d in self.decisions],
            "warnings": list(self.warnings),
        }
