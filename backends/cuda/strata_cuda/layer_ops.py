"""The cuda session's layer ops: the executor's LayerWork run on strata_cuda.fast.FastMoE's fused paths.

- `prefill_layer`: rmsnorm and router through the session's kernels, then FastMoE.prefill_layer: routing counts and
  positions on the device, one host sync for the counts (the GEMM sizes), the hits as size-class batched GEMMs
  over a compact stack, the misses streamed into the loan's ring slots on a copy stream (grouped copies, events),
  and the weighted sum added to the residual in k order. The cache's slot map is read before routing (`slot_of`
  of the runtime's ExpertCache) and the hits and misses are counted with `lookup` once the counts are known. A chunk
  without a ring admits its misses into the cache (copies on the executor's copy stream behind a fence, the compute
  stream waiting for them) when the cache could take every uncached expert of the layer without evicting one of its
  cached ones; otherwise the composed op runs it. The layer's norm and router outputs and FastMoE's stacks, tables
  and scratch are carved from the chunk's arena (the plan's workspace and the loan's buffer slots; `worst_carves`
  tells the executor how many buffer slots that takes), so the layer allocates nothing. After a streamed layer the
  hottest experts the ring still holds replace colder cached ones of the layer (device-to-device copies on the
  compute stream): the prompt leaves the cache holding what it routed to most.
- `decode_step`: every layer of the token as one CUDA graph replay (per layer: rmsnorm + router, gate/up, down
  into the residual), no host sync per layer, for f16, Q8_0 (kernels that read the quants and scales) and 'gguf'
  pools (QuantMoE's GEMV kernels); a missed f16 or Q8_0 expert is read by the kernels from mapped page-locked host
  memory (only rows the store has page-locked); 'gguf' misses are refilled first (a cache that holds every
  expert) or the step runs composed. After the replay the routed ids of all layers come back in one copy
  (asynchronous, into a page-locked buffer, on a side stream) for the hit and miss counts (one cache lookup for
  all layers); the executor calls `decode_launch`, queues the LM head, then `decode_done` counts while the head
  runs. With the same works as the last step and an unchanged slot table, the step's layers are the last step's. Misses are admitted off the critical path: after a
  step, the hottest experts it read from host memory (every missing one when the cache holds the whole model) are
  copied into the cache on the copy stream, and their maps say "host" until the copy has landed. When missed rows
  are not page-locked and the cache holds every expert, they are copied back before the step (a refill). The
  first step after a prompt tops the cache up: the slots the prompt's loan gave back empty get the hottest experts
  not cached (copies on the copy stream in groups, each read from host memory until it has landed).
  The session warms the plan's shape at open (every GEMM size class on the run's streams, the router and norm), so
  the first request pays no cuBLAS or cupy first use.
Where the fused paths do not apply (expert formats other than f16 and Q8_0, shapes off their grid, a chunk without a
ring in a cache too small to admit its misses, unmapped host memory in decode, 'gguf' decode misses in a cache
smaller than the model, a router bias) the core's ComposedLayerOps over the same session runs the
layer, so every model still runs.
cupy is imported on first use: this module imports without it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from strata_core.api.kernels import ExpertPool, LayerWork
from strata_core.errors import StrataError
from strata_core.runtime.devmem import DeviceFull

from .fast import DECODE_HOST_ARRAYS

EMPTY = -1
#: The fused paths' formats (FastMoE's layouts).
FUSED_DTYPES = ("f16", "q8_0")
#: The formats decode_step runs as one graph replay (gguf: QuantMoE's GEMV kernels, misses read from mapped host
#: rows where quant_decode.cu's kernels take the format, else every routed expert cached).
DECODE_DTYPES = ("f16", "q8_0", "gguf")
#: CudaLayerOps.decode_admit_hotter's default (bench/link_trace_h200.py measures both)
DECODE_ADMIT_HOTTER = True
#: CudaLayerOps.decode_landing's default. On: where a step's layers take the third-form decode kernels, decode
#: admits a missed expert by reserving a slot for it (ExpertCache.reserve) that the kernels write the expert into the
#: next time they read it from host memory, so an admission adds no bytes to the link. Off (copies, the default):
#: measured on the H200 at Qwen3-30B-A3B half-skewed (bench/results/lead_h200_s10/call2, lead_h200_s11/call1),
#: landing decoded Q8_0 at 268.3, 269.7 and 270.9 tok/s against 274.1, 275.5 and 275.8 by copies, F16 at 201.0 and
#: 203.2 against 200.3 and 203.9 (bench/README.md, "Half-cached decode"):
#: an expert missed is seldom routed again within LANDING_EXPIRE_STEPS steps of random tokens (37 of 133
#: reservations landed), so its hit rate is lower (0.945 against 0.950), and the copies' extra link bytes go on the
#: copy stream, beside the step, not in its way.
DECODE_LANDING = False
#: a landing reservation not filled within this many counted steps is given back (its slot empty again)
LANDING_EXPIRE_STEPS = 32
#: CudaLayerOps.decode_top_up's default. On: the first decode step after a prompt fills the slots the prompt's loan
#: gave back empty (ExpertCache.top_up: the hottest experts not cached, by the frequency the prompt left), copied on
#: the copy stream while the first steps run. Replayed against the routing recorded on the H200
#: (bench/decode_cache_policy.py on bench/results/s12_h200/decode_trace_*.npz): Qwen3-30B-A3B half-skewed Q8_0 decode
#: reads 17.4 experts a step from host memory instead of 19.2 (319 slots came back empty), F16 15.9 instead of 16.6.
DECODE_TOP_UP = True
#: top-up copies per landing event: each group reaches the slot maps as soon as it has landed
TOP_UP_GROUP = 16
#: The CPU share stays off on the fused path's fallback (it would need the runtime's share buffers).
_NO_SHARE = SimpleNamespace(armed_for=lambda tokens: False, rows_capacity=0)


class CudaLayerOps:
    """LayerOps on a cuda session: FastMoE per model shape, ComposedLayerOps where the fused paths do not apply."""

    name = "cuda-fused"
    #: the executor may hand decode_step the same LayerWork objects every step (x and workspace updated): nothing
    #: here keeps a work past its step except as the key of its cached DecodeLayers
    takes_reused_works = True
    #: f16 activations and intermediates, f32 accumulation (the --check bound of that path)
    precision = "f16"

    def __init__(self, memory: Any, kernels: Any, workspace_bytes: int = 0,
                 shape: tuple[int, int, int, int] | None = None, max_tokens: int = 0, layers: int = 0,
                 pool_dtype: str = "f16", slot_bytes: int = 0, pinned: Any = None):
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
                self._fast[tuple(shape)] = FastMoE(*shape, pinned=pinned)
                warm_gemms(self._fast[tuple(shape)], max(1, int(max_tokens)), str(pool_dtype))
                self._fast[tuple(shape)].decode_buffers()
                self._warm_router(kernels, max(1, int(max_tokens)), e, h)
            except Exception:  # a failed warm-up costs only time (the first request pays it)
                pass
        #: the plan's FastMoE shape and expert format (worst_carves sizes a chunk's buffers from them)
        self._plan_shape = tuple(shape) if shape is not None and tuple(shape) in self._fast else None
        self._plan_dtype, self._plan_slot_bytes = str(pool_dtype), int(slot_bytes)
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
        #: _upload_maps' two page-locked stagings ([host view, event after its last pull, buffer]) and the one in use
        self._maps_stage: list | None = None
        self._maps_flip = 0
        self._ids_dev: Any = None
        self._w_dev: Any = None
        if shape is not None and layers > 0:
            # the decode graph's small tables, made with the session (before the plan's regions are taken), so a
            # decode step allocates nothing
            import cupy as cp
            self._maps_dev = cp.empty((int(layers), 2 * e), dtype=cp.int32)  # slot maps | landing tables
            self._ids_dev = cp.empty((int(layers), k), dtype=cp.int32)
            self._w_dev = cp.empty((int(layers), k), dtype=cp.float32)
        #: a prompt's streamed layers leave their hottest ring experts in the cache (device-to-device copies)
        self.admit_from_ring = True
        self._prev_streamed: tuple | None = None
        #: decode admits at most this many bytes of the experts it read from host memory per step, off the
        #: critical path (0: decode admits nothing); about one step's worth of the link
        self.decode_admit_bytes = 64 << 20
        #: decode admits a missed expert only over a colder one (ExpertCache.worth_admitting): without it, each
        #: step's misses evicted the coldest slots whatever they held
        self.decode_admit_hotter = DECODE_ADMIT_HOTTER
        self._pending: tuple | None = None
        #: fill the slots a prompt's loan gave back at the next decode step (DECODE_TOP_UP); owed after a prompt
        self.decode_top_up = DECODE_TOP_UP
        self._top_up_owed = False
        #: the top-up's copy groups not known to have landed: (store rows, event after their copies), oldest first
        self._topping: list[tuple[np.ndarray, Any]] = []
        #: admit decode's misses by landing (DECODE_LANDING) where the step's kernels can
        self.decode_landing = DECODE_LANDING
        #: landing reservations: store row -> (its reserved slot, the count of steps when it was reserved)
        self._landing: dict[int, tuple[int, int]] = {}
        #: the landing tables [layers, E] the last built step's layers read (None: no landing), steps counted
        self._land_host: np.ndarray | None = None
        self._counted_steps = 0
        #: launched steps not counted yet, oldest first (at most two: a deferred step and the one queued after it):
        #: (works, slot maps, ids copy event, experts per layer, host buffer index, tick owed, landing tables)
        self._launched: list[tuple] = []
        #: the routed ids' two page-locked host buffers (steps alternate, so a step's copy never lands in the buffer
        #: the host is still to read), the one the last launched step's ids land in, and how many steps were launched
        self._ids_pair: tuple[np.ndarray, np.ndarray] | None = None
        self._ids_host: np.ndarray | None = None
        self._launch_no = 0
        #: greedy decode on the device (greedy_*): its kernels, the token on the device, the tokens' two page-locked
        #: host slots with their copy events, the slots queued and not read yet, and the embedding table's page-locking
        self._greedy: Any = None
        self._tok_dev: Any = None
        self._tok_host: np.ndarray | None = None
        self._tok_buf: Any = None
        self._tok_events: tuple = ()
        self._tok_queued: list[int] = []
        self._tok_read: list[int] = []
        self._tok_no = 0
        self._table_buf: Any = None
        try:
            # with the session, as the decode tables above: compiled and allocated before the plan's regions
            from .kernels import GreedyKernels
            import cupy as cp
            self._greedy = GreedyKernels()
            self._tok_dev = cp.zeros(1, dtype=cp.int32)
        except Exception:  # no greedy kernels here: the executor keeps the step loop (it costs only speed)
            self._greedy = self._tok_dev = None
        #: the session's page-locked allocator (the plan's pinned budget): the routed ids' host buffer comes from
        #: its runtime floor, so no page-locked byte of a decode step is outside the plan
        self._pinned = pinned
        self._ids_buf: Any = None
        self._ids_stream: Any = None
        #: the last step's (works, x address) when its layers came from the cache unchanged (see _decode_layers)
        self._quick: tuple | None = None
        from cupy.cuda import runtime
        self._rt = runtime
        #: the executor carves the LM head's outputs from the plan's arena for these kernels (they take out=)
        self._takes_out = {"rmsnorm": True, "linear": True}
        #: how many layers each path ran (a test and `strata run` can tell which path ran)
        self.counts = {"prefill_fused": 0, "prefill_composed": 0, "decode_graph_steps": 0, "decode_plain_steps": 0,
                       "decode_composed_steps": 0, "decode_layers_reused": 0}

    def head_linear(self, x: Any, w: Any, out: Any) -> Any | None:
        """The LM head out [T,O] f32 = x [T,H] f32 . w^T through the plan's FastMoE GEMV (warp rows, hardware half
        conversion, weights loaded before the wait for x), or None when it does not apply (no plan shape, not f16,
        more than GEMV_MAX_T rows, unaligned): the executor then calls the KernelSet's linear."""
        import cupy as cp
        from .kernels import GEMV_MAX_T
        fast = self._fast.get(self._plan_shape) if self._plan_shape is not None else None
        if (fast is None or out is None or not isinstance(w, cp.ndarray) or w.dtype != cp.float16
                or not w.flags.c_contiguous or not isinstance(x, cp.ndarray) or x.dtype != cp.float32 or x.ndim != 2
                or not x.flags.c_contiguous or not 0 < x.shape[0] <= GEMV_MAX_T or x.shape[1] % 8
                or w.ndim != 2 or w.shape[1] != x.shape[1] or w.data.ptr % 16 or x.data.ptr % 16
                or tuple(out.shape) != (x.shape[0], w.shape[0]) or out.dtype != cp.float32
                or not out.flags.c_contiguous):
            return None
        self.counts["head_gemv"] = self.counts.get("head_gemv", 0) + 1
        return fast.gemv_f16w(x, w, out)

    @staticmethod
    def _warm_router(kernels: Any, tokens: int, experts: int, hidden: int) -> None:
        """The norm and router of a `tokens`-token chunk once, as a layer calls them (out= buffers, f32 router):
        cupy compiles its helper kernels and cuBLAS loads its f32 GEMM at first use, which cost the first layer of
        the first request ~90 ms on the H200 (bench/results/a_h200/call2_diag_run_h200.json)."""
        import cupy as cp
        x = cp.zeros((tokens, hidden), dtype=cp.float32)
        xn = kernels.rmsnorm(x, cp.ones(hidden, dtype=cp.float32), out=cp.empty_like(x))
        kernels.linear(xn, cp.zeros((experts, hidden), dtype=cp.float32),
                       out=cp.empty((tokens, experts), dtype=cp.float32))
        kernels.linear(xn[:1], cp.zeros((experts, hidden), dtype=cp.float16))
        cp.cuda.get_current_stream().synchronize()

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
        if w.extras.get("router_bias") is not None:  # the fused routing's top k on the device adds no bias
            return None
        if w.pool is not None and w.pool.dtype == "gguf":  # Q4_K/Q5_K/Q6_K/MXFP4 rows: f16 scratch per expert group
            from .quant_ffn import quant_moe_for
            return quant_moe_for(self._fast, w, self._pinned)
        shape = self._shape(w)
        if shape is None:
            return None
        if shape not in self._fast:
            from .fast import FastMoE
            self._fast[shape] = FastMoE(*shape, pinned=self._pinned)
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
        self.decode_done()  # a decode step launched and never counted is counted before the prompt reads the cache
        self._release_landings(work.slots)  # the prompt may lend or admit into every slot
        self._await_top_up()  # nor may it lend a slot a top-up copy is still writing
        self._top_up_owed = True
        # (FastMoE, cache, layer, ring) of the last streamed prefill, when it was the call just before this one
        prev, self._prev_streamed = self._prev_streamed, None
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
        xn, logits = self._carve_prefill(work, fast)
        xn = self.kernels.rmsnorm(x, work.norm_w, out=xn)
        logits = self.kernels.linear(xn, work.router_w, out=logits)
        ring = np.asarray(work.ring, dtype=np.int64) if with_ring else None
        here = (id(fast), id(work.slots), int(work.layer), ring.tobytes()) if with_ring else None
        if with_ring:
            # the first copy group starts before the routing is known (fast.PREFETCH_MISSES); its slots' last
            # readers are known precisely when the previous layer of this chunk streamed through the same ring
            fast.prefetch_misses(work.pool, host, np.flatnonzero(slot_map < 0), ring,
                                 after_previous_layer=prev == (here[0], here[1], here[2] - 1, here[3]))

        seen_counts: list = []

        def on_counts(counts: np.ndarray) -> np.ndarray:
            seen_counts.append(counts)
            used = np.flatnonzero(counts > 0)
            work.slots.lookup(work.layer, used, counts[used])
            missed = used[slot_map[used] < 0]
            if with_ring or missed.size == 0:
                return slot_map
            return self._admit(work, slot_map, used, missed)

        try:
            fast.prefill_layer(xn, logits, work.pool, slot_map, host, ring, out=x, accumulate=True,
                               on_counts=on_counts)
        except BaseException:
            fast.settle_prefetch()  # no copy may land in the ring after its slots go back to the cache
            raise
        st = fast.stats
        report = work.extras.get("fallback")
        if getattr(fast, "fused_error", None) and report is not None:
            # the warm groups ran on the f16 scratch path instead: right, slower; the run says so once
            report("fused quant GEMM", f"{fast.fused_error}; warm groups take the f16 scratch path")
        if st.device_table:
            self.counts["prefill_device_table"] = self.counts.get("prefill_device_table", 0) + 1
        if st.device_hits:
            self.counts["prefill_device_hits"] = self.counts.get("prefill_device_hits", 0) + 1
        if st.prefetch:
            self.counts[f"prefetch_{st.prefetch}"] = self.counts.get(f"prefetch_{st.prefetch}", 0) + 1
        if with_ring and (st.misses or st.bytes_streamed):
            work.stats["experts_streamed"] += int(st.misses)
            work.stats["bytes_streamed"] += int(st.bytes_streamed)
            work.stats["ring_batches"] += int(st.copy_groups)
            if self.admit_from_ring and st.ring_held and seen_counts:
                read = self._admit_from_ring(work, fast, slot_map, st.ring_held, seen_counts[0])
                if read:
                    fast.ring_read(read)  # a later prefetch into these ring slots waits for these reads
        self._prev_streamed = here
        self.counts["prefill_fused"] += 1
        work.workspace.reset()
        if observer is not None:
            observer(work.phase, work.layer, x_in, np.asarray(self.memory.download(x)))

    def prefill_done(self) -> None:
        """Count every cached layer of the chunk whose counts stayed on the device (FastMoE.flush_counts): the
        executor calls this after a chunk's layers, before anything reads the cache's figures."""
        for fast in self._fast.values():
            fast.flush_counts()

    def _admit_from_ring(self, work: LayerWork, fast: Any, slot_map: np.ndarray, held: dict,
                         counts: np.ndarray) -> list[int]:
        """Swap this layer's cold cached experts for hotter ones the ring still holds, copied device to device on
        the compute stream after the layer (before the next layer's ring copies, which wait for this stream): the
        prompt leaves the cache holding what it routed to most, at HBM cost (about 5 us an expert), not the link's.

        Hotter is by the cache's decayed frequency, which the layer's lookup has just raised by this chunk's rows.
        A held expert replaces a cached one only when its frequency is higher, coldest first; empty usable slots
        are filled first. `fast` is the layer's FastMoE (its pull kernels copy the slots). Returns the ring slots
        read."""
        import cupy as cp
        cache = work.slots
        freq = getattr(cache, "freq", None)
        if freq is None or not hasattr(cache, "admit"):
            return []
        ring_slots = np.fromiter(held.keys(), dtype=np.int64, count=len(held))
        experts = np.fromiter(held.values(), dtype=np.int64, count=len(held))
        rows0 = int(cache.row(work.layer, 0))
        f_cand = freq[rows0 + experts]
        order = np.argsort(-f_cand, kind="stable")
        ring_slots, experts, f_cand = ring_slots[order], experts[order], f_cand[order]
        usable = cache.usable()
        empty = np.flatnonzero(usable & (cache.expert_in == EMPTY))
        cached = np.flatnonzero(slot_map >= 0)
        f_vict = np.sort(freq[rows0 + cached])
        # the i-th hottest candidate takes an empty slot, else the i-th coldest cached expert when it is colder
        n = 0
        for i in range(len(experts)):
            if i < len(empty):
                n += 1
                continue
            j = i - len(empty)
            if j >= len(f_vict) or not f_cand[i] > f_vict[j]:
                break
            n += 1
        if n == 0:
            return []
        victims = cached[np.argsort(freq[rows0 + cached], kind="stable")][: max(0, n - len(empty))]
        allowed = np.zeros(cache.slots, dtype=bool)
        allowed[empty[:n]] = True
        allowed[slot_map[victims]] = True
        got = cache.admit(work.layer, experts[:n], keep=np.flatnonzero(~allowed))
        stream = cp.cuda.get_current_stream()
        moved, read = 0, []
        for src, dst in zip(ring_slots[:n], got):
            if dst < 0:
                continue
            read.append(int(src))
            for arr in work.pool.arrays.values():
                per = int(arr.strides[0])
                d, s = int(arr.data.ptr) + int(dst) * per, int(arr.data.ptr) + int(src) * per
                # with the SMs: a device-to-device memcpy waits in the copy engine's queue behind the next layer's
                # ring copies, and the compute stream with it (fast.PULL_SMALL_COPIES)
                if not (getattr(fast, "pull_small_copies", False) and fast.pull(d, s, per, stream)):
                    self._rt.memcpyAsync(d, s, per, 3, stream.ptr)  # cudaMemcpyDeviceToDevice
            moved += 1
        work.stats["experts_admitted"] += moved
        self.counts["ring_admitted"] = self.counts.get("ring_admitted", 0) + moved
        return read

    def worst_carves(self, tokens: int, vocab: int, top_k: int | None = None) -> list:
        """The carves of a chunk's layer after its residual and of the LM head, in the order prefill_layer and the
        executor make them ((shape, dtype) or "fix" / "reset"): the executor replays them on a dry arena and lends
        only the buffer slots they need. Without the plan's shape: one carve no loan holds (lend them all)."""
        fast = self._fast.get(self._plan_shape) if self._plan_shape is not None else None
        if fast is None:
            return [((1 << 62,), np.uint8)]
        t, h, e = int(tokens), fast.hidden, fast.experts
        need = fast.prefill_buffer_bytes(t, self._plan_dtype, self._plan_slot_bytes)
        return (["fix", ((t, h), np.float32), ((t, e), np.float32)]
                + [((int(n),), np.uint8) for n in need.values() if n > 0]
                + ["reset", ((1, h), np.float32), ((1, int(vocab)), np.float32)])

    def _carve_prefill(self, work: LayerWork, fast: Any) -> tuple[Any, Any]:
        """The layer's norm output and router logits, and FastMoE's work buffers, carved from the chunk's arena (the
        plan's workspace and the loan's buffer slots), so the fused layer allocates nothing. Where the arena is too
        small they come from cupy's pool instead, counted in counts["buffers_outside_plan"]."""
        arena = work.workspace
        t, h, e = int(work.x.shape[0]), int(work.x.shape[1]), fast.experts
        mark = arena.mark()
        try:
            xn = arena.carve((t, h), np.float32)
            logits = arena.carve((t, e), np.float32)
            store = getattr(work.source, "store", None)
            need = fast.prefill_buffer_bytes(t, work.pool.dtype, int(getattr(store, "row_bytes", 0) or 0))
            lent = {}
            for name, nbytes in need.items():
                if nbytes > 0:
                    v = arena.carve((int(nbytes),), np.uint8)
                    lent[name] = (int(v.data.ptr), int(nbytes))
                else:
                    lent[name] = (0, 0)
        except (DeviceFull, AttributeError):
            arena.release(mark)
            fast.use_buffers(None)
            self.counts["buffers_outside_plan"] = self.counts.get("buffers_outside_plan", 0) + 1
            return None, None
        fast.use_buffers(lent)
        return xn, logits

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
        none = [None] * len(works) if not has.any() else None
        store = getattr(works[0].source, "store", None)
        pinned = getattr(store, "pinned_rows", None)
        dtype = getattr(getattr(store, "pool", None), "dtype", None)
        names = DECODE_HOST_ARRAYS.get(dtype) or (("blob",) if dtype == "gguf" else None)
        if store is None or pinned is None or names is None or store.pool.dtype != works[0].pool.dtype:
            return none
        if dtype == "gguf" and not self._gguf_reads_host(works, store):
            return none  # kernels that read cached experts only (misses are refilled first, or the step composed)
        pinned_here = pinned[rows].reshape(missing.shape)
        if np.any(missing & ~pinned_here):
            return None
        arrays = [store.pool.arrays[n] for n in names]
        if "same_address" not in self.__dict__:
            r = int(rows[0])
            rep = fast.host_mapping_report(tuple(int(a[r].ctypes.data) for a in arrays))
            self.same_address = all(x["host_ptr"] and x["device_ptr"] == x["host_ptr"] for x in rep)
        if not self.same_address:
            return none
        # a layer whose experts are all page-locked gets its host address whether or not it misses now, so the
        # graph's key (which includes them) stays the same while misses come and go: one capture per decode
        whole = pinned_here.all(axis=1)
        out = []
        for i, w in enumerate(works):
            if not (has[i] or whole[i]):
                out.append(None)
                continue
            r0 = int(rows[i * missing.shape[1]])
            if r0 not in self._bases:
                # a 'gguf' blob: the address of the layer's expert 0 and the store's row bytes (the kernels' stride)
                self._bases[r0] = ((int(arrays[0][r0].ctypes.data), int(arrays[0].strides[0])) if dtype == "gguf"
                                   else tuple(int(a[r0].ctypes.data) for a in arrays))
            out.append(self._bases[r0])
        return out

    def _gguf_reads_host(self, works: list[LayerWork], store: Any) -> bool:
        """Whether every layer's QuantMoE (its run of _decode_runs) reads its missed experts from the store's mapped
        rows (quant_decode.cu's kernels for its format, the rows aligned as their loads need), decided once per set
        of layers."""
        sig = tuple(id(w.router_w) for w in works)
        got = self.__dict__.get("_gguf_host")
        if got is None or got[0] != sig:
            blob = store.pool.arrays["blob"]
            runs = self._decode_runs(works) or ()
            ok = bool(runs)
            for f, a, b in runs:
                for w in works[a:b]:
                    r0 = int(w.slots.row(w.layer, 0))
                    ok = ok and f.reads_host_misses(w.pool, int(blob[r0].ctypes.data), int(blob.strides[0]))
            self._gguf_host = got = (sig, ok)
        return got[1]

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

    def _decode_layers(self, works: list[LayerWork], fast: Any, lands: bool = False) -> tuple | None:
        """(DecodeLayer of every work, the graph's key) with the device slot maps refreshed from the cache, or None
        when some layer's misses can be neither read from mapped host memory nor refilled. With `lands` each layer
        also reads its landing table (the reserved slots of _landing)."""
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
        maps = self._masked(table[self._rows].reshape(n, e_n).astype(np.int32))
        land = self._land_table(n, e_n) if lands else None
        quick = self._quick
        x_ptr = int(works[0].x.data.ptr)
        if (quick is not None and quick[0] is works and quick[1] == x_ptr and self._pending is None
                and not self._topping and self._layers_cache is not None and np.array_equal(self._maps_host, maps)
                and (land is None) == (self._land_host is None)
                and (land is None or np.array_equal(self._land_host, land))):
            # the same works over the same residual and an unchanged cache: the host addresses, the device maps
            # and the layers are the last step's (the O(layers) Python below costs ~0.1 ms a step)
            self.counts["decode_layers_reused"] += 1
            return self._layers_cache[1], self._layers_cache[2]
        self._quick = None
        hosts = self._hosts(works, fast, self._rows, maps < 0)
        if hosts is None:
            if not self._refill(works, maps):
                return None
            maps = self._masked(table[self._rows].reshape(n, e_n).astype(np.int32))
            hosts = self._hosts(works, fast, self._rows, maps < 0)
            if hosts is None:
                return None
        if self._maps_dev is None or tuple(self._maps_dev.shape) != (n, 2 * e_n):
            self._maps_dev = cp.empty((n, 2 * e_n), dtype=cp.int32)
            self._ids_dev = cp.empty((n, k), dtype=cp.int32)
            self._w_dev = cp.empty((n, k), dtype=cp.float32)
            self._maps_host = None
            self._layers_cache = None
        if (self._maps_host is None or not np.array_equal(self._maps_host, maps)
                or (land is None) != (self._land_host is None)
                or (land is not None and not np.array_equal(self._land_host, land))):
            self._upload_maps(fast, np.concatenate([maps, land if land is not None else np.full_like(maps, EMPTY)], 1))
            self._maps_host, self._land_host = maps, land
        sig = (int(works[0].x.data.ptr), tuple(hosts), lands,
               tuple((id(w.norm_w), id(w.router_w), id(w.pool)) for w in works))
        if self._layers_cache is None or self._layers_cache[0] != sig:
            layers = [DecodeLayer(norm_w=w.norm_w, router_w=w.router_w, pool=w.pool, slot_map=self._maps_dev[i, :e_n],
                                  ids=self._ids_dev[i], w=self._w_dev[i], host=hosts[i],
                                  land=self._maps_dev[i, e_n:] if lands else None) for i, w in enumerate(works)]
            key = ("stack", int(works[0].x.data.ptr)) + tuple(lay.key() for lay in layers)
            self._layers_cache = (sig, layers, key)
        self._quick = (works, x_ptr)
        return self._layers_cache[1], self._layers_cache[2]

    def _masked(self, maps: np.ndarray) -> np.ndarray:
        """The slot maps with every expert whose admission or top-up copy has not landed yet read from host memory
        (-1)."""
        if self._topping:
            while self._topping and self._topping[0][1].done:  # groups land in order
                self._topping.pop(0)
            if self._topping:
                flat = maps.reshape(-1)
                flat[np.isin(self._rows, np.concatenate([r for r, _ in self._topping]))] = -1
        if self._pending is not None:
            rows, event = self._pending
            if event.done:
                self._pending = None
            else:
                flat = maps.reshape(-1)
                hit = np.isin(self._rows, rows)
                flat[hit] = -1
        return maps

    def _top_up(self, works: list[LayerWork]) -> None:
        """Fill the empty slots (a prompt's loan came back) with the hottest experts of these layers not cached
        (ExpertCache.top_up), copied on the copy stream after the prompt's work, which used those slots, in groups
        of TOP_UP_GROUP whose landing events _masked reads: until a group lands the steps read it from host memory."""
        cache = works[0].slots
        top_up = getattr(cache, "top_up", None)
        if not self.decode_top_up or top_up is None or not hasattr(works[0].source, "upload"):
            return
        e_n = int(cache.experts_per_layer)
        by_layer = {int(w.layer): w for w in works}
        rows, slots = top_up(np.concatenate([np.asarray(cache.row(w.layer, np.arange(e_n)), dtype=np.int64)
                                             for w in works]))
        if rows.size == 0:
            return
        import cupy as cp
        cs = works[0].copy_stream
        fence = cp.cuda.Event(disable_timing=True)
        fence.record(cp.cuda.get_current_stream())
        cs.wait_event(fence)
        for g in range(0, rows.size, TOP_UP_GROUP):
            r_g, s_g = rows[g:g + TOP_UP_GROUP], slots[g:g + TOP_UP_GROUP]
            for r, slot in zip(r_g.tolist(), s_g.tolist()):
                by_layer[r // e_n].source.upload(int(r), int(slot), cs)
            landed = cp.cuda.Event(disable_timing=True)
            landed.record(cs)
            self._topping.append((r_g, landed))
        works[0].stats["experts_admitted"] += int(rows.size)
        self.counts["decode_topped_up"] = self.counts.get("decode_topped_up", 0) + int(rows.size)

    def _await_top_up(self) -> None:
        """The current stream waits for every top-up copy still in flight (a prompt may lend their slots)."""
        if self._topping:
            import cupy as cp
            cp.cuda.get_current_stream().wait_event(self._topping[-1][1])
            self._topping.clear()

    def _land_table(self, n: int, e_n: int) -> np.ndarray:
        """[n, E] int32: the slot reserved for each (layer, expert) of the step's layers (_landing), else -1."""
        land = np.full(n * e_n, EMPTY, dtype=np.int32)
        if self._landing:
            rows = np.fromiter(self._landing, dtype=np.int64)
            slots = np.fromiter((v[0] for v in self._landing.values()), dtype=np.int64)
            pos = np.searchsorted(self._rows, rows)
            ok = (pos < self._rows.size) & (self._rows[np.minimum(pos, self._rows.size - 1)] == rows)
            land[pos[ok]] = slots[ok]
        return land.reshape(n, e_n)

    def _lands(self, runs: list, works: list[LayerWork]) -> bool:
        """Whether this step admits by landing: decode_landing on, a cache that reserves, and every run's kernels
        writing a miss into its landing slot (FastMoE.lands_misses)."""
        ascending = all(a.layer < b.layer for a, b in zip(works, works[1:]))  # _land_table's searchsorted
        return bool(self.decode_landing and ascending and hasattr(works[0].slots, "reserve") and all(
            getattr(f, "lands_misses", None) is not None and f.lands_misses(works[a].pool) for f, a, _ in runs))

    def _land_commit(self, works: list[LayerWork], rows: np.ndarray, land: np.ndarray | None) -> None:
        """After a counted step: each routed row its landing table named was written into its reserved slot by
        the step's kernels, so the slot now holds it (ExpertCache.fill); reservations older than
        LANDING_EXPIRE_STEPS are given back empty."""
        cache = works[0].slots
        if land is not None and self._landing:
            flat = land.reshape(-1)
            at = np.searchsorted(self._rows, rows)
            for r, a in zip(rows.tolist(), at.tolist()):
                got = self._landing.get(r)
                if got is None or a >= self._rows.size or self._rows[a] != r or int(flat[a]) != got[0]:
                    continue  # not reserved when the step was launched (or since given back)
                del self._landing[r]
                if cache.slot_of[r] != EMPTY:  # admitted by a copy meanwhile: the reservation goes back
                    cache.give_back(np.asarray([got[0]], dtype=np.int64))
                    continue
                cache.fill(r, got[0])
                works[0].stats["experts_admitted"] += 1
                self.counts["decode_landed"] = self.counts.get("decode_landed", 0) + 1
        old = [r for r, (_, at) in self._landing.items() if self._counted_steps - at >= LANDING_EXPIRE_STEPS]
        if old:
            cache.give_back(np.asarray([self._landing.pop(r)[0] for r in old], dtype=np.int64))
            self.counts["decode_land_expired"] = self.counts.get("decode_land_expired", 0) + len(old)

    def _release_landings(self, cache: Any) -> None:
        """Give every landing reservation back empty (before a prompt, which may lend or admit into any slot)."""
        if self._landing:
            cache.give_back(np.asarray([v[0] for v in self._landing.values()], dtype=np.int64))
            self._landing.clear()

    def _reserve_landings(self, works: list[LayerWork], rows: np.ndarray) -> None:
        """Reserve slots for these store rows (hottest first) to land in; at most 2 x the step's admission budget
        reserved at once (a reservation holds its slot empty until the expert is read again)."""
        cache, e_n = works[0].slots, works[0].slots.experts_per_layer
        store = getattr(works[0].source, "store", None)
        budget = max(1, self.decode_admit_bytes // max(1, int(getattr(store, "row_bytes", 0) or 1)))
        rows = np.asarray([r for r in rows.tolist() if r not in self._landing], dtype=np.int64)
        rows = rows[: max(0, min(budget, 2 * budget - len(self._landing)))]
        for layer in np.unique(rows // e_n).tolist():
            r_l = rows[rows // e_n == layer]
            got = cache.reserve(int(layer), r_l - int(layer) * e_n)
            for r, slot in zip(r_l.tolist(), got.tolist()):
                if slot >= 0:
                    self._landing[int(r)] = (int(slot), self._counted_steps)
                    self.counts["decode_reserved"] = self.counts.get("decode_reserved", 0) + 1

    def _admit_decode_misses(self, works: list[LayerWork], maps: np.ndarray, ids: np.ndarray,
                             lands: bool = False) -> None:
        """Admit the hottest experts this step read from host memory, at most `decode_admit_bytes` a step, copied
        on the copy stream while the next steps run: until the copy lands their maps say -1 (host reads), so no
        graph reads a slot being written, and the evicted expert's slot is written only after this step's graph,
        which the ids' download has waited for (and after every step queued since: a deferred step's successor).

        What is missing is read from the cache's slot table now, not from the maps the step read (`maps` gives
        only their shape): in the step loop the two agree whenever an admission runs (none runs while an earlier
        one is in flight), and a deferred step's maps predate the previous step's admission, which they would
        repeat."""
        cache = works[0].slots
        if self.decode_admit_bytes <= 0 or not hasattr(cache, "admit"):
            return
        store = getattr(works[0].source, "store", None)
        row_bytes = int(getattr(store, "row_bytes", 0) or 0)
        if row_bytes <= 0:
            return
        maps = np.asarray(cache.slot_of[self._rows]).reshape(maps.shape)
        e_n = maps.shape[1]
        layer_of = np.asarray([w.layer for w in works], dtype=np.int64)
        routed_missing = np.take_along_axis(maps, ids.astype(np.int64), axis=1) < 0
        li, ki = np.nonzero(routed_missing)
        if li.size == 0:
            return
        room = int(getattr(cache, "slots", 0)) - int(getattr(cache, "slots_on_loan", 0)) + len(self._landing)
        whole = room >= len(works) * e_n
        if self._topping or (self._pending is not None and (whole or not lands)):
            return  # one copy admission in flight at a time (a top-up is one)
        if whole:
            # the cache holds the whole model (a prompt's loan emptied some slots): every missing expert comes
            # back in one batch of copies, into empty slots, evicting none
            self._release_landings(cache)
            rows = self._rows[maps.reshape(-1) < 0]
        else:
            rows = np.unique(layer_of[li] * e_n + ids[li, ki].astype(np.int64))
            budget = max(1, self.decode_admit_bytes // row_bytes)
            rows = rows[np.argsort(-cache.freq[rows], kind="stable")][:budget]
            if self.decode_admit_hotter and hasattr(cache, "worth_admitting"):
                rows = cache.worth_admitting(rows)
                if rows.size == 0:
                    return
        if lands and not whole:
            self._reserve_landings(works, rows)
            return
        import cupy as cp
        cs = works[0].copy_stream
        fence = cp.cuda.Event(disable_timing=True)
        fence.record(cp.cuda.get_current_stream())
        cs.wait_event(fence)  # the step's graph read the slots that are about to be overwritten
        admitted = []
        by_layer = {int(w.layer): w for w in works}
        for layer in np.unique(rows // e_n).tolist():
            r_l = rows[rows // e_n == layer]
            w = by_layer[int(layer)]
            got = cache.admit(int(layer), r_l - int(layer) * e_n, keep=None)
            for r, slot in zip(r_l.tolist(), got.tolist()):
                if slot >= 0:
                    w.source.upload(int(r), int(slot), cs)
                    admitted.append(int(r))
        if admitted:
            landed = cp.cuda.Event(disable_timing=True)
            landed.record(cs)
            self._pending = (np.asarray(admitted, dtype=np.int64), landed)
            works[0].stats["experts_admitted"] += len(admitted)
            self.counts["decode_admitted"] = self.counts.get("decode_admitted", 0) + len(admitted)

    def _upload_maps(self, fast: Any, maps: np.ndarray) -> None:
        """The step's slot maps to the device on the current stream: pulled by a kernel from one of two page-locked
        stagings (fast.PULL_SMALL_COPIES: a copy from pageable memory blocks the host and waits in the copy engine's
        queue behind the admissions' copies), else cupy's copy."""
        import cupy as cp
        st = cp.cuda.get_current_stream()
        if getattr(fast, "pull_small_copies", False):
            stage = self._maps_stage
            if stage is None or stage[0][0].size != maps.size:
                bufs = [fast._page_locked(maps.nbytes) for _ in range(2)]
                stage = self._maps_stage = [[np.frombuffer(b, dtype=np.int32, count=maps.size), None, b]
                                            for b in bufs]
            flip = self._maps_flip = 1 - self._maps_flip
            arr, ev, _ = stage[flip]
            if ev is not None:
                ev.synchronize()  # this staging's last pull has run (one step ago: nearly always done)
            arr[:] = maps.reshape(-1)
            if fast.pull(int(self._maps_dev.data.ptr), int(arr.ctypes.data), int(maps.nbytes), st,
                         host_base=int(arr.ctypes.data)):
                ev = cp.cuda.Event(disable_timing=True)
                ev.record(st)
                stage[flip][1] = ev
                return
        self._maps_dev.set(maps, stream=st)

    def _decode_runs(self, works: list[LayerWork]) -> list[tuple[Any, int, int]] | None:
        """(FastMoE, first, end) runs of consecutive works one fused decode object takes (one run for f16 and
        Q8_0; a 'gguf' model whose layers differ in format gets one QuantMoE per format), or None when some layer
        takes no fused decode. Cached per set of layers (their router arrays)."""
        sig = tuple(id(w.router_w) for w in works)
        got = getattr(self, "_runs_cache", None)
        if got is not None and got[0] == sig:
            return got[1]
        pool0, runs = works[0].pool, []
        fasts = [self._fast_for(w) for w in works]
        f0 = fasts[0]

        def same_pool(w: LayerWork) -> bool:
            # a 'gguf' pool is a per-layer view (its format) of the same arrays
            return w.pool.dtype == pool0.dtype and (w.pool.arrays is pool0.arrays or all(
                w.pool.arrays.get(n) is a for n, a in pool0.arrays.items()))

        ok = f0 is not None and pool0.dtype in DECODE_DTYPES and all(
            f is not None and f.experts == f0.experts and f.top_k == f0.top_k and same_pool(w)
            for f, w in zip(fasts, works))
        if ok:
            for i, f in enumerate(fasts):
                if runs and runs[-1][0] is f:
                    runs[-1] = (f, runs[-1][1], i + 1)
                else:
                    runs.append((f, i, i + 1))
        self._runs_cache = (sig, runs if ok else None)
        return self._runs_cache[1]

    def decode_step(self, works: list[LayerWork]) -> None:
        """Run every MoE layer of one decode token: one graph replay where the fused decode applies (one per run
        of layers of one format); the step's hits and misses are counted before this returns."""
        self.decode_launch(works)
        self.decode_done()

    def decode_launch(self, works: list[LayerWork], defer: bool = False) -> None:
        """decode_step without waiting for the device: the replay is queued and the routed ids' copy to the host
        with it; `decode_done` counts the step (the executor calls it once the LM head is queued behind the
        replay, so the host's counting overlaps the device's work). Without `defer`, a step launched earlier and not
        yet counted is counted first, so the cache is read in step order.

        `defer` (the executor's pipelined greedy loop): the step's cache tick is owed too and the previous step
        stays uncounted, so this step is queued before the host has read the previous one's ids or token; the
        decode_done that counts a deferred step ticks the cache first, so ticks and counts keep the step loop's
        order. This step's slot maps are read before the previous step is counted, so its admissions reach the
        maps one step later than in the step loop (the fences of _admit_decode_misses still hold: a slot is written
        only after every step queued before the admission). A step that takes the composed path counts everything
        pending, ticks and runs as the step loop does."""
        if not defer:
            self.decode_done()
        elif len(self._launched) >= 2:
            self.decode_done(keep=1)  # never more than two steps in flight: two ids buffers
        if not works:
            return
        observer = works[0].extras.get("observer")
        if self._top_up_owed:
            self._top_up_owed = False
            self._top_up(works)
        runs = self._decode_runs(works)
        got = None
        lands = runs is not None and self._lands(runs, works)
        if runs is not None:
            got = self._decode_layers(works, runs[0][0], lands)
        if got is None:
            self.counts["decode_composed_steps"] += 1
            if defer:
                self.decode_done()
                works[0].slots.tick()
            self._fallback(works[0]).decode_step(works)
            return
        import cupy as cp
        fast = runs[0][0]
        layers, key = got
        x = works[0].x
        stream = cp.cuda.get_current_stream()
        for f, _, _ in runs:
            f.compute_stream = stream
        for pending in self._launched:
            stream.wait_event(pending[2])  # its ids are still to be copied out of the buffer this replay writes
        if observer is None:
            if len(runs) == 1:
                fast.decode_stack(x, layers, graph=True, key=key)
            else:
                for f, a, b in runs:
                    f.decode_stack(x, layers[a:b], graph=True)
            self.counts["decode_graph_steps"] += 1
        else:
            # --check: layer by layer, each layer's residual handed to the observer
            for f, a, b in runs:
                for w, lay in zip(works[a:b], layers[a:b]):
                    x_in = np.asarray(self.memory.download(x))
                    f.decode_stack(x, [lay], graph=False)
                    observer(w.phase, w.layer, x_in, np.asarray(self.memory.download(x)))
            self.counts["decode_plain_steps"] += 1
        if defer:
            self.counts["decode_deferred_steps"] = self.counts.get("decode_deferred_steps", 0) + 1
        landed, which = self._download_ids(stream)
        self._launched.append((works, self._maps_host, landed, fast.experts, which, defer,
                               self._land_host if lands else None))
        seen = set()
        for w in works:  # the works share one arena: reset each once
            if id(w.workspace) not in seen:
                seen.add(id(w.workspace))
                w.workspace.reset()

    def _download_ids(self, stream: Any) -> tuple[Any, int]:
        """Copy the step's routed ids into a page-locked host buffer on a side stream that waits for `stream`'s
        replay (so the LM head queued next is not held behind the copy); the event that marks it landed and which
        of the two host buffers it lands in (steps alternate)."""
        import cupy as cp
        nbytes = int(self._ids_dev.nbytes)
        if self._ids_pair is None or self._ids_pair[0].shape != tuple(self._ids_dev.shape):
            self._ids_pair = self._ids_buffer(tuple(self._ids_dev.shape), nbytes)
        if self._ids_stream is None:
            self._ids_stream = cp.cuda.Stream(non_blocking=True)
            # one pair per host buffer, recorded again every other step (that buffer's last step is counted by then)
            self._ids_events = tuple((cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True))
                                     for _ in range(2))
        which = self._launch_no % 2
        self._launch_no += 1
        replayed, landed = self._ids_events[which]
        replayed.record(stream)
        self._ids_stream.wait_event(replayed)
        self._ids_host = self._ids_pair[which]
        self._rt.memcpyAsync(int(self._ids_host.ctypes.data), int(self._ids_dev.data.ptr), nbytes,
                             self._rt.memcpyDeviceToHost, self._ids_stream.ptr)
        landed.record(self._ids_stream)
        return landed, which

    def _ids_buffer(self, shape: tuple, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        """The routed ids' two host buffers: page-locked from the session's allocator (charged to the plan's pinned
        budget, its runtime floor), else pageable (then the copy holds the host until the replay ends;
        counts['ids_pageable'])."""
        if self._ids_buf is not None:
            self._pinned.free(self._ids_buf)
            self._ids_buf = None
        step = max(int(nbytes), 4)  # int32 ids: the second buffer starts aligned
        buf = self._pinned.alloc(2 * step, from_floor=True) if self._pinned is not None else None
        if buf is None:
            self.counts["ids_pageable"] = 1
            return np.empty(shape, dtype=np.int32), np.empty(shape, dtype=np.int32)
        self._ids_buf = buf
        self.counts.pop("ids_pageable", None)
        return tuple(np.ndarray(shape, dtype=np.int32, buffer=buf.array, offset=i * step) for i in range(2))

    def decode_done(self, keep: int = 0) -> None:
        """Count the launched steps' routed experts (one cache lookup for all layers of a step), oldest first, until
        at most `keep` are left uncounted, and queue the admission of the experts each read from host memory; a
        deferred step's cache tick comes first. Waits for those steps' ids only. A no-op when no step is pending."""
        while len(self._launched) > keep:
            self._count(self._launched.pop(0))

    def _count(self, launched: tuple) -> None:
        """Count one launched step (see decode_done)."""
        works, maps, landed, e_n, which, tick, land = launched
        landed.synchronize()
        ids = self._ids_pair[which].copy()  # a later step's copy reuses the page-locked buffer
        if tick:
            works[0].slots.tick()
        # store rows of every routed (layer, expert) of the step, counted in one call: row(0, r) is r, so one
        # lookup over layer 0's numbering is the per-layer lookups at once (48 calls cost ~0.5 ms a step)
        layer_ids = tuple(w.layer for w in works)
        offs = getattr(self, "_row_offsets", None)
        if offs is None or offs[0] != layer_ids:
            offs = (layer_ids, np.asarray(layer_ids, dtype=np.int64) * e_n, (max(layer_ids) + 1) * e_n)
            self._row_offsets = offs
        rows = (ids + offs[1][:, None]).ravel()
        cnt = np.bincount(rows, minlength=offs[2])
        used = np.flatnonzero(cnt)
        works[0].slots.lookup(0, used, cnt[used])
        self._counted_steps += 1
        # after the lookup (the step read its landing experts from host memory: misses), before any admission
        self._land_commit(works, used, land)
        if maps is not None and ((maps < 0).any() or (tick and (works[0].slots.slot_of[self._rows] < 0).any())):
            # after the lookup: this step's experts are warm (a deferred step's maps may predate an eviction)
            self._admit_decode_misses(works, maps, ids, lands=land is not None)

    # --- greedy decode on the device (the executor's pipelined loop) ----------------------------------------

    def greedy_table(self, embed: np.ndarray) -> Any | None:
        """The embedding table greedy_embed reads: the host's `embed` [V,H] f16 page-locked in place through the
        session's allocator (charged to the plan's pinned budget outside its runtime floor; no host byte more),
        which the kernel reads at its mapped address (one row of H halves a step, as decode reads missed
        experts); None when the budget or the driver refuses it (the executor then keeps the step loop)."""
        import cupy as cp
        if self._greedy is None or self._tok_dev is None:
            return None
        if (not isinstance(embed, np.ndarray) or embed.dtype != np.float16 or embed.ndim != 2
                or not embed.flags.c_contiguous or self._pinned is None):
            return None
        self.greedy_release()
        if self._tok_host is None:
            tok = self._pinned.alloc(64, from_floor=True)
            if tok is None:
                self.counts["tokens_pageable"] = 1
                self._tok_host = np.zeros(2, dtype=np.int32)
            else:
                self._tok_buf = tok
                self._tok_host = np.ndarray((2,), dtype=np.int32, buffer=tok.array)
            self._tok_events = (cp.cuda.Event(disable_timing=True), cp.cuda.Event(disable_timing=True))
        buf = self._pinned.register(embed)
        if buf is None or buf.handle is None:
            if buf is not None:
                self._pinned.free(buf)
            return None
        host = embed
        ptr = self._mapped_address(int(host.ctypes.data))
        if not ptr:
            self._pinned.free(buf)
            return None
        self._table_buf = buf
        return SimpleNamespace(ptr=ptr, vocab=int(embed.shape[0]), hidden=int(embed.shape[1]), keep=host)

    def _mapped_address(self, host_ptr: int) -> int:
        """The address kernels read this page-locked host memory at, or 0 where the device cannot read it."""
        import cupy as cp
        try:
            # cudaDevAttrCanUseHostPointerForRegisteredMem (91) and the driver's device address of the buffer
            same = bool(self._rt.deviceGetAttribute(91, cp.cuda.Device().id))
            attrs = self._rt.pointerGetAttributes(int(host_ptr))
            ptr = int(attrs.devicePointer) or (int(host_ptr) if same else 0)
            return ptr if int(attrs.type) == 1 else 0
        except Exception:
            return 0

    def embed_rows(self, table: Any, token_ids: np.ndarray, x: Any) -> bool:
        """x [n,H] f32 = the rows of these tokens of a greedy_table, gathered by the device from the page-locked
        table (the prefill's embedding: no host gather of the rows and no pageable upload while the device waits);
        False, with nothing queued, when the ids cannot be staged (the caller uploads the rows itself)."""
        import cupy as cp
        ids = np.ascontiguousarray(token_ids, dtype=np.int32).reshape(-1)
        if (self._greedy is None or table is None or x.dtype != cp.float32 or x.shape != (ids.size, table.hidden)
                or self._pinned is None or ids.size == 0 or int(ids.max()) >= table.vocab or int(ids.min()) < 0):
            return False
        stage = self.__dict__.get("_embed_ids")
        if stage is None or stage[0].size < ids.size:
            # the ids stay in page-locked staging the kernel reads at its mapped address: a device copy of them
            # would be device memory outside the plan (16,384 bytes for a 4096-token chunk, measured over the plan
            # on the H200: bench/results/lead_h200_s5b/)
            buf = self._pinned.alloc(4 * ids.size, from_floor=True)
            if buf is None:
                return False
            dev = self._mapped_address(int(buf.array.ctypes.data))
            if not dev:
                self._pinned.free(buf)
                return False
            if stage is not None:
                stage[2].synchronize()  # the last gather read its memory before it goes back
                self._pinned.free(stage[1])
            stage = self._embed_ids = [np.ndarray((ids.size,), dtype=np.int32, buffer=buf.array), buf,
                                       cp.cuda.Event(disable_timing=True), dev]
        host, _, done, dev = stage
        done.synchronize()  # the previous chunk's gather has read its ids
        host[: ids.size] = ids
        self._greedy.embed_rows(table.ptr, dev, ids.size, table.hidden, int(x.data.ptr))
        done.record(cp.cuda.get_current_stream())
        self.counts["embed_rows"] = self.counts.get("embed_rows", 0) + 1
        return True

    def greedy_release(self) -> None:
        """Give the embedding table's page-locking back to the session's allocator (idempotent)."""
        if self._table_buf is not None:
            self._pinned.free(self._table_buf)
            self._table_buf = None

    def greedy_start(self, token: int, table: Any) -> None:
        """The first decode step's token onto the device (stream-ordered); no token of an earlier request is left
        to read."""
        import cupy as cp
        token = int(token)
        if not 0 <= token < table.vocab:
            raise StrataError(f"greedy decode: token {token} is outside the vocabulary of {table.vocab}")
        self._tok_queued, self._tok_read = [], []
        self._tok_dev.set(np.array([token], dtype=np.int32), stream=cp.cuda.get_current_stream())

    def greedy_embed(self, table: Any, x: Any) -> None:
        """x [1,H] f32 = the table's row of the device's current token, on the current stream."""
        self._greedy.embed_row(table.ptr, int(self._tok_dev.data.ptr), table.hidden, int(x.data.ptr))
        self.counts["greedy_steps"] = self.counts.get("greedy_steps", 0) + 1

    def greedy_argmax(self, logits: Any) -> None:
        """The device's current token = np.argmax of the last row of logits [T,V] f32, and its copy into a
        page-locked host slot queued behind it on the current stream (greedy_token reads it)."""
        import cupy as cp
        if len(self._tok_queued) >= 2:
            self._tok_read.append(self._read_token())  # its slot is about to be written again
        v = int(logits.shape[-1])
        stream = cp.cuda.get_current_stream()
        self._greedy.argmax(int(logits.data.ptr) + (int(logits.shape[0]) - 1) * v * 4, v, int(self._tok_dev.data.ptr))
        which = self._tok_no % 2
        self._tok_no += 1
        self._rt.memcpyAsync(int(self._tok_host.ctypes.data) + 4 * which, int(self._tok_dev.data.ptr), 4,
                             self._rt.memcpyDeviceToHost, stream.ptr)
        self._tok_events[which].record(stream)
        self._tok_queued.append(which)

    def greedy_token(self) -> int:
        """The oldest token greedy_argmax queued and the host has not read (waits for its copy only)."""
        if self._tok_read:
            return self._tok_read.pop(0)
        return self._read_token()

    def _read_token(self) -> int:
        which = self._tok_queued.pop(0)
        self._tok_events[which].synchronize()
        return int(self._tok_host[which])
