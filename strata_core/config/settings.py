"""StrataSettings: the one typed settings object, and the only module that reads the environment.

Sources, highest first: command-line flags, environment (`STRATA_` prefix, `__` between levels, and the legacy flat
names of the engine this replaces), a TOML file (`--config FILE`, else `./strata.toml`, else `[tool.strata]` in
`./pyproject.toml`), backend defaults, core defaults.

The sources are layered here, not by pydantic-settings' own source chain, so that every value keeps where it came
from (`LoadedSettings.origins`) and a bad value names its key, its source and what is allowed. `StrataSettings()`
on its own therefore gives the core defaults and reads nothing.

Legacy variables (read once, mapped to their typed key, each reported in one notice naming the new key; a
new-style variable of the same key wins over a legacy one):

| legacy variable               | setting                         | mapping                                  |
|-------------------------------|---------------------------------|------------------------------------------|
| STRATA_PREFILL_CPU_SHARE      | prefill.cpu_share               | 0 -> off, 1 -> on                        |
| STRATA_PREFILL_CPU_SHARE_MAX  | prefill.cpu_share_max_tokens    | tokens                                   |
| STRATA_PIN_GUARD              | pinning.pin_guard               | 0/1 -> false/true                        |
| STRATA_PIN_RESERVE_GIB        | pinning.pin_reserve_gib         | GiB                                      |
| STRATA_ARENA_PIN_GIB          | pinning.arena_pin_gib           | GiB                                      |
| STRATA_WDDM_PIN_CAP_GIB       | pinning.wddm_pin_cap_gib        | GiB                                      |
| STRATA_TEST_PINNED_SHARE      | pinning.test_pinned_fraction    | fraction 0..1                            |
| STRATA_GFX12_DEFAULTS         | prefill.chunk                   | 0 -> auto:8192, 1 -> no change           |
| STRATA_GFX12_CHUNK            | prefill.chunk                   | 0 -> auto:8192, N -> auto:N              |
| STRATA_PREFILL_AUTO_MAX       | prefill.chunk                   | N -> auto:N                              |
| STRATA_RESIDENT_HEADROOM_GIB  | memory.resident_headroom_gib    | GiB                                      |
| STRATA_ELASTIC_SLOTS_GIB      | memory.elastic_slots_gib        | GiB                                      |
| STRATA_PREFILL_LEND_PCT       | prefill.lend_fraction           | percent -> fraction (50 -> 0.5)          |
| STRATA_PREFILL_STREAM_MIN     | prefill.stream_min_tokens       | tokens                                   |
| STRATA_TRACE                  | trace                           | same name, read as the new-style key     |
| STRATA_BRANCH_CHECKPOINT_ALIGN| (none)                          | ignored, with a notice saying why        |
| STRATA_ISA_FLOOR              | (none)                          | ignored, with a notice saying why        |

`LEGACY_VARIABLES` and `RETIRED_VARIABLES` below are the tables the code uses; `strata config table` prints it for the README.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping, NamedTuple, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from strata_core.errors import BadInput

ENV_PREFIX = "STRATA_"
ENV_NESTED_DELIMITER = "__"

#: Where a value may come from, highest precedence first.
SOURCES = ("flag", "env", "legacy-env", "toml", "backend-default", "default")


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

    @field_validator("expert_cache")
    @classmethod
    def _slots(cls, v: Any) -> Any:
        if v != "auto" and int(v) <= 0:
            raise ValueError("expected 'auto' or a positive slot count")
        return v


class PrefillSettings(_Group):
    """How prompts are read."""

    chunk: str = Field("auto", description="Prompt chunk: 'auto', 'auto:N' (auto capped at N) or N tokens")
    cpu_share: Literal["auto", "on", "off"] = Field("auto", description="Run part of small chunks' missed experts on the CPU")
    cpu_share_max_tokens: int = Field(1024, ge=0, description="The CPU share arms for chunks below this many tokens")
    lend_fraction: float | None = Field(None, gt=0, le=1, description="Largest fraction of the expert cache the prompt path may borrow (None: backend default)")
    stream_min_tokens: int | None = Field(None, ge=0, description="Prompts shorter than this are not streamed through the ring (None: backend default)")

    @field_validator("chunk", mode="before")
    @classmethod
    def _chunk(cls, v: Any) -> str:
        if isinstance(v, bool):
            raise ValueError("expected 'auto', 'auto:N' or N (a positive token count)")
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
    test_pinned_fraction: float | None = Field(None, ge=0, le=1, description="Testing only: the pinned fraction the ring policy sees, 0..1 (None: measured)")


class PluginSettings(_Group):
    """Which plugins load."""

    allow: list[str] = Field(default_factory=list, description="Only these entry points load (empty: all)")
    block: list[str] = Field(default_factory=list, description="These entry points never load")
    autoload: bool = Field(True, description="Load plugins from the strata.backends and strata.plugins entry points")


class SimSettings(_Group):
    """The simulated device of the 'sim' backend."""

    profile: str | None = Field(None, description="A strata.profile/1 or strata.scenario/1 file the sim device takes its facts from (None: built-in 24 GiB card)")
    inject: list[str] = Field(default_factory=list, description="Fault specs the sim backend injects (see `strata simulate --help`)")


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
    sim: SimSettings = Field(default_factory=SimSettings)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        """Only the values passed in: `load_settings` layers the sources itself, keeping each value's origin."""
        return (init_settings,)


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

    def default(self) -> Any:
        """The core default."""
        return self.info.get_default(call_default_factory=True)

    def allowed(self) -> str:
        """What values are allowed, in words."""
        return ALLOWED_TEXT.get(self.key) or _allowed_words(self.info)


#: Words for fields whose type alone does not say what is allowed.
ALLOWED_TEXT = {
    "prefill.chunk": "'auto', 'auto:N' or N (N a positive token count)",
    "memory.expert_cache": "'auto' or a positive slot count",
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
    if origin is Literal:
        names = [repr(a) for a in typing.get_args(ann)]
        words = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
    elif origin is list:
        words = "a list of names (TOML array, or comma-separated in env and flags)"
    elif ann is bool:
        words = "true or false (1/0, on/off, yes/no)"
    elif ann in (int, float):
        kind = "an integer" if ann is int else "a number"
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


FIELDS: dict[str, SettingField] = {f.key: f for f in iter_fields()}
GROUPS: frozenset[str] = frozenset(k.rsplit(".", 1)[0] for k in FIELDS if "." in k)


def _unknown_key(key: str, where: str) -> BadInput:
    close = difflib.get_close_matches(key, list(FIELDS), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else "; `strata config show` lists every key"
    return BadInput(f"{where}: unknown setting '{key}'{hint}")


# ---------------------------------------------------------------------------------------------------------------
# Values and their provenance


class Provenance(NamedTuple):
    """Where a value came from: a source (one of SOURCES) and an origin (the variable, file and line, or flag)."""

    source: str
    origin: str


class FlagValue(NamedTuple):
    """A flag value with the flag that set it (for `load_settings(flags=...)`)."""

    value: Any
    origin: str


@dataclass(frozen=True)
class LoadedSettings:
    """Settings with the provenance of every value and the notices loading produced (legacy names, overrides)."""

    settings: StrataSettings
    origins: dict[str, Provenance]
    notices: list[str] = field(default_factory=list)

    def value(self, key: str) -> Any:
        """The value of a dotted key."""
        obj: Any = self.settings
        for part in key.split("."):
            obj = getattr(obj, part)
        return obj

    def values_json(self) -> dict[str, dict]:
        """{"dotted.key": {"value", "source", "origin"}} for `strata.config/1`."""
        out = {}
        for key in FIELDS:
            v = self.value(key)
            prov = self.origins.get(key, Provenance("default", "core"))
            out[key] = {"value": list(v) if isinstance(v, (list, tuple)) else v, "source": prov.source,
                        "origin": prov.origin}
        return out


def _coerce_text(f: SettingField, text: str) -> Any:
    """A string from env or a flag, shaped for the field (lists split, 'none' for optional fields)."""
    s = text.strip()
    if f.optional and s.lower() in ("none", "null"):
        return None
    if f.is_list:
        if s.startswith("["):
            try:
                return json.loads(s)
            except json.JSONDecodeError:
                return s  # left to validation, which names the key
        return [p.strip() for p in s.split(",") if p.strip()]
    return s


def _validate_leaf(f: SettingField, value: Any, raw: Any, where: str) -> Any:
    """The validated value of one leaf, or BadInput naming the key, where it came from and what is allowed."""
    try:
        obj = f.owner.model_validate({f.key.rsplit(".", 1)[-1]: value}) if f.owner is not StrataSettings \
            else StrataSettings(**{f.key: value})
    except ValidationError:
        raise BadInput(f"{f.key}: {raw!r} from {where} is not allowed; allowed: {f.allowed()}") from None
    return getattr(obj, f.key.rsplit(".", 1)[-1])


# ---------------------------------------------------------------------------------------------------------------
# Legacy variables


class _Skip:
    """A legacy value that changes nothing (STRATA_GFX12_DEFAULTS=1)."""


SKIP = _Skip()


def _legacy_bool(text: str) -> bool:
    s = text.strip().lower()
    if s in ("1", "true", "on", "yes"):
        return True
    if s in ("0", "false", "off", "no"):
        return False
    raise ValueError("0 or 1")


def _legacy_share(text: str) -> str:
    s = text.strip().lower()
    if s == "auto":
        return "auto"
    return "on" if _legacy_bool(s) else "off"


def _legacy_number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError("a number >= 0") from None
    if v < 0 or v != v:
        raise ValueError("a number >= 0")
    return v


def _legacy_tokens(text: str) -> int:
    s = text.strip()
    if not s.isdigit():
        raise ValueError("a whole number of tokens >= 0")
    return int(s)


def _legacy_gfx12_chunk(text: str) -> str:
    n = _legacy_tokens(text)
    return "auto:8192" if n == 0 else f"auto:{n}"


def _legacy_gfx12_defaults(text: str) -> Any:
    return "auto:8192" if not _legacy_bool(text) else SKIP


def _legacy_auto_max(text: str) -> str:
    n = _legacy_tokens(text)
    if n <= 0:
        raise ValueError("a positive token count")
    return f"auto:{n}"


def _legacy_pct(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError("a percentage above 0 and at most 100") from None
    if not 0 < v <= 100:
        raise ValueError("a percentage above 0 and at most 100")
    return v / 100.0


def _legacy_fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError("a fraction from 0 to 1") from None
    if not 0 <= v <= 1:
        raise ValueError("a fraction from 0 to 1")
    return v


@dataclass(frozen=True)
class LegacyVariable:
    """A flat variable of the engine this replaces: the typed key it maps to and how its value converts."""

    name: str
    key: str
    convert: Callable[[str], Any]
    mapping: str


#: Every legacy variable, in the order they are applied: a later one that maps to the same key wins (so the
#: general STRATA_PREFILL_AUTO_MAX wins over the gfx12-only ones), and says so in a notice.
LEGACY_VARIABLES: tuple[LegacyVariable, ...] = (
    LegacyVariable("STRATA_PREFILL_CPU_SHARE", "prefill.cpu_share", _legacy_share, "0 -> off, 1 -> on"),
    LegacyVariable("STRATA_PREFILL_CPU_SHARE_MAX", "prefill.cpu_share_max_tokens", _legacy_tokens, "tokens"),
    LegacyVariable("STRATA_PIN_GUARD", "pinning.pin_guard", _legacy_bool, "0/1 -> false/true"),
    LegacyVariable("STRATA_PIN_RESERVE_GIB", "pinning.pin_reserve_gib", _legacy_number, "GiB"),
    LegacyVariable("STRATA_ARENA_PIN_GIB", "pinning.arena_pin_gib", _legacy_number, "GiB"),
    LegacyVariable("STRATA_WDDM_PIN_CAP_GIB", "pinning.wddm_pin_cap_gib", _legacy_number, "GiB"),
    LegacyVariable("STRATA_TEST_PINNED_SHARE", "pinning.test_pinned_fraction", _legacy_fraction, "fraction 0..1"),
    LegacyVariable("STRATA_GFX12_DEFAULTS", "prefill.chunk", _legacy_gfx12_defaults, "0 -> auto:8192, 1 -> no change"),
    LegacyVariable("STRATA_GFX12_CHUNK", "prefill.chunk", _legacy_gfx12_chunk, "0 -> auto:8192, N -> auto:N"),
    LegacyVariable("STRATA_PREFILL_AUTO_MAX", "prefill.chunk", _legacy_auto_max, "N -> auto:N"),
    LegacyVariable("STRATA_RESIDENT_HEADROOM_GIB", "memory.resident_headroom_gib", _legacy_number, "GiB"),
    LegacyVariable("STRATA_ELASTIC_SLOTS_GIB", "memory.elastic_slots_gib", _legacy_number, "GiB"),
    LegacyVariable("STRATA_PREFILL_LEND_PCT", "prefill.lend_fraction", _legacy_pct, "percent -> fraction (50 -> 0.5)"),
    LegacyVariable("STRATA_PREFILL_STREAM_MIN", "prefill.stream_min_tokens", _legacy_tokens, "tokens"),
    LegacyVariable("STRATA_TRACE", "trace", _legacy_bool, "same name: read as the new-style key"),
)
LEGACY_BY_NAME = {v.name: v for v in LEGACY_VARIABLES}

#: Legacy variables with no counterpart here: read only to say, in one notice, why they change nothing.
RETIRED_VARIABLES: dict[str, str] = {
    "STRATA_BRANCH_CHECKPOINT_ALIGN": "KV branch checkpoints belong to the engine that embeds Strata Core",
    "STRATA_ISA_FLOOR": "a build option of the old engine; Strata Core reads the CPU's flags at run time",
}


# ---------------------------------------------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class _Entry:
    """One value from one source, before layering."""

    key: str
    value: Any
    raw: Any
    source: str
    origin: str
    where: str  # how a message names it: "env STRATA_X", "strata.toml line 3", "flag --set"


def _env_entries(env: Mapping[str, str]) -> tuple[list[_Entry], list[str]]:
    """New-style and legacy entries from an environment mapping, and the notices they produce."""
    new: dict[str, _Entry] = {}
    legacy: dict[str, _Entry] = {}
    notices: list[str] = []
    upper = {str(k).upper(): str(v) for k, v in env.items()}
    for name, text in sorted(upper.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX):].lower().replace(ENV_NESTED_DELIMITER, ".")
        if key in FIELDS:
            f = FIELDS[key]
            new[key] = _Entry(key, _validate_leaf(f, _coerce_text(f, text), text, f"env {name}"), text, "env",
                              name, f"env {name}")
        elif ENV_NESTED_DELIMITER in name[len(ENV_PREFIX):] and name not in LEGACY_BY_NAME:
            close = difflib.get_close_matches(key, list(FIELDS), n=1)
            notices.append(f"{name} is not a setting and was ignored"
                           + (f" (did you mean {FIELDS[close[0]].env_name}?)" if close else ""))
    for name, why in RETIRED_VARIABLES.items():
        if name in upper:
            notices.append(f"{name} is a legacy name with no setting here ({why}); ignored")
    for lv in LEGACY_VARIABLES:
        if lv.name not in upper or FIELDS[lv.key].env_name == lv.name:
            continue  # STRATA_TRACE is its own new-style name
        text = upper[lv.name]
        where = f"legacy env {lv.name}"
        try:
            value = lv.convert(text)
        except ValueError as e:
            raise BadInput(f"{lv.key}: {text!r} from {where} is not allowed; allowed: {e}") from None
        if value is SKIP:
            notices.append(f"{lv.name}={text} is a legacy name for {lv.key}; this value changes nothing")
            continue
        value = _validate_leaf(FIELDS[lv.key], value, text, where)
        if lv.key in legacy:
            notices.append(f"{lv.name} overrides {legacy[lv.key].origin} for {lv.key}")
        legacy[lv.key] = _Entry(lv.key, value, text, "legacy-env", lv.name, where)
        shown = value if not isinstance(value, str) else f"'{value}'"
        notices.append(f"{lv.name}={text} is a legacy name: read as {lv.key}={shown} "
                       f"(new name: {FIELDS[lv.key].env_name})")
    for key, e in legacy.items():
        if key in new:
            notices.append(f"{e.origin} is overridden by {new[key].origin} for {key}")
    merged = {**legacy, **new}
    return list(merged.values()), notices


_TOML_KEY_LINE = re.compile(r'^\s*((?:[A-Za-z0-9_\-]+|"[^"]*"|\'[^\']*\')(?:\s*\.\s*(?:[A-Za-z0-9_\-]+|"[^"]*"|\'[^\']*\'))*)\s*=')
_TOML_TABLE_LINE = re.compile(r'^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$')


def _toml_key_lines(text: str, root: str) -> dict[str, int]:
    """The line of each dotted key (relative to the `root` table, '' or 'tool.strata') as written in the file."""
    lines: dict[str, int] = {}
    table: str | None = "" if not root else None
    for n, line in enumerate(text.splitlines(), start=1):
        m = _TOML_TABLE_LINE.match(line)
        if m:
            name = re.sub(r"\s*\.\s*", ".", m.group(1)).replace('"', "").replace("'", "")
            if not root:
                table = name
            elif name == root:
                table = ""
            elif name.startswith(root + "."):
                table = name[len(root) + 1:]
            else:
                table = None
            if table:
                lines.setdefault(table, n)
            continue
        m = _TOML_KEY_LINE.match(line)
        if m and table is not None:
            k = re.sub(r"\s*\.\s*", ".", m.group(1)).replace('"', "").replace("'", "")
            lines.setdefault(f"{table}.{k}" if table else k, n)
    return lines


def _line_of(key: str, lines: dict[str, int]) -> int | None:
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        n = lines.get(".".join(parts[:i]))
        if n is not None:
            return n
    return None


def _find_toml(config_file: str | None, cwd: Path) -> tuple[Path, str] | None:
    """The TOML file to read and its root table, or None when there is none."""
    if config_file:
        p = Path(config_file)
        if not p.is_absolute():
            p = cwd / p
        if not p.is_file():
            raise BadInput(f"--config {config_file}: no such file")
        return p, ("tool.strata" if p.name == "pyproject.toml" else "")
    if (cwd / "strata.toml").is_file():
        return cwd / "strata.toml", ""
    if (cwd / "pyproject.toml").is_file():
        return cwd / "pyproject.toml", "tool.strata"
    return None


def _toml_entries(path: Path, root: str, shown: str) -> list[_Entry]:
    """Entries of one TOML file (`root` selects `[tool.strata]` in a pyproject.toml)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{shown}: cannot read ({e})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"{shown}: not valid TOML: {e}") from None
    if root:
        for part in root.split("."):
            data = data.get(part, {}) if isinstance(data, dict) else {}
        if not data:
            return []
    lines = _toml_key_lines(text, root)
    out: list[_Entry] = []

    def where(key: str) -> str:
        n = _line_of(key, lines)
        return f"{shown} line {n}" if n else shown

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            key = f"{prefix}{k}"
            if key in FIELDS:
                f = FIELDS[key]
                w = where(key)
                value = None if (f.optional and isinstance(v, str) and v.lower() in ("none", "null")) else v
                out.append(_Entry(key, _validate_leaf(f, value, v, w), v, "toml", w, w))
            elif key in GROUPS and isinstance(v, dict):
                walk(v, key + ".")
            else:
                raise _unknown_key(key, where(key))

    walk(data, "")
    return out


def _flag_entries(flags: Mapping[str, Any]) -> list[_Entry]:
    """Entries of flags: {dotted key: value or FlagValue(value, origin)}; None values are left out."""
    out = []
    for key, v in flags.items():
        value, origin = (v.value, v.origin) if isinstance(v, FlagValue) else (v, f"--set {key}")
        if value is None:
            continue
        if key not in FIELDS:
            raise _unknown_key(key, f"flag {origin}")
        f = FIELDS[key]
        shaped = _coerce_text(f, value) if isinstance(value, str) else value
        out.append(_Entry(key, _validate_leaf(f, shaped, value, f"flag {origin}"), value, "flag", origin,
                          f"flag {origin}"))
    return out


def _nest(flat: Mapping[str, Any]) -> dict:
    out: dict = {}
    for key, v in flat.items():
        *groups, leaf = key.split(".")
        d = out
        for g in groups:
            d = d.setdefault(g, {})
        d[leaf] = v
    return out


def load_settings(flags: Mapping[str, Any] | None = None, config_file: str | None = None,
                  env: Mapping[str, str] | None = None, cwd: Path | None = None) -> LoadedSettings:
    """Layer flags > env (new-style over legacy) > TOML > core defaults; every value keeps its provenance.

    `env` defaults to the process environment (read here and nowhere else), `cwd` to the working directory.
    Raises BadInput, in one line naming the key, the source and what is allowed, on any bad value.
    """
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else Path(cwd)
    layers: list[list[_Entry]] = []  # lowest precedence first
    found = _find_toml(config_file, cwd)
    if found:
        path, root = found
        shown = config_file if config_file else path.name
        layers.append(_toml_entries(path, root, shown))
    env_entries, notices = _env_entries(env)
    layers.append(env_entries)
    layers.append(_flag_entries(flags or {}))
    values: dict[str, Any] = {}
    origins: dict[str, Provenance] = {k: Provenance("default", "core") for k in FIELDS}
    for layer in layers:
        for e in layer:
            values[e.key] = e.value
            origins[e.key] = Provenance(e.source, e.origin)
    try:
        settings = StrataSettings(**_nest(values))
    except ValidationError as e:  # each leaf was checked already; this is a cross-field rule
        raise BadInput(f"settings: {e.errors()[0].get('msg', 'invalid')}") from None
    return LoadedSettings(settings=settings, origins=origins, notices=notices)


def settings_from_partial(d: Mapping[str, Any] | None, where: str = "settings") -> StrataSettings:
    """Settings from a scenario's partial, nested `settings` block over the core defaults (BadInput names the key)."""
    if d is None:
        return StrataSettings()
    if not isinstance(d, Mapping):
        raise BadInput(f"{where}: expected an object, got {type(d).__name__}")
    values: dict[str, Any] = {}

    def walk(node: Mapping, prefix: str) -> None:
        for k, v in node.items():
            key = f"{prefix}{k}"
            if key in FIELDS:
                values[key] = _validate_leaf(FIELDS[key], v, v, f"{where}.{key}")
            elif key in GROUPS and isinstance(v, Mapping):
                walk(v, key + ".")
            else:
                raise _unknown_key(key, where)

    walk(d, "")
    return StrataSettings(**_nest(values))


# ---------------------------------------------------------------------------------------------------------------
# Backend defaults (filled in for display; the planner reads PlatformDefaults itself)

#: Settings left None that a backend's PlatformDefaults fill: key -> (PlatformDefaults field, divisor to the key's unit).
BACKEND_DEFAULT_FIELDS: dict[str, tuple[str, int]] = {
    "memory.vram_reserve_mib": ("vram_reserve_mib", 1),
    "memory.resident_headroom_gib": ("resident_headroom_bytes", 1 << 30),
    "prefill.lend_fraction": ("lend_fraction", 1),
    "prefill.stream_min_tokens": ("stream_min_tokens", 1),
    "pinning.pin_reserve_gib": ("pin_reserve_bytes", 1 << 30),
    "pinning.wddm_pin_cap_gib": ("pin_cap_bytes", 1 << 30),
    "pinning.pin_floor_mib": ("pin_floor_bytes", 1 << 20),
}


def with_backend_defaults(loaded: LoadedSettings, defaults: Any, backend: str) -> LoadedSettings:
    """Fill the values no source set (still None) from a backend's PlatformDefaults, as source backend-default."""
    values = loaded.settings.model_dump()
    origins = dict(loaded.origins)
    flat: dict[str, Any] = {}
    for key, (attr, unit) in BACKEND_DEFAULT_FIELDS.items():
        if loaded.value(key) is not None or origins[key].source != "default":
            continue
        raw = getattr(defaults, attr, None)
        if raw is None:
            continue
        flat[key] = raw / unit if unit != 1 else raw
        origins[key] = Provenance("backend-default", f"{backend} backend: PlatformDefaults.{attr}")
    for key, v in flat.items():
        group, leaf = key.split(".")
        values[group][leaf] = v
    return replace(loaded, settings=StrataSettings(**values), origins=origins)


# ---------------------------------------------------------------------------------------------------------------
# Command-line flags


def _parse_set(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise BadInput(f"flag --set {item}: expected KEY=VALUE, e.g. --set prefill.chunk=4096")
    key, value = item.split("=", 1)
    return key.strip(), value


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --config FILE, --backend NAME and --set KEY=VALUE (repeatable) to a command's parser."""
    g = parser.add_argument_group("settings")
    g.add_argument("--config", metavar="FILE", default=None,
                   help="TOML settings file (default: ./strata.toml, else [tool.strata] in ./pyproject.toml)")
    g.add_argument("--backend", metavar="NAME", default=None, help="backend to use: auto or a name (backend.name)")
    g.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="set_values",
                   help="set any setting by its dotted key, e.g. --set prefill.chunk=4096 (repeatable)")


def settings_from_args(args: argparse.Namespace, overrides: Mapping[str, Any] | None = None) -> LoadedSettings:
    """Load settings for a command: its --set/--backend flags and `overrides` (dotted key -> value) over the rest."""
    flags: dict[str, Any] = {}
    for item in getattr(args, "set_values", None) or []:
        key, value = _parse_set(item)
        flags[key] = FlagValue(value, f"--set {key}")
    if getattr(args, "backend", None):
        flags["backend.name"] = FlagValue(args.backend, "--backend")
    for key, v in (overrides or {}).items():
        if v is not None:
            flags[key] = v if isinstance(v, FlagValue) else FlagValue(v, f"flag for {key}")
    return load_settings(flags=flags, config_file=getattr(args, "config", None))


# ---------------------------------------------------------------------------------------------------------------
# Documentation tables (`strata config table`)

TABLE_BEGIN = "<!-- settings-table:begin (generated by `strata config table`; do not edit by hand) -->"
TABLE_END = "<!-- settings-table:end -->"


def _md(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[]" if not v else ", ".join(v)
    return str(v).replace("|", "\\|")


def settings_table_markdown() -> str:
    """The settings table and the legacy-variable table, in Markdown, generated from the schema."""
    rows = ["### Settings", "",
            "Set each key in `strata.toml` (`[group]` tables), as `STRATA_GROUP__KEY` in the environment, or with "
            "`--set group.key=VALUE`.", "",
            "| key | environment | default | allowed | what it does |", "|---|---|---|---|---|"]
    for f in FIELDS.values():
        rows.append(f"| `{f.key}` | `{f.env_name}` | {_md(f.default())} | {_md(f.allowed())} | "
                    f"{_md(f.info.description or '')} |")
    rows += ["", "### Legacy variables", "",
             "Read once, mapped to the typed key, reported with the new name; the new-style variable wins when both "
             "are set.", "", "| legacy variable | setting | mapping |", "|---|---|---|"]
    for lv in LEGACY_VARIABLES:
        rows.append(f"| `{lv.name}` | `{lv.key}` | {_md(lv.mapping)} |")
    for name, why in RETIRED_VARIABLES.items():
        rows.append(f"| `{name}` | none | ignored: {_md(why)} |")
    return "\n".join(rows) + "\n"


def settings_table_rows() -> list[dict]:
    """The settings table as JSON rows."""
    return [{"key": f.key, "env": f.env_name, "default": f.default(), "allowed": f.allowed(),
             "description": f.info.description or ""} for f in FIELDS.values()]


def legacy_table_rows() -> list[dict]:
    """The legacy-variable table as JSON rows."""
    return [{"name": lv.name, "key": lv.key, "mapping": lv.mapping} for lv in LEGACY_VARIABLES] + \
        [{"name": name, "key": None, "mapping": f"ignored: {why}"} for name, why in RETIRED_VARIABLES.items()]


def embed_table(text: str) -> str:
    """`text` (a README) with the generated tables placed between the markers; BadInput when they are missing."""
    if TABLE_BEGIN not in text or TABLE_END not in text:
        raise BadInput("the file has no settings-table markers; add the two marker lines where the table goes")
    head, rest = text.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_BEGIN}\n{settings_table_markdown()}{TABLE_END}{tail}"
