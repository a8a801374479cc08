"""Presets: ggml block sizes, and the byte math of two models checked against sums worked out by hand."""

import gguf
import pytest

from strata_core.errors import BadInput
from strata_core.models.resolve import list_presets, model_from_name
from strata_core.models.spec import kv_bytes_per_token, prompt_bytes_for
from strata_core.models.presets import PRESET_QUANTS, QUANTS, matrix_bytes


def test_quant_blocks_match_the_gguf_package_table():
    for q in QUANTS.values():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[q.name]] == (q.block_weights, q.block_bytes), q.name


def test_qwen3_30b_a3b_at_q4_k_by_hand():
    s = model_from_name("Qwen3-30B-A3B", "Q4_K")
    assert (s.moe_layers, s.experts_per_layer, s.top_k, s.hidden, s.expert_ffn, s.vocab) == (48, 128, 8, 2048, 768, 151936)
    # gate and up: 768 rows of 2048 weights = 8 Q4_K blocks of 144 bytes; down: 2048 rows of 768 = 3 blocks
    gate = 768 * 8 * 144
    down = 2048 * 3 * 144
    assert s.slot_bytes == 2 * gate + down == 2_654_208
    assert s.largest_blob_bytes == s.slot_bytes
    # 48 layers x 4 KV heads x 128 dims x (K and V) x 2 bytes
    assert s.kv_bytes_per_token == 98_304
    # attention per layer: q and o 2048 x 4096, k and v 2048 x 512; untied embeddings and LM head 151936 x 2048
    matrices = 48 * (2 * 2048 * 4096 + 2 * 2048 * 512) + 2 * 151936 * 2048
    # norms (attn, ffn, q, k) per layer, the output norm, the routers 128 x 2048 per layer, all f32
    f32_values = 48 * (2 * 2048 + 2 * 128) + 2048 + 48 * 128 * 2048
    assert s.dense_bytes == matrices * 144 // 256 + 4 * f32_values
    # 4 activations + router logits and top-8 pairs + 8 routed rows (in, out, gate, up)
    assert s.prompt_bytes_per_token == 4 * 2048 * 4 + 128 * 4 + 8 * 8 + 8 * (2 * 2048 + 2 * 768) * 4


def test_mixtral_at_q8_0_by_hand():
    s = model_from_name("mixtral-8x7b@q8_0")
    assert (s.moe_layers, s.experts_per_layer, s.top_k, s.hidden, s.expert_ffn) == (32, 8, 2, 4096, 14336)
    # every row is a whole number of 32-weight blocks of 34 bytes: 3 x 14336 x 4096 weights x 34/32
    assert s.slot_bytes == 3 * 14336 * 4096 // 32 * 34 == 187_170_816
    assert s.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2
    matrices = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024) + 2 * 32000 * 4096
    f32_values = 32 * 2 * 4096 + 4096 + 32 * 8 * 4096
    assert s.dense_bytes == -(-matrices * 34 // 32) + 4 * f32_values


def test_rows_that_are_not_whole_super_blocks_fall_back_like_llama_cpp():
    # DeepSeek-V2-Lite's down rows are 1408 weights: 5.5 Q4_K super-blocks, so llama.cpp stores them as Q5_0
    s = model_from_name("DeepSeek-V2-Lite", "Q4_K")
    assert s.slot_bytes == 2 * 1408 * (2048 // 256) * 144 + 2048 * (1408 // 32) * 22
    assert matrix_bytes("IQ3_S", 1, 1408) == 1408 // 32 * 18  # IQ4_NL
    assert s.moe_layers == 26 and s.experts_per_layer == 64 and s.top_k == 6


def test_every_preset_at_every_quant_is_a_valid_spec_and_smaller_quants_are_smaller():
    order = ["F16", "Q8_0", "Q4_K", "IQ3_S", "IQ3_XXS", "Q2_K", "IQ2_XS"]
    for name in list_presets():
        for q in PRESET_QUANTS:
            s = model_from_name(name, q)
            assert s.slot_bytes > 0 and s.dense_bytes > 0 and s.prompt_bytes_per_token > 0
        if name.startswith("Qwen3"):  # rows are whole super-blocks, so no fallback blurs the order
            sizes = [model_from_name(name, q).slot_bytes for q in order]
            assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    assert {"Qwen3-30B-A3B", "Qwen3-235B-A22B", "Mixtral-8x7B", "DeepSeek-V2-Lite", "gpt-oss-120b"} <= set(list_presets())


def test_gpt_oss_counts_only_full_attention_layers_per_token_and_expert_biases():
    s = model_from_name("gpt-oss-120b")
    assert s.quant == "MXFP4"
    assert s.kv_bytes_per_token == 18 * 8 * 64 * 2 * 2
    assert s.slot_bytes == 3 * 2880 * 2880 // 32 * 17 + (3 * 2880) * 4


def test_kv_dtype_scales_the_f16_figure():
    s = model_from_name("Qwen3-30B-A3B")
    assert kv_bytes_per_token(s, "f16") == s.kv_bytes_per_token
    assert kv_bytes_per_token(s, "f32") == 2 * s.kv_bytes_per_token
    assert kv_bytes_per_token(s, "int8") == s.kv_bytes_per_token // 2
    assert kv_bytes_per_token(s, "q8_0") == s.kv_bytes_per_token // 64 * 34
    with pytest.raises(BadInput, match="kv.dtype"):
        kv_bytes_per_token(s, "fp4")


def test_prompt_bytes_grow_with_each_term():
    base = prompt_bytes_for(1024, 64, 4, 512)
    assert prompt_bytes_for(2048, 64, 4, 512) > base
    assert prompt_bytes_for(1024, 128, 4, 512) > base
    assert prompt_bytes_for(1024, 64, 8, 512) > base
    assert prompt_bytes_for(1024, 64, 4, 1024) > base


@pytest.mark.parametrize("name,quant,needle", [
    ("Llama-3-8B", None, "unknown model"),
    ("Qwen3-30B-A3B", "Q3_K_M", "unknown quant"),
    ("Qwen3-30B-A3B@Q4_K", "Q8_0", "--quant"),
])
def test_bad_names_and_quants_are_bad_input(name, quant, needle):
    with pytest.raises(BadInput, match=needle):
        model_from_name(name, quant)


def test_names_ignore_case_dashes_and_org():
    a = model_from_name("Qwen/qwen3_30b_a3b", "iq3_s")
    assert a == model_from_name("Qwen3-30B-A3B@IQ3_S")
    assert a.quant == "IQ3_S" and a.source == "preset"
