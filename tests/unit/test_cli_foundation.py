"""The foundation commands end to end: backends, config show/table, doctor; exit codes and one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from strata_core import cli
from strata_core.api import API_VERSION
from strata_core.config.settings import LEGACY_VARIABLES, embed_table, fields_of, settings_table_markdown
from strata_core.config.table import documented_schema

#: Every documented key: the core's and the default plugins' groups (the built-in sim backend's `[sim]`).
FIELDS = fields_of(documented_schema())

ROOT = Path(__file__).resolve().parents[2]
IN_TREE = ("cpu", "sim", "cuda", "rocm", "sycl")


def run_json(capsys, argv) -> dict:
    """Run `strata ARGV` in-process; return its one JSON object (and check exit 0)."""
    rc = cli.main(argv)
    out = capsys.readouterr().out
    assert rc == 0, out
    obj = json.loads(out)
    assert isinstance(obj, dict) and "schema" in obj
    return obj


def strata(args, cwd, env=None) -> subprocess.CompletedProcess:
    """Run `strata ARGS` in a subprocess with no STRATA_* variable but those in `env`."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("STRATA_")}
    return subprocess.run([sys.executable, "-m", "strata_core.cli", *args], cwd=cwd, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=120)


def strata_here(args, cwd, env, monkeypatch, capsys) -> subprocess.CompletedProcess:
    """`strata ARGS` through cli.main in this process (no STRATA_* variable but `env`'s), as a CompletedProcess."""
    for name in list(os.environ):
        if name.upper().startswith("STRATA_"):
            monkeypatch.delenv(name)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_a_real_process_reports_bad_input_the_same_way(tmp_path):
    """One bad value through a fresh interpreter: exit 2, one stderr line, strata.error/1 on stdout."""
    r = strata(["config", "show", "--json"], cwd=tmp_path, env={"STRATA_PREFILL__CHUNK": "big"})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert json.loads(r.stdout)["schema"] == "strata.error/1"


# ------------------------------------------------------------------ strata backends


def test_backends_json_lists_every_in_tree_backend(clean_strata_env, capsys):
    report = run_json(capsys, ["backends", "--json"])
    assert report["schema"] == "strata.backends/1"
    by_name = {b["name"]: b for b in report["backends"]}
    assert set(IN_TREE) <= set(by_name)
    for b in report["backends"]:
        assert set(b) >= {"name", "vendor", "version", "api_version", "available", "reason", "install_hint",
                          "score", "devices"}
        assert b["available"] or b["reason"], f"{b['name']} is unavailable and gives no reason"
        assert b["available"] == bool(b["devices"]), f"{b['name']}: available iff it found a device"
    assert by_name["cpu"]["available"] and by_name["sim"]["available"]
    assert by_name["cpu"]["api_version"] == API_VERSION
    assert [by_name[n]["vendor"] for n in ("cuda", "rocm", "sycl")] == ["nvidia", "amd", "intel"]
    measured = {b["name"]: b["measured_us_per_layer"] for b in report["backends"]
                if b["measured_us_per_layer"] is not None}
    if report["auto_selection"]:  # host-CPU backends only: the measured-fastest of them
        assert report["selected"] == min(measured, key=measured.get)
    else:
        assert report["selected"] == max((b for b in report["backends"] if b["available"]),
                                         key=lambda b: b["score"])["name"]


def test_backends_selected_is_null_with_the_reason_when_resolution_fails(clean_strata_env, capsys):
    report = run_json(capsys, ["backends", "--json", "--backend", "no-such-backend"])
    assert report["selected"] is None and "no-such-backend" in report["selection_error"]


def test_backends_respects_the_block_list(clean_strata_env, capsys, monkeypatch):
    monkeypatch.setenv("STRATA_PLUGINS__BLOCK", "sycl")
    names = {b["name"] for b in run_json(capsys, ["backends", "--json"])["backends"]}
    assert "sycl" not in names and "cpu" in names and "sim" in names  # the built-ins are no entry points


def test_backends_table_for_people(clean_strata_env, capsys):
    assert cli.main(["backends"]) == 0
    out = capsys.readouterr().out
    for name in IN_TREE:
        assert name in out
    assert "selected:" in out


@pytest.fixture
def installed_backend_distribution(tmp_path):
    """A distribution built in tmp_path that registers a backend through the entry point, pip-installed for the test."""
    tag = uuid.uuid4().hex[:8]
    dist, module, backend = f"strata-ep-test-{tag}", f"strata_ep_test_{tag}", f"eptest{tag}"
    src = tmp_path / "dist"
    src.mkdir()
    (src / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{dist}"
        version = "0.0.1"

        [project.entry-points."strata.backends"]
        {backend} = "{module}"

        [tool.setuptools]
        py-modules = ["{module}"]
    """))
    (src / f"{module}.py").write_text(textwrap.dedent(f'''
        """A third-party backend, written as an outside distribution would."""
        from strata_core.api import API_VERSION
        from strata_core.api.backend import Backend, FactsOnlyDevice, ProbeResult
        from strata_core.api.facts import DeviceInfo
        from strata_core.api.hookspecs import hookimpl


        def probe():
            """One small device; a low score so it never wins 'auto' over the cpu backend."""
            dev = DeviceInfo(backend="{backend}", vendor="acme", name="Acme test card",
                             vram_total_bytes=1 << 30, vram_free_bytes=1 << 29)
            return ProbeResult(available=True, reason="acme runtime found", devices=(FactsOnlyDevice(dev),), score=1,
                               version="9.9")


        @hookimpl
        def strata_backends():
            """The test backend."""
            return [Backend(name="{backend}", vendor="acme", probe=probe, version="0.0.1", api_version=API_VERSION)]
    '''))
    # Into a private target seen through PYTHONPATH, never the shared venv: other tests (and xdist workers) running
    # at the same time must not see a backend appear and vanish.
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", "--target", str(site), str(src)],
                   check=True, cwd=tmp_path, capture_output=True, timeout=300)
    yield backend, {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def test_backend_from_an_installed_distribution_shows_up(installed_backend_distribution, tmp_path):
    name, env = installed_backend_distribution
    r = strata(["backends", "--json"], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    listed = {b["name"]: b for b in json.loads(r.stdout)["backends"]}
    assert name in listed
    b = listed[name]
    assert b["available"] and b["vendor"] == "acme" and b["reason"] == "acme runtime found"
    assert b["devices"][0]["name"] == "Acme test card"
    chosen = strata(["backends", "--json", "--backend", name], cwd=tmp_path, env=env)
    assert json.loads(chosen.stdout)["selected"] == name


# ------------------------------------------------------------------ strata config show


def test_legacy_cpu_share_off_shows_in_config_show(clean_strata_env, capsys, monkeypatch):
    monkeypatch.setenv("STRATA_PREFILL_CPU_SHARE", "0")
    report = run_json(capsys, ["config", "show", "--json", "--origin"])
    assert report["schema"] == "strata.config/1"
    share = report["values"]["prefill.cpu_share"]
    assert share == {"value": "off", "source": "legacy-env", "origin": "STRATA_PREFILL_CPU_SHARE"}
    assert any("STRATA_PREFILL_CPU_SHARE" in n and "prefill.cpu_share" in n for n in report["notices"])


def test_config_show_lists_every_key_with_a_known_source(clean_strata_env, capsys):
    (clean_strata_env / "strata.toml").write_text('[kv]\ndtype = "int8"\n')
    report = run_json(capsys, ["config", "show", "--json", "--set", "prefill.chunk=2048"])
    assert set(report["values"]) == set(FIELDS)
    assert {v["source"] for v in report["values"].values()} <= {"flag", "env", "legacy-env", "toml",
                                                                 "backend-default", "default"}
    assert report["values"]["kv.dtype"] == {"value": "int8", "source": "toml", "origin": "strata.toml line 2"}
    assert report["values"]["prefill.chunk"]["source"] == "flag"


def test_config_show_fills_unset_values_from_the_selected_backend(clean_strata_env, capsys):
    report = run_json(capsys, ["config", "show", "--json", "--backend", "cpu", "--set", "prefill.lend_fraction=0.5"])
    assert report["backend"] == "cpu"
    reserve = report["values"]["memory.vram_reserve_mib"]
    assert reserve["source"] == "backend-default" and "cpu" in reserve["origin"] and isinstance(reserve["value"], int)
    assert report["values"]["prefill.lend_fraction"] == {"value": 0.5, "source": "flag",
                                                         "origin": "--set prefill.lend_fraction"}


def test_config_show_without_a_backend_keeps_defaults_and_says_why(clean_strata_env, capsys):
    report = run_json(capsys, ["config", "show", "--json", "--backend", "nope"])
    assert report["backend"] is None
    assert report["values"]["memory.vram_reserve_mib"] == {"value": None, "source": "default", "origin": "core"}
    assert any("backend defaults not shown" in n and "nope" in n for n in report["notices"])


def test_config_show_origin_table(clean_strata_env, capsys, monkeypatch):
    monkeypatch.setenv("STRATA_PIN_GUARD", "0")
    assert cli.main(["config", "show", "--origin"]) == 0
    out = capsys.readouterr().out
    assert "legacy-env" in out and "pinning.pin_guard" in out


# ------------------------------------------------------------------ bad input: exit 2, one line, no traceback


BAD_INPUTS = [
    pytest.param({"STRATA_PREFILL__CHUNK": "big"}, None, [], ["prefill.chunk", "env STRATA_PREFILL__CHUNK", "allowed"],
                 id="env"),
    pytest.param({"STRATA_PREFILL_LEND_PCT": "250"}, None, [],
                 ["prefill.lend_fraction", "legacy env STRATA_PREFILL_LEND_PCT", "allowed"], id="legacy-env"),
    pytest.param({}, '[memory]\nvram_reserve_mib = "lots"\n', [],
                 ["memory.vram_reserve_mib", "strata.toml line 2", "allowed"], id="toml"),
    pytest.param({}, None, ["--set", "kv.dtype=int4"], ["kv.dtype", "flag --set kv.dtype", "'int8'"], id="flag"),
    pytest.param({}, None, ["--set", "prefill.chunk"], ["--set", "KEY=VALUE"], id="flag-format"),
    pytest.param({}, '[prefill]\nchunk = "auto"\n[kv\n', [], ["strata.toml", "not valid TOML", "line 3"],
                 id="malformed-toml"),
    pytest.param({}, '[prefill]\nchunk = 4096\nchunks = 1\n', [], ["strata.toml line 3", "unknown setting 'prefill.chunks'"],
                 id="unknown-toml-key"),
    pytest.param({}, None, ["--config", "missing.toml"], ["--config missing.toml"], id="missing-config"),
]

#: Cases that are a bad settings file: `backends` and `doctor` report them as a finding and go on.
FILE_CASES = {"toml", "malformed-toml", "unknown-toml-key", "missing-config"}


@pytest.mark.parametrize("command", [["config", "show", "--json"], ["backends", "--json"], ["doctor", "--json"]],
                         ids=lambda c: c[0])
@pytest.mark.parametrize("env,toml,flags,fragments", BAD_INPUTS)
def test_bad_input_exits_2_with_one_line(request, tmp_path, monkeypatch, capsys, command, env, toml, flags, fragments):
    if toml is not None:
        (tmp_path / "strata.toml").write_text(toml)
    r = strata_here([*command, *flags], tmp_path, env, monkeypatch, capsys)
    case = request.node.callspec.id.split("-" + command[0])[0]
    if command[0] in ("backends", "doctor") and case in FILE_CASES:
        assert r.returncode == 0, (r.stdout, r.stderr)
        report = json.loads(r.stdout)
        notices = report.get("notices", []) + report.get("settings_notices", [])
        finding = [n for n in notices if n.startswith("settings file skipped: ")]
        assert len(finding) == 1, notices
        for f in fragments:
            assert f in finding[0]
        return
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for f in fragments:
        assert f in lines[0]
    error = json.loads(r.stdout)  # --json: the error is one strata.error/1 object on stdout too
    assert error == {"schema": "strata.error/1", "error": lines[0].removeprefix("strata: error: "), "exit_code": 2}


# ------------------------------------------------------------------ strata config table and the README


def test_readme_settings_table_is_in_sync_with_the_generator():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert embed_table(readme) == readme, "run `strata config table --write README.md`"
    assert settings_table_markdown() in readme


def test_generated_table_names_every_key_and_legacy_variable():
    table = settings_table_markdown()
    for f in FIELDS.values():
        assert f"`{f.key}`" in table and f"`{f.env_name}`" in table
    for lv in LEGACY_VARIABLES:
        assert re.search(rf"\| `{lv.name}` \| `{re.escape(lv.key)}` \|", table)


def test_config_table_check_and_write(tmp_path, capsys):
    doc = tmp_path / "DOC.md"
    doc.write_text("# Doc\n\n<!-- settings-table:begin (generated by `strata config table`; do not edit by hand) -->\n"
                   "stale\n<!-- settings-table:end -->\n\ntail\n")
    assert cli.main(["config", "table", "--check", str(doc)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert cli.main(["config", "table", "--write", str(doc)]) == 0
    assert cli.main(["config", "table", "--check", str(doc)]) == 0
    text = doc.read_text()
    assert "stale" not in text and text.endswith("\n\ntail\n") and "`prefill.chunk`" in text


def test_config_table_on_a_file_without_markers_is_bad_input(tmp_path, capsys):
    doc = tmp_path / "DOC.md"
    doc.write_text("# nothing here\n")
    assert cli.main(["config", "table", "--check", str(doc)]) == 2
    assert "markers" in capsys.readouterr().err


def test_config_table_json(capsys):
    report = run_json(capsys, ["config", "table", "--json"])
    assert report["schema"] == "strata.config-table/1"
    assert [r["key"] for r in report["settings"]] == list(FIELDS)
    assert [r["name"] for r in report["legacy"]][:len(LEGACY_VARIABLES)] == [lv.name for lv in LEGACY_VARIABLES]


def test_readme_quick_start_has_exactly_two_setup_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", quick, flags=re.S)
    assert len(blocks) == 2 and all(len(b.strip().splitlines()) == 1 for b in blocks)
    main_job, tests = (b.strip() for b in blocks)
    assert main_job.endswith("strata run") and "pip install -e ." in main_job
    assert tests.endswith("pytest -n auto tests plugins/*/tests"), "every test the repo has, on every core"
    install_spec = re.search(r"pip install -e '([^']+)'", tests).group(1)
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"pip install --quiet -e '{install_spec}'" in ci
    assert "-m pytest -n auto" in ci and "plugins/*/tests" in ci, ".ci/run runs the README's test command"


# ------------------------------------------------------------------ strata doctor


def test_doctor_json(clean_strata_env, capsys, monkeypatch):
    monkeypatch.setenv("STRATA_TRACE", "1")
    monkeypatch.setenv("STRATA_ARENA_PIN_GIB", "12")
    report = run_json(capsys, ["doctor", "--json"])
    assert report["schema"] == "strata.doctor/1"
    assert report["host"]["ram_total_bytes"] > 0
    assert set(IN_TREE) <= {b["name"] for b in report["backends"]}
    assert report["selected"] in {b["name"] for b in report["backends"] if b["available"]}
    assert any("STRATA_ARENA_PIN_GIB" in n and "pinning.arena_pin_gib" in n for n in report["settings_notices"])


def test_doctor_text(clean_strata_env, capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "selected backend:" in out and "host:" in out


def test_backends_table_prints_install_hints_literally(clean_strata_env, capsys, monkeypatch):
    from types import ModuleType, SimpleNamespace

    from strata_core import registry as plugins
    from strata_core.api import API_VERSION
    from strata_core.api.backend import Backend, ProbeResult
    from strata_core.api.hookspecs import hookimpl

    mod = ModuleType("gpuish")
    mod.strata_backends = hookimpl(lambda: [Backend(name="gpuish", vendor="acme", api_version=API_VERSION,
                                                    probe=lambda: ProbeResult.unavailable("no [acme] device"),
                                                    install_hint="pip install 'strata-core[gpuish]'")])
    ep = SimpleNamespace(name="gpuish", load=lambda: mod)
    monkeypatch.setattr(plugins, "md", SimpleNamespace(entry_points=lambda group: [ep] if group == "strata.backends" else []))
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "no [acme] device" in out and "strata-core[gpuish]" in out
    assert "selected: cpu" in out  # the built-in cpu backend is always there


# ------------------------------------------------------------------ a plugin's own settings group, end to end


@pytest.fixture
def acme_group_plugin(monkeypatch):
    """An entry-point plugin declaring the settings group [acme] (level: 0..9); the values its apply saw."""
    from types import ModuleType, SimpleNamespace

    from pydantic import BaseModel, Field

    from strata_core import registry as plugins
    from strata_core.api.hookspecs import hookimpl
    from strata_core.api.settings import SettingsGroup

    class Acme(BaseModel):
        level: int = Field(1, ge=0, le=9, description="How hard the acme card works")

    seen: list = []
    mod = ModuleType("acme_plugin")
    mod.strata_settings_group = hookimpl(lambda: SettingsGroup(name="acme", model=Acme, apply=seen.append))
    ep = SimpleNamespace(name="acme", load=lambda: mod)
    monkeypatch.setattr(plugins, "md", SimpleNamespace(entry_points=lambda group: [ep] if group == "strata.plugins" else []))
    return seen


def test_a_plugin_group_is_shown_tabled_applied_and_refused_in_one_line(clean_strata_env, capsys, monkeypatch,
                                                                        acme_group_plugin):
    (clean_strata_env / "strata.toml").write_text("[acme]\nlevel = 2\n")
    report = run_json(capsys, ["config", "show", "--json"])
    assert report["values"]["acme.level"] == {"value": 2, "source": "toml", "origin": "strata.toml line 2"}
    assert "sim.profile" in report["values"], "the sim backend's group is there too"
    monkeypatch.setenv("STRATA_ACME__LEVEL", "4")
    assert run_json(capsys, ["config", "show", "--json"])["values"]["acme.level"]["value"] == 4
    assert [g.level for g in acme_group_plugin][-1] == 4, "the registry applied the validated group"
    table = run_json(capsys, ["config", "table", "--json"])
    assert "acme.level" in [r["key"] for r in table["settings"]]
    capsys.readouterr()
    assert cli.main(["config", "show", "--set", "acme.level=12"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["strata: error: acme.level: '12' from flag --set acme.level is not allowed; allowed: "
                   "an integer >= 0 and <= 9"]


# ------------------------------------------------------------------ 80 columns


@pytest.mark.parametrize("argv", [["config", "show", "--origin"], ["config", "show"], ["backends"], ["doctor"],
                                  ["plan", "--backend", "cpu", "--explain"]], ids=lambda a: " ".join(a))
def test_tables_fit_80_columns_and_keys_are_never_cut(clean_strata_env, capsys, monkeypatch, argv):
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= 80, max(lines, key=len)
    if argv[0] == "config":
        for key in FIELDS:
            assert any(ln.startswith(f"│ {key} ") for ln in lines), f"{key} cut or wrapped"
    elif argv[0] == "backends":
        assert all(f"│ {name} " in out for name in IN_TREE), "backend names whole"


# ------------------------------------------------------------------ strata bench says what it is doing


SMALL_BENCH = ["bench", "--backend", "cpu", "--tokens", "32", "--experts", "4", "--top-k", "2", "--hidden", "32",
               "--ffn", "32", "--repeat", "1"]


def test_bench_reports_progress_on_stderr_and_none_under_json(clean_strata_env, capsys):
    assert cli.main(SMALL_BENCH) == 0
    err = capsys.readouterr().err.splitlines()
    steps = [ln for ln in err if ln.startswith("strata bench: ")]
    assert steps[0].startswith("strata bench: planning and opening cpu device")
    assert [ln.split("(")[1].split(",")[0] for ln in steps[1:]] == [f"{i} of 6" for i in range(1, 7)]
    assert cli.main([*SMALL_BENCH, "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["schema"] == "strata.bench/1" and "strata bench:" not in err


# ------------------------------------------------------------------ strata plan --save-profile


def test_plan_save_profile_writes_this_machine_and_plans_from_it(clean_strata_env, capsys):
    first = run_json(capsys, ["plan", "--backend", "cpu", "--save-profile", "me.json", "--json"])
    saved = json.loads((clean_strata_env / "me.json").read_text())
    assert first["profile_saved"] == "me.json" and saved["schema"] == "strata.profile/1"
    assert saved["backend"] == "cpu" and saved["device"] == first["device"] and saved["host"] == first["host"]
    again = run_json(capsys, ["plan", "--profile", "me.json", "--json"])
    assert again["device"] == first["device"] and again["host"] == first["host"]
    assert again["vram"] == first["vram"], "the same facts give the same plan"
