"""Bad input, table-driven, over every command: malformed settings (env, TOML, flags), profiles, scenarios, GGUF files.

Each row runs `strata` in a fresh interpreter with an empty temporary working directory (plus the row's input files)
and no STRATA_* variable but the row's own, and must: exit 2; print exactly one line on stderr, with no traceback;
write nothing (the working directory and the output paths are unchanged).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from bad_helpers import SCENARIO_FILES, strata_subprocess

COMMANDS = {
    "backends": ["backends"],
    "config": ["config", "show"],
    "plan": ["plan", "--plot", "out/plan.png"],
    "run": ["run", "--prompt-tokens", "8", "--decode-tokens", "1"],
    "simulate": ["simulate", "--scenario", "good.json"],
    "doctor": ["doctor"],
}

#: Malformed settings, by source: (id, extra argv, env, files).
SETTINGS_CASES = [
    ("env-not-a-number", [], {"STRATA_MEMORY__VRAM_RESERVE_MIB": "lots"}, {}),
    ("env-chunk-zero", [], {"STRATA_PREFILL__CHUNK": "0"}, {}),
    ("env-bad-literal", [], {"STRATA_KV__DTYPE": "int4"}, {}),
    ("env-legacy-bad", [], {"STRATA_PREFILL_CPU_SHARE": "maybe"}, {}),
    ("env-legacy-lend-pct", [], {"STRATA_PREFILL_LEND_PCT": "-20"}, {}),
    ("env-bad-fault-spec", [], {"STRATA_SIM__INJECT": "disk-full:every"}, {}),
    ("env-missing-sim-profile", [], {"STRATA_SIM__PROFILE": "nowhere.json"}, {}),
    ("toml-syntax", [], {}, {"strata.toml": "[memory\nvram_reserve_mib = 3\n"}),
    ("toml-unknown-key", [], {}, {"strata.toml": "[memory]\nvram_reserv_mib = 3\n"}),
    ("toml-wrong-type", [], {}, {"strata.toml": "[memory]\nvram_reserve_mib = \"lots\"\n"}),
    ("toml-negative", [], {}, {"strata.toml": "[prefill]\nlend_fraction = -0.5\n"}),
    ("pyproject-bad-value", [], {}, {"pyproject.toml": "[tool.strata.kv]\nmax_context = 0\n"}),
    ("config-missing-file", ["--config", "missing.toml"], {}, {}),
    ("config-not-toml", ["--config", "bad.toml"], {}, {"bad.toml": "\x00\x01 not toml ["}),
    ("flag-set-no-equals", ["--set", "prefill.chunk"], {}, {}),
    ("flag-set-unknown-key", ["--set", "memory.nope=1"], {}, {}),
    ("flag-set-bad-value", ["--set", "memory.expert_cache=-3"], {}, {}),
    ("flag-set-bad-fault", ["--set", "sim.inject=pinned-alloc:nth=0"], {}, {}),
]


def _scenario() -> dict:
    """A well-formed scenario to corrupt (a shared one when present, else a small inline one)."""
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


#: Command-specific file cases: (id, argv, files as {name: text or bytes}).
FILE_CASES = [
    ("plan-profile-not-json", ["plan", "--profile", "p.json", "--plot", "out/p.png"], {"p.json": "{ nope"}),
    ("plan-profile-array", ["plan", "--profile", "p.json"], {"p.json": "[1, 2]"}),
    ("plan-profile-missing", ["plan", "--profile", "nowhere.json"], {}),
    ("plan-profile-no-device", ["plan", "--profile", "p.json"],
     {"p.json": json.dumps({"schema": "strata.profile/1", "backend": "cuda", "host": {}})}),
    ("plan-profile-bytes-text", ["plan", "--profile", "p.json"], {"p.json": _profile_text(vram_total_bytes="lots")}),
    ("plan-profile-and-scenario", ["plan", "--profile", "p.json", "--scenario", "s.json"],
     {"p.json": _profile_text(), "s.json": json.dumps(_scenario())}),
    ("plan-scenario-no-model", ["plan", "--scenario", "s.json"], {"s.json": _corrupt("model", ...)}),
    ("plan-scenario-top-k-above-experts", ["plan", "--scenario", "s.json", "--plot", "out/s.png"],
     {"s.json": _corrupt("model.top_k", 100000)}),
    ("plan-scenario-zero-layers", ["plan", "--scenario", "s.json"], {"s.json": _corrupt("model.moe_layers", 0)}),
    ("plan-scenario-absurd-layers", ["plan", "--scenario", "s.json"],
     {"s.json": _corrupt("model.moe_layers", 10 ** 12)}),
    ("plan-scenario-bad-settings", ["plan", "--scenario", "s.json"],
     {"s.json": _corrupt("settings", {"prefill": {"chunk": "huge"}})}),
    ("plan-scenario-unknown-setting", ["plan", "--scenario", "s.json"],
     {"s.json": _corrupt("settings", {"memory": {"no_such": 1}})}),
    ("plan-model-unknown-preset", ["plan", "--model", "No-Such-Model-7B"], {}),
    ("simulate-not-json", ["simulate", "--scenario", "s.json"], {"s.json": "not json at all"}),
    ("simulate-missing-file", ["simulate", "--scenario", "nowhere.json"], {}),
    ("simulate-no-profile", ["simulate", "--scenario", "s.json"], {"s.json": _corrupt("profile", ...)}),
    ("simulate-negative-request", ["simulate", "--scenario", "s.json"],
     {"s.json": _corrupt("requests.0", {"prompt_tokens": -3})}),
    ("simulate-requests-not-a-list", ["simulate", "--scenario", "s.json"], {"s.json": _corrupt("requests", 7)}),
    ("simulate-absurd-experts", ["simulate", "--scenario", "s.json"],
     {"s.json": _corrupt("model.experts_per_layer", 10 ** 13)}),
    ("simulate-bad-inject", ["simulate", "--scenario", "good.json", "--inject", "vram-drop:bytes=lots"], {}),
    ("simulate-negative-requests", ["simulate", "--scenario", "good.json", "--requests", "-1"], {}),
    ("simulate-scenario-is-a-profile", ["simulate", "--scenario", "p.json"], {"p.json": _profile_text()}),
    ("run-negative-prompt", ["run", "--prompt-tokens", "-5"], {}),
    ("run-prompt-not-a-number", ["run", "--prompt-tokens", "abc"], {}),
    ("run-prompt-above-context", ["run", "--prompt-tokens", "10000000"], {}),
    ("plan-unknown-flag", ["plan", "--no-such-flag"], {}),
    # commands that select a backend (backends, config show and doctor list them; simulate always runs on sim)
    ("plan-unknown-backend", ["plan", "--backend", "nosuch"], {}),
    ("run-unknown-backend", ["run", "--backend", "nosuch", "--prompt-tokens", "8"], {}),
]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(root.rglob("*"))}


def _check(tmp_path: Path, argv: list[str], env: dict[str, str], files: dict) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "good.json").write_text(json.dumps(_scenario()))
    for name, content in files.items():
        (cwd / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    before = _snapshot(cwd)
    p = strata_subprocess(argv, cwd=cwd, env=env)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, f"exit {p.returncode}, stderr: {p.stderr[-800:]}"
    assert "Traceback" not in p.stderr
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{p.stderr}"
    assert lines[0].strip()
    assert _snapshot(cwd) == before, "the command wrote something"


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case_id, extra, env, files", SETTINGS_CASES, ids=[c[0] for c in SETTINGS_CASES])
def test_malformed_settings_are_refused_by_every_command(tmp_path, command, case_id, extra, env, files):
    _check(tmp_path, COMMANDS[command] + extra, env, files)


@pytest.mark.parametrize("case_id, argv, files", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_malformed_files_and_flags_are_refused(tmp_path, case_id, argv, files):
    _check(tmp_path, argv, {}, files)


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory) -> bytes:
    """The bytes of a valid tiny MoE GGUF, written once for the module."""
    return _gguf_bytes(tmp_path_factory.mktemp("gguf"))


GGUF_IDS = [c[0] for c in _gguf_cases(b"\0" * 64)]


@pytest.mark.parametrize("command", ["plan", "run"])
@pytest.mark.parametrize("case_id", GGUF_IDS)
def test_broken_gguf_files_are_refused(tmp_path, good_gguf, command, case_id):
    content = dict(_gguf_cases(good_gguf))[case_id]
    argv = ["plan", "--model", "m.gguf", "--plot", "out/m.png"] if command == "plan" else \
        ["run", "--model", "m.gguf", "--prompt-tokens", "8", "--decode-tokens", "1"]
    _check(tmp_path, argv, {}, {"m.gguf": content})


def test_the_good_inputs_are_accepted(tmp_path, good_gguf):
    """The table's inputs only fail where they were broken: the same commands on the good files exit 0."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "good.json").write_text(json.dumps(_scenario()))
    (cwd / "p.json").write_text(_profile_text())
    (cwd / "m.gguf").write_bytes(good_gguf)
    for argv in (["plan", "--scenario", "good.json"], ["plan", "--profile", "p.json"], ["plan", "--model", "m.gguf"],
                 ["simulate", "--scenario", "good.json", "--json"], ["config", "show"], ["doctor"], ["backends"],
                 ["run", "--model", "m.gguf", "--prompt-tokens", "8", "--decode-tokens", "1", "--backend", "cpu"]):
        p = strata_subprocess(argv, cwd=cwd)
        assert p.returncode == 0, f"{argv}: exit {p.returncode}: {p.stderr[-600:]}"
