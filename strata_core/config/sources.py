"""The sources of settings (flags, environment, legacy environment, TOML), layered with the provenance of every value.

This is the only module of Strata Core that reads the environment.

Sources, highest first: command-line flags, environment (`STRATA_` prefix, `__` between levels, and the legacy flat
names of the engine this replaces), a TOML file (`--config FILE`, else `./strata.toml`, else `[tool.strata]` in
`./pyproject.toml`), backend defaults, core defaults.

The sources are layered here, not by pydantic-settings' own source chain, so that every value keeps where it came
from (`LoadedSettings.origins`) and a bad value names its key, its source and what is allowed. `StrataSettings()`
on its own therefore gives the core defaults and reads nothing.

Legacy variables are read once, mapped to their typed key, and each reported in one notice naming the new key; a
new-style variable of the same key wins over a legacy one. `LEGACY_VARIABLES` and `RETIRED_VARIABLES` below are the
tables the code uses; `strata config table` prints them for the README. Any other `STRATA_*` variable is reported
in a notice, with the closest setting's variable when one is close (`STRATA_PREFILL_CHUNK` ->
`STRATA_PREFILL__CHUNK`).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

from pydantic import BaseModel, ValidationError

from strata_core.config.schema import (CORE_GROUPS, ENV_NESTED_DELIMITER, ENV_PREFIX, MAX_TOKENS, SettingField,
                                       StrataSettings, fields_of, groups_of, schema_with_groups)
from strata_core.errors import BadInput


class ConfigFileError(BadInput):
    """A settings file that cannot be used (missing, a directory, not UTF-8, not TOML, a bad key or value in it)."""


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
        for key in fields_of(type(self.settings)):
            v = self.value(key)
            prov = self.origins.get(key, Provenance("default", "core"))
            out[key] = {"value": list(v) if isinstance(v, (list, tuple)) else v, "source": prov.source,
                        "origin": prov.origin}
        return out


def _unknown_key(key: str, where: str, fields: Mapping[str, SettingField]) -> BadInput:
    close = difflib.get_close_matches(key, list(fields), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else "; `strata config show` lists every key"
    return BadInput(f"{where}: unknown setting '{key}'{hint}")


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


def _shown(raw: Any) -> str:
    text = repr(raw)
    return text if len(text) <= 80 else text[:77] + "..."


def validate_leaf(f: SettingField, value: Any, raw: Any, where: str) -> Any:
    """The validated value of one leaf, or BadInput naming the key, where it came from and what is allowed."""
    try:
        if issubclass(f.owner, StrataSettings):
            obj = f.owner(**{f.leaf: value})
        else:
            obj = f.owner.model_validate({f.leaf: value})
    except ValidationError:
        raise BadInput(f"{f.key}: {_shown(raw)} from {where} is not allowed; allowed: {f.allowed()}") from None
    return getattr(obj, f.leaf)


# ---------------------------------------------------------------------------------------------------------------
# Legacy variables


class _Skip:
    """A legacy value that changes nothing (STRATA_GFX12_DEFAULTS=1)."""


SKIP = _Skip()
_ASCII_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


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


def _finite(text: str, words: str) -> float:
    """A finite number written in ASCII (no inf, nan or fullwidth digits), else ValueError(words)."""
    if not _ASCII_FLOAT.fullmatch(text.strip()):
        raise ValueError(words)
    return float(text)


def _legacy_number(text: str) -> float:
    v = _finite(text, "a finite number >= 0 (GiB)")
    if v < 0:
        raise ValueError("a finite number >= 0 (GiB)")
    return v


def _legacy_tokens(text: str) -> int:
    s = text.strip()
    if not re.fullmatch(r"[0-9]+", s) or int(s) > MAX_TOKENS:
        raise ValueError(f"a whole number of tokens from 0 to {MAX_TOKENS}")
    return int(s)


def _legacy_gfx12_chunk(text: str) -> str:
    n = _legacy_tokens(text)
    return "auto:8192" if n == 0 else f"auto:{n}"


def _legacy_gfx12_defaults(text: str) -> Any:
    return "auto:8192" if not _legacy_bool(text) else SKIP


def _legacy_auto_max(text: str) -> str:
    n = _legacy_tokens(text)
    if n <= 0:
        raise ValueError(f"a token count from 1 to {MAX_TOKENS}")
    return f"auto:{n}"


def _legacy_pct(text: str) -> float:
    words = "a percentage above 0 and at most 100"
    v = _finite(text, words)
    if not 0 < v <= 100:
        raise ValueError(words)
    return v / 100.0


def _legacy_fraction(text: str) -> float:
    v = _finite(text, "a fraction from 0 to 1")
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


def _unknown_variable_notice(name: str, fields: Mapping[str, SettingField]) -> str:
    """The notice for a STRATA_* variable that is no setting, with the closest variable that is one."""
    known = [f.env_name for f in fields.values()] + list(LEGACY_BY_NAME) + list(RETIRED_VARIABLES)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return (f"{name} is not a setting and was ignored"
            + (f" (did you mean {close[0]}?)" if close else "; `strata config table` lists every variable"))


def _env_entries(env: Mapping[str, str], fields: Mapping[str, SettingField]) -> tuple[list[_Entry], list[str]]:
    """New-style and legacy entries from an environment mapping, and the notices they produce."""
    new: dict[str, _Entry] = {}
    legacy: dict[str, _Entry] = {}
    notices: list[str] = []
    upper = {str(k).upper(): str(v) for k, v in env.items()}
    by_env = {f.env_name: f for f in fields.values()}
    for name, text in sorted(upper.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        f = by_env.get(name)
        if f is not None:
            new[f.key] = _Entry(f.key, validate_leaf(f, _coerce_text(f, text), text, f"env {name}"), text, "env",
                                name, f"env {name}")
        elif name not in LEGACY_BY_NAME and name not in RETIRED_VARIABLES:
            notices.append(_unknown_variable_notice(name, fields))
    for name, why in RETIRED_VARIABLES.items():
        if name in upper:
            notices.append(f"{name} is a legacy name with no setting here ({why}); ignored")
    for lv in LEGACY_VARIABLES:
        if lv.name not in upper or fields[lv.key].env_name == lv.name:
            continue  # STRATA_TRACE is its own new-style name
        text = upper[lv.name]
        where = f"legacy env {lv.name}"
        try:
            value = lv.convert(text)
        except ValueError as e:
            raise BadInput(f"{lv.key}: {_shown(text)} from {where} is not allowed; allowed: {e}") from None
        if value is SKIP:
            notices.append(f"{lv.name}={text} is a legacy name for {lv.key}; this value changes nothing")
            continue
        value = validate_leaf(fields[lv.key], value, text, where)
        if lv.key in legacy:
            notices.append(f"{lv.name} overrides {legacy[lv.key].origin} for {lv.key}")
        legacy[lv.key] = _Entry(lv.key, value, text, "legacy-env", lv.name, where)
        shown = value if not isinstance(value, str) else f"'{value}'"
        notices.append(f"{lv.name}={text} is a legacy name: read as {lv.key}={shown} "
                       f"(new name: {fields[lv.key].env_name})")
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


def _find_toml(config_file: str | None, cwd: Path, notices: list[str]) -> tuple[Path, str, str] | None:
    """The TOML file to read, its root table and how messages name it; None when there is none."""
    if config_file is not None:
        if not str(config_file).strip():
            raise ConfigFileError("--config: expected a TOML file name, got ''")
        p = Path(config_file)
        if not p.is_absolute():
            p = cwd / p
        if p.is_dir():
            raise ConfigFileError(f"--config {config_file}: is a directory, not a TOML file")
        if not p.is_file():
            raise ConfigFileError(f"--config {config_file}: no such file")
        return p, ("tool.strata" if p.name == "pyproject.toml" else ""), str(config_file)
    strata_toml = cwd / "strata.toml"
    if strata_toml.is_dir():
        raise ConfigFileError("./strata.toml: is a directory, not a TOML file (remove it, or pass --config FILE)")
    if strata_toml.exists():
        return strata_toml, "", "strata.toml"
    pyproject = cwd / "pyproject.toml"
    if pyproject.is_dir():
        notices.append("./pyproject.toml is a directory; no [tool.strata] settings were read from it")
        return None
    if pyproject.exists():
        return pyproject, "tool.strata", "pyproject.toml"
    return None


def _read_text(path: Path, shown: str) -> str:
    """A settings file's text, or ConfigFileError naming what is wrong (unreadable, not UTF-8)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigFileError(f"{shown}: cannot read ({e.strerror or e})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigFileError(f"{shown}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def _toml_entries(path: Path, root: str, shown: str, fields: Mapping[str, SettingField],
                  groups: frozenset[str], notices: list[str], unknown_groups_later: bool = False) -> list[_Entry]:
    """Entries of one TOML file (`root` selects `[tool.strata]` in a pyproject.toml)."""
    try:
        text = _read_text(path, shown)
    except ConfigFileError:
        if root:  # a pyproject.toml is not ours: only its [tool.strata] table is
            notices.append(f"./{shown} cannot be read as UTF-8 text; no [tool.strata] settings were read from it")
            return []
        raise
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        if root and "tool.strata" not in text and "[tool]" not in text:
            notices.append(f"./{shown} is not valid TOML ({e}); it has no [tool.strata] table, so it was skipped")
            return []
        raise ConfigFileError(f"{shown}: not valid TOML: {e}") from None
    if root:
        for part in root.split("."):
            data = data.get(part, {}) if isinstance(data, dict) else {}
        if not isinstance(data, dict):
            raise ConfigFileError(f"{shown}: [{root}] must be a table")
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
            if key in fields:
                f = fields[key]
                w = where(key)
                value = None if (f.optional and isinstance(v, str) and v.lower() in ("none", "null")) else v
                try:
                    out.append(_Entry(key, validate_leaf(f, value, v, w), v, "toml", w, w))
                except BadInput as e:
                    raise ConfigFileError(str(e)) from None
            elif key in groups and isinstance(v, dict):
                walk(v, key + ".")
            elif unknown_groups_later and not prefix and key not in StrataSettings.model_fields:
                continue  # perhaps a plugin's group: the second pass, with the plugins' groups, decides
            elif isinstance(v, dict) and not prefix:
                close = difflib.get_close_matches(key, sorted(groups), n=1)
                hint = (f"did you mean [{close[0]}]?" if close else
                        f"groups here: {', '.join(sorted(groups))}; a plugin's group exists once it is installed")
                raise ConfigFileError(f"{where(key)}: unknown settings group [{key}]; {hint}")
            else:
                raise ConfigFileError(str(_unknown_key(key, where(key), fields)))

    walk(data, "")
    return out


def _flag_entries(flags: Mapping[str, Any], fields: Mapping[str, SettingField]) -> list[_Entry]:
    """Entries of flags: {dotted key: value or FlagValue(value, origin)}; None values are left out."""
    out = []
    for key, v in flags.items():
        value, origin = (v.value, v.origin) if isinstance(v, FlagValue) else (v, f"--set {key}")
        if value is None:
            continue
        if key not in fields:
            raise _unknown_key(key, f"flag {origin}", fields)
        f = fields[key]
        shaped = _coerce_text(f, value) if isinstance(value, str) else value
        out.append(_Entry(key, validate_leaf(f, shaped, value, f"flag {origin}"), value, "flag", origin,
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


_GROUP_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def check_plugin_groups(groups: Mapping[str, type[BaseModel]] | None) -> dict[str, type[BaseModel]]:
    """The plugin groups ({name: pydantic model}) a schema may take; BadInput for one that shadows a core name."""
    out: dict[str, type[BaseModel]] = {}
    for name, model in (groups or {}).items():
        if name in StrataSettings.model_fields:
            raise BadInput(f"settings group '{name}': a plugin may not declare a core group's name")
        if not _GROUP_NAME.fullmatch(name):
            raise BadInput(f"settings group '{name}': a group name is lower-case letters, digits and '_'")
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise BadInput(f"settings group '{name}': expected a pydantic model, got {type(model).__name__}")
        out[name] = model
    return out


#: plugin_groups' answers by (allow, block, autoload, id of the entry-point source): loading the plugins costs tens
#: of milliseconds and a scenario or a test may ask hundreds of times. The source object is kept with its answer,
#: so its id cannot be reused by another while cached (tests swap the source to add plugins).
_GROUPS_CACHE: dict[tuple, tuple[Any, dict[str, type[BaseModel]]]] = {}


def plugin_groups(plugins: Any) -> dict[str, type[BaseModel]]:
    """{name: model} of the settings groups the plugins that these `plugins` settings load declare (sim's always)."""
    from strata_core import registry  # the registry reads settings; settings ask it only for groups
    source = registry.md
    key = (tuple(plugins.allow), tuple(plugins.block), bool(plugins.autoload), id(source))
    hit = _GROUPS_CACHE.get(key)
    if hit is not None and hit[0] is source:
        return dict(hit[1])
    host = registry.load_plugins(allow=plugins.allow, block=plugins.block, autoload=plugins.autoload)
    groups = {g.name: g.model for g in host.settings_groups() if g.name not in StrataSettings.model_fields}
    if len(_GROUPS_CACHE) >= 16:
        _GROUPS_CACHE.clear()
    _GROUPS_CACHE[key] = (source, groups)
    return dict(groups)


def load_settings(flags: Mapping[str, Any] | None = None, config_file: str | None = None,
                  env: Mapping[str, str] | None = None, cwd: Path | None = None,
                  groups: Mapping[str, type[BaseModel]] | None = None,
                  skip_bad_file: bool = False) -> LoadedSettings:
    """Layer flags > env (new-style over legacy) > TOML > core defaults; every value keeps its provenance.

    `env` defaults to the process environment (read here and nowhere else), `cwd` to the working directory.
    `groups` are the plugin settings groups the schema takes besides the core's; None asks the registry for those
    of the plugins these settings load (`plugins.allow`, `block`, `autoload`: read first, from the same sources).
    Raises BadInput, in one line naming the key, the source and what is allowed, on any bad value; with
    `skip_bad_file`, a bad settings file is a notice and its values are left out.
    """
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else Path(cwd)
    if groups is None:
        first = _load(flags, config_file, env, cwd, {}, skip_bad_file, plugin_keys_later=True)
        groups = plugin_groups(first.settings.plugins)
    return _load(flags, config_file, env, cwd, groups, skip_bad_file)


def _load(flags, config_file, env, cwd, groups, skip_bad_file, plugin_keys_later: bool = False) -> LoadedSettings:
    """One layering over the schema with `groups`; `plugin_keys_later` leaves keys of unknown groups for the second."""
    schema = schema_with_groups(check_plugin_groups(groups))
    fields = fields_of(schema)
    group_names = groups_of(schema)
    notices: list[str] = []
    layers: list[list[_Entry]] = []  # lowest precedence first
    try:
        found = _find_toml(config_file, cwd, notices)
        if found:
            path, root, shown = found
            layers.append(_toml_entries(path, root, shown, fields, group_names, notices,
                                        unknown_groups_later=plugin_keys_later))
    except ConfigFileError as e:
        if not skip_bad_file:
            raise
        notices.append(f"settings file skipped: {e}")
    env_entries, env_notices = _env_entries(env, fields)
    notices += env_notices
    layers.append(env_entries)
    layers.append(_flag_entries({k: v for k, v in (flags or {}).items()
                                 if not (plugin_keys_later and k.split(".", 1)[0] not in StrataSettings.model_fields)},
                                fields))
    values: dict[str, Any] = {}
    origins: dict[str, Provenance] = {k: Provenance("default", "core") for k in fields}
    for layer in layers:
        for e in layer:
            values[e.key] = e.value
            origins[e.key] = Provenance(e.source, e.origin)
    try:
        settings = schema(**_nest(values))
    except ValidationError as e:  # each leaf was checked already; this is a cross-field rule
        raise BadInput(f"settings: {e.errors()[0].get('msg', 'invalid')}") from None
    return LoadedSettings(settings=settings, origins=origins, notices=notices)


def settings_from_partial(d: Mapping[str, Any] | None, where: str = "settings",
                          groups: Mapping[str, type[BaseModel]] | None = None) -> StrataSettings:
    """Settings from a scenario's partial, nested `settings` block over the core defaults (BadInput names the key)."""
    if groups is None:
        groups = plugin_groups(StrataSettings().plugins)
    schema = schema_with_groups(check_plugin_groups(groups))
    if d is None:
        return schema()
    if not isinstance(d, Mapping):
        raise BadInput(f"{where}: expected an object, got {type(d).__name__}")
    fields = fields_of(schema)
    group_names = groups_of(schema)
    values: dict[str, Any] = {}

    def walk(node: Mapping, prefix: str) -> None:
        for k, v in node.items():
            key = f"{prefix}{k}"
            if key in fields:
                values[key] = validate_leaf(fields[key], v, v, f"{where}.{key}")
            elif key in group_names and isinstance(v, Mapping):
                walk(v, key + ".")
            else:
                raise _unknown_key(key, where, fields)

    walk(d, "")
    return schema(**_nest(values))


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
        is_int = fields_of(type(loaded.settings))[key].allowed().startswith("an integer")
        # Whole units for integer keys (bytes to MiB, rounded up so the shown default never undercounts).
        flat[key] = (-(-int(raw) // unit) if is_int else raw / unit) if unit != 1 else raw
        origins[key] = Provenance("backend-default", f"{backend} backend: PlatformDefaults.{attr}")
    for key, v in flat.items():
        group, leaf = key.split(".")
        values[group][leaf] = v
    return replace(loaded, settings=type(loaded.settings)(**values), origins=origins)


def user_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Strata's per-user cache folder (measured backend speeds): $XDG_CACHE_HOME/strata, %LOCALAPPDATA%\\strata\\cache
    on Windows, else ~/.cache/strata."""
    env = os.environ if env is None else env
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]) / "strata"
    if os.name == "nt" and env.get("LOCALAPPDATA"):
        return Path(env["LOCALAPPDATA"]) / "strata" / "cache"
    return Path(env.get("HOME") or Path.home()) / ".cache" / "strata"
