"""Bad input, table-driven, over every command: malformed settings (env, legacy env, TOML, flags), numbers out of
their physical bounds, profiles, scenarios, GGUF files, files that are directories or not UTF-8.

Each row runs `strata` (in-process through `cli.main`, a few rows also in a fresh interpreter) in an empty temporary
working directory (plus the row's input files) with no STRATA_* variable but the row's own, and must: exit 2; print
exactly one line on stderr, with no traceback; write nothing (the working directory is unchanged). With `--json`
the error is also one `strata.error/1` object on stdout. `strata backends` and `strata doctor` are the exception
for a bad settings file: they report it as a notice and go on (exit 0), since they are what one runs to find it.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from bad_helpers import SCENARIO_FILES, strata_inprocess, strata_subprocess

COMMANDS = {
    "backends": ["backends"],
    "config": ["config", "show"],
    "plan": ["plan", "--plot", "out/plan.png"],
    "run": ["run", "--prompt-tokens", "8", "--decode-tokens", "1"],
    "simulate": ["simulate", "--scenario", "good.json"],
    "doctor": ["doctor"],
    "bench": ["bench", "--tokens", "8", "--repeat", "1"],
}

#: Commands that report a bad settings file instead of stopping on it.
REPORTS_FILE_PROBLEMS = ("backends", "doctor")

BAD_UTF8 = b"[memory]\nvram_reserve_mib = 3 # \xff\xfe caf\xe9\n"

#: Malformed settings, by source: (id, extra argv, env, files, is a settings-file problem).
SETTINGS_CASES = [
    # the environment, new-style names
    ("env-not-a-number", [], {"STRATA_MEMORY__VRAM_RESERVE_MIB": "lots"}, {}, False),
    ("env-chunk-zero", [], {"STRATA_PREFILL__CHUNK": "0"}, {}, False),
    ("env-bad-literal", [], {"STRATA_KV__DTYPE": "int4"}, {}, False),
    ("env-bad-fault-spec", [], {"STRATA_SIM__INJECT": "disk-full:every"}, {}, False),
    ("env-missing-sim-profile", [], {"STRATA_SIM__PROFILE": "nowhere.json"}, {}, False),
    ("env-garbage-sim-profile", [], {"STRATA_SIM__PROFILE": "junk.json"}, {"junk.json": "garbage, not a profile"}, False),
    ("env-sim-profile-directory", [], {"STRATA_SIM__PROFILE": "adir"}, {"adir/": None}, False),
    ("env-sim-profile-not-utf8", [], {"STRATA_SIM__PROFILE": "p.json"}, {"p.json": b"{\"schema\": \"\xff\"}"}, False),
    ("env-gib-inf", [], {"STRATA_MEMORY__ELASTIC_SLOTS_GIB": "inf"}, {}, False),
    ("env-gib-nan", [], {"STRATA_PINNING__PIN_RESERVE_GIB": "nan"}, {}, False),
    ("env-gib-beyond-bound", [], {"STRATA_PINNING__ARENA_PIN_GIB": "1e30"}, {}, False),
    ("env-context-1e23", [], {"STRATA_KV__MAX_CONTEXT": "1e23"}, {}, False),
    ("env-context-huge-int", [], {"STRATA_KV__MAX_CONTEXT": "99999999999999999999"}, {}, False),
    ("env-fullwidth-digits", [], {"STRATA_KV__MAX_CONTEXT": "\uff13\uff12\uff17\uff16\uff18"}, {}, False),
    ("env-float-for-int", [], {"STRATA_PREFILL__CPU_SHARE_MAX_TOKENS": "512.5"}, {}, False),
    ("env-device-negative", [], {"STRATA_BACKEND__DEVICE": "-1"}, {}, False),
    ("env-backend-empty", [], {"STRATA_BACKEND__NAME": ""}, {}, False),
    ("env-bad-bool", [], {"STRATA_PLUGINS__AUTOLOAD": "maybe"}, {}, False),
    ("env-slots-beyond-bound", [], {"STRATA_MEMORY__EXPERT_CACHE": "99999999999"}, {}, False),
    # the environment, legacy names
    ("env-legacy-bad", [], {"STRATA_PREFILL_CPU_SHARE": "maybe"}, {}, False),
    ("env-legacy-lend-pct", [], {"STRATA_PREFILL_LEND_PCT": "-20"}, {}, False),
    ("env-legacy-lend-pct-nan", [], {"STRATA_PREFILL_LEND_PCT": "nan"}, {}, False),
    ("env-legacy-gib-inf", [], {"STRATA_ELASTIC_SLOTS_GIB": "inf"}, {}, False),
    ("env-legacy-gib-beyond-bound", [], {"STRATA_PIN_RESERVE_GIB": "1e300"}, {}, False),
    ("env-legacy-tokens-fullwidth", [], {"STRATA_PREFILL_STREAM_MIN": "\uff11\uff10"}, {}, False),
    ("env-legacy-tokens-huge", [], {"STRATA_PREFILL_AUTO_MAX": "99999999999999999999"}, {}, False),
    ("env-legacy-fraction", [], {"STRATA_TEST_PINNED_SHARE": "1.5"}, {}, False),
    # TOML
    ("toml-syntax", [], {}, {"strata.toml": "[memory\nvram_reserve_mib = 3\n"}, True),
    ("toml-unknown-key", [], {}, {"strata.toml": "[memory]\nvram_reserv_mib = 3\n"}, True),
    ("toml-unknown-group", [], {}, {"strata.toml": "[nosuch]\nkey = 3\n"}, True),
    ("toml-wrong-type", [], {}, {"strata.toml": "[memory]\nvram_reserve_mib = \"lots\"\n"}, True),
    ("toml-negative", [], {}, {"strata.toml": "[prefill]\nlend_fraction = -0.5\n"}, True),
    ("toml-gib-inf", [], {}, {"strata.toml": "[memory]\nelastic_slots_gib = inf\n"}, True),
    ("toml-gib-nan", [], {}, {"strata.toml": "[pinning]\npin_reserve_gib = nan\n"}, True),
    ("toml-float-for-int", [], {}, {"strata.toml": "[memory]\nvram_reserve_mib = 3.5\n"}, True),
    ("toml-bool-for-int", [], {}, {"strata.toml": "[kv]\nmax_context = true\n"}, True),
    ("toml-context-1e23", [], {}, {"strata.toml": "[kv]\nmax_context = 1e23\n"}, True),
    ("toml-chunk-beyond-bound", [], {}, {"strata.toml": "[prefill]\nchunk = \"auto:99999999999\"\n"}, True),
    ("toml-slots-fraction", [], {}, {"strata.toml": "[memory]\nexpert_cache = 2.5\n"}, True),
    ("toml-empty-plugin-name", [], {}, {"strata.toml": "[plugins]\nallow = [\"\"]\n"}, True),
    ("toml-not-utf8", [], {}, {"strata.toml": BAD_UTF8}, True),
    ("toml-is-a-directory", [], {}, {"strata.toml/": None}, True),
    ("toml-bad-sim-profile", [], {}, {"strata.toml": "[sim]\nprofile = \"junk.json\"\n", "junk.json": "[1, 2]"},
     False),
    ("pyproject-bad-value", [], {}, {"pyproject.toml": "[tool.strata.kv]\nmax_context = 0\n"}, True),
    ("pyproject-strata-table-broken", [], {}, {"pyproject.toml": "[tool.strata\nkv = 1\n"}, True),
    ("config-missing-file", ["--config", "missing.toml"], {}, {}, True),
    ("config-not-toml", ["--config", "bad.toml"], {}, {"bad.toml": "\x00\x01 not toml ["}, True),
    ("config-directory", ["--config", "adir"], {}, {"adir/": None}, True),
    ("config-empty-name", ["--config", ""], {}, {}, True),
    # flags
    ("flag-set-no-equals", ["--set", "prefill.chunk"], {}, {}, False),
    ("flag-set-no-key", ["--set", "=3"], {}, {}, False),
    ("flag-set-unknown-key", ["--set", "memory.nope=1"], {}, {}, False),
    ("flag-set-unknown-group", ["--set", "nosuch.key=1"], {}, {}, False),
    ("flag-set-bad-value", ["--set", "memory.expert_cache=-3"], {}, {}, False),
    ("flag-set-bad-fault", ["--set", "sim.inject=pinned-alloc:nth=0"], {}, {}, False),
    ("flag-set-gib-inf", ["--set", "memory.elastic_slots_gib=inf"], {}, {}, False),
    ("flag-set-context-1e23", ["--set", "kv.max_context=1e23"], {}, {}, False),
    ("flag-set-fullwidth", ["--set", "kv.max_context=\uff13\uff12"], {}, {}, False),
    ("flag-set-float-for-int", ["--set", "memory.vram_reserve_mib=2.5"], {}, {}, False),
    ("flag-set-fraction-above-one", ["--set", "pinning.test_pinned_fraction=1.5"], {}, {}, False),
    ("flag-set-device-huge", ["--set", "backend.device=1000000000"], {}, {}, False),
    ("flag-set-empty-dtype", ["--set", "kv.dtype="], {}, {}, False),
    ("flag-set-bad-sim-profile", ["--set", "sim.profile=junk.json"], {}, {"junk.json": "\"a string\""}, False),
    ("flag-backend-empty", ["--backend", ""], {}, {}, False),
    ("flag-backend-spaces", ["--backend", "no such"], {}, {}, False),
]


def _scenario() -> dict:
    """A well-formed scenario to corrupt (the project's own copy of a seed scenario, else a small inline one)."""
    if SCENARIO_FILES:
        return json.loads(SCENARIO_FILES[0].read_text())
    return {"schema": "strata.scenario/1",
            "profile": {"backend": "cuda",
                        "device": {"name": "card", "vram_total_bytes": 12 << 30, "vram_free_bytes": 8 << 30},
                        "host": {"os": "linux", "ram_total_bytes": 64 << 30, "ram_available_bytes": 48 << 30}},
            "model": {"moe_layers": 8, "experts_per_layer": 16, "top_k": 2, "hidden": 1024, "slot_bytes": 1 << 20,
                      "largest_blob_bytes": 1 << 20, "prompt_bytes_per_token": 4096},
            "settings": {}, "requests": [{"prompt_tokens": 1000}], "expect": {}}


def _corrupt(path: str, value) -> str:
    """The good scenario with one field (dotted path) set to `value` (or removed, for value ...), as JSON text."""
    d = _scenario()
    *parents, leaf = path.split(".")
    node = d
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is ...:
        del node[leaf]
    elif isinstance(node, list):
        node[int(leaf)] = value
    else:
        node[leaf] = value
    return json.dumps(d)


def _profile_text(**device_changes) -> str:
    s = _scenario()["profile"]
    s = {"schema": "strata.profile/1", **s}
    s["device"] = {**s["device"], **device_changes}
    return json.dumps(s)


def _host_profile_text(**host_changes) -> str:
    s = json.loads(_profile_text())
    s["host"] = {**s["host"], **host_changes}
    return json.dumps(s)


def _gguf_bytes(tmp_dir: Path) -> bytes:
    from strata_core.models.gguf import write_tiny_moe_gguf
    return write_tiny_moe_gguf(tmp_dir / "seed.gguf", layers=2, experts=4, top_k=2, hidden=32, ffn=32,
                               vocab=16).read_bytes()


def _gguf_cases(good: bytes) -> list[tuple[str, bytes]]:
    """A valid MoE GGUF, broken in the ways a download or a hand edit breaks one."""
    magic_ver = good[:8]
    absurd_tensors = magic_ver + struct.pack("<Q", 1 << 60) + good[16:]
    absurd_kv = good[:16] + struct.pack("<Q", 1 << 60) + good[24:]
    return [("gguf-empty", b""), ("gguf-truncated-header", good[:10]), ("gguf-truncated-body", good[: len(good) // 2]),
            ("gguf-wrong-magic", b"GGML" + good[4:]), ("gguf-absurd-tensor-count", absurd_tensors),
            ("gguf-absurd-kv-count", absurd_kv), ("gguf-text", b"this is not a model\n" * 50)]


#: Command-specific file and flag cases: (id, argv, files as {name: text or bytes; "name/": a directory}).
FILE_CASES = [
    # profiles
    ("plan-profile-not-json", ["plan", "--profile", "p.json", "--plot", "out/p.png"], {"p.json": "{ nope"}),
    ("plan-profile-array", ["plan", "--profile", "p.json"], {"p.json": "[1, 2]"}),
    ("plan-profile-missing", ["plan", "--profile", "nowhere.json"], {}),
    ("plan-profile-directory", ["plan", "--profile", "adir"], {"adir/": None}),
    ("plan-profile-not-utf8", ["plan", "--profile", "p.json"], {"p.json": b"\xff\xfe{}"}),
    ("plan-profile-latin1", ["plan", "--profile", "p.json"],
     {"p.json": _profile_text(name="carte graphique E").encode().replace(b"graphique E", b"graphique \xe9")}),
    ("plan-profile-no-device", ["plan", "--profile", "p.json"],
     {"p.json": json.dumps({"schema": "strata.profile/1", "backend": "cuda", "host": {}})}),
    ("plan-profile-bytes-text", ["plan", "--profile", "p.json"], {"p.json": _profile_text(vram_total_bytes="lots")}),
    ("plan-profile-vram-1e30", ["plan", "--profile", "p.json"], {"p.json": _profile_text(vram_free_bytes=1e30)}),
    ("plan-profile-vram-huge-int", ["plan", "--profile", "p.json"],
     {"p.json": _profile_text(vram_total_bytes=10 ** 30)}),
    ("plan-profile-vram-fraction", ["plan", "--profile", "p.json"], {"p.json": _profile_text(vram_free_bytes=1.5)}),
    ("plan-profile-vram-negative", ["plan", "--profile", "p.json"], {"p.json": _profile_text(vram_free_bytes=-1)}),
    ("plan-profile-vram-bool", ["plan", "--profile", "p.json"], {"p.json": _profile_text(vram_free_bytes=True)}),
    ("plan-profile-index-huge", ["plan", "--profile", "p.json"], {"p.json": _profile_text(index=10 ** 9)}),
    ("plan-profile-ram-1e30", ["plan", "--profile", "p.json"], {"p.json": _host_profile_text(ram_total_bytes=1e30)}),
    ("plan-profile-pinnable-text", ["plan", "--profile", "p.json"],
     {"p.json": _host_profile_text(pinnable_bytes="all")}),
    ("plan-profile-nan", ["plan", "--profile", "p.json"],
     {"p.json": _profile_text().replace('"vram_free_bytes": ', '"vram_free_bytes": NaN, "x": ')}),
    ("plan-profile-and-scenario", ["plan", "--profile", "p.json", "--scenario", "s.json"],
     {"p.json": _profile_text(), "s.json": json.dumps(_scenario())}),
    # scenarios
    ("plan-scenario-no-model", ["plan", "--scenario", "s.json"], {"s.json": _corrupt("model", ...)}),
    ("plan-scenario-top-k-above-experts", ["plan", "--scenario", "s.json", "--plot", "out/s.png"],
     {"s.json": _corrupt("model.top_k", 100000)}),
    ("plan-scenario-zero-layers", ["plan", "--scenario", "s.json"], {"s.json": _corrupt("model.moe_layers", 0)}),
    ("plan-scenario-absurd-layers", ["plan", "--scenario", "s.json"],
     {"s.json": _corrupt("model.moe_layers", 10 ** 12)}),
    ("plan-scenario-hidden-1e30", ["plan", "--scenario", "s.json"], {"s.json": _corrupt("model.hidden", 1e30)}),
    ("plan-scenario-slot-fraction", ["plan", "--scenario", "s.json"], {"s.json": _corrupt("model.slot_bytes", 2.5)}),
    ("plan-scenario-top-k-bool", ["plan", "--scenario", "s.json"], {"s.json": _corrupt("model.top_k", True)}),
    ("plan-scenario-bad-settings", ["plan", "--scenario", "s.json"],
     {"s.json": _corrupt("settings", {"prefill": {"chunk": "huge"}})}),
    ("plan-scenario-unknown-setting", ["plan", "--scenario", "s.json"],
     {"s.json": _corrupt("settings", {"memory": {"no_such": 1}})}),
    ("plan-scenario-settings-gib-text-inf", ["plan", "--scenario", "s.json"],
     {"s.json": _corrupt("settings", {"memory": {"elastic_slots_gib": "inf"}})}),
    ("plan-scenario-settings-context-float", ["plan", "--scenario", "s.json"],
     {"s.json": _corrupt("settings", {"kv": {"max_context": 1e23}})}),
    ("plan-scenario-settings-not-object", ["plan", "--scenario", "s.json"], {"s.json": _corrupt("settings", [1])}),
    ("plan-scenario-request-huge", ["plan", "--scenario", "s.json"],
     {"s.json": _corrupt("requests.0", {"prompt_tokens": 10 ** 20})}),
    ("plan-scenario-request-fraction", ["plan", "--scenario", "s.json"],
     {"s.json": _corrupt("requests.0", {"prompt_tokens": 1.5})}),
    ("plan-scenario-not-utf8", ["plan", "--scenario", "s.json"], {"s.json": b"\xef\xbb\xbf{\"a\": \"\xff\"}"}),
    ("plan-scenario-directory", ["plan", "--scenario", "adir"], {"adir/": None}),
    ("plan-model-unknown-preset", ["plan", "--model", "No-Such-Model-7B"], {}),
    ("plan-model-empty", ["plan", "--model", ""], {}),
    ("plan-plot-unknown-format", ["plan", "--plot", "out.xyz"], {}),
    ("plan-plot-directory", ["plan", "--plot", "adir.png"], {"adir.png/": None}),
    ("plan-plot-empty", ["plan", "--plot", ""], {}),
    ("plan-unknown-flag", ["plan", "--no-such-flag"], {}),
    ("plan-save-profile-not-json-name", ["plan", "--save-profile", "me.txt"], {}),
    ("plan-save-profile-directory", ["plan", "--save-profile", "adir.json"], {"adir.json/": None}),
    ("plan-save-profile-with-a-profile", ["plan", "--profile", "p.json", "--save-profile", "me.json"],
     {"p.json": _profile_text()}),
    ("plan-save-profile-refused-plan", ["plan", "--save-profile", "me.json", "--set", "memory.expert_cache=16000000"],
     {}),
    ("plan-unknown-backend", ["plan", "--backend", "nosuch"], {}),
    ("plan-autoload-off-unknown-backend", ["plan", "--set", "plugins.autoload=false", "--backend", "cuda"], {}),
    ("plan-allow-list-excludes-backend", ["plan", "--set", "plugins.allow=nosuch", "--backend", "sycl"], {}),
    # simulate
    ("simulate-not-json", ["simulate", "--scenario", "s.json"], {"s.json": "not json at all"}),
    ("simulate-missing-file", ["simulate", "--scenario", "nowhere.json"], {}),
    ("simulate-directory", ["simulate", "--scenario", "adir"], {"adir/": None}),
    ("simulate-not-utf8", ["simulate", "--scenario", "s.json"], {"s.json": b"\x80\x81\x82"}),
    ("simulate-no-scenario", ["simulate"], {}),
    ("simulate-no-profile", ["simulate", "--scenario", "s.json"], {"s.json": _corrupt("profile", ...)}),
    ("simulate-negative-request", ["simulate", "--scenario", "s.json"],
     {"s.json": _corrupt("requests.0", {"prompt_tokens": -3})}),
    ("simulate-requests-not-a-list", ["simulate", "--scenario", "s.json"], {"s.json": _corrupt("requests", 7)}),
    ("simulate-absurd-experts", ["simulate", "--scenario", "s.json"],
     {"s.json": _corrupt("model.experts_per_layer", 10 ** 13)}),
    ("simulate-bad-inject", ["simulate", "--scenario", "good.json", "--inject", "vram-drop:bytes=lots"], {}),
    ("simulate-unknown-fault", ["simulate", "--scenario", "good.json", "--inject", "disk-full:every"], {}),
    ("simulate-negative-requests", ["simulate", "--scenario", "good.json", "--requests", "-1"], {}),
    ("simulate-huge-requests", ["simulate", "--scenario", "good.json", "--requests", "99999999999999999999"], {}),
    ("simulate-requests-float", ["simulate", "--scenario", "good.json", "--requests", "2.5"], {}),
    ("simulate-negative-seed", ["simulate", "--scenario", "good.json", "--seed", "-1"], {}),
    ("simulate-seed-text", ["simulate", "--scenario", "good.json", "--seed", "abc"], {}),
    ("simulate-negative-decode", ["simulate", "--scenario", "good.json", "--decode-tokens", "-1"], {}),
    ("simulate-scenario-is-a-profile", ["simulate", "--scenario", "p.json"], {"p.json": _profile_text()}),
    # run
    ("run-negative-prompt", ["run", "--prompt-tokens", "-5"], {}),
    ("run-prompt-not-a-number", ["run", "--prompt-tokens", "abc"], {}),
    ("run-prompt-float", ["run", "--prompt-tokens", "1e3"], {}),
    ("run-prompt-fullwidth", ["run", "--prompt-tokens", "\uff18"], {}),
    ("run-prompt-above-context", ["run", "--prompt-tokens", "10000000"], {}),
    ("run-prompt-huge", ["run", "--prompt-tokens", "99999999999999999999"], {}),
    ("run-negative-decode", ["run", "--decode-tokens", "-1"], {}),
    ("run-negative-seed", ["run", "--seed", "-1", "--prompt-tokens", "8"], {}),
    ("run-unknown-backend", ["run", "--backend", "nosuch", "--prompt-tokens", "8"], {}),
    ("run-backend-unavailable-here", ["run", "--backend", "rocm", "--prompt-tokens", "8"], {}),
    ("run-device-index-absent", ["run", "--backend", "cpu", "--set", "backend.device=5", "--prompt-tokens", "8"], {}),
    ("run-autoload-off-entry-point-backend", ["run", "--set", "plugins.autoload=false", "--backend", "sycl",
                                              "--prompt-tokens", "8"], {}),
    ("run-blocked-backend", ["run", "--set", "plugins.block=sycl", "--backend", "sycl", "--prompt-tokens", "8"], {}),
    ("run-model-directory", ["run", "--model", "adir.gguf", "--prompt-tokens", "8"], {"adir.gguf/": None}),
    ("run-model-missing", ["run", "--model", "nowhere.gguf", "--prompt-tokens", "8"], {}),
    # bench
    ("bench-huge-tokens", ["bench", "--tokens", "1000000000000"], {}),
    ("bench-zero-tokens", ["bench", "--tokens", "0"], {}),
    ("bench-zero-top-k", ["bench", "--top-k", "0"], {}),
    ("bench-experts-float", ["bench", "--experts", "1e3"], {}),
    ("bench-negative-seed", ["bench", "--seed", "-1"], {}),
    ("bench-zero-repeat", ["bench", "--repeat", "0"], {}),
    ("bench-huge-hidden", ["bench", "--hidden", "99999999999"], {}),
    ("bench-unknown-backend", ["bench", "--backend", "nosuch", "--tokens", "8", "--repeat", "1"], {}),
    # config
    ("config-table-check-missing", ["config", "table", "--check", "nowhere.md"], {}),
    ("config-table-check-no-markers", ["config", "table", "--check", "r.md"], {"r.md": "# no markers here\n"}),
    ("config-table-write-no-markers", ["config", "table", "--write", "r.md"], {"r.md": "# no markers here\n"}),
    ("config-table-check-directory", ["config", "table", "--check", "adir"], {"adir/": None}),
    ("config-table-check-not-utf8", ["config", "table", "--check", "r.md"], {"r.md": b"\xff\xfe"}),
    ("config-unknown-action-flag", ["config", "show", "--no-such-flag"], {}),
    # the command line itself
    ("unknown-command", ["nosuch"], {}),
    ("json-unknown-flag", ["backends", "--json", "--no-such-flag"], {}),
]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(root.rglob("*"))}


def _make_cwd(tmp_path: Path, files: dict) -> Path:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "good.json").write_text(json.dumps(_scenario()))
    for name, content in files.items():
        if name.endswith("/"):
            (cwd / name.rstrip("/")).mkdir()
        else:
            (cwd / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return cwd


def _assert_refused(code: int, out: str, err: str, argv: list[str]) -> None:
    """Exit 2, one line on stderr, no traceback; under --json, one strata.error/1 object on stdout."""
    lines = err.strip().splitlines()
    assert code == 2, f"exit {code}, stderr: {err[-800:]}"
    assert "Traceback" not in err
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{err}"
    assert lines[0].strip()
    if "--json" in argv:
        assert json.loads(out) == {"schema": "strata.error/1", "error": lines[0].removeprefix("strata: error: "),
                                   "exit_code": 2}


def _check(tmp_path, monkeypatch, capsys, argv: list[str], env: dict[str, str], files: dict) -> None:
    cwd = _make_cwd(tmp_path, files)
    before = _snapshot(cwd)
    code, out, err = strata_inprocess(argv, cwd, env, monkeypatch, capsys)
    _assert_refused(code, out, err, argv)
    assert _snapshot(cwd) == before, "the command wrote something"


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case_id, extra, env, files, file_problem", SETTINGS_CASES,
                         ids=[c[0] for c in SETTINGS_CASES])
def test_malformed_settings_are_refused_by_every_command(tmp_path, monkeypatch, capsys, command, case_id, extra, env,
                                                         files, file_problem):
    if not (file_problem and command in REPORTS_FILE_PROBLEMS):
        _check(tmp_path, monkeypatch, capsys, COMMANDS[command] + extra, env, files)
        return
    # backends and doctor: the bad file is a finding in the report, and the report goes on
    cwd = _make_cwd(tmp_path, files)
    before = _snapshot(cwd)
    code, out, err = strata_inprocess(COMMANDS[command] + extra + ["--json"], cwd, env, monkeypatch, capsys)
    assert code == 0, f"exit {code}, stderr: {err[-800:]}"
    assert "Traceback" not in err
    report = json.loads(out)
    notices = report.get("notices", []) + report.get("settings_notices", [])
    assert len([n for n in notices if n.startswith("settings file skipped: ")]) == 1, notices
    assert _snapshot(cwd) == before, "the command wrote something"


@pytest.mark.parametrize("case_id, argv, files", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_malformed_files_and_flags_are_refused(tmp_path, monkeypatch, capsys, case_id, argv, files):
    _check(tmp_path, monkeypatch, capsys, argv, {}, files)


@pytest.mark.parametrize("case_id, argv, files", [c for c in FILE_CASES if c[0] in (
    "plan-profile-directory", "simulate-negative-seed", "run-prompt-float", "bench-huge-tokens",
    "plan-plot-unknown-format")], ids=lambda v: v if isinstance(v, str) else "")
def test_a_real_process_refuses_the_same_way(tmp_path, case_id, argv, files):
    """A handful of rows through a fresh interpreter: the in-process path hides nothing a real process shows."""
    cwd = _make_cwd(tmp_path, files)
    before = _snapshot(cwd)
    p = strata_subprocess([*argv, "--json"], cwd=cwd)
    _assert_refused(p.returncode, p.stdout, p.stderr, [*argv, "--json"])
    assert _snapshot(cwd) == before


@pytest.mark.parametrize("argv", [["config", "table", "--json"], ["backends"], ["plan", "--backend", "cpu"]],
                         ids=lambda a: " ".join(a))
def test_a_closed_stdout_ends_quietly(tmp_path, argv):
    """`strata ... | head` where the reader has gone before the first write: no traceback, exit 0, JSON or table."""
    import os
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("STRATA_")}
    p = subprocess.Popen([sys.executable, "-m", "strata_core.cli", *argv], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # every write the command makes meets a closed pipe
    err = p.stderr.read().decode()
    code = p.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert code == 0 and err == ""


def test_there_are_at_least_150_bad_inputs():
    """The issue asks for 150 bad inputs through the real command; count what the tables drive."""
    settings_rows = len(SETTINGS_CASES) * len(COMMANDS)
    assert settings_rows + len(FILE_CASES) + len(GGUF_IDS) * 2 >= 150
    assert len({c[0] for c in SETTINGS_CASES}) == len(SETTINGS_CASES)
    assert len({c[0] for c in FILE_CASES}) == len(FILE_CASES)


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory) -> bytes:
    """The bytes of a valid tiny MoE GGUF, written once for the module."""
    return _gguf_bytes(tmp_path_factory.mktemp("gguf"))


GGUF_IDS = [c[0] for c in _gguf_cases(b"\0" * 64)]


@pytest.mark.parametrize("command", ["plan", "run"])
@pytest.mark.parametrize("case_id", GGUF_IDS)
def test_broken_gguf_files_are_refused(tmp_path, monkeypatch, capsys, good_gguf, command, case_id):
    content = dict(_gguf_cases(good_gguf))[case_id]
    argv = ["plan", "--model", "m.gguf", "--plot", "out/m.png"] if command == "plan" else \
        ["run", "--model", "m.gguf", "--prompt-tokens", "8", "--decode-tokens", "1"]
    _check(tmp_path, monkeypatch, capsys, argv, {}, {"m.gguf": content})


def test_the_good_inputs_are_accepted(tmp_path, monkeypatch, capsys, good_gguf):
    """The tables' inputs only fail where they were broken: the same commands on the good files exit 0."""
    cwd = _make_cwd(tmp_path, {"p.json": _profile_text(), "m.gguf": good_gguf,
                               "strata.toml": "[memory]\nvram_reserve_mib = 3\n[kv]\nmax_context = 4096\n"})
    for argv in (["plan", "--scenario", "good.json"], ["plan", "--profile", "p.json"], ["plan", "--model", "m.gguf"],
                 ["simulate", "--scenario", "good.json", "--json", "--seed", "3", "--requests", "2"],
                 ["config", "show"], ["doctor"], ["backends"],
                 ["config", "show", "--set", "memory.elastic_slots_gib=1.5", "--set", "kv.max_context=8192"],
                 ["run", "--model", "m.gguf", "--prompt-tokens", "8", "--decode-tokens", "1", "--backend", "cpu"]):
        code, out, err = strata_inprocess(argv, cwd, {"STRATA_SIM__PROFILE": "p.json"}, monkeypatch, capsys)
        assert code == 0, f"{argv}: exit {code}: {err[-600:]}"
    p = strata_subprocess(["plan", "--scenario", "good.json", "--json"], cwd=cwd)
    assert p.returncode == 0 and json.loads(p.stdout)["schema"] == "strata.plan/1", p.stderr[-600:]
