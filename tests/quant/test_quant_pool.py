"""'gguf' expert pools: the file's bytes unchanged in the host store, the contract's block table, and the numpy
grouped FFN over them against the float64 reference (which dequantizes with the same ggml formulas, then carries
no rounding); the OpenCL C kernels of moe.cl against the same reference on Intel's CPU runtime."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from strata_core.api.kernels import EXPERT_FORMATS, GGUF_BLOCKS, ExpertFormat, ExpertPool
from strata_core.models.gguf import _open_reader, model_from_gguf, read_moe_tensors
from strata_core.reference import kernels as ref
from strata_core.reference import quants
from strata_core.testing import reference64 as r64

#: f32 accumulation of exactly dequantized weights: the f32 path's bound (strata_core.testing.tolerance)
F32_BOUND = 1e-5


def test_the_contract_block_table_is_the_oracles():
    assert GGUF_BLOCKS == {n: (f.block_weights, f.block_bytes) for n, f in quants.FORMATS.items()}
    assert set(EXPERT_FORMATS) - {"f16", "q8_0"} <= set(GGUF_BLOCKS)


def test_the_host_pool_holds_the_files_expert_bytes_unchanged(gguf_files):
    for arch, path in gguf_files.items():
        spec = model_from_gguf(path)
        t = read_moe_tensors(path, spec)
        blob = t.experts.arrays["blob"]
        tensors = {x.name: x for x in _open_reader(path).tensors}
        assert blob.shape == (spec.moe_layers * spec.experts_per_layer, spec.slot_bytes), arch
        for i, (b, fmt) in enumerate(zip(t.blocks, t.experts.formats)):
            rows = blob[i * 8:(i + 1) * 8]
            gate = np.asarray(tensors[f"blk.{b}.ffn_gate_exps.weight"].data).view(np.uint8).reshape(8, -1)
            down = np.asarray(tensors[f"blk.{b}.ffn_down_exps.weight"].data).view(np.uint8).reshape(8, -1)
            assert np.array_equal(rows[:, :gate.shape[1]], gate), (arch, b)
            assert np.array_equal(rows[:, fmt.down_offset:fmt.bias_offset], down), (arch, b)


@pytest.mark.parametrize("arch", ["qwen3moe", "llama", "gpt-oss", "olmoe"])
def test_the_numpy_grouped_ffn_over_file_bytes_matches_the_float64_reference(gguf_files, arch):
    pool = read_moe_tensors(gguf_files[arch]).experts
    x = np.random.default_rng(1).standard_normal((37, 256)).astype(np.float32)
    offsets, slots = np.array([0, 10, 10, 29, 37]), np.array([8, 9, 12, 15])
    for layer in range(len(pool.formats)):
        lp = pool.for_layer(layer)
        base = layer * 8
        y = ref.moe_grouped_ffn(x, offsets, slots + base - 8, lp)
        want = r64.moe_grouped_ffn(x, offsets, slots + base - 8, lp)
        assert r64.relative_error(y, want) <= F32_BOUND, (arch, layer)


def test_a_changed_byte_of_a_slot_changes_its_output(gguf_files):
    lp = read_moe_tensors(gguf_files["gpt-oss"]).experts.for_layer(0)
    x = np.random.default_rng(2).standard_normal((5, 256)).astype(np.float32)
    base = ref.moe_grouped_ffn(x, np.array([0, 5]), np.array([3]), lp)
    fmt = lp.fmt
    for at in (5, fmt.down_offset + 7, fmt.bias_offset + 2 * fmt.ffn * 4 + 1):  # gate quants, down quants, down bias
        blob = lp.arrays["blob"].copy()
        blob[3, at] ^= 0x40
        y = ref.moe_grouped_ffn(x, np.array([0, 5]), np.array([3]), lp.with_arrays({"blob": blob}))
        assert not np.array_equal(y, base), at


def test_a_pool_with_per_layer_formats_hands_kernels_one_format():
    fa, fb = ExpertFormat("q4_k", "q4_k", 256, 256), ExpertFormat("q4_k", "q6_k", 256, 256)
    pool = ExpertPool("gguf", {"blob": np.zeros((4, fb.nbytes), np.uint8)}, (fa, fb))
    assert ExpertPool.slot_bytes("gguf", 256, 256, (fa, fb)) == fb.nbytes > fa.nbytes
    with pytest.raises(ValueError, match="for_layer"):
        pool.fmt
    assert pool.for_layer(0).fmt == fa and pool.for_layer(1).fmt == fb
    assert pool.for_layer(1).arrays["blob"] is pool.arrays["blob"]


@pytest.mark.parametrize("backend", ["opencl"])  # sycl builds the same program (tests/quant/test_quant_run.py)
def test_moe_cl_computes_gguf_pools_from_their_bytes(gguf_files, backend):
    from types import SimpleNamespace
    if importlib.util.find_spec({"opencl": "pyopencl", "sycl": "dpctl"}[backend]) is None:
        pytest.skip(f"the {backend} backend's vendor library is not installed")
    if backend == "sycl":
        from strata_sycl.backend import BACKEND
    else:
        from strata_opencl.backend import BACKEND
    probe = BACKEND.probe()
    assert probe.available, probe.reason
    session = probe.devices[0].open(SimpleNamespace(pinned=SimpleNamespace(limit_bytes=64 << 20,
                                                                            floor_bytes=8 << 20)))
    try:
        x = np.random.default_rng(3).standard_normal((40, 256)).astype(np.float32)
        offsets, slots = np.array([0, 17, 17, 30, 40], np.int32), np.array([11, 9, 12, 15], np.int32)
        archs = ("qwen3moe", "llama", "gpt-oss", "olmoe") if backend == "opencl" else ("qwen3moe", "gpt-oss")
        for arch in archs:
            pool = read_moe_tensors(gguf_files[arch]).experts.for_layer(1)
            dev = pool.with_arrays({"blob": session.memory.to_device(pool.arrays["blob"])})
            y = np.asarray(session.memory.download(session.kernels.moe_grouped_ffn(x, offsets, slots, dev)))
            want = r64.moe_grouped_ffn(x, offsets, slots, pool)
            assert r64.relative_error(y, want) <= F32_BOUND, arch
    finally:
        session.close()


def test_the_float64_moe_layer_is_each_tokens_weighted_experts(gguf_files):
    """r64.moe_layer (the GPU quant tests' reference) against each token's top k summed one by one through
    moe_grouped_ffn, and r64.topk_margin against a hand-made gap."""
    pool = read_moe_tensors(gguf_files["qwen3moe"]).experts
    lp = pool.for_layer(1)
    e_n = int(lp.arrays["blob"].shape[0]) // len(pool.formats)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, lp.fmt.hidden)).astype(np.float32)
    logits = rng.standard_normal((5, e_n)).astype(np.float32)
    slot_of = e_n + rng.permutation(e_n)  # layer 1's own slots
    got = r64.moe_layer(x, logits, lp, slot_of, 2)
    ids, w = r64.route_topk(logits, 2)
    for t in range(5):
        ys = r64.moe_grouped_ffn(np.repeat(x[t:t + 1], 2, 0), np.arange(3), slot_of[ids[t]], lp)
        assert np.allclose(got[t], (w[t][:, None] * ys).sum(0), rtol=1e-12, atol=1e-12), t
    assert r64.topk_margin(np.array([[3.0, 1.0, 2.5, 0.0], [0.0, 5.0, 4.0, 4.5]]), 2) == 0.5  # 4.5 - 4 (row 2)
