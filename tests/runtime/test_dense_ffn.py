"""Shared experts, dense FFN blocks and router biases (strata_core.runtime.dense_ffn) through `strata run --check`.

Real Q4_K_M-style files (tests/quant's writer): qwen2moe (a shared expert with its sigmoid gate in every MoE layer),
deepseek2 (a dense first block, then a shared expert in every MoE layer) and gpt-oss (a router bias, expert biases).
Each runs with --check on every backend installed; its outputs differ from the same file with those FFNs zeroed,
and a run that drops or breaks one of them fails its check (so the check covers them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json

import numpy as np
import pytest

from strata_core.cli import main
from strata_core.models.gguf import _open_reader, model_from_gguf, read_moe_tensors, write_moe_gguf
from strata_core.runtime import dense_ffn

CACHE_SLOTS = 6
PROMPT_TOKENS = 32
DECODE_TOKENS = 2
ARCHS = ("qwen2moe", "deepseek2")
BACKENDS = ("cpu", "sim", "opencl", "sycl")
VENDOR_MODULE = {"opencl": "pyopencl", "sycl": "dpctl"}
MATRIX = [(b, a) for b in BACKENDS for a in ARCHS]
#: the shape tests/quant uses: hidden and FFN 256 (one K super-block a row), 8 experts, top 2, 2 MoE layers
SHAPE = dict(layers=2, gate_up="q4_k", down="q6_k")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """(arch, zeroed) -> path; the zeroed file is the same draw with its shared/dense FFNs' down rows zero."""
    d = tmp_path_factory.mktemp("dense_ffn")
    out = {}
    for i, arch in enumerate((*ARCHS, "gpt-oss")):
        kw = dict(SHAPE) if arch != "gpt-oss" else dict(layers=2, gate_up="mxfp4", down="mxfp4",
                                                        embed_type="q8_0", head_type="q8_0")
        for zero in (False, True):
            out[arch, zero] = write_moe_gguf(d / f"{arch}{'-zero' if zero else ''}.gguf", arch=arch, seed=i,
                                             zero_ffns=zero, **kw)
    return out


def run_json(path, backend: str = "cpu", *extra: str) -> tuple[int, dict, str]:
    """`strata run --model PATH --check --json` in this process: (exit code, strata.run/1, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["run", "--model", str(path), "--backend", backend, "--check", "--prompt-tokens", str(PROMPT_TOKENS),
            "--decode-tokens", str(DECODE_TOKENS), "--set", f"memory.expert_cache={CACHE_SLOTS}", *extra, "--json"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    text = out.getvalue()
    return rc, (json.loads(text) if text.strip() else {}), err.getvalue()


def _skip_without_vendor(backend: str) -> None:
    vendor = VENDOR_MODULE.get(backend)
    if vendor and importlib.util.find_spec(vendor) is None:
        pytest.skip(f"{vendor} is not installed (the {backend} backend's extra)")


@pytest.mark.parametrize("backend,arch", MATRIX, ids=[f"{b}-{a}" for b, a in MATRIX])
def test_shared_experts_and_dense_blocks_are_computed_and_checked(files, backend, arch):
    _skip_without_vendor(backend)
    rc, r, err = run_json(files[arch, False], backend)
    assert rc == 0, err[-3000:]
    assert r["check"] == "passed", r["check_report"]
    assert r["check_report"]["tolerance"] <= 1e-5
    t = read_moe_tensors(files[arch, False])
    shared = [f for f in t.ffns if f.kind == "shared"]
    dense = [f for f in t.ffns if f.kind == "dense"]
    assert len(shared) == 2 and len(dense) == (1 if arch == "deepseek2" else 0)
    passes = 1 + DECODE_TOKENS  # one prefill chunk, then one pass a decode token
    # every pass checks each MoE layer, each layer again with its shared expert, and each dense block
    assert r["check_report"]["layers_checked"] == passes * (2 * 2 + len(dense))
    assert "not computed" not in err
    # the plan's dense line is what the device holds: routers, norms, LM head and these FFNs in the file's bytes
    from strata_core.models.synthetic import device_dense_bytes
    ffn_bytes = sum(int(a.nbytes) for f in t.ffns for a in f.device_arrays.values())
    assert r["plan"]["vram"]["dense_bytes"] == r["device_regions"]["dense"] == r["dense_device_bytes"] \
        == device_dense_bytes(2, 8, 256, 64) + ffn_bytes
    if backend in ("cpu", "sim"):  # sycl/opencl carve no views yet (issue 12): their peak is not the plan's
        assert r["device_bytes_peak_measured"] == r["device_bytes_planned"]
    # the zeroed file (same draw, shared/dense FFNs adding nothing) also passes, with other outputs
    rc0, r0, err0 = run_json(files[arch, True], backend)
    assert rc0 == 0 and r0["check"] == "passed", err0[-3000:]
    assert r0["outputs_sha256"] != r["outputs_sha256"]


def _relative_errors(report: dict) -> list[str]:
    return [f for f in report["failures"] if "relative error" in f]


def test_a_run_whose_shared_expert_adds_nothing_fails_its_check(files, monkeypatch):
    # the shared expert's output is overwritten with zeros after it is computed: the run is the zeroed file's
    orig = dense_ffn.DenseFfnLayerOps._ffn

    def zeroed(self, w, f, xn, out):
        y = orig(self, w, f, xn, out)
        self.dm.upload(y, np.zeros(tuple(y.shape), np.float32))
        return y

    monkeypatch.setattr(dense_ffn.DenseFfnLayerOps, "_ffn", zeroed)
    for arch in ARCHS:
        rc, r, err = run_json(files[arch, False], "sim")
        assert rc == 1 and r["check"] == "failed", (arch, r.get("check_report"))
        bad = _relative_errors(r["check_report"])
        assert any("prefill.shared layer 0" in f for f in bad), bad
        if arch == "deepseek2":
            assert any("prefill.dense layer 0" in f for f in bad), bad


def test_a_run_that_skips_a_dense_block_fails_its_check(files, monkeypatch):
    # every layer the run reports is right, but the dense block never ran: the coverage check names it
    monkeypatch.setattr(dense_ffn.DenseFfnLayerOps, "_dense_block", lambda self, w, f: None)
    rc, r, err = run_json(files["deepseek2", False], "cpu")
    assert rc == 1 and r["check"] == "failed"
    assert any("dense FFN block 0: observed 0 times in 3 passes" in f for f in r["check_report"]["failures"]), r


def test_a_run_without_the_shared_gate_fails_its_check(files, monkeypatch):
    # qwen2moe's shared expert is scaled by sigmoid(xn . gate): a run that adds it unscaled is wrong
    monkeypatch.setattr(dense_ffn, "_sigmoid", lambda z: np.ones_like(z))
    rc, r, err = run_json(files["qwen2moe", False], "cpu")
    assert rc == 1 and any("prefill.shared layer" in f for f in _relative_errors(r["check_report"])), r


def test_the_router_bias_is_added_before_the_top_k(files, monkeypatch):
    rc, r, err = run_json(files["gpt-oss", False], "sim")
    assert rc == 0 and r["check"] == "passed", err[-3000:]
    assert "not computed" not in err
    t = read_moe_tensors(files["gpt-oss", False])
    assert all(b is not None and b.shape == (8,) for b in t.router_biases)
    # without the bias the routing (and so the layers) differ from the reference's
    orig = dense_ffn.DenseFfnLayerOps.__init__

    def no_bias(self, *a, **kw):
        orig(self, *a, **kw)
        self.router_bias = {}

    monkeypatch.setattr(dense_ffn.DenseFfnLayerOps, "__init__", no_bias)
    rc, r, err = run_json(files["gpt-oss", False], "sim")
    assert rc == 1 and _relative_errors(r["check_report"]), r["check_report"]


def test_the_dense_ffns_are_the_files_bytes_on_the_plans_dense_line(files):
    path = files["deepseek2", False]
    tensors = {t.name: t for t in _open_reader(path).tensors}
    spec = model_from_gguf(path)
    t = read_moe_tensors(path, spec)
    names = {"dense": ("ffn_gate", "ffn_up", "ffn_down"), "shared": ("ffn_gate_shexp", "ffn_up_shexp",
                                                                      "ffn_down_shexp")}
    total = 0
    for f in t.ffns:
        raw = [np.asarray(tensors[f"blk.{f.block}.{n}.weight"].data).view(np.uint8).reshape(-1)
               for n in names[f.kind]]
        # the slot holds the gate, up and down rows exactly as the file stores them
        assert np.array_equal(f.pool.arrays["blob"].reshape(-1), np.concatenate(raw)), f.key
        total += f.pool.arrays["blob"].nbytes
    assert total == sum(int(tensors[f"blk.{f.block}.{n}.weight"].n_bytes) for f in t.ffns for n in names[f.kind])
    # the plan's dense line is the file's non-expert bytes, these included
    expert = sum(int(x.n_bytes) for n, x in tensors.items() if "_exps." in n)
    assert spec.dense_bytes == sum(int(x.n_bytes) for x in tensors.values()) - expert
    assert spec.dense_bytes > total


def test_a_model_without_dense_ffns_runs_the_sessions_own_layer_ops():
    # the tiny model (and any file without shared experts, dense blocks or router biases) keeps its bits
    from strata_core.models.synthetic import generate_weights, model_spec
    w = generate_weights(model_spec("t", 1, 4, 2, 32, 32, 16), seed=0)
    ops = object()
    assert dense_ffn.wrap(ops, w, {}, None, None, False, 1) is ops
    assert dense_ffn.wrap(ops, None, {}, None, None, False, 1) is ops


def test_the_plan_counts_the_shared_experts_buffers_per_token(files):
    from strata_core.models.spec import prompt_bytes_for, shared_expert_bytes_per_token
    base = prompt_bytes_for(256, 8, 2, 256)
    assert model_from_gguf(files["qwen2moe", False]).prompt_bytes_per_token == base + shared_expert_bytes_per_token(256)
    assert model_from_gguf(files["deepseek2", False]).prompt_bytes_per_token == base + shared_expert_bytes_per_token(256)
    assert model_from_gguf(files["gpt-oss", False]).prompt_bytes_per_token == base  # no shared expert
    assert shared_expert_bytes_per_token(256) == 256 * 4 + 8


def test_gpt_oss_expert_biases_are_computed_and_checked(files, monkeypatch):
    # gpt-oss's experts carry f32 gate/up/down biases in their slots: a grouped FFN that ignored them fails the check
    from dataclasses import replace

    from strata_core.reference import kernels as ref
    t = read_moe_tensors(files["gpt-oss", False])
    assert all(f.bias for f in t.experts.formats)
    orig = ref.gguf_expert_ffn
    monkeypatch.setattr(ref, "gguf_expert_ffn", lambda x, row, fmt: orig(x, row, replace(fmt, bias=False)))
    rc, r, err = run_json(files["gpt-oss", False], "cpu")
    assert rc == 1 and _relative_errors(r["check_report"]), r["check_report"]
