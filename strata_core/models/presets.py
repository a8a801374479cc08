"""Presets of public MoE models: their published shapes, and the byte math that turns a shape and a quant into a ModelSpec.

Every shape number below comes from the model's published `config.json` on the Hugging Face hub (the URL is in
each preset). Byte sizes follow ggml's block structs (ggml-common.h): a quant type stores `block_weights` weights
in `block_bytes` bytes, and a matrix row must be a whole number of blocks.

Approximations, in one place so the planner's consumers know what they get:
- expert blobs are exact for the stated quant, including llama.cpp's fallback for rows that are not a whole
  number of 256-weight super-blocks (see `ROW_FALLBACK`);
- dense bytes (attention, embeddings, LM head, shared experts, dense FFN layers) store matrices at the expert
  quant, but never below Q4_K's rate, because llama.cpp's quant mixes keep attention and output tensors at higher
  precision in low-bit files; norms, biases and routers are f32. A real file differs by its quant mix (read it
  with `strata plan --model FILE.gguf` for the exact figure);
- KV bytes per token are counted at f16 (`strata_core.models.spec.kv_bytes_per_token` scales them to the KV dtype).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from strata_core.errors import BadInput
from strata_core.models.spec import F32_BYTES, ModelSpec, prompt_bytes_for


@dataclass(frozen=True)
class QuantType:
    """A GGUF tensor type: `block_bytes` bytes store `block_weights` weights."""

    name: str
    block_weights: int
    block_bytes: int

    def row_bytes(self, row_weights: int) -> int:
        """Bytes of one row of `row_weights` weights; the row must be a whole number of blocks."""
        if row_weights % self.block_weights:
            raise ValueError(f"{self.name}: a row of {row_weights} weights is not a whole number of "
                             f"{self.block_weights}-weight blocks")
        return row_weights // self.block_weights * self.block_bytes


#: ggml's block structs (ggml-common.h), as sizeof(block) over the weights it holds; QK_K = 256.
QUANTS: dict[str, QuantType] = {q.name: q for q in (
    QuantType("F32", 1, 4),
    QuantType("F16", 1, 2),            # ggml_half
    QuantType("BF16", 1, 2),           # ggml_bf16_t
    QuantType("Q8_0", 32, 34),         # block_q8_0: half d; int8 qs[32]
    QuantType("Q5_1", 32, 24),         # block_q5_1: half d, m; uint8 qh[4]; uint8 qs[16]
    QuantType("Q5_0", 32, 22),         # block_q5_0: half d; uint8 qh[4]; uint8 qs[16]
    QuantType("Q4_0", 32, 18),         # block_q4_0: half d; uint8 qs[16]
    QuantType("IQ4_NL", 32, 18),       # block_iq4_nl: half d; uint8 qs[16]
    QuantType("MXFP4", 32, 17),        # block_mxfp4: uint8 e; uint8 qs[16]
    QuantType("Q6_K", 256, 210),       # block_q6_K: uint8 ql[128], qh[64]; int8 scales[16]; half d
    QuantType("Q5_K", 256, 176),       # block_q5_K: half d, dmin; uint8 scales[12]; uint8 qh[32], qs[128]
    QuantType("Q4_K", 256, 144),       # block_q4_K: half d, dmin; uint8 scales[12]; uint8 qs[128]
    QuantType("Q2_K", 256, 84),        # block_q2_K: uint8 scales[16]; uint8 qs[64]; half d, dmin
    QuantType("IQ2_XS", 256, 74),      # block_iq2_xs: half d; uint16 qs[32]; uint8 scales[8]
    QuantType("IQ3_XXS", 256, 98),     # block_iq3_xxs: half d; uint8 qs[96]
    QuantType("IQ3_S", 256, 110),      # block_iq3_s: half d; uint8 qs[64], qh[8], signs[32], scales[4]
)}

#: The quant types a preset may be asked for (the others above only serve fallbacks and GGUF reading); a name of
#: MIXES stands for its mix.
PRESET_QUANTS = ("F16", "BF16", "Q8_0", "Q4_K", "Q4_K_M", "Q5_K", "Q5_K_M", "Q6_K", "Q2_K", "IQ2_XS", "IQ3_XXS",
                 "IQ3_S", "MXFP4")

#: llama.cpp's _M mixes (llama-quant.cpp) of an expert: (gate and up type, ffn_down type of the layers
#: use_more_bits picks, ffn_down type of the others).
MIXES = {"Q4_K_M": ("Q4_K", "Q6_K", "Q4_K"), "Q5_K_M": ("Q5_K", "Q6_K", "Q5_K")}

#: llama.cpp's quantizer (llama-quant.cpp) gives a tensor whose rows are not a whole number of 256-weight
#: super-blocks this 32-weight type instead; DeepSeek-V2-Lite's 1408-wide down rows and gpt-oss's 2880-wide rows hit it.
ROW_FALLBACK = {"Q2_K": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL",
                "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits(i, n): the first and the last eighth of the layers, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def quant_types(quant: str) -> frozenset[str]:
    """The expert types a quant name stores: a mix's types (Q4_K_M: Q4_K and Q6_K), else the quant itself."""
    q = str(quant).upper()
    return frozenset(MIXES.get(q, (q,)))


def expert_types(quant: str, layer: int, layers: int) -> tuple[str, str]:
    """(gate and up type, down type) of one MoE layer's experts at a preset quant (a mix's per-layer choice)."""
    if quant in MIXES:
        gate_up, more, other = MIXES[quant]
        return gate_up, more if use_more_bits(layer, layers) else other
    return quant, quant

#: The dense tensors of a preset are stored at no less than this rate (see the module docstring).
DENSE_FLOOR_QUANT = "Q4_K"


def matrix_bytes(quant: str, rows: int, row_weights: int) -> int:
    """Bytes of a rows x row_weights matrix at `quant`, with llama.cpp's fallback for rows of the wrong length."""
    q = QUANTS[quant]
    if row_weights % q.block_weights:
        fallback = QUANTS.get(ROW_FALLBACK.get(quant, ""), QUANTS["F16"])
        q = fallback if row_weights % fallback.block_weights == 0 else QUANTS["F16"]
    return rows * q.row_bytes(row_weights)


@dataclass(frozen=True)
class PresetConfig:
    """A public MoE model's shape as its config.json gives it (fields named after the usual config keys)."""

    name: str
    config_url: str
    layers: int                     # num_hidden_layers
    moe_layers: int                 # layers whose FFN is routed experts
    experts: int                    # routed experts per MoE layer
    top_k: int                      # experts each token is routed to
    hidden: int                     # hidden_size
    expert_ffn: int                 # one routed expert's FFN width
    vocab: int                      # vocab_size
    heads: int                      # num_attention_heads
    kv_heads: int                   # num_key_value_heads
    head_dim: int
    default_quant: str = "Q4_K"
    tied_embeddings: bool = False   # tie_word_embeddings
    dense_ffn: int = 0              # FFN width of the layers that are not MoE
    shared_ffn: int = 0             # total FFN width of the shared experts of one MoE layer (counted as dense)
    attn_params_per_layer: int = 0  # attention weights of one layer when not plain GQA (0: from heads)
    kv_values_per_token_layer: int = 0  # KV values one layer caches per token (0: 2 x kv_heads x head_dim)
    kv_layers: int = 0              # layers whose KV grows with the context (0: all)
    sliding_window_tokens: int = 0  # the other layers keep this many tokens of KV
    f32_params_per_layer: int = 0   # norms, biases and sinks of one layer (f32)
    expert_bias_values: int = 0     # f32 biases of one expert (gate, up and down)

    @property
    def attention_params(self) -> int:
        """Attention weights of one layer: q and o (hidden x heads x head_dim), k and v (hidden x kv_heads x head_dim)."""
        if self.attn_params_per_layer:
            return self.attn_params_per_layer
        return 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def kv_values_per_layer(self) -> int:
        """KV values one layer caches per token."""
        return self.kv_values_per_token_layer or 2 * self.kv_heads * self.head_dim


PRESETS: tuple[PresetConfig, ...] = (
    PresetConfig(
        name="Qwen3-30B-A3B", config_url="https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json",
        # num_hidden_layers 48, decoder_sparse_step 1 and mlp_only_layers [] (every layer MoE), num_experts 128,
        # num_experts_per_tok 8, hidden_size 2048, moe_intermediate_size 768, vocab_size 151936,
        # num_attention_heads 32, num_key_value_heads 4, head_dim 128, tie_word_embeddings false
        layers=48, moe_layers=48, experts=128, top_k=8, hidden=2048, expert_ffn=768, vocab=151936,
        heads=32, kv_heads=4, head_dim=128,
        f32_params_per_layer=2 * 2048 + 2 * 128,  # attn_norm, ffn_norm, q_norm, k_norm
    ),
    PresetConfig(
        name="Qwen3-235B-A22B", config_url="https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json",
        # num_hidden_layers 94 (all MoE), num_experts 128, num_experts_per_tok 8, hidden_size 4096,
        # moe_intermediate_size 1536, vocab_size 151936, num_attention_heads 64, num_key_value_heads 4, head_dim 128
        layers=94, moe_layers=94, experts=128, top_k=8, hidden=4096, expert_ffn=1536, vocab=151936,
        heads=64, kv_heads=4, head_dim=128,
        f32_params_per_layer=2 * 4096 + 2 * 128,
    ),
    PresetConfig(
        name="Mixtral-8x7B", config_url="https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json",
        # num_hidden_layers 32 (all MoE), num_local_experts 8, num_experts_per_tok 2, hidden_size 4096,
        # intermediate_size 14336 (each expert), vocab_size 32000, num_attention_heads 32, num_key_value_heads 8,
        # head_dim = hidden_size / num_attention_heads = 128
        layers=32, moe_layers=32, experts=8, top_k=2, hidden=4096, expert_ffn=14336, vocab=32000,
        heads=32, kv_heads=8, head_dim=128,
        f32_params_per_layer=2 * 4096,
    ),
    PresetConfig(
        name="DeepSeek-V2-Lite", config_url="https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json",
        # num_hidden_layers 27, first_k_dense_replace 1 (layer 0 dense, intermediate_size 10944), n_routed_experts 64,
        # num_experts_per_tok 6, hidden_size 2048, moe_intermediate_size 1408, n_shared_experts 2 (2 x 1408, dense),
        # vocab_size 102400, num_attention_heads 16; MLA: q_lora_rank null, kv_lora_rank 512, qk_nope_head_dim 128,
        # qk_rope_head_dim 64, v_head_dim 128
        layers=27, moe_layers=26, experts=64, top_k=6, hidden=2048, expert_ffn=1408, vocab=102400,
        heads=16, kv_heads=16, head_dim=128, dense_ffn=10944, shared_ffn=2 * 1408,
        # q_proj 2048x(16x192) + kv_a_proj_with_mqa 2048x(512+64) + kv_b_proj 512x(16x(128+128)) + o_proj (16x128)x2048
        attn_params_per_layer=2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 16 * 128 * 2048,
        # llama.cpp's MLA cache keeps the compressed latent (512) and the rope key (64) per layer and token
        kv_values_per_token_layer=512 + 64,
        f32_params_per_layer=2 * 2048 + 512,  # attn_norm, ffn_norm, kv_a_layernorm
    ),
    PresetConfig(
        name="gpt-oss-120b", config_url="https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json",
        # num_hidden_layers 36 (all MoE), num_local_experts 128, num_experts_per_tok 4, hidden_size 2880,
        # intermediate_size 2880, vocab_size 201088, num_attention_heads 64, num_key_value_heads 8, head_dim 64;
        # layer_types alternate sliding_attention (sliding_window 128) and full_attention; experts published in MXFP4
        layers=36, moe_layers=36, experts=128, top_k=4, hidden=2880, expert_ffn=2880, vocab=201088,
        heads=64, kv_heads=8, head_dim=64, default_quant="MXFP4",
        kv_layers=18, sliding_window_tokens=128,
        # attn/ffn norms, q/k/v/o biases, 64 attention sinks, the router's 128 biases
        f32_params_per_layer=2 * 2880 + (64 * 64 + 2 * 8 * 64 + 2880) + 64 + 128,
        expert_bias_values=2 * 2880 + 2880,  # gate_up bias (2 x ffn) and down bias (hidden)
    ),
)


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_BY_KEY = {_key(p.name): p for p in PRESETS}


def list_presets() -> tuple[str, ...]:
    """The names of the built-in presets."""
    return tuple(p.name for p in PRESETS)


def find_preset(name: str) -> PresetConfig:
    """The preset of that name (case, dashes and an 'org/' prefix ignored), or BadInput listing the presets."""
    key = _key(name.rsplit("/", 1)[-1])
    if key not in _BY_KEY:
        raise BadInput(f"--model: unknown model '{name}' (presets: {', '.join(list_presets())}; "
                       f"or give a path to a .gguf file)")
    return _BY_KEY[key]


def expert_slot_bytes(p: PresetConfig, quant: str) -> int:
    """One expert's blob: gate and up (expert_ffn rows of hidden), down (hidden rows of expert_ffn), f32 biases; a
    mix's largest layer (a slot holds any layer's expert)."""
    def layer_bytes(gate_up: str, down: str) -> int:
        return 2 * matrix_bytes(gate_up, p.expert_ffn, p.hidden) + matrix_bytes(down, p.hidden, p.expert_ffn)
    blob = max(layer_bytes(*expert_types(quant, i, p.moe_layers)) for i in range(p.moe_layers))
    return blob + p.expert_bias_values * F32_BYTES


def dense_bytes(p: PresetConfig, quant: str) -> int:
    """Non-expert bytes: attention, embeddings and LM head, dense FFN layers and shared experts, f32 small tensors."""
    base = QUANTS[MIXES[quant][0] if quant in MIXES else quant]
    rate = base if _rate(base) >= _rate(QUANTS[DENSE_FLOOR_QUANT]) else QUANTS[DENSE_FLOOR_QUANT]
    matrices = (p.layers * p.attention_params
                + p.vocab * p.hidden * (1 if p.tied_embeddings else 2)
                + (p.layers - p.moe_layers) * 3 * p.hidden * p.dense_ffn
                + p.moe_layers * 3 * p.hidden * p.shared_ffn)
    f32_values = p.layers * p.f32_params_per_layer + p.hidden + p.moe_layers * p.experts * p.hidden  # + routers
    window_layers = p.layers - (p.kv_layers or p.layers)
    # a sliding-window layer's KV does not grow with the context: it is a fixed f16 buffer, counted here
    window_kv = window_layers * p.sliding_window_tokens * p.kv_values_per_layer * 2
    return -(-matrices * rate.block_bytes // rate.block_weights) + f32_values * F32_BYTES + window_kv


def _rate(q: QuantType) -> float:
    return q.block_bytes / q.block_weights


def kv_bytes_per_token_f16(p: PresetConfig) -> int:
    """KV bytes one token of context adds, at f16: the context-growing layers times their KV values times 2 bytes."""
    return (p.kv_layers or p.layers) * p.kv_values_per_layer * 2


def spec_from_preset(p: PresetConfig, quant: str) -> ModelSpec:
    """The ModelSpec of a preset at a quant type."""
    q = quant.upper()
    if q not in PRESET_QUANTS:
        raise BadInput(f"--quant: unknown quant '{quant}' (known: {', '.join(PRESET_QUANTS)})")
    slot = expert_slot_bytes(p, q)
    spec = ModelSpec(
        name=f"{p.name}@{q}", moe_layers=p.moe_layers, experts_per_layer=p.experts, top_k=p.top_k,
        hidden=p.hidden, slot_bytes=slot, largest_blob_bytes=slot,  # every expert of a preset is alike
        prompt_bytes_per_token=prompt_bytes_for(p.hidden, p.experts, p.top_k, p.expert_ffn),
        dense_bytes=dense_bytes(p, q), kv_bytes_per_token=kv_bytes_per_token_f16(p), expert_ffn=p.expert_ffn,
        quant=q, vocab=p.vocab, source="preset",
    )
    spec.validate(spec.name)
    return spec


def model_from_name(name: str, quant: str | None = None) -> ModelSpec:
    """A preset's ModelSpec: 'Qwen3-30B-A3B' (its default quant), 'Qwen3-30B-A3B@IQ3_S', or name plus `quant`."""
    base, _, at_quant = str(name).partition("@")
    if at_quant and quant and at_quant.upper() != quant.upper():
        raise BadInput(f"--model/--quant: '{name}' names quant {at_quant} but --quant says {quant}")
    p = find_preset(base)
    return spec_from_preset(p, quant or at_quant or p.default_quant)
