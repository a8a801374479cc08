"""`strata run --model FILE --check` on real Q4_K_M-style GGUF files of every architecture: cpu, sim, sycl, opencl.

Each file's experts stay in their own bytes: the plan's slot bytes are the file's expert bytes (the largest layer's
where the down type differs per layer), the device pool is exactly plan slots x slot bytes, and missed experts
stream at those bytes. The check compares every layer with the float64 reference at the f32 path's tolerance.
Every architecture runs on every backend (sycl and opencl build their OpenCL program once per process).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json

import numpy as np
import pytest

from strata_core.cli import main
from strata_core.models.gguf import model_from_gguf, read_moe_tensors

CACHE_SLOTS = 6  # of 16 or 24 experts: misses stream in every layer

ARCHS = ("qwen3moe", "qwen2moe", "llama", "deepseek2", "gpt-oss", "olmoe")
MATRIX = [(b, a) for b in ("cpu", "sim", "opencl", "sycl") for a in ARCHS]
VENDOR_MODULE = {"opencl": "pyopencl", "sycl": "dpctl"}


def run_json(*argv: str) -> tuple[int, dict, str]:
    """`strata run ARGV --json` in this process: (exit code, the strata.run/1 object, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["run", *argv, "--json"])
    text = out.getvalue()
    return rc, (json.loads(text) if text.strip() else {}), err.getvalue()


@pytest.mark.parametrize("backend,arch", MATRIX, ids=[f"{b}-{a}" for b, a in MATRIX])
def test_a_quantized_gguf_runs_from_its_own_bytes_with_check(gguf_files, backend, arch):
    vendor = VENDOR_MODULE.get(backend)
    if vendor and importlib.util.find_spec(vendor) is None:
        pytest.skip(f"{vendor} is not installed (the {backend} backend's extra)")
    path = gguf_files[arch]
    spec = model_from_gguf(path)
    pool = read_moe_tensors(path, spec).experts
    rc, r, err = run_json("--model", str(path), "--backend", backend, "--check", "--prompt-tokens", "32",
                          "--decode-tokens", "2", "--set", f"memory.expert_cache={CACHE_SLOTS}")
    assert rc == 0, err[-3000:]
    assert r["check"] == "passed", r["check_report"]
    assert r["check_report"]["tolerance"] <= 1e-5, "quantized experts are dequantized exactly: the f32 path's bound"
    assert pool.dtype == "gguf"
    slot = r["plan"]["expert_cache"]["slot_bytes"]
    # the plan's slot is the file's expert: its gate, up and down rows (and biases) as the file stores them
    assert slot == max(f.nbytes for f in pool.formats) == pool.arrays["blob"].shape[1]
    assert r["cache_pool_bytes"] == CACHE_SLOTS * slot == r["plan"]["vram"]["expert_cache_bytes"]
    assert r["bytes_streamed"] > 0 and r["bytes_streamed"] % slot == 0
    # shared experts, dense blocks and router biases are computed (tests/runtime/test_dense_ffn.py): no line says
    # any is left out
    assert "not computed" not in err


def test_the_q4_k_m_layers_differ_and_the_slot_is_the_largest(gguf_files):
    pool = read_moe_tensors(gguf_files["qwen3moe"]).experts
    assert [f.down for f in pool.formats] == ["q4_k", "q4_k", "q6_k"]
    sizes = [f.nbytes for f in pool.formats]
    assert sizes[0] < sizes[2] == pool.arrays["blob"].shape[1]
    # a smaller layer's rows fill the start of its slots, the rest is zero
    assert not pool.arrays["blob"][:8, sizes[0]:].any() and pool.arrays["blob"][16:, sizes[0]:].any()


def test_an_iq_expert_tensor_is_refused_in_one_line_before_anything_is_allocated(tmp_path):
    import gguf

    w = gguf.GGUFWriter(tmp_path / "iq.gguf", "qwen3moe")
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_embedding_length(256)
    t = gguf.GGMLQuantizationType.IQ2_XXS
    blk, nb = gguf.GGML_QUANT_SIZES[t]
    w.add_tensor("token_embd.weight", np.zeros((8, 256), np.float32))
    w.add_tensor("output_norm.weight", np.ones(256, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(256, np.float32))
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((4, 256), np.float32))
    for k in ("gate", "up", "down"):
        w.add_tensor(f"blk.0.ffn_{k}_exps.weight", np.zeros((4, 256, 256 // blk * nb), np.uint8), raw_dtype=t)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    rc, r, err = run_json("--model", str(tmp_path / "iq.gguf"), "--backend", "cpu")
    assert rc == 2 and r["schema"] == "strata.error/1"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "blk.0.ffn_gate_exps.weight" in lines[0] and "IQ2_XXS" in lines[0]
    assert "Q4_K" in lines[0] and "MXFP4" in lines[0]
    assert "expert arena" not in err and "plan" not in r


def test_run_help_lists_the_expert_formats(capsys):
    try:
        assert main(["run", "--help"]) == 0
    except SystemExit as e:  # argparse's own exit, where the CLI lets it through
        assert e.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for fmt in ("F16", "BF16", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "Q4_K_M"):
        assert fmt in text, fmt


def test_the_cpu_share_runs_gguf_experts_on_host_bytes(gguf_files):
    # the share computes some misses on the host store's own rows (biases included) while the device runs the rest
    rc, r, err = run_json("--model", str(gguf_files["gpt-oss"]), "--backend", "sim", "--check", "--prompt-tokens",
                          "300", "--decode-tokens", "1", "--set", f"memory.expert_cache={CACHE_SLOTS}", "--set",
                          "prefill.cpu_share=on")
    assert rc == 0, err[-3000:]
    assert r["check"] == "passed" and r["cpu_share"]["experts"] > 0, r["cpu_share"]
