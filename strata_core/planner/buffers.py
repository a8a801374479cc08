"""The prompt path's per-token buffer formula, in its two parts, so the runtime sizes buffers as the plan counts them.

`models.spec.prompt_bytes_for` is the total the planner plans with; the runtime carves a chunk's buffers from its
loan in these two parts (per token, then per routed row): one formula, called from both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata_core.models.presets import quant_types
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



def uses_dequant_scratch(model) -> bool:
    """Whether a model's experts are computed through the f16 scratch: a 'gguf' pool (a BF16 file's too), or where
    the pool is not named, a quant in SCRATCH_QUANTS or a mix of them (Q4_K_M, Q5_K_M)."""
    pool = str(getattr(model, "expert_pool", "") or "")
    if pool:
        return pool == "gguf"
    return bool(quant_types(str(getattr(model, "quant", ""))) & SCRATCH_QUANTS)


#: Bytes of one f16 weight.
F16_BYTES = 2
#: Most whole experts a half of the scratch holds (more is an f16 copy of most of a layer, for little gain).
SCRATCH_GROUP_EXPERTS = 32
#: Row granularity of a gate/up piece and column granularity of a down piece (32-weight chunks; 256 where the
#: piece is at least that wide, whole K-quant super-blocks).
PIECE_ROWS, PIECE_COLS, PIECE_COLS_WIDE = 32, 32, 256


def f16_expert_bytes(hidden: int, expert_ffn: int) -> int:
    """Bytes of one expert's gate, up and down matrices in f16."""
    return 3 * int(hidden) * int(expert_ffn) * F16_BYTES


@dataclass(frozen=True)
class ScratchLayout:
    """How a prefill uses a dequantization scratch budget: groups of whole experts in two halves, or pieces of one."""

    #: whole experts a half holds (two halves in turn); 0: pieces of one expert, one at a time in the whole buffer
    group_experts: int
    #: gate (and as many up) output rows a gate/up piece dequantizes (ffn: the whole matrix)
    gate_up_rows: int
    #: K columns of down a piece dequantizes (ffn: the whole matrix)
    down_cols: int
    #: bytes of the budget the layout uses (the prefill's "scratch" buffer, the plan's line)
    nbytes: int


def scratch_layout(hidden: int, ffn: int, experts: int, budget_bytes: int,
                   most_experts: int = SCRATCH_GROUP_EXPERTS) -> ScratchLayout:
    """The layout of a scratch of at most budget_bytes for experts of this shape (ValueError when the budget
    cannot hold even a piece: a 32-row gate/up piece and a 32-column down piece)."""
    h, f = int(hidden), int(ffn)
    per = f16_expert_bytes(h, f)
    g = min(int(experts), int(most_experts), int(budget_bytes) // 2 // per)
    if g >= 1:
        return ScratchLayout(g, f, f, 2 * g * per)
    rows = min(f, int(budget_bytes) // (2 * F16_BYTES * h) // PIECE_ROWS * PIECE_ROWS)  # gate rows, as many up rows
    cols = int(budget_bytes) // (F16_BYTES * h)
    cols = min(f, cols // PIECE_COLS_WIDE * PIECE_COLS_WIDE if cols >= PIECE_COLS_WIDE else
               cols // PIECE_COLS * PIECE_COLS)
    if rows <= 0 or cols <= 0:
        raise ValueError(f"a dequantization scratch of {budget_bytes} bytes cannot hold a piece of an expert at hidden "
                         f"{h}: at least {F16_BYTES * h * max(2 * PIECE_ROWS, PIECE_COLS)} bytes")
    return ScratchLayout(0, rows, cols, max(2 * F16_BYTES * rows * h, F16_BYTES * h * cols))


def dequant_scratch_bytes(model, defaults) -> int:
    """Device bytes of a prefill's dequantization scratch, a part of the workspace line: for models whose experts
    use it (uses_dequant_scratch), what scratch_layout takes of the backend's budget (the budget itself where the expert
    shape is unknown or the budget holds no piece); else 0."""
    budget = int(getattr(defaults, "dequant_scratch_bytes", 0) or 0)
    if budget <= 0 or not uses_dequant_scratch(model):
        return 0
    if model.hidden <= 0 or model.expert_ffn <= 0:
        return budget
    try:
        return scratch_layout(model.hidden, model.expert_ffn, model.experts_per_layer, budget).nbytes
    except ValueError:
        return budget


def weight_copies_bytes(model, defaults) -> int:
    """Host bytes of the f32 copies a backend's kernels keep of read-only dense weights they multiply: each router
    [experts, hidden] and the LM head [vocab, hidden] as f32, those whose copy is within the backend's
    `kernel_f32_copy_limit_bytes` (an upper bound: a weight already in f32 is not copied); 0 without such a limit."""
    limit = int(getattr(defaults, "kernel_f32_copy_limit_bytes", 0) or 0)
    if limit <= 0:
        return 0
    router = model.experts_per_layer * model.hidden * F32_BYTES
    head = model.vocab * model.hidden * F32_BYTES
    return model.moe_layers * (router if router <= limit else 0) + (head if head <= limit else 0)
