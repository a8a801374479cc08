"""The cuda session's layer ops: the executor's LayerWork run on strata_cuda.fast.FastMoE's fused paths.

- `prefill_layer`: rmsnorm and router through the session's kernels, then FastMoE.prefill_layer: routing counts and
  positions on the device, one host sync for the counts (the GEMM sizes), the hits as size-class batched GEMMs
  over a compact stack, the misses streamed into the loan's ring slots on a copy stream (grouped copies, events),
  and the weighted sum added to the residual in k order. The cache's slot map is read before routing (`slot_of`
  of the runtime's ExpertCache) and the hits and misses are counted with `lookup` once the counts are known. A chunk
  without a ring admits its misses into the cache (copies on the executor's copy stream behind a fence, the compute
  stream waiting for them) when the cache could take every uncached expert of the layer without evicting one of its
  cached ones; otherwise the composed op runs it.
- `decode_step`: every layer of the token as one CUDA graph replay (per layer: rmsnorm + router, gate/up, down
  into the residual), no host sync per layer; a missed expert is read by the kernels from mapped page-locked host
  memory (only rows the store has page-locked). After the replay the routed ids of all layers come back in one copy
  for the hit and miss counts. Decode admits no misses on the critical path; once, when a cache that holds every
  expert lacks some (a prompt's loan overwrote them) and they cannot be read from host memory, they are copied back
  before the step (a refill), so later steps replay the graph with every expert cached.
Where the fused paths do not apply (expert formats other than f16 and Q8_0, shapes off their grid, a chunk without a
ring in a cache too small to admit its misses, Q8_0 or unmapped host memory in decode) the core's ComposedLayerOps over the same session runs the
layer, so every model still runs.
cupy is imported on first use: this module imports without it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from strata_core.api.kernels import ExpertPool, LayerWork
from strata_core.errors import StrataError

EMPTY = -1
#: The fused paths' formats (FastMoE's layouts).
FUSED_DTYPES = ("f16", "q8_0")
#: The CPU share stays off on the fused path's fallback (it would need the runtime's share buffers).
_NO_SHARE = SimpleNamespace(armed_for=lambda tokens: False, rows_capacity=0)


class CudaLayerOps:
    """LayerOps on a cuda session: FastMoE per model shape, ComposedLayerOps where the fused paths do not apply."""

    name = "cuda-fused"
    #: f16 activations and intermediates, f32 accumulation (the --check bound of that path)
    precision = "f16"

    def __init__(self, memory: Any, kernels: Any, workspace_bytes: int = 0,
                 shape: tuple[int, int, int, int] | None = None, max_tokens: int = 0):
        from .fast import FastMoE, precompile, warm_gemms, warm_up
        try:
            warm_up()  # at session open: NVRTC, cuBLAS start-up and handles stay out of the first layer's time
        except Exception:  # a failed warm-up costs only time: the first layer pays it, or reports what is wrong
            precompile()
        self._fast: dict[tuple, Any] = {}
        e, k, h, f = shape or (0, 0, 0, 0)
        if shape is not None and h % 32 == 0 and f % 32 == 0 and e <= 256 and k <= 16:
            try:
                # the plan's shape: its FastMoE built now and every GEMM size class its chunks can meet run once,
                # so cuBLAS loads its kernels here and not inside the first request's layers
                self._fast[tuple(shape)] = FastMoE(*shape)
                warm_gemms(self._fast[tuple(shape)], max(1, int(max_tokens)))
            except Exception:  # a failed warm-up costs only time (the first request pays it)
                pass
        self.memory = memory
        self.kernels = kernels
        self.workspace_bytes = int(workspace_bytes)
        self._composed: Any = None
        self._maps_host: np.ndarray | None = None
        self._rows_for: tuple = ()
        self._rows = np.zeros(0, np.int64)
        self._bases: dict[int, tuple[int, int]] = {}
        self._layers_cache: tuple | None = None
        self._maps_dev: Any = None
        self._ids_dev: Any = None
        self._w_dev: Any = None
        #: how many layers each path ran (a test and `strata run` can tell which path ran)
        self.counts = {"prefill_fused": 0, "prefill_composed": 0, "decode_graph_steps": 0, "decode_plain_steps": 0,
                       "decode_composed_steps": 0}

    # --- shapes and fallbacks ------------------------------------------------------------------------------

    @staticmethod
    def _shape(w: LayerWork) -> tuple[int, int, int, int] | None:
        """(E, K, H, F) of the work when the fused paths take it, else None."""
        pool = w.pool
        if pool is None or pool.dtype not in FUSED_DTYPES or w.router_w is None:
            return None
        down = pool.arrays.get("w_down" if pool.dtype == "f16" else "down_q")
        if down is None or not hasattr(down, "data"):
            return None
        e, h, f = int(w.router_w.shape[0]), int(down.shape[1]), int(down.shape[2])
        if h % 32 or f % 32 or e > 256 or w.top_k > 16:
            return None
        return e, int(w.top_k), h, f

    def _fast_for(self, w: LayerWork) -> Any:
        """The FastMoE of this work's shape (built once), or None when the fused paths do not apply."""
        if w.pool is not None and w.pool.dtype == "gguf":  # Q4_K/Q5_K/Q6_K/MXFP4 rows: f16 scratch per expert group
            from .quant_ffn import quant_moe_for
            return quant_moe_for(self._fast, w)
        shape = self._shape(w)
        if shape is None:
            return None
        if shape not in self._fast:
            from .fast import FastMoE
            self._fast[shape] = FastMoE(*shape)
        return self._fast[shape]

    def _fallback(self, w: LayerWork) -> Any:
        """The core's composed layer ops over this session (built once)."""
        if self._composed is None:
            from strata_core.runtime.layer_ops import ComposedLayerOps
            store = getattr(w.source, "store", None)
            if store is None:
                raise StrataError("cuda layer ops: this layer needs the composed path, and its expert source has "
                                  "no host store")
            down = w.pool.arrays.get("w_down", w.pool.arrays.get("down_q"))
            ffn = int(down.shape[2]) if down is not None and getattr(down, "ndim", 0) == 3 else 0
            self._composed = ComposedLayerOps(dm=self.memory, kernels=self.kernels, store=store, share=_NO_SHARE,
                                              hidden=int(w.x.shape[1]), expert_ffn=ffn,
                                              experts_per_layer=int(getattr(w.slots, "experts_per_layer", 0)),
                                              layers=int(getattr(w.slots, "layers", 1)),
                                              workspace_bytes=self.workspace_bytes)
        return self._composed

    # --- the cache as the fused paths see it ---------------------------------------------------------------

    @staticmethod
    def _slot_map(w: LayerWork, experts: int) -> np.ndarray:
        """Slot of every expert of the layer (-1: missed), read without counting a lookup."""
        rows = np.asarray(w.slots.row(w.layer, np.arange(experts)), dtype=np.int64)
        table = getattr(w.slots, "slot_of", None)
        if table is None:
            raise StrataError("cuda layer ops need the runtime's expert cache (its slot_of table)")
        return np.asarray(table[rows], dtype=np.int64)

    @staticmethod
    def _host_layer(w: LayerWork, experts: int) -> ExpertPool | None:
        """The host store's experts of this layer, indexed by expert id (views, no copy)."""
        store = getattr(w.source, "store", None)
        if store is None or getattr(store.pool, "dtype", None) != w.pool.dtype:
            return None
        r0 = int(w.slots.row(w.layer, 0))
        return ExpertPool(w.pool.dtype, {k: a[r0:r0 + experts] for k, a in store.pool.arrays.items()})

    # --- prefill -------------------------------------------------------------------------------------------

    def prefill_layer(self, work: LayerWork) -> None:
        """Run one MoE layer of a prompt chunk in place on work.x."""
        fast = self._fast_for(work)
        with_ring = work.ring is not None and len(work.ring) > 0
        host = self._host_layer(work, fast.experts) if fast is not None and with_ring else None
        slot_map = self._slot_map(work, fast.experts) if fast is not None else None
        if fast is None or (with_ring and host is None) or (not with_ring and not self._can_admit(work, slot_map)):
            self.counts["prefill_composed"] += 1
            self._fallback(work).prefill_layer(work)
            return
        import cupy as cp
        observer = work.extras.get("observer")
        x = work.x
        x_in = np.asarray(self.memory.download(x)) if observer is not None else None
        fast.compute_stream = cp.cuda.get_current_stream()
        xn = self.kernels.rmsnorm(x, work.norm_w)
        logits = self.kernels.linear(xn, work.router_w)
        ring = np.asarray(work.ring, dtype=np.int64) if with_ring else None

        def on_counts(counts: np.ndarray) -> np.ndarray:
            used = np.flatnonzero(counts > 0)
            work.slots.lookup(work.layer, used, counts[used])
            missed = used[slot_map[used] < 0]
            if with_ring or missed.size == 0:
                return slot_map
            return self._admit(work, slot_map, used, missed)

        fast.prefill_layer(xn, logits, work.pool, slot_map, host, ring, out=x, accumulate=True, on_counts=on_counts)
        st = fast.stats
        if with_ring and st.misses:
            work.stats["experts_streamed"] += int(st.misses)
            work.stats["bytes_streamed"] += int(st.bytes_streamed)
            work.stats["ring_batches"] += int(st.copy_groups)
        self.counts["prefill_fused"] += 1
        work.workspace.reset()
        if observer is not None:
            observer(work.phase, work.layer, x_in, np.asarray(self.memory.download(x)))

    @staticmethod
    def _can_admit(work: LayerWork, slot_map: np.ndarray) -> bool:
        """Could every uncached expert of this layer be admitted without evicting one of its cached experts? Then a
        chunk without a ring admits its misses (known only after routing) on the fused path."""
        usable = getattr(work.slots, "usable", None)
        if usable is None:
            return False
        return int(np.count_nonzero(usable())) - int(np.count_nonzero(slot_map >= 0)) >= \
            int(np.count_nonzero(slot_map < 0))

    def _admit(self, work: LayerWork, slot_map: np.ndarray, used: np.ndarray, missed: np.ndarray) -> np.ndarray:
        """Admit every missed expert into the cache (never evicting this layer's hits), copies ordered before the
        compute stream's next work; the new slot map. Raises when the cache cannot take them all."""
        import cupy as cp
        hits = slot_map[used]
        hits = hits[hits >= 0]
        got = work.slots.admit(work.layer, missed, keep=hits)
        if np.any(got < 0):
            raise StrataError(f"layer {work.layer}: the cache cannot take the {missed.size} missed experts of this "
                              f"chunk without a ring")
        cs = work.copy_stream
        fence = cp.cuda.Event(disable_timing=True)
        fence.record(cp.cuda.get_current_stream())
        cs.wait_event(fence)  # earlier layers' kernels may still read the evicted slots
        for e, slot in zip(missed, got):
            work.source.upload(int(work.slots.row(work.layer, int(e))), int(slot), cs)
        landed = cp.cuda.Event(disable_timing=True)
        landed.record(cs)
        cp.cuda.get_current_stream().wait_event(landed)
        work.stats["experts_admitted"] += int(missed.size)
        out = slot_map.copy()
        out[missed] = got
        return out

    # --- decode --------------------------------------------------------------------------------------------

    def _hosts(self, works: list[LayerWork], fast: Any, rows: np.ndarray, missing: np.ndarray) -> list | None:
        """Per layer, the host addresses the kernels read its missed experts at (None: no miss), or None when some
        missed row is pageable or the device cannot use registered memory at its host address."""
        has = missing.any(axis=1)
        if not has.any():
            return [None] * len(works)
        store = getattr(works[0].source, "store", None)
        pinned = getattr(store, "pinned_rows", None)
        if store is None or pinned is None or store.pool.dtype != "f16":
            return None
        if np.any(missing & ~pinned[rows].reshape(missing.shape)):
            return None
        a13, a2 = store.pool.arrays["w_gate_up"], store.pool.arrays["w_down"]
        if "same_address" not in self.__dict__:
            r = int(rows.reshape(missing.shape)[missing][0])
            rep = fast.host_mapping_report((int(a13[r].ctypes.data), int(a2[r].ctypes.data)))
            self.same_address = all(x["host_ptr"] and x["device_ptr"] == x["host_ptr"] for x in rep)
        if not self.same_address:
            return None
        out = []
        for i, w in enumerate(works):
            if not has[i]:
                out.append(None)
                continue
            r0 = int(rows[i * missing.shape[1]])
            if r0 not in self._bases:
                self._bases[r0] = (int(a13[r0].ctypes.data), int(a2[r0].ctypes.data))
            out.append(self._bases[r0])
        return out

    def _refill(self, works: list[LayerWork], maps: np.ndarray) -> bool:
        """Copy every missing expert back into a cache that can hold them all (behind a fence, on the copy stream,
        the compute stream waiting for it); False when the cache is smaller than the model."""
        import cupy as cp
        cache = works[0].slots
        room = int(getattr(cache, "slots", 0)) - int(getattr(cache, "slots_on_loan", 0))
        if room < int(getattr(cache, "layers", 0)) * int(getattr(cache, "experts_per_layer", 0)) or room <= 0:
            return False
        cs = works[0].copy_stream
        fence = cp.cuda.Event(disable_timing=True)
        fence.record(cp.cuda.get_current_stream())
        cs.wait_event(fence)
        for w, row in zip(works, maps):
            missed = np.flatnonzero(row < 0)
            if not missed.size:
                continue
            got = w.slots.admit(w.layer, missed)
            for e, slot in zip(missed, got):
                if slot >= 0:
                    w.source.upload(int(w.slots.row(w.layer, int(e))), int(slot), cs)
            w.stats["experts_admitted"] += int((got >= 0).sum())
        landed = cp.cuda.Event(disable_timing=True)
        landed.record(cs)
        cp.cuda.get_current_stream().wait_event(landed)
        return True

    def _decode_layers(self, works: list[LayerWork], fast: Any) -> tuple | None:
        """(DecodeLayer of every work, the graph's key) with the device slot maps refreshed from the cache, or None
        when some layer's misses can be neither read from mapped host memory nor refilled."""
        import cupy as cp
        from .fast import DecodeLayer
        n, e_n, k = len(works), fast.experts, fast.top_k
        layer_ids = tuple(w.layer for w in works)
        if self._rows_for != layer_ids:
            self._rows = np.concatenate([np.asarray(w.slots.row(w.layer, np.arange(e_n)), dtype=np.int64)
                                         for w in works])
            self._rows_for = layer_ids
        table = getattr(works[0].slots, "slot_of", None)
        if table is None:
            raise StrataError("cuda layer ops need the runtime's expert cache (its slot_of table)")
        maps = table[self._rows].reshape(n, e_n).astype(np.int32)
        hosts = self._hosts(works, fast, self._rows, maps < 0)
        if hosts is None:
            if not self._refill(works, maps):
                return None
            maps = table[self._rows].reshape(n, e_n).astype(np.int32)
            hosts = self._hosts(works, fast, self._rows, maps < 0)
            if hosts is None:
                return None
        if self._maps_dev is None or self._maps_dev.shape != maps.shape:
            self._maps_dev = cp.empty(maps.shape, dtype=cp.int32)
            self._ids_dev = cp.empty((n, k), dtype=cp.int32)
            self._w_dev = cp.empty((n, k), dtype=cp.float32)
            self._maps_host = None
            self._layers_cache = None
        if self._maps_host is None or not np.array_equal(self._maps_host, maps):
            self._maps_dev.set(maps, stream=cp.cuda.get_current_stream())
            self._maps_host = maps
        sig = (int(works[0].x.data.ptr), tuple(hosts),
               tuple((id(w.norm_w), id(w.router_w), id(w.pool)) for w in works))
        if self._layers_cache is None or self._layers_cache[0] != sig:
            layers = [DecodeLayer(norm_w=w.norm_w, router_w=w.router_w, pool=w.pool, slot_map=self._maps_dev[i],
                                  ids=self._ids_dev[i], w=self._w_dev[i], host=hosts[i]) for i, w in enumerate(works)]
            key = ("stack", int(works[0].x.data.ptr)) + tuple(lay.key() for lay in layers)
            self._layers_cache = (sig, layers, key)
        return self._layers_cache[1], self._layers_cache[2]

    def decode_step(self, works: list[LayerWork]) -> None:
        """Run every MoE layer of one decode token: one graph replay where the fused decode applies."""
        if not works:
            return
        fast = self._fast_for(works[0])
        observer = works[0].extras.get("observer")
        if fast is None or works[0].pool.dtype != "f16" or any(self._shape(w) != self._shape(works[0])
                                                               for w in works):
            self.counts["decode_composed_steps"] += 1
            self._fallback(works[0]).decode_step(works)
            return
        import cupy as cp
        got = self._decode_layers(works, fast)
        if got is None:
            self.counts["decode_composed_steps"] += 1
            self._fallback(works[0]).decode_step(works)
            return
        layers, key = got
        fast.compute_stream = cp.cuda.get_current_stream()
        x = works[0].x
        if observer is None:
            fast.decode_stack(x, layers, graph=True, key=key)
            self.counts["decode_graph_steps"] += 1
        else:
            # --check: layer by layer, each layer's residual handed to the observer
            for w, lay in zip(works, layers):
                x_in = np.asarray(self.memory.download(x))
                fast.decode_stack(x, [lay], graph=False)
                observer(w.phase, w.layer, x_in, np.asarray(self.memory.download(x)))
            self.counts["decode_plain_steps"] += 1
        ids = self._ids_dev.get(stream=cp.cuda.get_current_stream())
        e_n = fast.experts
        # store rows of every routed (layer, expert) of the step, counted in one call: row(0, r) is r, so one
        # lookup over layer 0's numbering is the per-layer lookups at once (48 calls cost ~0.5 ms a step)
        rows = (ids + (np.asarray([w.layer for w in works], dtype=np.int64) * e_n)[:, None]).ravel()
        cnt = np.bincount(rows, minlength=(max(w.layer for w in works) + 1) * e_n)
        used = np.flatnonzero(cnt)
        works[0].slots.lookup(0, used, cnt[used])
        seen = set()
        for w in works:  # the works share one arena: reset each once
            if id(w.workspace) not in seen:
                seen.add(id(w.workspace))
                w.workspace.reset()
