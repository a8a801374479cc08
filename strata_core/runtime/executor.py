"""The executor: chunked prefill and decode over the MoE layers, through the layer ops only.

The executor embeds a chunk (or a decode token), hands every MoE layer's whole work (`LayerWork`) to the session's
`LayerOps` (`prefill_layer` per layer of a chunk, `decode_step` for all layers of one token), then runs the LM head.
It keeps chunking, ticks, stats and progress; routing, grouping, hits, the ring, admission and the CPU share are the
layer op's (the core's default composition is `strata_core.runtime.layer_ops.ComposedLayerOps`). The model has no
attention (out of scope for Strata Core): each token is independent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from strata_core.api.kernels import LayerWork
from strata_core.reference.kernels import ExpertPool
from strata_core.runtime.cache import ExpertCache
from strata_core.runtime.cpu_share import CpuShare
from strata_core.runtime.layer_ops import (KERNEL_SCRATCH_FACTOR, MIN_ROWS_PER_CALL, ComposedLayerOps,  # noqa: F401
                                           DeviceFull, Routing, StoreSource, new_counters)
from strata_core.runtime.loan import Loan, NoLoan
from strata_core.runtime.runlog import RunLog
from strata_core.runtime.store import ExpertStore
from strata_core.models.weights import ModelWeights


@dataclass
class ExecStats:
    """Counters of one run (all requests); the layer ops' counters live in `layer` (see layer_ops.COUNTERS)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    chunks: int = 0
    layer: dict = field(default_factory=new_counters)

    @property
    def experts_streamed(self) -> int:
        """Experts copied into the device (ring or admission)."""
        return self.layer["experts_streamed"]

    @property
    def bytes_streamed(self) -> int:
        """Bytes copied into the device for missed experts."""
        return self.layer["bytes_streamed"]

    @property
    def experts_admitted(self) -> int:
        """Missed experts admitted into the cache."""
        return self.layer["experts_admitted"]

    @property
    def cpu_share_experts(self) -> int:
        """Missed experts the CPU share ran."""
        return self.layer["cpu_share_experts"]

    @property
    def ring_batches(self) -> int:
        """Batches streamed through the ring."""
        return self.layer["ring_batches"]

    @property
    def workspace_peak_bytes(self) -> int:
        """The largest chunk buffers plus one grouped call's buffers, from their shapes."""
        return self.layer["workspace_peak_bytes"]


#: Called in --check runs after every layer, (phase, layer, x_in [T,H] f32, x_out [T,H] f32), and after the LM head,
#: ("head", -1, x_last [1,H] f32, logits [1,V] f32); host arrays.
LayerObserver = Callable[[str, int, np.ndarray, np.ndarray], None]

_NO_RING = np.zeros(0, np.int32)


class HeapWorkspace:
    """A Workspace whose views are fresh device arrays, freed on reset."""

    def __init__(self, dm: Any):
        self.dm = dm
        self._live: list = []

    def carve(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A device array of this shape; DeviceFull when the device refuses it."""
        a = self.dm.alloc(shape, dtype)
        if a is None:
            raise DeviceFull(f"the device refused a {shape} {np.dtype(dtype).name} workspace buffer")
        self._live.append(a)
        return a

    def reset(self) -> None:
        """Free every carved array."""
        for a in self._live:
            self.dm.free(a)
        self._live.clear()


class Executor:
    """Runs requests' prefill and decode over a device ExpertPool whose slots the ExpertCache manages."""

    def __init__(self, *, dm: Any, kernels: Any, cache: ExpertCache, store: ExpertStore, device_pool: ExpertPool,
                 weights: ModelWeights | None, dense_dev: dict[str, Any] | None, share: CpuShare, log: RunLog,
                 top_k: int, hidden: int, workspace_bytes: int = 0, accounting_only: bool = False, seed: int = 0,
                 observer: LayerObserver | None = None, staging: Any = None, layer_ops: Any = None):
        self.dm = dm
        self.k = kernels
        self.cache = cache
        self.store = store
        self.pool = device_pool
        self.weights = weights
        self.dense = dense_dev or {}
        self.share = share
        self.log = log
        self.top_k = int(top_k)
        self.hidden = int(hidden)
        self.workspace_bytes = int(workspace_bytes)
        self.accounting_only = accounting_only
        self.observer = self._timed(observer) if observer is not None else None
        #: Seconds spent in the observer (--check): excluded from the request's timings.
        self.observer_s = 0.0
        self.stats = ExecStats()
        self.counters = self.stats.layer
        #: Page-locked staging for experts the arena could not pin (None: copies from pageable memory).
        self.staging = staging
        #: Called with (phase, tokens) after every prefill chunk and decode step (progress bars).
        self.progress: Callable[[str, int], None] | None = None
        self.copy_stream = dm.new_stream()
        self.source = StoreSource(dm, device_pool, store, staging, self.counters, accounting_only)
        self.workspace = HeapWorkspace(dm)
        ffn = weights.expert_ffn if weights is not None else 0
        self.ops = layer_ops if layer_ops is not None else ComposedLayerOps(
            dm=dm, kernels=kernels, store=store, share=share, hidden=hidden, expert_ffn=ffn,
            experts_per_layer=cache.experts_per_layer, layers=cache.layers, workspace_bytes=workspace_bytes,
            accounting_only=accounting_only, seed=seed)

    def _timed(self, observer: LayerObserver) -> LayerObserver:
        """The observer, its time (downloads and comparisons) added to observer_s."""
        def call(phase: str, layer: int, x_in: np.ndarray, x_out: np.ndarray) -> None:
            t0 = time.perf_counter()
            try:
                observer(phase, layer, x_in, x_out)
            finally:
                self.observer_s += time.perf_counter() - t0
        return call

    # --- device helpers ------------------------------------------------------------------------------------

    def _put(self, host: np.ndarray, temps: list) -> Any:
        """Host -> a fresh device array, remembered in temps to free; DeviceFull when the device says no."""
        arr = self.dm.to_device(np.ascontiguousarray(host))
        if arr is None:
            raise DeviceFull(f"the device refused {host.nbytes} bytes of prompt buffers")
        temps.append(arr)
        return arr

    def _free(self, temps: list) -> None:
        for a in temps:
            self.dm.free(a)
        temps.clear()

    def _works(self, phase: str, x: Any, tokens: int, ring: np.ndarray) -> list[LayerWork]:
        """The LayerWork of every MoE layer for one chunk or one decode step (all on the same residual x)."""
        extras = {"observer": self.observer} if self.observer is not None else {}
        return [LayerWork(phase=phase, layer=layer, tokens=tokens, x=x, norm_w=self.dense.get(f"norm.{layer}"),
                          router_w=self.dense.get(f"router.{layer}"), top_k=self.top_k, pool=self.pool,
                          slots=self.cache, source=self.source, workspace=self.workspace, ring=ring,
                          compute_stream=None, copy_stream=self.copy_stream, stats=self.counters, extras=extras)
                for layer in range(self.cache.layers)]

    # --- prefill and decode --------------------------------------------------------------------------------

    def _embed(self, token_ids: np.ndarray, temps: list) -> Any:
        """The residual stream of these tokens on the device (None in accounting mode)."""
        if self.accounting_only:
            return None
        return self._put(self.weights.dense.embed[token_ids].astype(np.float32), temps)

    def _head(self, x: Any, temps: list) -> np.ndarray:
        """Final norm and LM head of the last token of x -> logits [V] f32 on the host."""
        x_last = x[-1:] if x.shape[0] > 1 else x
        xn = self.k.rmsnorm(x_last, self.dense["final_norm"])
        logits = np.asarray(self.dm.download(self.k.linear(xn, self.dense["lm_head"])), dtype=np.float32)[-1]
        if self.observer is not None:
            self.observer("head", -1, np.asarray(self.dm.download(x_last)), logits[None, :])
        return logits

    def prefill(self, prompt: np.ndarray | int, loan: Loan | NoLoan) -> np.ndarray | None:
        """Read a prompt in the loan's chunks; the last token's logits (None in accounting mode)."""
        total = int(prompt) if np.isscalar(prompt) else len(prompt)
        chunk = max(1, int(loan.chunk_tokens))
        ring = loan.ring if isinstance(loan, Loan) else _NO_RING
        logits = None
        for start in range(0, total, chunk):
            n = min(chunk, total - start)
            temps: list = []
            try:
                self.cache.tick()
                x = self._embed(None if np.isscalar(prompt) else prompt[start:start + n], temps)
                for work in self._works("prefill", x, n, ring):
                    self.ops.prefill_layer(work)
                if start + n >= total and not self.accounting_only:
                    logits = self._head(x, temps)
            finally:
                self._free(temps)
            self.stats.chunks += 1
            self.stats.prefill_tokens += n
            if self.progress:
                self.progress("prefill", n)
        return logits

    def decode_step(self, token: int) -> np.ndarray | None:
        """One decode step of one token; its logits (None in accounting mode)."""
        temps: list = []
        try:
            self.cache.tick()
            x = self._embed(np.array([token]) if not self.accounting_only else None, temps)
            self.ops.decode_step(self._works("decode", x, 1, _NO_RING))
            logits = None if self.accounting_only else self._head(x, temps)
        finally:
            self._free(temps)
        self.stats.decode_tokens += 1
        if self.progress:
            self.progress("decode", 1)
        return logits
