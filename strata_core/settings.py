"""StrataSettings: the one typed settings object, and the only module that reads the environment.

Sources, highest first: command-line flags, environment (`STRATA_` prefix, `__` between levels, and the legacy flat
names of the engine this replaces), a TOML file (`--config FILE`, else `./strata.toml`, else `[tool.strata]` in
`./pyproject.toml`), backend defaults, core defaults.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BackendSettings(_Group):
    """Which backend and device run the engine."""

    name: str = Field("auto", description="'auto' (highest probe score) or a backend name: cpu, sim, cuda, rocm, sycl, ...")
    device: int = Field(0, ge=0, description="Device index within the backend")


class MemorySettings(_Group):
    """VRAM and host-RAM budgets."""

    vram_reserve_mib: int | None = Field(None, ge=0, description="VRAM kept free for the driver and display, MiB (None: backend default)")
    expert_cache: Union[Literal["auto"], int] = Field("auto", description="Expert-cache slots: 'auto' (all that fit) or a slot count")
    resident_experts: bool = Field(False, description="Keep every expert not in the cache resident (locked) in host RAM")
    resident_headroom_gib: float | None = Field(None, ge=0, description="Host RAM kept free beside resident experts, GiB (None: backend default)")
    elastic_slots_gib: float = Field(0.0, ge=0, description="Idle expert-cache slots trimmed when quiet, GiB (0: off)")


class PrefillSettings(_Group):
    """How prompts are read."""

    chunk: str = Field("auto", description="Prompt chunk: 'auto', 'auto:N' (auto capped at N) or N tokens")
    cpu_share: Literal["auto", "on", "off"] = Field("auto", description="Run part of small chunks' missed experts on the CPU")
    cpu_share_max_tokens: int = Field(1024, ge=0, description="The CPU share arms for chunks below this many tokens")
    lend_fraction: float | None = Field(None, gt=0, le=1, description="Largest fraction of the expert cache the prompt path may borrow (None: backend default)")
    stream_min_tokens: int | None = Field(None, ge=0, description="Prompts shorter than this are not streamed through the ring (None: backend default)")

    @field_validator("chunk")
    @classmethod
    def _chunk(cls, v: str) -> str:
        s = str(v).strip().lower()
        if s == "auto":
            return s
        body = s[5:] if s.startswith("auto:") else s
        if not body.isdigit() or int(body) <= 0:
            raise ValueError("expected 'auto', 'auto:N' or N (a positive token count)")
        return s

    def chunk_request(self) -> tuple[str, int | None]:
        """('auto', None), ('auto', N cap) or ('fixed', N)."""
        if self.chunk == "auto":
            return "auto", None
        if self.chunk.startswith("auto:"):
            return "auto", int(self.chunk[5:])
        return "fixed", int(self.chunk)


class KvSettings(_Group):
    """The KV cache."""

    dtype: Literal["f16", "bf16", "int8", "q8_0", "f32"] = Field("f16", description="KV cache element type")
    max_context: int = Field(32768, gt=0, description="Longest context a request may use, tokens")
    resident_cells: int | None = Field(None, ge=0, description="KV cells kept in VRAM per layer; the rest streams from pinned RAM (None: all)")


class PinningSettings(_Group):
    """Page-locked host memory."""

    arena_pin_gib: float | None = Field(None, ge=0, description="Cap on the expert arena's page-locked bytes, GiB (None: the plan's limit)")
    pin_guard: bool = Field(True, description="Pace arena registration and keep a page-locked floor for runtime allocations")
    pin_reserve_gib: float | None = Field(None, ge=0, description="Host RAM never page-locked, GiB (None: backend default)")
    wddm_pin_cap_gib: float | None = Field(None, ge=0, description="Page-locked cap under WDDM, GiB (None: backend default)")
    pin_floor_mib: int | None = Field(None, ge=0, description="Page-locked memory kept out of the arena for runtime allocations, MiB (None: backend default)")


class PluginSettings(_Group):
    """Which plugins load."""

    allow: list[str] = Field(default_factory=list, description="Only these entry points load (empty: all)")
    block: list[str] = Field(default_factory=list, description="These entry points never load")
    autoload: bool = Field(True, description="Load plugins from the strata.backends and strata.plugins entry points")


class StrataSettings(BaseSettings):
    """Every setting of Strata Core, in nested groups."""

    model_config = SettingsConfigDict(env_prefix="STRATA_", env_nested_delimiter="__", extra="forbid",
                                      validate_assignment=True)

    backend: BackendSettings = Field(default_factory=BackendSettings)
    memory: MemorySettings = Field(default_factory=MemorySettings)
    prefill: PrefillSettings = Field(default_factory=PrefillSettings)
    kv: KvSettings = Field(default_factory=KvSettings)
    pinning: PinningSettings = Field(default_factory=PinningSettings)
    trace: bool = Field(False, description="Log every loan, fallback and decision as it happens")
    plugins: PluginSettings = Field(default_factory=PluginSettings)
