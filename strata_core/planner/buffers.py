"""The prompt path's per-token buffer formula, in its two parts, so the runtime sizes buffers as the plan counts them.

`models.spec.prompt_bytes_for` is the total the planner plans with; the runtime carves a chunk's buffers from its
loan in these two parts (per token, then per routed row): one formula, called from both sides.
"""

from __future__ import annotations

from strata_core.models.spec import ACTIVATION_BUFFERS, F32_BYTES

#: A routed row's token index (int32) and routing weight (f32).
ROUTE_ENTRY_BYTES = 4 + F32_BYTES


def token_buffer_bytes(hidden: int, experts: int, top_k: int) -> int:
    """Per token of chunk: the hidden-sized f32 activations, the router's f32 logits and the top-k (id, weight) pairs."""
    return ACTIVATION_BUFFERS * hidden * F32_BYTES + experts * F32_BYTES + top_k * ROUTE_ENTRY_BYTES


def routed_row_bytes(hidden: int, expert_ffn: int) -> int:
    """Per routed row: the gathered input and the expert's output (hidden f32 each), the gate and up intermediates."""
    return (2 * hidden + 2 * expert_ffn) * F32_BYTES


def prompt_bytes_per_token(hidden: int, experts: int, top_k: int, expert_ffn: int) -> int:
    """Device bytes a token of chunk needs: its own buffers and its top_k routed rows (= models.spec.prompt_bytes_for)."""
    return token_buffer_bytes(hidden, experts, top_k) + top_k * routed_row_bytes(hidden, expert_ffn)


def chunk_buffer_bytes(chunk_tokens: int, hidden: int, experts: int, top_k: int, expert_ffn: int) -> int:
    """Device bytes of a chunk's prompt buffers."""
    return int(chunk_tokens) * prompt_bytes_per_token(hidden, experts, top_k, expert_ffn)


#: Expert quant types a 'gguf' pool keeps in the file's own bytes and a backend may compute through f16
#: dequantization scratch (PlatformDefaults.dequant_scratch_bytes); F16, BF16 and Q8_0 need none of it here.
SCRATCH_QUANTS = frozenset({"Q4_K", "Q5_K", "Q6_K", "MXFP4"})

#: Bytes of one f16 weight.
F16_BYTES = 2


def f16_expert_bytes(hidden: int, expert_ffn: int) -> int:
    """Bytes of one expert's gate, up and down matrices in f16."""
    return 3 * int(hidden) * int(expert_ffn) * F16_BYTES


def dequant_scratch_bytes(model, defaults) -> int:
    """Device bytes of a prefill's dequantization scratch, a part of the workspace line: the backend's budget for
    models whose experts are in SCRATCH_QUANTS, no more than two groups of every expert of a layer take; else 0."""
    budget = int(getattr(defaults, "dequant_scratch_bytes", 0) or 0)
    if budget <= 0 or str(getattr(model, "quant", "")).upper() not in SCRATCH_QUANTS:
        return 0
    per = f16_expert_bytes(model.hidden, model.expert_ffn)
    return min(budget, 2 * int(model.experts_per_layer) * per) if per > 0 else budget
