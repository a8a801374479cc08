"""The kernel contract: expert formats (the layouts a slot holds) and the KernelSet every device provides.

Layouts (S expert slots, H hidden, F expert FFN width, T tokens, N routed rows, G groups):
- f16 experts:  w_gate_up [S, 2F, H] f16 (rows 0..F-1 gate, F..2F-1 up), w_down [S, H, F] f16.
- Q8_0 experts: the same matrices as ggml's Q8_0: blocks of 32 along the last axis, int8 quants `*_q` and one
  f16 scale per block `*_d` ([.., C/32]); value = q * d.
- activations are f32; expert outputs are f32.
SwiGLU: y = (silu(x Wg^T) * (x Wu^T)) Wd^T. The numpy oracle of every kernel is `strata_core.reference.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

QK8_0 = 32  # ggml's Q8_0 block length


@dataclass
class ExpertPool:
    """Expert weights held in S slots of one memory (device or host), in one of two dtypes ('f16' or 'q8_0')."""

    dtype: str
    arrays: dict[str, Any]

    @property
    def slots(self) -> int:
        """How many expert slots the pool holds."""
        key = "w_gate_up" if self.dtype == "f16" else "gate_up_q"
        return int(self.arrays[key].shape[0])

    @staticmethod
    def slot_bytes(dtype: str, hidden: int, ffn: int) -> int:
        """Bytes of one expert slot in this dtype."""
        n = 3 * hidden * ffn
        if dtype == "f16":
            return 2 * n
        if dtype == "q8_0":
            return n + 2 * (n // QK8_0)
        raise ValueError(f"unknown expert dtype {dtype!r}")

    @staticmethod
    def array_specs(dtype: str, slots: int, hidden: int, ffn: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        """name -> (shape, numpy dtype) of every array a pool of this dtype holds."""
        if dtype == "f16":
            return {"w_gate_up": ((slots, 2 * ffn, hidden), np.float16),
                    "w_down": ((slots, hidden, ffn), np.float16)}
        if dtype == "q8_0":
            return {"gate_up_q": ((slots, 2 * ffn, hidden), np.int8),
                    "gate_up_d": ((slots, 2 * ffn, hidden // QK8_0), np.float16),
                    "down_q": ((slots, hidden, ffn), np.int8),
                    "down_d": ((slots, hidden, ffn // QK8_0), np.float16)}
        raise ValueError(f"unknown expert dtype {dtype!r}")


@runtime_checkable
class KernelSet(Protocol):
    """The kernels of one device. The contract, with shapes and dtypes, is `strata_core.reference.kernels`."""

    name: str

    def route_topk(self, logits: Any, k: int) -> tuple[Any, Any]:
        """[T,E] f32 router logits -> (ids [T,k] int32, weights [T,k] f32, softmax over the top k)."""

    def gather(self, x: Any, rows: Any) -> Any:
        """x [T,H], rows [N] int32 -> x[rows] [N,H]."""

    def scatter_add(self, out: Any, rows: Any, y: Any, scale: Any) -> None:
        """out[rows[i]] += scale[i] * y[i] for i < N (out [T,H] f32, y [N,H] f32, scale [N] f32)."""

    def moe_grouped_ffn(self, x: Any, offsets: Any, slots: Any, weights: Any) -> Any:
        """SwiGLU experts over token groups: rows offsets[g]:offsets[g+1] of x run expert slot slots[g]."""

    def dequantize_q8_0(self, qs: Any, d: Any) -> Any:
        """Q8_0 blocks (qs [R,C] int8, d [R,C/32] f16) -> [R,C] f16."""

    def rmsnorm(self, x: Any, w: Any, eps: float = 1e-6) -> Any:
        """[T,H] f32, w [H] -> x / rms(x) * w."""

    def linear(self, x: Any, w: Any) -> Any:
        """x [T,H] f32, w [O,H] f16 or f32 -> x w^T [T,O] f32."""
