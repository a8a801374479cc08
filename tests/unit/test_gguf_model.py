"""GGUF: write a tiny MoE file, read its ModelSpec and weights back, and refuse files that are not MoE GGUFs."""

import gguf
import numpy as np
import pytest

from strata_core.errors import BadInput
from strata_core.models.gguf import load_gguf_weights, model_from_gguf, read_moe_tensors, write_tiny_moe_gguf
from strata_core.reference.kernels import ExpertPool, dequantize_q8_0, moe_grouped_ffn, relative_error
from strata_core.models.resolve import resolve_model

SHAPE = dict(layers=3, experts=6, top_k=2, hidden=64, ffn=96, vocab=50)


@pytest.mark.parametrize("dtype,bytes_per_weight", [("F16", 2.0), ("BF16", 2.0), ("Q8_0", 34 / 32)])
def test_round_trip_counts_and_exact_bytes(tmp_path, dtype, bytes_per_weight):
    p = write_tiny_moe_gguf(tmp_path / "m.gguf", dtype=dtype, seed=3, **SHAPE)
    s = model_from_gguf(p)
    assert (s.moe_layers, s.experts_per_layer, s.top_k, s.hidden, s.expert_ffn, s.vocab) == (3, 6, 2, 64, 96, 50)
    assert s.quant == dtype
    assert s.slot_bytes == s.largest_blob_bytes == int(3 * 64 * 96 * bytes_per_weight)
    # token_embd and output at the file's type; norms and routers f32
    typed = int(2 * 50 * 64 * bytes_per_weight)
    f32 = 4 * (3 * (2 * 64 + 6 * 64) + 64)
    assert s.dense_bytes == typed + f32
    assert s.source == f"gguf:{p}"
    assert resolve_model(str(p)) == s


def test_weights_come_back_in_numpy_order_and_deterministic(tmp_path):
    a = load_gguf_weights(write_tiny_moe_gguf(tmp_path / "a.gguf", seed=7, **SHAPE))
    b = load_gguf_weights(write_tiny_moe_gguf(tmp_path / "b.gguf", seed=7, **SHAPE))
    c = load_gguf_weights(write_tiny_moe_gguf(tmp_path / "c.gguf", seed=8, **SHAPE))
    assert a["token_embd.weight"].shape == (50, 64)
    assert a["blk.2.ffn_gate_inp.weight"].shape == (6, 64) and a["blk.2.ffn_gate_inp.weight"].dtype == np.float32
    assert a["blk.0.ffn_gate_exps.weight"].shape == (6, 96, 64)
    assert a["blk.0.ffn_down_exps.weight"].shape == (6, 64, 96)
    assert a["blk.0.ffn_down_exps.weight"].dtype == np.float16
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["blk.1.ffn_up_exps.weight"], c["blk.1.ffn_up_exps.weight"])


def test_q8_0_and_bf16_carry_the_same_weights_as_f16(tmp_path):
    f16 = load_gguf_weights(write_tiny_moe_gguf(tmp_path / "f.gguf", dtype="F16", seed=5, **SHAPE))
    q8 = load_gguf_weights(write_tiny_moe_gguf(tmp_path / "q.gguf", dtype="Q8_0", seed=5, **SHAPE))
    bf = load_gguf_weights(write_tiny_moe_gguf(tmp_path / "b.gguf", dtype="BF16", seed=5, **SHAPE))
    qs, d = q8["blk.1.ffn_down_exps.weight"]
    assert qs.dtype == np.int8 and qs.shape == (6, 64, 96) and d.dtype == np.float16 and d.shape == (6, 64, 3)
    ref = f16["blk.1.ffn_down_exps.weight"]
    assert relative_error(dequantize_q8_0(qs, d), ref) < 1e-2
    assert bf["blk.1.ffn_down_exps.weight"].dtype == np.float32
    assert relative_error(bf["blk.1.ffn_down_exps.weight"], ref) < 1e-2


def test_q8_0_layout_matches_the_gguf_package_dequantizer(tmp_path):
    p = write_tiny_moe_gguf(tmp_path / "q.gguf", dtype="Q8_0", seed=2, **SHAPE)
    t = next(t for t in gguf.GGUFReader(p).tensors if t.name == "blk.0.ffn_gate_exps.weight")
    theirs = gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(6, 96, 64)
    qs, d = load_gguf_weights(p)["blk.0.ffn_gate_exps.weight"]
    np.testing.assert_allclose(dequantize_q8_0(qs, d).astype(np.float32), theirs, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", ["F16", "Q8_0"])
def test_layer_pool_runs_the_reference_experts(tmp_path, dtype):
    p = write_tiny_moe_gguf(tmp_path / "m.gguf", dtype=dtype, seed=1, **SHAPE)
    w = load_gguf_weights(p)
    pool = read_moe_tensors(p).experts
    assert pool.dtype == dtype.lower() and pool.slots == 3 * 6
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    y = moe_grouped_ffn(x, np.array([0, 4]), np.array([6 + 5]), pool)
    gate, up, down = (w[f"blk.1.ffn_{k}_exps.weight"] for k in ("gate", "up", "down"))
    if dtype == "Q8_0":  # the oracle computes q * d exactly, not rounded to f16 as dequantize_q8_0 returns it
        gate, up, down = (np.repeat(d.astype(np.float32), 32, axis=-1) * q for q, d in (gate, up, down))
    g, u = x @ gate[5].astype(np.float32).T, x @ up[5].astype(np.float32).T
    expect = (g / (1 + np.exp(-g)) * u) @ down[5].astype(np.float32).T
    assert relative_error(y, expect) < 1e-5


def test_largest_blob_is_the_max_over_layers(tmp_path):
    p = tmp_path / "mixed.gguf"
    w = gguf.GGUFWriter(p, "qwen3moe")
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_embedding_length(32)
    w.add_tensor("token_embd.weight", np.zeros((10, 32), np.float16))
    w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4, 64, 32), np.float16))  # 4096 bytes an expert
    w.add_tensor("blk.1.ffn_gate_exps.weight", np.zeros((4, 64, 32), np.float32))  # 8192 bytes an expert
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    s = model_from_gguf(p)
    assert s.largest_blob_bytes == 64 * 32 * 4
    assert s.slot_bytes == (64 * 32 * 2 + 64 * 32 * 4) // 2
    assert s.expert_ffn == 64 and s.dense_bytes == 10 * 32 * 2


def _dense_only(path, with_expert_count):
    w = gguf.GGUFWriter(path, "llama")
    w.add_embedding_length(32)
    if with_expert_count:
        w.add_expert_count(4)
        w.add_expert_used_count(2)
    w.add_tensor("token_embd.weight", np.zeros((10, 32), np.float16))
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((64, 32), np.float16))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def test_dense_models_are_refused_naming_what_is_missing(tmp_path):
    with pytest.raises(BadInput, match="not an MoE model: no 'llama.expert_count'"):
        model_from_gguf(_dense_only(tmp_path / "a.gguf", False))
    with pytest.raises(BadInput, match="no expert tensors"):
        model_from_gguf(_dense_only(tmp_path / "b.gguf", True))


def test_wrong_magic_and_truncation_are_bad_input(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(BadInput, match="not a GGUF file"):
        model_from_gguf(bad)
    good = write_tiny_moe_gguf(tmp_path / "m.gguf", **SHAPE).read_bytes()
    for cut in (len(good) - 100, len(good) // 2, 40, 10):
        t = tmp_path / f"cut{cut}.gguf"
        t.write_bytes(good[:cut])
        with pytest.raises(BadInput, match="truncated|corrupt"):
            model_from_gguf(t)
        with pytest.raises(BadInput):
            load_gguf_weights(t)
    with pytest.raises(BadInput, match="cannot read"):
        model_from_gguf(tmp_path / "missing.gguf")


def test_tiny_writer_refuses_bad_shapes(tmp_path):
    with pytest.raises(BadInput, match="Q8_0"):
        write_tiny_moe_gguf(tmp_path / "x.gguf", dtype="Q8_0", hidden=40, ffn=96)
    with pytest.raises(BadInput, match="dtype"):
        write_tiny_moe_gguf(tmp_path / "x.gguf", dtype="Q4_K")
    with pytest.raises(BadInput, match="top_k"):
        write_tiny_moe_gguf(tmp_path / "x.gguf", experts=2, top_k=3)
