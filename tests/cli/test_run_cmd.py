"""`strata run`: the main job end to end on the cpu backend (numpy, the reference), its --check, and its bad inputs."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from strata_core.cli import main
from strata_core.models.gguf import write_tiny_moe_gguf

RUN = [sys.executable, "-m", "strata_core.cli", "run"]


def _json_run(capsys, *argv) -> tuple[int, dict]:
    rc = main(["run", *argv, "--json"])
    out = capsys.readouterr().out
    return rc, (json.loads(out) if out.strip() else {})


def test_default_run_on_the_cpu_backend_passes_its_check_and_streams_through_loans(clean_strata_env):
    p = subprocess.run(RUN + ["--backend", "cpu", "--check", "--json"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout)
    assert r["schema"] == "strata.run/1" and r["backend"] == "cpu" and r["check"] == "passed"
    for key in ("device", "model", "plan", "prompt_tokens", "decode_tokens", "prefill_tokens_per_s",
                "decode_tokens_per_s", "cache_hit_rate", "bytes_streamed", "loans", "halvings", "fallbacks"):
        assert key in r, key
    assert r["model"]["source"] == "tiny" and r["prompt_tokens"] == 3000 and r["decode_tokens"] == 64
    assert len(r["tokens"]) == 65
    slots = r["plan"]["expert_cache"]["slots"]
    assert slots == r["model"]["moe_layers"] * r["model"]["experts_per_layer"] // 2, "the tiny model's half cache"
    assert r["loans"] >= 1 and r["bytes_streamed"] > 0 and 0 < r["cache_hit_rate"] < 1
    assert r["cache_pool_bytes"] == r["plan"]["vram"]["expert_cache_bytes"]
    assert r["device_bytes_allocated"] <= r["device_bytes_planned"]
    assert r["device_bytes_peak_estimate"] <= r["device_bytes_planned"]
    assert r["check_report"]["layers_checked"] > 0
    # numpy accumulates in f32: the bound applied is the f32 path's, and the real error sits well inside it
    assert r["check_report"]["precision"] == "f32" and r["check_report"]["tolerance"] == 1e-5
    assert r["check_report"]["worst_rel_err"] <= r["check_report"]["tolerance"]
    assert any("attention" in n for n in r["notes"])
    # measured beside planned (cpu: the high-water of the plan's regions; nothing else is allocated while serving)
    assert r["device_bytes_peak_source"].startswith("host memory")
    assert 0.98 * r["device_bytes_planned"] <= r["device_bytes_peak_measured"] <= r["device_bytes_planned"]
    assert sum(r["device_regions"].values()) == r["device_bytes_peak_measured"]
    assert r["host_rss_peak_bytes"] > 0 and r["host_bytes_planned"] > 0
    assert r["pinned_bytes_peak"] > 0
    # timings: --check's own time is outside prefill_s/decode_s, and the rates are those timings
    assert r["check_s"] > 0 and r["prefill_s"] > 0 and r["decode_s"] > 0
    assert r["prefill_tokens_per_s"] == pytest.approx(r["prompt_tokens"] / r["prefill_s"])
    assert r["decode_tokens_per_s"] == pytest.approx(r["decode_tokens"] / r["decode_s"])
    layers = r["model"]["moe_layers"]
    assert r["time_per_layer_us"]["decode"] == pytest.approx(1e6 * r["decode_s"] / (64 * layers))
    assert r["link_gb_per_s"] > 0
    assert 0 < r["cache_hit_rate_prefill"] < 1 and 0 < r["cache_hit_rate_decode"] <= 1
    # the idle part of the loan caches experts: the tiny model's prefill hit 8% when the whole loan was evicted
    assert r["cache_hit_rate_prefill"] > 0.2


@pytest.mark.parametrize("dtype", ["F16", "BF16", "Q8_0"])
def test_a_tiny_moe_gguf_runs_end_to_end_with_check(clean_strata_env, capsys, dtype):
    # many small experts: a cache of half of them is large enough to lend the prompt path its ring
    path = write_tiny_moe_gguf(clean_strata_env / f"tiny-{dtype}.gguf", layers=4, experts=512, top_k=2, hidden=32,
                               ffn=32, vocab=256, dtype=dtype, seed=3)
    rc, r = _json_run(capsys, "--model", str(path), "--backend", "cpu", "--check", "--prompt-tokens", "1100",
                      "--decode-tokens", "4", "--set", "memory.expert_cache=1024")
    assert rc == 0, capsys.readouterr().err
    assert r["check"] == "passed" and r["model"]["source"].startswith("gguf:")
    assert r["plan"]["expert_cache"]["slots"] == 1024
    assert r["loans"] == 1 and r["ring_batches"] > 0, "a 1100-token prompt streams its misses through a loan"
    assert r["plan"]["vram"]["kv_bytes"] == 0, "no attention runs, so no KV is planned for the run"
    assert r["device_bytes_peak_estimate"] <= r["device_bytes_planned"]
    assert r["cache_hit_rate"] < 1 and r["bytes_streamed"] > 0


def test_a_check_mismatch_exits_1(clean_strata_env, capsys, monkeypatch):
    from strata_core.runtime import check as check_mod
    orig = check_mod.ReferenceCheck.layer_update

    def wrong(self, layer, x):
        upd, clear = orig(self, layer, x)
        return upd * 1.01, clear

    monkeypatch.setattr(check_mod.ReferenceCheck, "layer_update", wrong)
    rc, r = _json_run(capsys, "--backend", "cpu", "--check", "--prompt-tokens", "200", "--decode-tokens", "2")
    assert rc == 1 and r["check"] == "failed" and r["check_report"]["failures"]


def _one_line_exit_2(args, tmp):
    p = subprocess.run(RUN + args, capture_output=True, text=True, timeout=300, cwd=tmp)
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


def test_bad_inputs_exit_2_with_one_line(clean_strata_env):
    tmp = clean_strata_env
    assert "cannot read" in _one_line_exit_2(["--model", str(tmp / "missing.gguf")], tmp)
    (tmp / "junk.gguf").write_bytes(b"not a gguf at all")
    assert "not a GGUF" in _one_line_exit_2(["--model", str(tmp / "junk.gguf")], tmp)
    assert "kv.max_context" in _one_line_exit_2(["--backend", "cpu", "--prompt-tokens", "5000",
                                                 "--set", "kv.max_context=4096"], tmp)
    assert "expert_cache" in _one_line_exit_2(["--backend", "cpu", "--set", "memory.expert_cache=100000000"], tmp)
    assert "--prompt-tokens" in _one_line_exit_2(["--prompt-tokens", "0"], tmp)


def test_skew_concentrates_the_generated_routing_where_a_half_cache_holds_it(clean_strata_env, capsys):
    args = ("--backend", "cpu", "--prompt-tokens", "1024", "--decode-tokens", "32")
    rc0, plain = _json_run(capsys, *args)
    rc1, skewed = _json_run(capsys, *args, "--skew", "1")
    assert rc0 == rc1 == 0
    assert plain["model"]["popularity_skew"] == 0.0 and skewed["model"]["popularity_skew"] == 1.0
    # the tiny model's cache holds half its experts, the popular ones first: under the skew decode's rows land
    # on them (measured 0.98 skewed, 0.52 uniform)
    assert skewed["cache_hit_rate_decode"] > plain["cache_hit_rate_decode"] + 0.25, (plain, skewed)
    assert skewed["tokens"] != plain["tokens"], "the same weights were generated"


def test_skew_is_refused_for_a_gguf_file_and_out_of_range(clean_strata_env):
    tmp = clean_strata_env
    path = tmp / "tiny.gguf"
    write_tiny_moe_gguf(path)
    assert "GGUF file" in _one_line_exit_2(["--model", str(path), "--skew", "1"], tmp)
    assert "--skew" in _one_line_exit_2(["--skew", "-1"], tmp)
    assert "--skew" in _one_line_exit_2(["--skew", "nan"], tmp)


def test_a_gguf_without_experts_is_refused(clean_strata_env):
    import gguf
    path = clean_strata_env / "dense.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "not an MoE model" in _one_line_exit_2(["--model", str(path)], clean_strata_env)


def test_the_summary_table_names_what_ran(clean_strata_env, capsys):
    rc = main(["run", "--backend", "cpu", "--prompt-tokens", "300", "--decode-tokens", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    for word in ("prefill", "decode", "hit rate", "streamed", "loans", "fallbacks", "check"):
        assert word in out
