"""The kit's expected values: every kernel of the contract computed in float64 from the same inputs.

The numpy oracle (`strata_core.reference.kernels`) is an f32 implementation under test like any backend; the kit
and `strata run --check` compare against these float64 values instead, so the oracle is never its own judge.
Quantized weights are dequantized exactly: Q8_0 as q * d in float64; the rows of a 'gguf' pool (K formats, MXFP4,
bf16) by `strata_core.reference.quants.dequantize`, ggml's own f32 formula (bit-exact with gguf-py), then held in
float64, so the products and sums after it carry no rounding. Integer results (top-k ids, gathered rows) are the
same as the oracle's by definition of the contract (ties to the lower id).
"""

from __future__ import annotations

import numpy as np

from strata_core.api.kernels import QK8_0, ExpertPool
from strata_core.reference import quants

F64 = np.float64


def dequantize_q8_0_exact(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q8_0 (qs [.., C] int8, d [.., C/32] f16) -> [.., C] float64 q * d, not rounded."""
    b = np.asarray(qs).reshape(*qs.shape[:-1], qs.shape[-1] // QK8_0, QK8_0).astype(F64)
    return (b * np.asarray(d).astype(F64)[..., None]).reshape(qs.shape)


def dequantize_q8_0(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The contract's dequantize_q8_0 result: the exact q * d rounded once to f16 (round to nearest even)."""
    return dequantize_q8_0_exact(qs, d).astype(np.float16)


def route_topk(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [T,k] int32 by descending logit, ties to the lower id; softmax weights over them in float64)."""
    logits = np.asarray(logits)
    order = np.argsort(-logits.astype(F64), axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(logits.astype(F64), order, axis=1)
    e = np.exp(top - top[:, :1])
    return order.astype(np.int32), e / e.sum(axis=1, keepdims=True)


def gather(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """x[rows], in x's own dtype (a copy: exact)."""
    return np.ascontiguousarray(np.asarray(x)[np.asarray(rows, dtype=np.int64)])


def scatter_add(out: np.ndarray, rows: np.ndarray, y: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """out + sum_i scale[i] * y[i] at rows[i], in float64 (a new array)."""
    acc = np.asarray(out, dtype=F64).copy()
    np.add.at(acc, np.asarray(rows, dtype=np.int64), np.asarray(y, dtype=F64) * np.asarray(scale, dtype=F64)[:, None])
    return acc


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x / rms(x) * w in float64."""
    x = np.asarray(x, dtype=F64)
    return x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps) * np.asarray(w, dtype=F64)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w^T in float64 (f16 weights are exact in float64)."""
    return np.asarray(x, dtype=F64) @ np.asarray(w, dtype=F64).T


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


def expert_parts(pool: ExpertPool, slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(w_gate_up [2F,H], w_down [H,F], gate-up bias [2F] or None, down bias [H] or None) of one host slot, float64."""
    a = pool.arrays
    if pool.dtype == "f16":
        return np.asarray(a["w_gate_up"][slot], dtype=F64), np.asarray(a["w_down"][slot], dtype=F64), None, None
    if pool.dtype == "q8_0":
        return (dequantize_q8_0_exact(a["gate_up_q"][slot], a["gate_up_d"][slot]),
                dequantize_q8_0_exact(a["down_q"][slot], a["down_d"][slot]), None, None)
    if pool.dtype == "gguf":
        from strata_core.reference.kernels import gguf_expert_parts
        fmt = pool.fmt
        gu, down, b13, b2 = gguf_expert_parts(a["blob"][slot], fmt)
        return (quants.dequantize(fmt.gate_up, gu, fmt.hidden).astype(F64),
                quants.dequantize(fmt.down, down, fmt.ffn).astype(F64),
                None if b13 is None else b13.astype(F64), None if b2 is None else b2.astype(F64))
    raise ValueError(f"the float64 reference has no expert format {pool.dtype!r}")


def expert_matrices(pool: ExpertPool, slot: int) -> tuple[np.ndarray, np.ndarray]:
    """(w_gate_up [2F,H], w_down [H,F]) of one host slot in float64, quantized formats dequantized exactly."""
    return expert_parts(pool, slot)[:2]


def f16_expert_matrices(pool: ExpertPool, slot: int) -> tuple[np.ndarray, np.ndarray]:
    """(w_gate_up, w_down) of one slot as f16 tensor-core kernels use them: the oracle's float32 rounded once to
    f16, in float64."""
    w13, w2 = expert_matrices(pool, slot)
    return (w13.astype(np.float32).astype(np.float16).astype(np.float64),
            w2.astype(np.float32).astype(np.float16).astype(np.float64))


def worst_element_error(out: np.ndarray, want: np.ndarray, floor: float = 0.01) -> float:
    """max |out - want| / (|want| + floor x rms(want)) over the elements (0 for none): one wrong weight in a row
    shows, an f16 output's own rounding (2^-11 relative) does not."""
    if not want.size:
        return 0.0
    rms = float(np.sqrt(np.mean(want * want)))
    return float(np.max(np.abs(out - want) / (np.abs(want) + floor * rms)))


def swiglu_expert(x: np.ndarray, w13: np.ndarray, w2: np.ndarray, b13: np.ndarray | None = None,
                  b2: np.ndarray | None = None) -> np.ndarray:
    """One SwiGLU expert on rows x [n,H] in float64 (with the biases a gpt-oss slot carries)."""
    f = w2.shape[1]
    gu = np.asarray(x, dtype=F64) @ w13.T
    if b13 is not None:
        gu = gu + b13
    y = (_silu(gu[:, :f]) * gu[:, f:]) @ w2.T
    return y + b2 if b2 is not None else y


def expert_ffn(pool: ExpertPool, slot: int, x: np.ndarray) -> np.ndarray:
    """The expert in `slot` of a host pool on rows x [n,H], in float64."""
    return swiglu_expert(x, *expert_parts(pool, slot))


def moe_grouped_ffn(x: np.ndarray, offsets: np.ndarray, slots: np.ndarray, pool: ExpertPool) -> np.ndarray:
    """Rows offsets[g]:offsets[g+1] of x run the expert in slot slots[g], in float64; rows of no group are 0."""
    x = np.asarray(x, dtype=F64)
    y = np.zeros_like(x)
    for g in range(len(slots)):
        lo, hi = int(offsets[g]), int(offsets[g + 1])
        if hi > lo:
            y[lo:hi] = expert_ffn(pool, int(slots[g]), x[lo:hi])
    return y


def moe_layer(x: np.ndarray, logits: np.ndarray, pool: ExpertPool, slot_of: np.ndarray, k: int) -> np.ndarray:
    """One MoE layer's output in float64: sum over each token's top k of w_k * expert(slot_of[id_k])(x)."""
    ids, w = route_topk(logits, k)
    y = np.zeros(x.shape, F64)
    for e in np.unique(ids):
        rows, ks = np.nonzero(ids == e)
        y[rows] += w[rows, ks, None] * expert_ffn(pool, int(slot_of[e]), x[rows])
    return y


def topk_margin(logits: np.ndarray, k: int) -> float:
    """The smallest gap between a token's k-th and (k+1)-th logit (a near-tie may route either way)."""
    s = np.sort(logits, axis=1)[:, ::-1]
    return float((s[:, k - 1] - s[:, k]).min())


def relative_error(out: np.ndarray, want: np.ndarray) -> float:
    """||out - want|| / ||want|| in float64 (NaN or inf anywhere in out gives inf)."""
    out = np.asarray(out, dtype=F64)
    want = np.asarray(want, dtype=F64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    den = np.linalg.norm(want)
    return float(np.linalg.norm(out - want) / (den if den > 0 else 1.0))
