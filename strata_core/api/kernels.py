"""The kernel contract: expert formats (the layouts a slot holds) and the KernelSet every device provides.

Layouts (S expert slots, H hidden, F expert FFN width, T tokens, N routed rows, G groups):
- f16 experts:  w_gate_up [S, 2F, H] f16 (rows 0..F-1 gate, F..2F-1 up), w_down [S, H, F] f16.
- Q8_0 experts: the same matrices as ggml's Q8_0: blocks of 32 along the last axis, int8 quants `*_q` and one
  f16 scale per block `*_d` ([.., C/32]); value = q * d.
- GGUF experts (dtype 'gguf', versionadded 2.0): one uint8 array `blob` [S, slot_bytes]; a slot holds one expert's
  rows exactly as the GGUF file stores them (`ExpertFormat`: gate rows [F] then up rows [F], each H weights in the
  gate/up type, then down rows [H], each F weights in the down type, then, when the file has expert biases, f32
  gate [F], up [F] and down [H] biases). The types may differ per layer (Q4_K_M: some layers' down rows Q6_K, others
  Q4_K): the pool then carries one ExpertFormat per MoE layer, its slot bytes are the largest layer's, and a layer op
  hands kernels `pool.for_layer(layer)`, a pool of one format.
- activations are f32; expert outputs are f32.
SwiGLU: y = (silu(x Wg^T) * (x Wu^T)) Wd^T. The numpy oracle of every kernel is `strata_core.reference.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

QK8_0 = 32  # ggml's Q8_0 block length

#: ggml weight types a 'gguf' pool's rows may be in: name -> (weights per block, bytes per block) (ggml-common.h;
#: the same table as strata_core.reference.quants.FORMATS, which the tests hold it to).
GGUF_BLOCKS: dict[str, tuple[int, int]] = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34),
                                           "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
                                           "mxfp4": (32, 17)}
#: Expert formats of the contract: a device advertises the ones its grouped FFN computes in DeviceCaps.expert_formats
#: ('f16' and 'q8_0' pools, and every GGUF_BLOCKS type inside a 'gguf' pool).
EXPERT_FORMATS: tuple[str, ...] = ("f16", "q8_0", "bf16", "q4_k", "q5_k", "q6_k", "mxfp4")


def gguf_row_bytes(fmt: str, weights: int) -> int:
    """Bytes of one row of `weights` weights of ggml type `fmt`; ValueError when not whole blocks."""
    try:
        bw, bb = GGUF_BLOCKS[fmt]
    except KeyError:
        raise ValueError(f"unknown expert weight type {fmt!r} (known: {', '.join(GGUF_BLOCKS)})") from None
    if weights % bw:
        raise ValueError(f"{fmt}: a row of {weights} weights is not a whole number of {bw}-weight blocks")
    return weights // bw * bb


@dataclass(frozen=True)
class ExpertFormat:
    """The byte layout of one expert slot of a 'gguf' pool: the file's rows as they are (see the module docstring)."""

    gate_up: str        # ggml type of the gate and up rows (a GGUF_BLOCKS name)
    down: str           # ggml type of the down rows
    hidden: int
    ffn: int
    bias: bool = False  # f32 gate, up and down biases follow the rows (gpt-oss)

    @property
    def gate_up_row_bytes(self) -> int:
        """Bytes of one gate (or up) row: `hidden` weights."""
        return gguf_row_bytes(self.gate_up, self.hidden)

    @property
    def down_row_bytes(self) -> int:
        """Bytes of one down row: `ffn` weights."""
        return gguf_row_bytes(self.down, self.ffn)

    @property
    def down_offset(self) -> int:
        """Byte offset of the down rows in a slot."""
        return 2 * self.ffn * self.gate_up_row_bytes

    @property
    def bias_offset(self) -> int:
        """Byte offset of the f32 biases (gate [F], up [F], down [H]) in a slot; the slot's end without biases."""
        return self.down_offset + self.hidden * self.down_row_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of one expert in this format."""
        return self.bias_offset + (4 * (2 * self.ffn + self.hidden) if self.bias else 0)

    @property
    def label(self) -> str:
        """'q4_k/q6_k' (gate-up/down), '+bias' when it carries biases."""
        return f"{self.gate_up}/{self.down}" + ("+bias" if self.bias else "")


@dataclass
class ExpertPool:
    """Expert weights held in S slots of one memory (device or host): dtype 'f16', 'q8_0' or 'gguf' (raw file rows,
    laid out by `formats`: one ExpertFormat for every layer, or one per MoE layer); 'raw' is an accounting phantom."""

    dtype: str
    arrays: dict[str, Any]
    formats: tuple[ExpertFormat, ...] = ()

    @property
    def slots(self) -> int:
        """How many expert slots the pool holds."""
        key = {"f16": "w_gate_up", "q8_0": "gate_up_q"}.get(self.dtype, "blob")
        return int(self.arrays[key].shape[0])

    @property
    def fmt(self) -> ExpertFormat:
        """The one ExpertFormat of a 'gguf' pool (ValueError when it has one per layer: use for_layer first)."""
        if len(set(self.formats)) != 1:
            raise ValueError(f"expert pool: {len(set(self.formats))} formats; a kernel takes pool.for_layer(layer)")
        return self.formats[0]

    def for_layer(self, layer: int) -> "ExpertPool":
        """This pool as one layer's kernels see it: the same arrays, that layer's format only."""
        if len(set(self.formats)) <= 1:
            return self
        return ExpertPool(self.dtype, self.arrays, (self.formats[int(layer)],))

    def with_arrays(self, arrays: dict[str, Any]) -> "ExpertPool":
        """A pool of the same dtype and formats over other arrays (a device copy, one slot's views)."""
        return ExpertPool(self.dtype, arrays, self.formats)

    @staticmethod
    def slot_bytes(dtype: str, hidden: int, ffn: int, formats: tuple[ExpertFormat, ...] = ()) -> int:
        """Bytes of one expert slot in this dtype ('gguf': the largest of its formats)."""
        n = 3 * hidden * ffn
        if dtype == "f16":
            return 2 * n
        if dtype == "q8_0":
            return n + 2 * (n // QK8_0)
        if dtype == "gguf" and formats:
            return max(f.nbytes for f in formats)
        raise ValueError(f"unknown expert dtype {dtype!r}")

    @staticmethod
    def array_specs(dtype: str, slots: int, hidden: int, ffn: int,
                    formats: tuple[ExpertFormat, ...] = ()) -> dict[str, tuple[tuple[int, ...], Any]]:
        """name -> (shape, numpy dtype) of every array a pool of this dtype holds."""
        if dtype == "gguf":
            return {"blob": ((slots, ExpertPool.slot_bytes(dtype, hidden, ffn, formats)), np.uint8)}
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
    """The kernels of one device. The contract, with shapes and dtypes, is `strata_core.reference.kernels`.

    `out` (versionadded 2.0): the buffer (for route_topk the pair of buffers) the kernel writes its result into and
    returns; the runtime carves it from a plan region, so a kernel given `out` allocates no device memory for its
    result. None: the kernel allocates its result (kept for backends written before 2.0).
    """

    name: str

    def route_topk(self, logits: Any, k: int, out: tuple[Any, Any] | None = None) -> tuple[Any, Any]:
        """[T,E] f32 router logits -> (ids [T,k] int32, weights [T,k] f32, softmax over the top k)."""

    def gather(self, x: Any, rows: Any, out: Any = None) -> Any:
        """x [T,H], rows [N] int32 -> x[rows] [N,H]."""

    def scatter_add(self, out: Any, rows: Any, y: Any, scale: Any) -> None:
        """out[rows[i]] += scale[i] * y[i] for i < N (out [T,H] f32, y [N,H] f32, scale [N] f32)."""

    def moe_grouped_ffn(self, x: Any, offsets: Any, slots: Any, weights: Any, out: Any = None) -> Any:
        """SwiGLU experts over token groups: rows offsets[g]:offsets[g+1] of x run expert slot slots[g]."""

    def dequantize_q8_0(self, qs: Any, d: Any, out: Any = None) -> Any:
        """Q8_0 blocks (qs [R,C] int8, d [R,C/32] f16) -> [R,C] f16."""

    def rmsnorm(self, x: Any, w: Any, eps: float = 1e-6, out: Any = None) -> Any:
        """[T,H] f32, w [H] -> x / rms(x) * w."""

    def linear(self, x: Any, w: Any, out: Any = None) -> Any:
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
    #: cannot (a fused decode graph) leaves the layer unchecked, and --check reports fewer layers. "fallback"
    #: (always there in a run): call it as fallback(what, why) when an optional path of the op was turned off (a
    #: kernel that did not build, a shape it lacks); the run reports each `what` once among its fallbacks.
    extras: dict = field(default_factory=dict)


@runtime_checkable
class LayerOps(Protocol):
    """A prefill layer and a decode step, each given its whole work.

    Optional: `prefill_done()`, which the executor calls after each chunk's layers where an op has it (an op that
    counts a chunk's cache lookups late, the CUDA ops' device-table layers, counts them there)."""

    name: str

    def prefill_layer(self, work: LayerWork) -> None:
        """Run one MoE layer of a prompt chunk in place on work.x."""

    def decode_step(self, works: list[LayerWork]) -> None:
        """Run every MoE layer of one decode token in order (one graph replay where the device can)."""
