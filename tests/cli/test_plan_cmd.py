"""`strata plan`: sources of the machine and model, settings precedence, outputs, and bad input as exit 2."""

import json
import sys
from pathlib import Path

import pytest

from strata_core.cli import main
from strata_core.commands.plan import loan_sample
from strata_core.api.facts import MIB
from strata_core.models.gguf import write_tiny_moe_gguf
from strata_core.planner.plan import LoanRow

SCENARIOS = Path(__file__).resolve().parents[1] / "data" / "scenarios"
RESERVE700 = SCENARIOS / "seed2090-rtx4070ti-reserve700.json"
needs_scenarios = pytest.mark.skipif(not RESERVE700.is_file(), reason=f"shared scenario {RESERVE700} is absent")


def _run(capsys, *argv):
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _profile(tmp_path, **device_overrides):
    """A strata.profile/1 file: an RTX 4070 Ti on a 64 GB Windows host (facts of the seed), edited as asked."""
    device = {"name": "NVIDIA GeForce RTX 4070 Ti", "arch": "sm_89", "vram_total_bytes": 12877561856,
              "vram_free_bytes": 11 * 1024 * MIB, "driver_model": "wddm", **device_overrides}
    host = {"os": "windows", "ram_total_bytes": 64 * 1024 * MIB, "ram_available_bytes": 40 * 1024 * MIB,
            "pinnable_bytes": None, "cpu": {"name": "x", "cores": 12, "flags": ["avx2"]}}
    p = tmp_path / "profile.json"
    p.write_text(json.dumps({"schema": "strata.profile/1", "backend": "cuda", "device": device, "host": host}))
    return p


def test_this_machine_with_the_default_model(capsys):
    rc, out, err = _run(capsys, "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["schema"] == "strata.plan/1" and d["origin"] == "this machine"
    assert d["expert_cache"]["slots"] >= 1 and d["prompt"]["chunk"] >= 1


def test_profile_and_preset_with_quant(tmp_path, capsys):
    rc, out, err = _run(capsys, "--profile", str(_profile(tmp_path)), "--model", "Qwen3-30B-A3B", "--quant", "IQ3_S",
                        "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["model"]["name"] == "Qwen3-30B-A3B@IQ3_S" and d["backend"] == "cuda"
    assert d["device"]["name"] == "NVIDIA GeForce RTX 4070 Ti"
    assert d["vram"]["dense_bytes"] == d["model"]["dense_bytes"] > 0


def test_gguf_model_is_planned_from_its_tensors(tmp_path, capsys):
    g = write_tiny_moe_gguf(tmp_path / "m.gguf", layers=2, experts=8, top_k=2, hidden=64, ffn=64, vocab=32)
    rc, out, err = _run(capsys, "--profile", str(_profile(tmp_path)), "--model", str(g), "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["model"]["source"] == f"gguf:{g}" and d["expert_cache"]["slot_bytes"] == 3 * 64 * 64 * 2
    # 16 experts in all fit easily: the cache holds every one of them and no more
    assert d["expert_cache"]["slots"] == 16


@needs_scenarios
def test_flags_beat_the_scenario_which_beats_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("STRATA_MEMORY__VRAM_RESERVE_MIB", "2000")
    rc, out, err = _run(capsys, "--scenario", str(RESERVE700), "--json")
    assert rc == 0, err
    assert json.loads(out)["vram"]["reserve_bytes"] == 700 * MIB
    rc, out, err = _run(capsys, "--scenario", str(RESERVE700), "--set", "memory.vram_reserve_mib=1000", "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["vram"]["reserve_bytes"] == 1000 * MIB
    assert [r["prompt_tokens"] for r in d["requests"]] == [6000, 4000, 3080, 2000, 4000, 20000]


@needs_scenarios
def test_tables_and_explain_give_every_decision_and_its_reason(capsys):
    rc, out, err = _run(capsys, "--scenario", str(RESERVE700), "--json")
    decisions = json.loads(out)["decisions"]
    rc, out, err = _run(capsys, "--scenario", str(RESERVE700), "--explain")
    assert rc == 0, err
    flat = "".join(out.split())
    assert "VRAM" in out and "Prompt path" in out and "Decisions" in out
    for dec in decisions:
        assert "".join(dec["why"].split()) in flat


@needs_scenarios
def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed here")
    png = tmp_path / "plan.png"
    rc, out, err = _run(capsys, "--scenario", str(RESERVE700), "--plot", str(png))
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, out, err = _run(capsys, "--profile", str(_profile(tmp_path)), "--plot", str(tmp_path / "x.png"))
    assert rc == 2
    assert "pip install 'strata-core[plot]'" in err and len(err.strip().splitlines()) == 1


def test_a_machine_with_no_plan_exits_2_with_the_planners_line(tmp_path, capsys):
    rc, out, err = _run(capsys, "--profile", str(_profile(tmp_path, vram_free_bytes=300 * MIB)),
                        "--model", "Mixtral-8x7B", "--quant", "F16")
    assert rc == 2 and out == ""
    assert err.startswith("strata: error:") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("text,needle", [
    ("{not json", "not valid JSON"),
    (json.dumps({"schema": "strata.profile/1", "backend": "cuda", "device": {"name": "x", "vram_total_bytes": 1},
                 "host": {"os": "linux", "ram_total_bytes": 1, "ram_available_bytes": 1}}), "'vram_free_bytes'"),
    (json.dumps({"schema": "strata.profile/1", "backend": "cuda",
                 "device": {"name": "x", "vram_total_bytes": 1, "vram_free_bytes": 1}}), "'host'"),
])
def test_bad_profiles_exit_2_naming_file_and_field(tmp_path, capsys, text, needle):
    p = tmp_path / "bad.json"
    p.write_text(text)
    rc, out, err = _run(capsys, "--profile", str(p), "--json")
    # with --json the failure is also one strata.error/1 object on stdout (DESIGN.md, machine-readable outputs)
    assert rc == 2 and json.loads(out) == {"schema": "strata.error/1", "error": err.strip()[len("strata: error: "):],
                                           "exit_code": 2}
    assert str(p) in err and needle in err and len(err.strip().splitlines()) == 1


@needs_scenarios
def test_bad_scenario_exits_2_naming_file_and_field(tmp_path, capsys):
    d = json.loads(RESERVE700.read_text())
    del d["model"]["top_k"]
    p = tmp_path / "s.json"
    p.write_text(json.dumps(d))
    rc, out, err = _run(capsys, "--scenario", str(p), "--json")
    assert rc == 2 and str(p) in err and "'top_k'" in err


@pytest.mark.parametrize("argv,needle", [
    (["--model", "No-Such-Model"], "unknown model"),
    (["--quant", "Q4_K"], "--quant"),
    (["--model", "missing.gguf"], "missing.gguf"),
    (["--set", "prefill.chunk=lots"], "prefill.chunk"),
])
def test_bad_flags_exit_2(tmp_path, capsys, argv, needle):
    rc, out, err = _run(capsys, "--profile", str(_profile(tmp_path)), *argv)
    assert rc == 2 and needle in err


def test_list_models(capsys):
    rc, out, err = _run(capsys, "--list-models", "--json")
    d = json.loads(out)
    assert rc == 0 and d["schema"] == "strata.models/1" and "Mixtral-8x7B" in d["presets"]


def _rows(loans):
    return tuple(LoanRow(chunk=256 * (i + 1), ring_slots=0, buffer_slots=n, loan_slots=n) for i, n in enumerate(loans))


def test_loan_sample_keeps_ends_peak_and_every_step_down():
    loans = _rows(list(range(100, 140)) + [90] + list(range(91, 130)))
    shown = loan_sample(loans, limit=10)
    chunks = [r.chunk for r, _ in shown]
    assert chunks[0] == loans[0].chunk and chunks[-1] == loans[-1].chunk
    assert loans[39].chunk in chunks  # the peak (139)
    downs = [r.chunk for r, down in shown if down]
    assert downs == [loans[40].chunk] and loans[39].chunk in chunks
    assert len(shown) < len(loans)


# --- issue 12.7: plan and run agree ------------------------------------------------------------------------------

def test_plan_shows_the_cache_and_chunk_run_uses_for_the_tiny_model(capsys):
    """`strata plan` showed 2048 slots / chunk 4096 for the tiny model while `strata run` used 1024 / 2560."""
    rc, out, err = _run(capsys, "--backend", "cpu", "--json")
    assert rc == 0, err
    planned = json.loads(out)
    # what `strata run` plans with: its own model resolution and the one Target resolution
    from strata_core.cli import build_parser
    from strata_core.commands.run import resolve_run_model
    from strata_core.config import settings_from_args
    from strata_core.planner import plan_for_machine
    from strata_core.registry import load_from_settings
    loaded = settings_from_args(build_parser().parse_args(["run", "--backend", "cpu"]))
    plugins = load_from_settings(loaded.settings)
    spec, _, settings = resolve_run_model(None, loaded, 0)
    ran = plan_for_machine(plugins, plugins.resolve_target(loaded.settings), spec, settings).to_json()
    assert planned["expert_cache"] == ran["expert_cache"] and planned["prompt"]["chunk"] == ran["prompt"]["chunk"]
    assert planned["expert_cache"]["slots"] < planned["model"]["moe_layers"] * planned["model"]["experts_per_layer"]
    # an explicit setting wins over the model's default, in both
    rc, out, err = _run(capsys, "--backend", "cpu", "--json", "--set", "memory.expert_cache=1500")
    assert rc == 0 and json.loads(out)["expert_cache"]["slots"] == 1500


@needs_scenarios
def test_a_request_beyond_kv_max_context_is_refused_by_the_plan_as_by_the_runtime(tmp_path, capsys):
    d = json.loads(RESERVE700.read_text())
    d["requests"] = [{"prompt_tokens": 4000}, {"prompt_tokens": 10 ** 12}]
    p = tmp_path / "long.json"
    p.write_text(json.dumps(d))
    rc, out, err = _run(capsys, "--scenario", str(p), "--json")
    assert rc == 0, err
    rows = json.loads(out)["requests"]
    assert rows[0]["fits"] and rows[0]["refused_reason"] is None
    assert not rows[1]["fits"] and "kv.max_context" in rows[1]["refused_reason"]
    rc = main(["simulate", "--scenario", str(p), "--json"])
    sim = json.loads(capsys.readouterr()[0])
    assert rc == 0 and sim["requests"][1]["refused_reason"] == rows[1]["refused_reason"]


def _decisions(capsys, *argv):
    rc, out, err = _run(capsys, "--backend", "cpu", "--json", *argv)
    assert rc == 0, err
    return json.loads(out)["decisions"]


@pytest.mark.parametrize("setting,key", [("prefill.chunk=auto:1024", "prefill.chunk"),
                                         ("prefill.chunk=512", "prefill.chunk"),
                                         ("kv.max_context=1024", "kv.max_context")])
def test_explain_names_the_setting_that_capped_or_fixed_the_chunk(capsys, setting, key):
    chunk = [d for d in _decisions(capsys, "--set", setting) if d["what"] == "prompt.chunk"][-1]
    assert chunk["source"] == f"setting {key}", chunk
    assert chunk["origin"].startswith(f"setting {key} (flag:"), chunk
    rc, out, err = _run(capsys, "--backend", "cpu", "--explain", "--set", setting)
    assert rc == 0 and f"[setting {key} (flag:" in out


@pytest.mark.parametrize("spelling", ["fp16", "float16", "half", "F16"])
def test_kv_dtype_accepts_common_spellings(tmp_path, capsys, spelling):
    rc, out, err = _run(capsys, "--profile", str(_profile(tmp_path)), "--model", "Qwen3-30B-A3B", "--json",
                        "--set", f"kv.dtype={spelling}")
    assert rc == 0, err
    d = json.loads(out)
    assert d["settings"]["kv"]["dtype"] == "f16"
    rc, out, _ = _run(capsys, "--profile", str(_profile(tmp_path)), "--model", "Qwen3-30B-A3B", "--json")
    assert json.loads(out)["vram"]["kv_bytes"] == d["vram"]["kv_bytes"] > 0
