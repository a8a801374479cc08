"""The settings schema: the core's pydantic groups, their physical bounds, and the schema as a flat list of keys.

Every number is checked where it enters: finite, inside a named physical bound, and an integer where an integer
is meant (text must be ASCII digits: no `inf`, no `1e23` for a token count, no fullwidth digits, no 3.5 slots).
The check runs in the groups themselves, so flags, environment, legacy variables, TOML, `--set` and a scenario's
`settings` block all meet the same rule and the same words.
"""

from __future__ import annotations

import math
import re
import types
import typing
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any, Iterator, Literal, Mapping, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, create_model, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "STRATA_"
ENV_NESTED_DELIMITER = "__"

#: Where a value may come from, highest precedence first.
SOURCES = ("flag", "env", "legacy-env", "toml", "backend-default", "default")

# Physical bounds, named in every message that refuses a value beyond them. Generous on purpose: they catch typos
# and overflow (1e23 tokens, inf GiB), not unusual machines.
MAX_TOKENS = 1 << 24          #: 16 Mi tokens: the longest context, chunk or threshold a setting may name
MAX_SLOTS = 1 << 24           #: expert-cache slots
MAX_GIB = 1 << 16             #: 64 TiB of host RAM or VRAM, in GiB
MAX_MIB = 1 << 26             #: the same 64 TiB, in MiB
MAX_DEVICE_INDEX = 1023       #: device indices within one backend

#: A backend or entry-point name: what `strata backends` lists (letters, digits, '.', '_', '-').
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,63}$"
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]

_INT_TEXT = re.compile(r"[+-]?[0-9]+")
_FLOAT_TEXT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _number_kinds(annotation: Any) -> tuple[set[type], set[str]]:
    """The numeric types (int, float) and literal strings an annotation allows."""
    kinds: set[type] = set()
    literals: set[str] = set()
    stack = [annotation]
    while stack:
        a = stack.pop()
        origin = typing.get_origin(a)
        if origin is Literal:
            literals.update(str(x) for x in typing.get_args(a))
        elif origin in (Union, types.UnionType):
            stack.extend(typing.get_args(a))
        elif a in (int, float):
            kinds.add(a)
    return kinds, literals


def check_number_shape(annotation: Any, value: Any) -> Any:
    """`value` unchanged when its shape fits a numeric field (ASCII digits, finite, no float for an int), else ValueError."""
    kinds, literals = _number_kinds(annotation)
    if not kinds or value is None:
        return value
    want = "an integer" if float not in kinds else "a finite number"
    if isinstance(value, bool):
        raise ValueError(f"expected {want}, got a boolean")
    if isinstance(value, str):
        s = value.strip()
        if s.lower() in literals:
            return s.lower()
        if int in kinds and _INT_TEXT.fullmatch(s):
            return s
        if float in kinds and _FLOAT_TEXT.fullmatch(s):
            if not math.isfinite(float(s)):
                raise ValueError(f"expected {want}")
            return s
        raise ValueError(f"expected {want} written in ASCII digits")
    if isinstance(value, float):
        if float not in kinds:
            raise ValueError("expected an integer, got a fractional number")
        if not math.isfinite(value):
            raise ValueError("expected a finite number")
    return value


class _Group(BaseModel):
    """A settings group: unknown keys refused, assignments validated, numbers shaped as their fields say."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _number_shape(cls, v: Any, info) -> Any:
        f = cls.model_fields.get(info.field_name)
        return check_number_shape(f.annotation, v) if f is not None else v


#: The base plugin groups may derive from to get the same number rules (any pydantic model is accepted).
SettingsGroupModel = _Group


class BackendSettings(_Group):
    """Which backend and device run the engine."""

    name: str = Field("auto", pattern=NAME_PATTERN,
                      description="'auto' (highest probe score) or a backend name: cpu, sim, cuda, rocm, sycl, ...")
    device: int = Field(0, ge=0, le=MAX_DEVICE_INDEX, description="Device index within the backend")


class MemorySettings(_Group):
    """VRAM and host-RAM budgets."""

    vram_reserve_mib: int | None = Field(None, ge=0, le=MAX_MIB, description="VRAM kept free for the driver and display, MiB (None: backend default)")
    expert_cache: Union[Literal["auto"], int] = Field("auto", description="Expert-cache slots: 'auto' (all that fit) or a slot count")
    resident_experts: bool = Field(False, description="Keep every expert not in the cache resident (locked) in host RAM")
    resident_headroom_gib: float | None = Field(None, ge=0, le=MAX_GIB, allow_inf_nan=False, description="Host RAM kept free beside resident experts, GiB (None: backend default)")
    elastic_slots_gib: float = Field(0.0, ge=0, le=MAX_GIB, allow_inf_nan=False, description="Idle expert-cache slots trimmed when quiet, GiB (0: off)")

    @field_validator("expert_cache")
    @classmethod
    def _slots(cls, v: Any) -> Any:
        if v != "auto" and not 0 < int(v) <= MAX_SLOTS:
            raise ValueError(f"expected 'auto' or a slot count from 1 to {MAX_SLOTS}")
        return v


class PrefillSettings(_Group):
    """How prompts are read."""

    chunk: str = Field("auto", description="Prompt chunk: 'auto', 'auto:N' (auto capped at N) or N tokens")
    cpu_share: Literal["auto", "on", "off"] = Field("auto", description="Run part of small chunks' missed experts on the CPU")
    cpu_share_max_tokens: int = Field(1024, ge=0, le=MAX_TOKENS, description="The CPU share arms for chunks below this many tokens")
    lend_fraction: float | None = Field(None, gt=0, le=1, allow_inf_nan=False, description="Largest fraction of the expert cache the prompt path may borrow (None: backend default)")
    stream_min_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS, description="Prompts shorter than this are not streamed through the ring (None: backend default)")

    @field_validator("chunk", mode="before")
    @classmethod
    def _chunk(cls, v: Any) -> str:
        bad = ValueError(f"expected 'auto', 'auto:N' or N (a token count from 1 to {MAX_TOKENS})")
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise bad
        s = str(v).strip().lower()
        if s == "auto":
            return s
        body = s[5:] if s.startswith("auto:") else s
        if not re.fullmatch(r"[0-9]+", body) or not 0 < int(body) <= MAX_TOKENS:
            raise bad
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

    dtype: Literal["f16", "bf16", "int8", "q8_0", "f32"] = Field("f16", description="KV cache element type (fp16, float16, half, bfloat16, fp32, float32, q8 and i8 are read as their short names)")
    max_context: int = Field(32768, gt=0, le=MAX_TOKENS, description="Longest context a request may use, tokens")
    resident_cells: int | None = Field(None, ge=0, le=MAX_TOKENS, description="KV cells kept in VRAM per layer; the rest streams from pinned RAM (None: all)")

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_spelling(cls, v: Any) -> Any:
        return KV_DTYPE_SPELLINGS.get(v.strip().lower(), v.strip().lower()) if isinstance(v, str) else v


#: Common spellings of the KV dtypes -> the names the schema keeps (issue 12.7).
KV_DTYPE_SPELLINGS = {"fp16": "f16", "float16": "f16", "half": "f16", "bfloat16": "bf16", "fp32": "f32",
                      "float32": "f32", "float": "f32", "q8": "q8_0", "q8_0": "q8_0", "i8": "int8"}


class PinningSettings(_Group):
    """Page-locked host memory."""

    arena_pin_gib: float | None = Field(None, ge=0, le=MAX_GIB, allow_inf_nan=False, description="Cap on the expert arena's page-locked bytes, GiB (None: the plan's limit)")
    pin_guard: bool = Field(True, description="Pace arena registration and keep a page-locked floor for runtime allocations")
    pin_reserve_gib: float | None = Field(None, ge=0, le=MAX_GIB, allow_inf_nan=False, description="Host RAM never page-locked, GiB (None: backend default)")
    wddm_pin_cap_gib: float | None = Field(None, ge=0, le=MAX_GIB, allow_inf_nan=False, description="Page-locked cap under WDDM, GiB (None: backend default)")
    pin_floor_mib: int | None = Field(None, ge=0, le=MAX_MIB, description="Page-locked memory kept out of the arena for runtime allocations, MiB (None: backend default)")
    test_pinned_fraction: float | None = Field(None, ge=0, le=1, allow_inf_nan=False, description="Testing only: the pinned fraction the ring policy sees, 0..1 (None: measured)")


class PluginSettings(_Group):
    """Which plugins load."""

    allow: list[Name] = Field(default_factory=list, description="Only these entry points load (empty: all)")
    block: list[Name] = Field(default_factory=list, description="These entry points never load")
    autoload: bool = Field(True, description="Load plugins from the strata.backends and strata.plugins entry points")


class StrataSettings(BaseSettings):
    """Every setting of Strata Core, in nested groups."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTED_DELIMITER, extra="forbid",
                                      validate_assignment=True)

    backend: BackendSettings = Field(default_factory=BackendSettings)
    memory: MemorySettings = Field(default_factory=MemorySettings)
    prefill: PrefillSettings = Field(default_factory=PrefillSettings)
    kv: KvSettings = Field(default_factory=KvSettings)
    pinning: PinningSettings = Field(default_factory=PinningSettings)
    trace: bool = Field(False, description="Log every loan, fallback and decision as it happens")
    plugins: PluginSettings = Field(default_factory=PluginSettings)
    # Plugin groups (the built-in sim backend's `[sim]` among them) are added by `schema_with_groups`.

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        """Only the values passed in: `load_settings` layers the sources itself, keeping each value's origin."""
        return (init_settings,)


#: Groups of the core schema that a plugin may not take over.
CORE_GROUPS = frozenset(n for n, f in StrataSettings.model_fields.items()
                        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel))


@lru_cache(maxsize=32)
def _schema_cached(groups: tuple[tuple[str, type], ...]) -> type[StrataSettings]:
    fields = {name: (model, Field(default_factory=model, description=(model.__doc__ or "").strip().splitlines()[0]
                                  if model.__doc__ else ""))
              for name, model in groups}
    return create_model("StrataSettings", __base__=StrataSettings, __doc__=StrataSettings.__doc__, **fields)


def schema_with_groups(groups: Mapping[str, type[BaseModel]] | None) -> type[StrataSettings]:
    """StrataSettings extended by plugin groups ({name: pydantic model}); the core schema when there are none.

    The same groups give the same class (cached), so two loads compare equal. A plugin group named like a core
    group (memory, kv, ...) replaces nothing: `sources.check_plugin_groups` refuses it first.
    """
    extra = tuple(sorted((n, m) for n, m in (groups or {}).items()
                         if n not in StrataSettings.model_fields))
    return _schema_cached(extra) if extra else StrataSettings


# ---------------------------------------------------------------------------------------------------------------
# The schema as a flat list of dotted keys


@dataclass(frozen=True)
class SettingField:
    """One leaf setting: its dotted key, pydantic field and the group model that owns it."""

    key: str
    info: FieldInfo
    owner: type[BaseModel]

    @property
    def env_name(self) -> str:
        """The new-style environment variable of this key."""
        return ENV_PREFIX + self.key.upper().replace(".", ENV_NESTED_DELIMITER)

    @property
    def optional(self) -> bool:
        """True when None is an allowed value."""
        return _allows_none(self.info.annotation)

    @property
    def is_list(self) -> bool:
        """True for list-valued settings."""
        return typing.get_origin(_strip_none(self.info.annotation)) is list

    @property
    def leaf(self) -> str:
        """The key's last part (the field's name in its group)."""
        return self.key.rsplit(".", 1)[-1]

    def default(self) -> Any:
        """The core default."""
        return self.info.get_default(call_default_factory=True)

    def allowed(self) -> str:
        """What values are allowed, in words."""
        return ALLOWED_TEXT.get(self.key) or _allowed_words(self.info)


#: Words for fields whose type alone does not say what is allowed.
ALLOWED_TEXT = {
    "prefill.chunk": f"'auto', 'auto:N' or N (N a token count from 1 to {MAX_TOKENS})",
    "memory.expert_cache": f"'auto' or a slot count from 1 to {MAX_SLOTS}",
    "backend.name": "'auto' or an installed backend's name (see `strata backends`)",
}


def _is_group(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _allows_none(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def _strip_none(annotation: Any) -> Any:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _allowed_words(info: FieldInfo) -> str:
    ann = _strip_none(info.annotation)
    origin = typing.get_origin(ann)
    if origin is Annotated:
        ann = typing.get_args(ann)[0]
        origin = typing.get_origin(ann)
    if origin is Literal:
        names = [repr(a) for a in typing.get_args(ann)]
        words = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
    elif origin is list:
        words = "a list of names (TOML array, or comma-separated in env and flags)"
    elif ann is bool:
        words = "true or false (1/0, on/off, yes/no)"
    elif ann in (int, float):
        kind = "an integer" if ann is int else "a finite number"
        bounds = []
        for m in info.metadata:
            for attr, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                if getattr(m, attr, None) is not None:
                    bounds.append(f"{sym} {getattr(m, attr)}")
        words = kind + (" " + " and ".join(bounds) if bounds else "")
    elif ann is str:
        words = "text"
    else:
        words = str(ann)
    if _allows_none(info.annotation):
        words += ", or none"
    return words


def iter_fields(model: type[BaseModel] = StrataSettings, prefix: str = "") -> Iterator[SettingField]:
    """Every leaf setting, in schema order."""
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        if _is_group(info.annotation):
            yield from iter_fields(info.annotation, key + ".")
        else:
            yield SettingField(key=key, info=info, owner=model)


@lru_cache(maxsize=32)
def fields_of(schema: type[StrataSettings]) -> dict[str, SettingField]:
    """{dotted key: SettingField} of a schema (the core one, or one with plugin groups)."""
    return {f.key: f for f in iter_fields(schema)}


def groups_of(schema: type[StrataSettings]) -> frozenset[str]:
    """The group names of a schema."""
    return frozenset(k.rsplit(".", 1)[0] for k in fields_of(schema) if "." in k)


FIELDS: dict[str, SettingField] = fields_of(StrataSettings)
GROUPS: frozenset[str] = groups_of(StrataSettings)
