"""The kernel contract: expert formats (the layouts a slot holds) and the KernelSet every device provides.

Layouts (S expert slots, H hidden, F expert FFN width, T tokens, N routed rows, G groups):
- f16 experts:  w_gate_up [S, 2F, H] f16 (rows 0..F-1 gate, F..2F-1 up), w_down [S, H, F] f16.
- Q8_0 experts: the same matrices as ggml's Q8_0: blocks of 32 along the last axis, int8 quants `*_q` and one
  f16 scale per block `*_d` ([.., C/32]); value = q * d.
- activations are f32; expert outputs are f32.
SwiGLU: y = (silu(x Wg^T) * (x Wu^T)) Wd^T. The numpy oracle of every kernel is `strata_core.reference.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


# --- layer ops (versionadded 2.0) ----------------------------------------------------------------------------------
# The executor calls only these. The core composes a default from the primitives above, so a new backend needs only
# the primitives; a fast backend overrides them (fused paths, graphs), as a ggml backend computes a whole graph.


@runtime_checkable
class SlotTable(Protocol):
    """The expert cache's slot table as a layer op sees it (slots on loan are never returned by lookup or admit)."""

    def lookup(self, layer: int, experts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Slot of each (layer, expert) in the device pool, or -1 for a miss; counts feed the eviction order."""

    def admit(self, layer: int, experts: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """Slots for missed experts (evicting the coldest, never a slot in `keep`); -1 where none can be had."""

    def row(self, layer: int, expert: int) -> int:
        """The host store's row of (layer, expert)."""


@runtime_checkable
class ExpertSource(Protocol):
    """Where missed experts come from: the host store (page-locked where the plan pinned it)."""

    def upload(self, row: int, slot: int, stream: Any) -> None:
        """Copy expert `row` of the host store into device pool slot `slot` on `stream` (asynchronous)."""


@runtime_checkable
class Workspace(Protocol):
    """The plan's device workspace region: every buffer a layer op needs is carved from it (no kernel allocates)."""

    def carve(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A device array view of the region (released with `reset`); raises DeviceFull when the region is spent."""

    def reset(self) -> None:
        """Release every carved view (between layers or steps)."""


@dataclass
class LayerWork:
    """One MoE layer's whole work, as the executor hands it to a layer op.

    `x` is the residual [T,H] f32 on the device, updated in place: x += sum_k w_k * expert_k(rmsnorm(x)).
    `ring` holds the pool slots lent to this chunk for streaming misses (empty: misses are admitted into the cache).
    `workspace` is where every buffer of the op comes from: for a prefill chunk, the loan's buffer slots and the
    plan's workspace region; for decode, the workspace region. It is reset by the executor between layers.
    The works of one chunk (or one decode step) share `x`, `stats` and `extras`.
    """

    phase: str                 # "prefill" or "decode"
    layer: int
    tokens: int
    x: Any
    norm_w: Any
    router_w: Any
    top_k: int
    pool: ExpertPool
    slots: SlotTable
    source: ExpertSource
    workspace: Workspace
    ring: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    compute_stream: Any = None
    copy_stream: Any = None
    #: counters the op adds to (ints, all present): experts_streamed, bytes_streamed, experts_admitted,
    #: cpu_share_experts, ring_batches, workspace_peak_bytes. Hits and misses are counted by `slots.lookup`.
    stats: dict = field(default_factory=dict)
    #: the runtime's own handles an op may use. "observer" (only in --check runs): call it after each layer as
    #: observer(phase, layer, x_in, x_out) with host copies of the residual before and after the layer; an op that
    #: cannot (a fused decode graph) leaves the layer unchecked, and --check reports fewer layers.
    extras: dict = field(default_factory=dict)


@runtime_checkable
class LayerOps(Protocol):
    """A prefill layer and a decode step, each given its whole work."""

    name: str

    def prefill_layer(self, work: LayerWork) -> None:
        """Run one MoE layer of a prompt chunk in place on work.x."""

    def decode_step(self, works: list[LayerWork]) -> None:
        """Run every MoE layer of one decode token in order (one graph replay where the device can)."""
