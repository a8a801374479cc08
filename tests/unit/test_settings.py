"""Settings: every source, their precedence, provenance, legacy names and bad values from each source."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from pydantic import Field

from strata_core.api.facts import GIB, MIB, PlatformDefaults
from strata_core.config import SettingsGroupModel
from strata_core.errors import BadInput
from strata_core.config.settings import (FIELDS, fields_of, LEGACY_VARIABLES, FlagValue, Provenance, StrataSettings,
                                  add_settings_arguments, load_settings, settings_from_args, settings_from_partial,
                                  with_backend_defaults)

SCENARIOS = Path(__file__).resolve().parents[1] / "data" / "scenarios"


def load(tmp_path, env=None, flags=None, config_file=None):
    """load_settings confined to tmp_path and an explicit environment."""
    return load_settings(flags=flags, config_file=config_file, env=env or {}, cwd=tmp_path)


# ------------------------------------------------------------------ defaults and each source


def test_core_defaults_with_no_source(tmp_path):
    loaded = load(tmp_path)
    assert loaded.settings == type(loaded.settings)()
    assert set(loaded.origins) == set(fields_of(type(loaded.settings)))
    assert set(FIELDS) < set(loaded.origins) and {"sim.profile", "sim.inject"} < set(loaded.origins)
    assert all(p == Provenance("default", "core") for p in loaded.origins.values())
    assert loaded.notices == []


def test_constructing_settings_reads_no_environment(monkeypatch):
    monkeypatch.setenv("STRATA_TRACE", "1")
    monkeypatch.setenv("STRATA_PREFILL__CHUNK", "4096")
    s = StrataSettings()
    assert s.trace is False and s.prefill.chunk == "auto"


def test_env_new_style_nested(tmp_path):
    loaded = load(tmp_path, env={"STRATA_PREFILL__CHUNK": "4096", "STRATA_MEMORY__VRAM_RESERVE_MIB": "1200",
                                 "STRATA_PLUGINS__BLOCK": "cuda, rocm", "STRATA_KV__RESIDENT_CELLS": "none",
                                 "PATH": "/bin"})
    s = loaded.settings
    assert s.prefill.chunk == "4096" and s.prefill.chunk_request() == ("fixed", 4096)
    assert s.memory.vram_reserve_mib == 1200
    assert s.plugins.block == ["cuda", "rocm"]
    assert s.kv.resident_cells is None
    assert loaded.origins["prefill.chunk"] == Provenance("env", "STRATA_PREFILL__CHUNK")
    assert loaded.origins["plugins.block"] == Provenance("env", "STRATA_PLUGINS__BLOCK")
    assert loaded.origins["kv.dtype"].source == "default"


def test_env_names_are_case_insensitive(tmp_path):
    assert load(tmp_path, env={"strata_prefill__chunk": "2048"}).settings.prefill.chunk == "2048"


def test_unknown_nested_env_variable_is_a_notice_not_an_error(tmp_path):
    loaded = load(tmp_path, env={"STRATA_PREFIL__CHUNK": "4096"})
    assert loaded.settings.prefill.chunk == "auto"
    assert len(loaded.notices) == 1
    assert "STRATA_PREFIL__CHUNK" in loaded.notices[0] and "STRATA_PREFILL__CHUNK" in loaded.notices[0]


def test_strata_toml_in_working_directory(tmp_path):
    (tmp_path / "strata.toml").write_text('trace = true\n\n[prefill]\nchunk = "auto:8192"\n\n[memory]\nvram_reserve_mib = 900\n')
    loaded = load(tmp_path)
    assert loaded.settings.prefill.chunk == "auto:8192"
    assert loaded.settings.memory.vram_reserve_mib == 900
    assert loaded.settings.trace is True
    assert loaded.origins["prefill.chunk"] == Provenance("toml", "strata.toml line 4")
    assert loaded.origins["memory.vram_reserve_mib"] == Provenance("toml", "strata.toml line 7")
    assert loaded.origins["trace"] == Provenance("toml", "strata.toml line 1")


def test_toml_dotted_keys_and_inline_tables(tmp_path):
    (tmp_path / "strata.toml").write_text('prefill.chunk = 2048\nkv = { dtype = "int8" }\n')
    loaded = load(tmp_path)
    assert loaded.settings.prefill.chunk == "2048"
    assert loaded.settings.kv.dtype == "int8"
    assert loaded.origins["prefill.chunk"].origin == "strata.toml line 1"
    assert loaded.origins["kv.dtype"].origin == "strata.toml line 2"


def test_pyproject_tool_strata(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.strata.pinning]\npin_guard = false\n')
    loaded = load(tmp_path)
    assert loaded.settings.pinning.pin_guard is False
    assert loaded.origins["pinning.pin_guard"] == Provenance("toml", "pyproject.toml line 5")


def test_pyproject_without_tool_strata_is_ignored(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n[tool.other]\nchunk = 3\n')
    assert load(tmp_path).settings.model_dump() == type(load(tmp_path).settings)().model_dump()


def test_strata_toml_wins_over_pyproject(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.strata.prefill]\nchunk = "1024"\n')
    (tmp_path / "strata.toml").write_text('[prefill]\nchunk = "2048"\n')
    assert load(tmp_path).settings.prefill.chunk == "2048"


def test_config_file_wins_over_strata_toml(tmp_path):
    (tmp_path / "strata.toml").write_text('[prefill]\nchunk = "2048"\n')
    other = tmp_path / "site.toml"
    other.write_text('[prefill]\nchunk = "512"\n')
    loaded = load(tmp_path, config_file=str(other))
    assert loaded.settings.prefill.chunk == "512"
    assert loaded.origins["prefill.chunk"] == Provenance("toml", f"{other} line 2")


def test_config_file_missing_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="--config nope.toml: no such file"):
        load(tmp_path, config_file="nope.toml")


def test_flags(tmp_path):
    loaded = load(tmp_path, flags={"prefill.chunk": "4096", "backend.name": FlagValue("sim", "--backend"),
                                   "kv.max_context": 65536, "memory.expert_cache": None})
    assert loaded.settings.prefill.chunk == "4096"
    assert loaded.settings.backend.name == "sim"
    assert loaded.settings.kv.max_context == 65536
    assert loaded.origins["prefill.chunk"] == Provenance("flag", "--set prefill.chunk")
    assert loaded.origins["backend.name"] == Provenance("flag", "--backend")
    assert loaded.origins["memory.expert_cache"].source == "default"  # a None flag is "not given"


# ------------------------------------------------------------------ precedence

LAYERS = ("toml", "legacy-env", "env", "flag")  # lowest first


@pytest.mark.parametrize("present", [
    ("toml",), ("legacy-env",), ("env",), ("flag",),
    ("toml", "legacy-env"), ("toml", "env"), ("toml", "flag"), ("legacy-env", "env"), ("env", "flag"),
    ("toml", "legacy-env", "env"), ("toml", "legacy-env", "env", "flag"), ("legacy-env", "flag"),
])
def test_precedence_flag_env_legacy_toml(tmp_path, present):
    # Each layer sets prefill.cpu_share_max_tokens to a value of its own; the highest present layer must win.
    value_of = {"toml": 100, "legacy-env": 200, "env": 300, "flag": 400}
    env, flags = {}, {}
    if "toml" in present:
        (tmp_path / "strata.toml").write_text(f"[prefill]\ncpu_share_max_tokens = {value_of['toml']}\n")
    if "legacy-env" in present:
        env["STRATA_PREFILL_CPU_SHARE_MAX"] = str(value_of["legacy-env"])
    if "env" in present:
        env["STRATA_PREFILL__CPU_SHARE_MAX_TOKENS"] = str(value_of["env"])
    if "flag" in present:
        flags["prefill.cpu_share_max_tokens"] = str(value_of["flag"])
    loaded = load(tmp_path, env=env, flags=flags)
    winner = max(present, key=LAYERS.index)
    assert loaded.settings.prefill.cpu_share_max_tokens == value_of[winner]
    assert loaded.origins["prefill.cpu_share_max_tokens"].source == winner


def test_lower_sources_still_fill_other_keys(tmp_path):
    (tmp_path / "strata.toml").write_text('[kv]\ndtype = "int8"\n[prefill]\nchunk = "1024"\n')
    loaded = load(tmp_path, env={"STRATA_PREFILL__CHUNK": "2048"}, flags={"trace": "1"})
    assert (loaded.settings.kv.dtype, loaded.settings.prefill.chunk, loaded.settings.trace) == ("int8", "2048", True)
    assert [loaded.origins[k].source for k in ("kv.dtype", "prefill.chunk", "trace")] == ["toml", "env", "flag"]


# ------------------------------------------------------------------ legacy variables

LEGACY_CASES = [
    ("STRATA_PREFILL_CPU_SHARE", "0", "prefill.cpu_share", "off"),
    ("STRATA_PREFILL_CPU_SHARE", "1", "prefill.cpu_share", "on"),
    ("STRATA_PREFILL_CPU_SHARE_MAX", "512", "prefill.cpu_share_max_tokens", 512),
    ("STRATA_PIN_GUARD", "0", "pinning.pin_guard", False),
    ("STRATA_PIN_RESERVE_GIB", "6", "pinning.pin_reserve_gib", 6.0),
    ("STRATA_ARENA_PIN_GIB", "20.5", "pinning.arena_pin_gib", 20.5),
    ("STRATA_WDDM_PIN_CAP_GIB", "8", "pinning.wddm_pin_cap_gib", 8.0),
    ("STRATA_TEST_PINNED_SHARE", "0.25", "pinning.test_pinned_fraction", 0.25),
    ("STRATA_GFX12_DEFAULTS", "0", "prefill.chunk", "auto:8192"),
    ("STRATA_GFX12_CHUNK", "0", "prefill.chunk", "auto:8192"),
    ("STRATA_GFX12_CHUNK", "12288", "prefill.chunk", "auto:12288"),
    ("STRATA_PREFILL_AUTO_MAX", "4096", "prefill.chunk", "auto:4096"),
    ("STRATA_RESIDENT_HEADROOM_GIB", "3.5", "memory.resident_headroom_gib", 3.5),
    ("STRATA_ELASTIC_SLOTS_GIB", "2", "memory.elastic_slots_gib", 2.0),
    ("STRATA_PREFILL_LEND_PCT", "50", "prefill.lend_fraction", 0.5),
    ("STRATA_PREFILL_STREAM_MIN", "2048", "prefill.stream_min_tokens", 2048),
    ("STRATA_TRACE", "1", "trace", True),
]


def test_every_legacy_variable_has_a_case():
    assert {c[0] for c in LEGACY_CASES} == {v.name for v in LEGACY_VARIABLES}


@pytest.mark.parametrize("name,text,key,expected", LEGACY_CASES)
def test_legacy_variable_maps_to_its_key(tmp_path, name, text, key, expected):
    loaded = load(tmp_path, env={name: text})
    assert loaded.value(key) == expected
    if name == "STRATA_TRACE":  # the new-style name is the same: no notice, plain env
        assert loaded.origins[key] == Provenance("env", name)
        assert loaded.notices == []
    else:
        assert loaded.origins[key] == Provenance("legacy-env", name)
        assert len(loaded.notices) == 1
        note = loaded.notices[0]
        assert "\n" not in note and name in note and key in note and FIELDS[key].env_name in note


@pytest.mark.parametrize("name", ["STRATA_BRANCH_CHECKPOINT_ALIGN", "STRATA_ISA_FLOOR"])
def test_retired_legacy_variable_changes_nothing_and_says_why(tmp_path, name):
    loaded = load(tmp_path, env={name: "1"})
    assert loaded.settings == type(loaded.settings)()
    assert len(loaded.notices) == 1 and name in loaded.notices[0] and "ignored" in loaded.notices[0]


def test_gfx12_defaults_on_changes_nothing(tmp_path):
    loaded = load(tmp_path, env={"STRATA_GFX12_DEFAULTS": "1"})
    assert loaded.settings.prefill.chunk == "auto"
    assert loaded.origins["prefill.chunk"].source == "default"
    assert "STRATA_GFX12_DEFAULTS" in loaded.notices[0] and "prefill.chunk" in loaded.notices[0]


def test_new_style_variable_overrides_legacy_and_says_so(tmp_path):
    loaded = load(tmp_path, env={"STRATA_PREFILL_CPU_SHARE": "0", "STRATA_PREFILL__CPU_SHARE": "on"})
    assert loaded.settings.prefill.cpu_share == "on"
    assert loaded.origins["prefill.cpu_share"] == Provenance("env", "STRATA_PREFILL__CPU_SHARE")
    assert any("STRATA_PREFILL_CPU_SHARE is overridden by STRATA_PREFILL__CPU_SHARE" in n for n in loaded.notices)


def test_later_legacy_variable_for_the_same_key_wins_and_says_so(tmp_path):
    loaded = load(tmp_path, env={"STRATA_GFX12_CHUNK": "0", "STRATA_PREFILL_AUTO_MAX": "2048"})
    assert loaded.settings.prefill.chunk == "auto:2048"
    assert loaded.origins["prefill.chunk"].origin == "STRATA_PREFILL_AUTO_MAX"
    assert any("STRATA_PREFILL_AUTO_MAX overrides STRATA_GFX12_CHUNK" in n for n in loaded.notices)


def test_legacy_env_loses_to_a_flag_but_beats_toml(tmp_path):
    (tmp_path / "strata.toml").write_text('[prefill]\ncpu_share = "on"\n')
    assert load(tmp_path, env={"STRATA_PREFILL_CPU_SHARE": "0"}).settings.prefill.cpu_share == "off"
    flagged = load(tmp_path, env={"STRATA_PREFILL_CPU_SHARE": "0"}, flags={"prefill.cpu_share": "auto"})
    assert flagged.settings.prefill.cpu_share == "auto"


# ------------------------------------------------------------------ bad values, each source


@pytest.mark.parametrize("env,key,allowed", [
    ({"STRATA_PREFILL__CHUNK": "big"}, "prefill.chunk", "'auto', 'auto:N' or N"),
    ({"STRATA_PREFILL__CHUNK": "auto:0"}, "prefill.chunk", "'auto', 'auto:N' or N"),
    ({"STRATA_MEMORY__VRAM_RESERVE_MIB": "-1"}, "memory.vram_reserve_mib", "an integer >= 0"),
    ({"STRATA_PREFILL__CPU_SHARE": "maybe"}, "prefill.cpu_share", "'auto', 'on' or 'off'"),
    ({"STRATA_PREFILL__LEND_FRACTION": "1.5"}, "prefill.lend_fraction", "a finite number > 0 and <= 1"),
    ({"STRATA_MEMORY__EXPERT_CACHE": "0"}, "memory.expert_cache", "'auto' or a slot count from 1 to"),
    ({"STRATA_TRACE": "loud"}, "trace", "true or false"),
])
def test_bad_env_value_names_key_source_and_allowed(tmp_path, env, key, allowed):
    with pytest.raises(BadInput) as e:
        load(tmp_path, env=env)
    msg = str(e.value)
    name = next(iter(env))
    assert "\n" not in msg
    assert msg.startswith(f"{key}:") and f"env {name}" in msg and allowed in msg


@pytest.mark.parametrize("name,text,allowed", [
    ("STRATA_PREFILL_CPU_SHARE", "2", "0 or 1"),
    ("STRATA_PREFILL_LEND_PCT", "150", "percentage"),
    ("STRATA_GFX12_CHUNK", "-5", "whole number"),
    ("STRATA_PIN_RESERVE_GIB", "lots", "number >= 0"),
    ("STRATA_PREFILL_AUTO_MAX", "0", "a token count from 1 to"),
])
def test_bad_legacy_value_names_the_legacy_variable(tmp_path, name, text, allowed):
    with pytest.raises(BadInput) as e:
        load(tmp_path, env={name: text})
    msg = str(e.value)
    assert f"legacy env {name}" in msg and allowed in msg and "\n" not in msg


def test_bad_toml_value_names_file_line_key_and_allowed(tmp_path):
    (tmp_path / "strata.toml").write_text('# site settings\n[kv]\nmax_context = 131072\ndtype = "int4"\n')
    with pytest.raises(BadInput) as e:
        load(tmp_path)
    msg = str(e.value)
    assert msg.startswith("kv.dtype:") and "strata.toml line 4" in msg and "'int8'" in msg


def test_bad_flag_value_names_the_flag(tmp_path):
    with pytest.raises(BadInput) as e:
        load(tmp_path, flags={"kv.max_context": "0"})
    msg = str(e.value)
    assert msg.startswith("kv.max_context:") and "flag --set kv.max_context" in msg and "an integer > 0" in msg


def test_malformed_toml_names_file_and_line(tmp_path):
    (tmp_path / "strata.toml").write_text('[prefill]\nchunk = "4096"\n[kv\ndtype = "int8"\n')
    with pytest.raises(BadInput) as e:
        load(tmp_path)
    msg = str(e.value)
    assert msg.startswith("strata.toml: not valid TOML") and "line 3" in msg


@pytest.mark.parametrize("text,key,line", [
    ('[prefill]\nchunk = "auto"\nchunck = 4096\n', "prefill.chunck", 3),
    ('verbose = true\n', "verbose", 1),
    ('prefill = 4096\n', "prefill", 1),
])
def test_unknown_toml_key_is_named(tmp_path, text, key, line):
    (tmp_path / "strata.toml").write_text(text)
    with pytest.raises(BadInput) as e:
        load(tmp_path)
    assert f"strata.toml line {line}: unknown setting '{key}'" in str(e.value)


def test_an_unknown_toml_group_is_named_with_the_closest_group(tmp_path):
    (tmp_path / "strata.toml").write_text('[memroy]\nvram_reserve_mib = 700\n')
    with pytest.raises(BadInput, match=r"^strata.toml line 1: unknown settings group \[memroy\]; did you mean \[memory\]\?$"):
        load(tmp_path)


def test_unknown_flag_key_is_named(tmp_path):
    with pytest.raises(BadInput, match="unknown setting 'prefill.chunks'; did you mean 'prefill.chunk'"):
        load(tmp_path, flags={"prefill.chunks": "4096"})


# ------------------------------------------------------------------ argparse glue


def _parse(argv):
    p = argparse.ArgumentParser()
    add_settings_arguments(p)
    return p.parse_args(argv)


def test_settings_from_args(clean_strata_env, monkeypatch):
    monkeypatch.setenv("STRATA_PREFILL__CHUNK", "1024")
    args = _parse(["--backend", "sim", "--set", "prefill.chunk=2048", "--set", "kv.dtype=int8"])
    loaded = settings_from_args(args, overrides={"memory.expert_cache": 900, "trace": None})
    s = loaded.settings
    assert (s.backend.name, s.prefill.chunk, s.kv.dtype, s.memory.expert_cache) == ("sim", "2048", "int8", 900)
    assert loaded.origins["backend.name"] == Provenance("flag", "--backend")
    assert loaded.origins["prefill.chunk"] == Provenance("flag", "--set prefill.chunk")
    assert loaded.origins["memory.expert_cache"].source == "flag"
    assert loaded.origins["trace"].source == "default"


def test_settings_from_args_reads_config_flag(clean_strata_env):
    cfg = clean_strata_env / "c.toml"
    cfg.write_text('[backend]\nname = "sim"\n')
    loaded = settings_from_args(_parse(["--config", str(cfg)]))
    assert loaded.settings.backend.name == "sim" and loaded.origins["backend.name"].source == "toml"


def test_set_without_equals_is_bad_input(clean_strata_env):
    with pytest.raises(BadInput, match="expected KEY=VALUE"):
        settings_from_args(_parse(["--set", "prefill.chunk"]))


# ------------------------------------------------------------------ partial settings (scenarios)


def test_every_seed_scenario_settings_block_loads():
    paths = sorted(SCENARIOS.glob("*.json"))
    assert paths, f"the project's scenario copies are missing from {SCENARIOS}"  # they ship with the tests
    for path in paths:
        block = json.loads(path.read_text())["settings"]
        s = settings_from_partial(block, where=path.name)
        for group, values in block.items():
            for k, v in values.items():
                assert getattr(getattr(s, group), k) == v, f"{path.name}: {group}.{k}"


def test_partial_settings_keep_defaults_elsewhere():
    s = settings_from_partial({"memory": {"vram_reserve_mib": 700}})
    assert s.memory.vram_reserve_mib == 700
    assert s.prefill == StrataSettings().prefill


@pytest.mark.parametrize("block,fragment", [
    ({"memory": {"vram_reserve_mib": -4}}, "memory.vram_reserve_mib: -4 from settings.memory.vram_reserve_mib"),
    ({"memory": {"vram_reserve": 4}}, "unknown setting 'memory.vram_reserve'"),
    ({"prefill": "auto"}, "unknown setting 'prefill'"),
    ({"kv": {"dtype": "int3"}}, "kv.dtype"),
])
def test_partial_settings_bad_input_names_key(block, fragment):
    with pytest.raises(BadInput) as e:
        settings_from_partial(block)
    assert fragment in str(e.value)


# ------------------------------------------------------------------ backend defaults


def test_backend_defaults_fill_only_unset_values(tmp_path):
    loaded = load(tmp_path, env={"STRATA_MEMORY__VRAM_RESERVE_MIB": "3000"})
    d = PlatformDefaults(vram_reserve_mib=777, lend_fraction=0.75, resident_headroom_bytes=3 * GIB,
                         pin_floor_bytes=256 * MIB, pin_cap_bytes=None)
    filled = with_backend_defaults(loaded, d, "rocm")
    s = filled.settings
    assert s.memory.vram_reserve_mib == 3000 and filled.origins["memory.vram_reserve_mib"].source == "env"
    assert s.prefill.lend_fraction == 0.75
    assert s.memory.resident_headroom_gib == 3.0
    assert s.pinning.pin_floor_mib == 256
    assert s.pinning.wddm_pin_cap_gib is None and filled.origins["pinning.wddm_pin_cap_gib"].source == "default"
    assert filled.origins["prefill.lend_fraction"].source == "backend-default"
    assert "rocm" in filled.origins["prefill.lend_fraction"].origin
    assert loaded.settings.prefill.lend_fraction is None  # the input is left as it was


# ------------------------------------------------------------------ unknown STRATA_* variables


@pytest.mark.parametrize("name, closest", [
    ("STRATA_PREFILL_CHUNK", "STRATA_PREFILL__CHUNK"),      # one underscore where two belong
    ("STRATA_PREFIL__CHUNK", "STRATA_PREFILL__CHUNK"),      # a typo in the group
    ("STRATA_KV__MAX_CONTEXTS", "STRATA_KV__MAX_CONTEXT"),
    ("STRATA_PIN_GAURD", "STRATA_PIN_GUARD"),               # a legacy name, misspelt
])
def test_an_unknown_variable_is_a_notice_with_the_closest_name(tmp_path, name, closest):
    loaded = load(tmp_path, env={name: "4096"})
    said = [n for n in loaded.notices if n.startswith(name)]
    assert said == [f"{name} is not a setting and was ignored (did you mean {closest}?)"]
    assert loaded.settings == type(loaded.settings)(), "an unknown variable changes nothing"


def test_an_unknown_variable_far_from_every_name_says_where_the_names_are(tmp_path):
    loaded = load(tmp_path, env={"STRATA_ZZZZZZZZZZZZ": "1"})
    assert loaded.notices == ["STRATA_ZZZZZZZZZZZZ is not a setting and was ignored; "
                              "`strata config table` lists every variable"]


def test_variables_outside_the_prefix_are_not_ours(tmp_path):
    assert load(tmp_path, env={"STRATAX_FOO": "1", "PATH": "/bin"}).notices == []


# ------------------------------------------------------------------ plugin settings groups


class AcmeLevels(SettingsGroupModel):
    """A plugin's own group: one bounded integer and one name."""

    level: int = Field(1, ge=0, le=9, description="How hard the acme card works")
    mode: str = Field("calm", description="The acme card's mode")


def test_a_plugin_group_is_read_from_every_source_with_its_origin(tmp_path):
    (tmp_path / "strata.toml").write_text("[acme]\nmode = \"loud\"\n")
    loaded = load_settings(env={"STRATA_ACME__LEVEL": "3"}, cwd=tmp_path, groups={"acme": AcmeLevels})
    assert loaded.settings.acme.level == 3 and loaded.settings.acme.mode == "loud"
    assert loaded.origins["acme.level"] == Provenance("env", "STRATA_ACME__LEVEL")
    assert loaded.origins["acme.mode"] == Provenance("toml", "strata.toml line 2")
    flagged = load_settings(flags={"acme.level": "7"}, env={}, cwd=tmp_path, groups={"acme": AcmeLevels})
    assert flagged.settings.acme.level == 7 and flagged.origins["acme.level"].source == "flag"


def test_a_plugin_groups_values_are_validated_by_its_model_in_one_line(tmp_path):
    with pytest.raises(BadInput) as e:
        load_settings(flags={"acme.level": "12"}, env={}, cwd=tmp_path, groups={"acme": AcmeLevels})
    assert str(e.value).startswith("acme.level: '12' from flag --set acme.level is not allowed; allowed: an integer")
    with pytest.raises(BadInput, match="unknown setting 'acme.levl'; did you mean 'acme.level'"):
        load_settings(flags={"acme.levl": "1"}, env={}, cwd=tmp_path, groups={"acme": AcmeLevels})


def test_an_unknown_group_is_still_refused(tmp_path):
    (tmp_path / "strata.toml").write_text("[acme]\nlevel = 3\n")
    with pytest.raises(BadInput, match=r"^strata.toml line 1: unknown settings group \[acme\]; groups here: backend, kv, memory, "):
        load_settings(env={}, cwd=tmp_path, groups={})
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInput, match="^flag --set nosuch.key: unknown setting 'nosuch.key'"):
        load_settings(flags={"nosuch.key": "1"}, env={}, cwd=tmp_path / "empty")


def test_a_plugin_may_not_take_a_core_groups_name(tmp_path):
    with pytest.raises(BadInput, match="settings group 'memory': a plugin may not declare a core group's name"):
        load_settings(env={}, cwd=tmp_path, groups={"memory": AcmeLevels})


def test_the_sim_group_is_the_sim_backends_not_the_cores(tmp_path):
    from strata_core.builtin.sim.settings import SimSettings
    assert "sim" not in StrataSettings.model_fields
    loaded = load_settings(flags={"sim.inject": "pinned-alloc:every"}, env={}, cwd=tmp_path)
    assert isinstance(loaded.settings.sim, SimSettings) and loaded.settings.sim.inject == ["pinned-alloc:every"]


# ------------------------------------------------------------------ settings files that are not ours


def test_an_unrelated_broken_pyproject_is_skipped_with_a_notice(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project\nname = 'someone else'\n")
    loaded = load(tmp_path)
    assert loaded.settings == type(loaded.settings)()
    assert len(loaded.notices) == 1 and loaded.notices[0].startswith("./pyproject.toml is not valid TOML")
    assert "no [tool.strata] table, so it was skipped" in loaded.notices[0]


def test_a_pyproject_without_a_strata_table_is_read_silently(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'someone else'\n")
    loaded = load(tmp_path)
    assert loaded.notices == [] and loaded.settings == type(loaded.settings)()


def test_a_strata_toml_directory_is_named_as_such(tmp_path):
    (tmp_path / "strata.toml").mkdir()
    with pytest.raises(BadInput, match=r"^\./strata\.toml: is a directory, not a TOML file"):
        load(tmp_path)


def test_a_report_command_skips_a_bad_settings_file_with_a_notice(tmp_path):
    (tmp_path / "strata.toml").write_text("[kv\n")
    loaded = load_settings(env={}, cwd=tmp_path, skip_bad_file=True)
    assert loaded.notices == [n for n in loaded.notices if n.startswith("settings file skipped: strata.toml: not "
                                                                         "valid TOML")] and len(loaded.notices) == 1
