"""The numpy reference kernels: the contract of `KernelSet`, shapes and dtypes included, and the oracle.

Layouts (S expert slots, H hidden, F expert FFN width, T tokens, N routed rows, G groups):
- f16 experts:  w_gate_up [S, 2F, H] f16 (rows 0..F-1 gate, F..2F-1 up), w_down [S, H, F] f16.
- Q8_0 experts: the same matrices as ggml's Q8_0: blocks of 32 along the last axis, int8 quants `*_q` and one
  f16 scale per block `*_d` ([.., C/32]); value = q * d.
- GGUF experts (dtype 'gguf'): one uint8 `blob` [S, slot_bytes] of the file's own rows (api.kernels.ExpertFormat),
  computed per tile of weight rows (`quants.matmul_quant`): never dequantized into a copy of the whole expert.
- activations are f32; expert outputs are f32.
SwiGLU: y = (silu(x Wg^T + bg) * (x Wu^T + bu)) Wd^T + bd (biases only where the format carries them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strata_core.api.kernels import QK8_0, ExpertFormat, ExpertPool  # noqa: F401  (re-exported: the contract)
from strata_core.reference import quants


def quantize_q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[.., C] float -> (q int8 [.., C], d f16 [.., C/32]) as ggml's Q8_0 does (d = amax / 127, round to nearest)."""
    w = np.asarray(w, dtype=np.float32)
    if w.shape[-1] % QK8_0:
        raise ValueError(f"Q8_0 needs the last axis to be a multiple of {QK8_0}, got {w.shape[-1]}")
    b = w.reshape(*w.shape[:-1], w.shape[-1] // QK8_0, QK8_0)
    d = np.abs(b).max(axis=-1) / 127.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.rint(b * inv[..., None]).clip(-127, 127).astype(np.int8)
    return q.reshape(w.shape), d.astype(np.float16)


def dequantize_q8_0(qs: np.ndarray, d: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Q8_0 (qs [.., C] int8, d [.., C/32] f16) -> [.., C] f16 (into `out` when given)."""
    b = qs.reshape(*qs.shape[:-1], qs.shape[-1] // QK8_0, QK8_0).astype(np.float32)
    r = (b * d.astype(np.float32)[..., None]).reshape(qs.shape).astype(np.float16)
    return _into(out, r)


def _into(out: np.ndarray | None, r: np.ndarray) -> np.ndarray:
    """r itself, or r copied into the given output buffer (which is returned)."""
    if out is None:
        return r
    np.copyto(out, r.reshape(out.shape), casting="same_kind")
    return out


def route_topk(logits: np.ndarray, k: int, out: tuple[np.ndarray, np.ndarray] | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """[T,E] f32 -> (ids [T,k] int32 by descending logit, ties to the lower id; weights [T,k] f32 softmax over them).

    `out` = (ids, weights) buffers to write into.
    """
    logits = np.asarray(logits, dtype=np.float32)
    order = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, order, axis=1)
    e = np.exp(top - top[:, :1])
    ids, wts = order.astype(np.int32), (e / e.sum(axis=1, keepdims=True)).astype(np.float32)
    if out is None:
        return ids, wts
    return _into(out[0], ids), _into(out[1], wts)


def gather(x: np.ndarray, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x [T,H], rows [N] int32 -> [N,H] (into `out` when given)."""
    if out is not None:
        return np.take(x, np.asarray(rows, dtype=np.int64), axis=0, out=out)
    return np.ascontiguousarray(x[np.asarray(rows, dtype=np.int64)])


def scatter_add(out: np.ndarray, rows: np.ndarray, y: np.ndarray, scale: np.ndarray) -> None:
    """out[rows[i]] += scale[i] * y[i], in place (out [T,H] f32)."""
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return
    # np.add.at is unbuffered and slow; sum each row's contributions in one sorted pass instead.
    order = np.argsort(rows, kind="stable")
    sorted_rows = rows[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_rows[1:] != sorted_rows[:-1])))
    contrib = (np.asarray(y, dtype=np.float32)[order] * np.asarray(scale, dtype=np.float32)[order, None])
    out[sorted_rows[starts]] += np.add.reduceat(contrib, starts, axis=0)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float = 1e-6, out: np.ndarray | None = None) -> np.ndarray:
    """[T,H] f32, w [H] -> x / rms(x) * w, f32 (into `out` when given)."""
    x = np.asarray(x, dtype=np.float32)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps)
    if out is not None:
        return np.multiply(x * r, np.asarray(w, dtype=np.float32), out=out)
    return (x * r * np.asarray(w, dtype=np.float32)).astype(np.float32)


def linear(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x [T,H] f32, w [O,H] (f16 or f32) -> x @ w^T [T,O] f32 (into `out` when given)."""
    if out is not None:
        return np.matmul(np.asarray(x, dtype=np.float32), np.asarray(w, dtype=np.float32).T, out=out)
    return (np.asarray(x, dtype=np.float32) @ np.asarray(w, dtype=np.float32).T).astype(np.float32)


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1.0 + np.exp(-v))


#: Weight rows a GGUF expert dequantizes at a time (the tile of `quants.matmul_quant`).
GGUF_TILE_ROWS = 64


def gguf_expert_parts(blob_row: np.ndarray, fmt: ExpertFormat) -> tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                                         np.ndarray | None]:
    """One 'gguf' slot's bytes -> (gate_up rows [2F, rb] u8, down rows [H, rb] u8, f32 biases [2F] and [H] or None)."""
    b = np.asarray(blob_row, dtype=np.uint8).reshape(-1)
    f, h = fmt.ffn, fmt.hidden
    gu = b[:fmt.down_offset].reshape(2 * f, fmt.gate_up_row_bytes)
    down = b[fmt.down_offset:fmt.bias_offset].reshape(h, fmt.down_row_bytes)
    if not fmt.bias:
        return gu, down, None, None
    bias = np.frombuffer(b[fmt.bias_offset:fmt.nbytes].tobytes(), dtype="<f4").astype(np.float32)
    return gu, down, bias[:2 * f], bias[2 * f:]


def gguf_expert_ffn(x: np.ndarray, blob_row: np.ndarray, fmt: ExpertFormat) -> np.ndarray:
    """One SwiGLU expert from its GGUF bytes on rows x [n,H] f32 -> [n,H] f32, dequantized a tile of rows at a time."""
    gu_raw, down_raw, b13, b2 = gguf_expert_parts(blob_row, fmt)
    f = fmt.ffn
    gu = quants.matmul_quant(x, gu_raw, fmt.gate_up, fmt.hidden, GGUF_TILE_ROWS)
    if b13 is not None:
        gu = gu + b13
    act = (_silu(gu[:, :f]) * gu[:, f:]).astype(np.float32)
    y = quants.matmul_quant(act, down_raw, fmt.down, f, GGUF_TILE_ROWS)
    return y + b2 if b2 is not None else y


def expert_matrices(pool: ExpertPool, slot: int) -> tuple[np.ndarray, np.ndarray]:
    """(w_gate_up [2F,H], w_down [H,F]) of one slot as f32, dequantized where needed (a 'gguf' slot: its biases are
    `gguf_expert_parts`'s; moe_grouped_ffn never builds these matrices for such a pool)."""
    a = pool.arrays
    if pool.dtype == "gguf":
        fmt = pool.fmt
        gu, down, _, _ = gguf_expert_parts(a["blob"][slot], fmt)
        return quants.dequantize(fmt.gate_up, gu, fmt.hidden), quants.dequantize(fmt.down, down, fmt.ffn)
    if pool.dtype == "f16":
        return a["w_gate_up"][slot].astype(np.float32), a["w_down"][slot].astype(np.float32)
    # q * d exactly (an int8 times an f16 fits f32's mantissa), as ggml and moe.cl compute it: the contract's f16
    # dequantize_q8_0 output would round every weight once more, an error only an f16 path makes
    return _dequantize_q8_0_f32(a["gate_up_q"][slot], a["gate_up_d"][slot]), \
        _dequantize_q8_0_f32(a["down_q"][slot], a["down_d"][slot])


def _dequantize_q8_0_f32(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q8_0 -> [.., C] f32 q * d, exact (not rounded to f16)."""
    b = qs.reshape(*qs.shape[:-1], qs.shape[-1] // QK8_0, QK8_0).astype(np.float32)
    return (b * d.astype(np.float32)[..., None]).reshape(qs.shape)


def moe_grouped_ffn(x: np.ndarray, offsets: np.ndarray, slots: np.ndarray, pool: ExpertPool,
                    out: np.ndarray | None = None) -> np.ndarray:
    """x [N,H] f32; rows offsets[g]:offsets[g+1] run the SwiGLU expert in slot slots[g] -> y [N,H] f32 (into `out`)."""
    x = np.asarray(x, dtype=np.float32)
    if out is None:
        y = np.zeros_like(x)
    else:
        y = out
        y.fill(0)
    fmt = pool.fmt if pool.dtype == "gguf" else None
    for g in range(len(slots)):
        lo, hi = int(offsets[g]), int(offsets[g + 1])
        if hi <= lo:
            continue
        if fmt is not None:
            # per tile of weight rows from the slot's own bytes, never the expert's whole dequantized matrices
            y[lo:hi] = gguf_expert_ffn(x[lo:hi], pool.arrays["blob"][int(slots[g])], fmt)
            continue
        w13, w2 = expert_matrices(pool, int(slots[g]))
        f = w2.shape[1]
        gu = x[lo:hi] @ w13.T
        y[lo:hi] = (_silu(gu[:, :f]) * gu[:, f:]) @ w2.T
    return y


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere gives inf)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (den if den > 0 else 1.0))


class ReferenceKernels:
    """The numpy KernelSet: device arrays are numpy arrays. Used by the cpu and sim backends."""

    name = "numpy-reference"
    #: every kernel accumulates in f32 (see strata_core.testing.tolerance)
    precision = "f32"

    def route_topk(self, logits, k, out=None):
        """See module docstring."""
        return route_topk(logits, k, out=out)

    def gather(self, x, rows, out=None):
        """See module docstring."""
        return gather(x, rows, out=out)

    def scatter_add(self, out, rows, y, scale):
        """See module docstring."""
        scatter_add(out, rows, y, scale)

    def moe_grouped_ffn(self, x, offsets, slots, weights, out=None):
        """See module docstring."""
        return moe_grouped_ffn(x, offsets, slots, weights, out=out)

    def dequantize_q8_0(self, qs, d, out=None):
        """See module docstring."""
        return dequantize_q8_0(qs, d, out=out)

    def rmsnorm(self, x, w, eps=1e-6, out=None):
        """See module docstring."""
        return rmsnorm(x, w, eps, out=out)

    def linear(self, x, w, out=None):
        """See module docstring."""
        return linear(x, w, out=out)
