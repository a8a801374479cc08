"""Scenario files load, and bad ones are refused naming the file and the field."""

import json

import pytest

from strata_core.errors import BadInput
from strata_core.scenario import load_scenario

from .conftest import SCENARIO_FILES, scenario_params


@pytest.mark.parametrize("path", scenario_params())
def test_every_shared_scenario_loads(path):
    raw = json.loads(path.read_text())
    s = load_scenario(path)
    assert s.requests == tuple(r["prompt_tokens"] for r in raw["requests"])
    assert s.profile.backend == raw["profile"]["backend"]
    assert s.model.slot_bytes == raw["model"]["slot_bytes"]
    for group, values in raw["settings"].items():
        for key, v in values.items():
            assert getattr(getattr(s.settings, group), key) == v
            assert f"{group}.{key}" in s.settings_keys


def _write(tmp_path, d):
    p = tmp_path / "s.json"
    p.write_text(json.dumps(d) if isinstance(d, dict) else d)
    return p


@pytest.mark.parametrize("path", scenario_params(SCENARIO_FILES[:1]))
@pytest.mark.parametrize("drop,needle", [
    (("profile", "host", "ram_available_bytes"), "profile.host: missing field 'ram_available_bytes'"),
    (("profile", "device", "vram_free_bytes"), "profile.device: missing field 'vram_free_bytes'"),
    (("model", "slot_bytes"), "model: missing field 'slot_bytes'"),
    (("model",), "missing field 'model'"),
    (("schema",), "field 'schema'"),
])
def test_missing_fields_are_named_with_the_file(tmp_path, path, drop, needle):
    d = json.loads(path.read_text())
    node = d
    for k in drop[:-1]:
        node = node[k]
    del node[drop[-1]]
    p = _write(tmp_path, d)
    with pytest.raises(BadInput) as e:
        load_scenario(p)
    assert str(p) in str(e.value) and needle in str(e.value)


@pytest.mark.parametrize("path", scenario_params(SCENARIO_FILES[:1]))
def test_bad_settings_and_requests_are_named(tmp_path, path):
    d = json.loads(path.read_text())
    d["settings"]["prefill"]["chunk"] = "huge"
    with pytest.raises(BadInput, match="prefill.chunk"):
        load_scenario(_write(tmp_path, d))
    d = json.loads(path.read_text())
    d["requests"][0] = {"prompt_tokens": -5}
    with pytest.raises(BadInput, match=r"requests\[0\]"):
        load_scenario(_write(tmp_path, d))


def test_not_json_names_the_file_and_line(tmp_path):
    p = _write(tmp_path, '{"schema": "strata.scenario/1",\n  "profile": }')
    with pytest.raises(BadInput, match=f"{p}: not valid JSON \\(line 2"):
        load_scenario(p)
