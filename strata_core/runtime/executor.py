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
from strata_core.runtime.devmem import Arena, HeapArena, byte_view, can_view
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
    def copy_s(self) -> float:
        """Seconds the expert copies took: the simulator's copy ledger, else a host timer around the uploads."""
        sim = _sim_copy_seconds(getattr(self, "dm", None))
        if sim is not None:
            return sim - (getattr(self, "copy_seconds0", None) or 0.0)
        src = getattr(self, "source", None)
        return src.copy_s if src is not None else 0.0

    @property
    def copy_time_source(self) -> str:
        """Where copy_s comes from."""
        if _sim_copy_seconds(getattr(self, "dm", None)) is not None:
            return "the simulated device's copy ledger"
        return "host timer around the upload calls (a backend with asynchronous copies: the time to enqueue them)"

    @property
    def workspace_peak_bytes(self) -> int:
        """The largest chunk buffers plus one grouped call's buffers, from their shapes."""
        return self.layer["workspace_peak_bytes"]


#: Called in --check runs after every layer, (phase, layer, x_in [T,H] f32, x_out [T,H] f32), and after the LM head,
#: ("head", -1, x_last [1,H] f32, logits [1,V] f32); host arrays.
LayerObserver = Callable[[str, int, np.ndarray, np.ndarray], None]

_NO_RING = np.zeros(0, np.int32)
#: What layer ops offer to run greedy decode on the device (besides decode_launch(works, defer=True) and
#: decode_done(keep)): greedy_table(embed) -> table or None, greedy_start(token, table), greedy_embed(table, x),
#: greedy_argmax(logits), greedy_token() -> int; optionally greedy_release() (the executor's close).
GREEDY_CAPABILITY = ("greedy_table", "greedy_start", "greedy_embed", "greedy_argmax", "greedy_token")


class Executor:
    """Runs requests' prefill and decode over a device ExpertPool whose slots the ExpertCache manages."""

    def __init__(self, *, dm: Any, kernels: Any, cache: ExpertCache, store: ExpertStore, device_pool: ExpertPool,
                 weights: ModelWeights | None, dense_dev: dict[str, Any] | None, share: CpuShare, log: RunLog,
                 top_k: int, hidden: int, workspace_bytes: int = 0, accounting_only: bool = False, seed: int = 0,
                 observer: LayerObserver | None = None, staging: Any = None, layer_ops: Any = None,
                 regions: dict[str, Any] | None = None):
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
        self.observer_cpu_s = 0.0
        self.stats = ExecStats()
        self.counters = self.stats.layer
        #: Page-locked staging for experts the arena could not pin (None: copies from pageable memory).
        self.staging = staging
        #: Called with (phase, tokens) after every prefill chunk and decode step (progress bars).
        self.progress: Callable[[str, int], None] | None = None
        self.copy_stream = dm.new_stream()
        self.source = StoreSource(dm, device_pool, store, staging, self.counters, accounting_only)
        self.stats.source = self.source
        self.stats.dm = dm
        self.stats.copy_seconds0 = _sim_copy_seconds(dm)
        #: The plan's flat device regions besides the pool and the dense weights (workspace, owned_prompt, kv).
        self.regions = regions or {}
        ws = self.regions.get("workspace")
        #: Buffers are carved from the plan's regions (False: the backend has no views; per-use allocations)
        self.carves = accounting_only or (ws is not None and can_view(dm, ws))
        self.vocab = int(weights.vocab) if weights is not None else 0
        ffn = weights.expert_ffn if weights is not None else 0
        self.ops = layer_ops if layer_ops is not None else ComposedLayerOps(
            dm=dm, kernels=kernels, store=store, share=share, hidden=hidden, expert_ffn=ffn,
            experts_per_layer=cache.experts_per_layer, layers=cache.layers, workspace_bytes=workspace_bytes,
            accounting_only=accounting_only, seed=seed)
        #: The core's own layer ops take a decode step's works as the same objects every step, x and workspace
        #: updated (a session's own ops get fresh ones, since they may keep them, unless they say they take them
        #: reused: building 48 works a step cost ~0.28 ms of host time on the H200)
        self._reuse_works = layer_ops is None or bool(getattr(layer_ops, "takes_reused_works", False))
        self._step_works: list[LayerWork] | None = None
        #: (workspace region, its decode arena, the arena's empty mark): one arena for every decode step
        self._step_arena: tuple[Any, Arena, tuple] | None = None
        from strata_core.runtime import dense_ffn  # the FFNs beside the routed experts (shared, dense, router bias)
        self.ops = dense_ffn.wrap(self.ops, weights, self.dense, dm, kernels, accounting_only, cache.layers)
        #: greedy decode with the token chosen on the device (decode_greedy); False keeps the step loop (tests
        #: compare the two)
        self.greedy_pipeline = True
        self._greedy_for: Any = None
        self._greedy_table: Any = None
        if self._greedy_ops:
            self._prepare_greedy()  # at start-up: the table's copy and the kernels' compile stay out of decode

    @property
    def _launches(self) -> bool:
        """Do the ops queue a decode step without waiting (decode_launch) and count it later (decode_done)? Then
        the LM head is queued behind the step before the host counts its experts. Looked up on the class, so a
        wrapper's attribute forwarding never skips the wrapper's own decode_step."""
        t = type(self.ops)
        return hasattr(t, "decode_launch") and hasattr(t, "decode_done")

    @property
    def _greedy_ops(self) -> bool:
        """Do the ops choose a greedy token on the device and embed it there, and queue a step with its counting
        deferred (GREEDY_CAPABILITY and decode_launch / decode_done, looked up on the class as _launches is)? Not
        with --check (the observer reads every layer step by step), nor in accounting mode."""
        t = type(self.ops)
        return (self._launches and all(hasattr(t, n) for n in GREEDY_CAPABILITY) and self.observer is None
                and not self.accounting_only and self.carves and self.weights is not None
                and self.weights.dense is not None)

    def _prepare_greedy(self) -> None:
        """Ask the ops for the embedding table their greedy_embed reads, made from the host's (the embedding is
        no device line of the plan: the ops place it in page-locked memory, charged to the pinned budget); None:
        the step loop runs."""
        self._greedy_for = self.ops
        self._greedy_table = self.ops.greedy_table(self.weights.dense.embed)
        if self._greedy_table is None:
            self.log.trace("greedy decode: the layer ops give no embedding table for the device; step by step")

    def close(self) -> None:
        """Give back what the greedy loop's ops hold for this run (its page-locked embedding table)."""
        release = getattr(type(self.ops), "greedy_release", None)
        if release is not None and self._greedy_table is not None:
            release(self.ops)
        self._greedy_table, self._greedy_for = None, None

    @property
    def pipelines_greedy(self) -> bool:
        """Will decode_greedy keep the device busy across steps (token chosen and embedded on the device)?"""
        if not self.greedy_pipeline or not self._greedy_ops:
            return False
        if self._greedy_for is not self.ops:
            self._prepare_greedy()
        return self._greedy_table is not None

    def _sample(self) -> None:
        """Let the device memory read its driver figure (a no-op where the backend keeps its own peak)."""
        f = getattr(self.dm, "sample", None)
        if f is not None:
            f()

    def _timed(self, observer: LayerObserver) -> LayerObserver:
        """The observer, its time (downloads and comparisons) added to observer_s."""
        def call(phase: str, layer: int, x_in: np.ndarray, x_out: np.ndarray) -> None:
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                observer(phase, layer, x_in, x_out)
            finally:
                self.observer_s += time.perf_counter() - t0
                self.observer_cpu_s += time.process_time() - c0
        return call

    # --- buffers: arenas over the plan's regions ------------------------------------------------------------

    def _region_sizes(self, loan: Loan | NoLoan | None) -> list[int]:
        names = ["workspace"] + (["owned_prompt"] if loan is not None else [])
        return [int(self.regions[n].nbytes) for n in names if n in self.regions]

    def _arena(self, loan: Loan | NoLoan | None) -> Arena:
        """The buffers of a chunk (loan given) or a decode step (None): the workspace region, then owned prompt
        buffers, then the loan's buffer slots of the cache pool viewed as bytes."""
        if self.accounting_only:
            return Arena(self.dm, sizes=[])
        if not self.carves:
            return HeapArena(self.dm)
        names = ["workspace"] + (["owned_prompt"] if loan is not None else [])
        extents = [self.regions[n] for n in names if n in self.regions]
        if isinstance(loan, Loan) and len(loan.buffers):
            for a, b in _runs(loan.buffers):
                for arr in self.pool.arrays.values():
                    v = byte_view(self.dm, arr[a:b])
                    if v is not None:
                        extents.append(v)
        return Arena(self.dm, extents)

    def _slot_part_bytes(self) -> list[int]:
        """Bytes one slot takes in each of the pool's arrays (a run of n slots is n times these, per array)."""
        return [int(arr[0].nbytes) for arr in self.pool.arrays.values()]

    def buffer_slots_needed(self, chunk_tokens: int, planned_slots: int) -> int:
        """The fewest of a loan's planned buffer slots that hold a chunk's buffers beside the workspace region.

        The carves of a chunk's worst layer are replayed on a dry arena of the same extents, in the same order;
        slots the chunk would not touch stay in the cache (an idle loan costs no hits).
        """
        if self.accounting_only or not self.carves or not hasattr(self.ops, "worst_carves"):
            return planned_slots
        base = self._region_sizes(NoLoan(0, chunk_tokens, ""))
        parts = self._slot_part_bytes()
        steps = [((chunk_tokens, self.hidden), np.float32)] + self.ops.worst_carves(chunk_tokens, self.vocab, self.top_k)

        def fits(n: int) -> bool:
            return Arena(None, sizes=base + [n * p for p in parts]).replay(steps)

        if fits(0):
            return 0
        if not fits(planned_slots):
            return planned_slots
        lo, hi = 0, planned_slots  # fits(lo) False, fits(hi) True
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        return hi

    def _works(self, phase: str, x: Any, tokens: int, ring: np.ndarray, arena: Arena) -> list[LayerWork]:
        """The LayerWork of every MoE layer for one chunk or one decode step (all on the same residual x)."""
        extras: dict[str, Any] = {"fallback": self.log.fallback}
        if self.observer is not None:
            extras["observer"] = self.observer
        return [LayerWork(phase=phase, layer=layer, tokens=tokens, x=x, norm_w=self.dense.get(f"norm.{layer}"),
                          router_w=self.dense.get(f"router.{layer}"), top_k=self.top_k, pool=self.pool.for_layer(layer),
                          slots=self.cache, source=self.source, workspace=arena, ring=ring,
                          compute_stream=None, copy_stream=self.copy_stream, stats=self.counters, extras=extras)
                for layer in range(self.cache.layers)]

    def _decode_works(self, x: Any, arena: Arena) -> list[LayerWork]:
        """The works of one decode step: made once and given this step's residual and arena (core layer ops)."""
        works = self._step_works
        if works is None or not self._reuse_works:
            works = self._works("decode", x, 1, _NO_RING, arena)
            if self._reuse_works:
                self._step_works = works
            return works
        for w in works:
            w.x = x
            w.workspace = arena
        return works

    # --- prefill and decode --------------------------------------------------------------------------------

    def _embed(self, token_ids: np.ndarray, arena: Arena) -> Any:
        """The residual stream of these tokens, carved from the arena for the chunk's life (None in accounting)."""
        if self.accounting_only:
            return None
        table = self.weights.dense.embed
        embed_rows = getattr(self.ops, "embed_rows", None)
        if (isinstance(token_ids, np.ndarray) and self._greedy_table is not None and self._greedy_for is self.ops
                and embed_rows is not None):
            # a prompt chunk's rows (decode's one row is a slice of the table): the device gathers them from the
            # page-locked table the greedy loop reads (~8 ms of host gather and pageable upload, with the device
            # idle, for a 4096-token chunk of Qwen3-30B-A3B on the H200)
            x = arena.carve((len(token_ids), int(table.shape[1])), np.float32)
            if embed_rows(self._greedy_table, np.asarray(token_ids), x):
                arena.fix()
                return x
            arena.reset()
        # the rows in the table's own dtype: DeviceMemory.upload widens them (on the device where it can, which
        # halves the bytes copied and spares the host a 4096-row f16 -> f32 pass of ~30 ms)
        host = table[token_ids]
        x = arena.carve(host.shape, np.float32)
        self.dm.upload(x, host)
        arena.fix()
        return x

    def _head(self, x: Any, arena: Arena, before_download: Callable[[], None] | None = None) -> np.ndarray:
        """Final norm and LM head of the last token of x -> logits [V] f32 on the host (`before_download` is
        called once the head is queued, before the host waits for its logits)."""
        x_last = x[-1:] if x.shape[0] > 1 else x
        lg = self._head_queued(x_last, arena)
        if before_download is not None:
            before_download()
        logits = np.asarray(self.dm.download(lg), dtype=np.float32)[-1]
        arena.reset()
        if self.observer is not None:
            self.observer("head", -1, np.asarray(self.dm.download(x_last)), logits[None, :])
        return logits

    def _head_queued(self, x_last: Any, arena: Arena) -> Any:
        """Final norm and LM head of x_last [1,H] queued on the device: the logits [1,V] f32, on the device."""
        k = self.ops
        takes = getattr(k, "_takes_out", {})
        xn_out = arena.carve((1, self.hidden), np.float32) if takes.get("rmsnorm") else None
        xn = self.k.rmsnorm(x_last, self.dense["final_norm"], out=xn_out) if xn_out is not None else \
            self.k.rmsnorm(x_last, self.dense["final_norm"])
        lg_out = arena.carve((1, self.vocab), np.float32) if takes.get("linear") else None
        # the session's own head GEMV where its ops have one (looked up on the class, as _launches does; None: it
        # does not apply to these arrays)
        own = getattr(type(k), "head_linear", None) if lg_out is not None else None
        lg = own(k, xn, self.dense["lm_head"], lg_out) if own is not None else None
        if lg is None:
            lg = self.k.linear(xn, self.dense["lm_head"], out=lg_out) if lg_out is not None else \
                self.k.linear(xn, self.dense["lm_head"])
        return lg

    def prefill(self, prompt: np.ndarray | int, loan: Loan | NoLoan) -> np.ndarray | None:
        """Read a prompt in the loan's chunks; the last token's logits (None in accounting mode)."""
        total = int(prompt) if np.isscalar(prompt) else len(prompt)
        chunk = max(1, int(loan.chunk_tokens))
        ring = loan.ring if isinstance(loan, Loan) else _NO_RING
        logits = None
        for start in range(0, total, chunk):
            n = min(chunk, total - start)
            self.cache.tick()
            arena = self._arena(loan)
            try:
                x = self._embed(None if np.isscalar(prompt) else prompt[start:start + n], arena)
                for work in self._works("prefill", x, n, ring, arena):
                    self.ops.prefill_layer(work)
                done = getattr(self.ops, "prefill_done", None)  # optional: ops that count a chunk's layers late
                if done is not None:
                    done()
                if start + n >= total and not self.accounting_only:
                    logits = self._head(x, arena)
                self._sample()
            finally:
                _close(arena)
            self.stats.chunks += 1
            self.stats.prefill_tokens += n
            if self.progress:
                self.progress("prefill", n)
        return logits

    def _decode_arena(self) -> Arena:
        """A decode step's arena over the workspace region: made once and emptied each step where buffers are carved
        (building one cost a few microseconds of a cpu decode step), else a new one."""
        if self.accounting_only or not self.carves:
            return self._arena(None)
        ws = self.regions.get("workspace")
        got = self._step_arena
        if got is None or got[0] is not ws:
            arena = _StepArena(self.dm, [ws] if ws is not None else [])
            self._step_arena = (ws, arena, arena.mark())
            return arena
        arena = got[1]
        arena.release(got[2])
        arena.fix()
        return arena

    def decode_step(self, token: int) -> np.ndarray | None:
        """One decode step of one token; its logits (None in accounting mode)."""
        self.cache.tick()
        arena = self._decode_arena()
        try:
            # the token's row as a slice of the table (a view; an index array would copy it first); an id out of
            # range is indexed as before, to fail as before
            rows = None if self.accounting_only else (
                slice(token, token + 1) if 0 <= token < self.vocab else np.array([token]))
            x = self._embed(rows, arena)
            works = self._decode_works(x, arena)
            if self._launches:
                self.ops.decode_launch(works)
                logits = None if self.accounting_only else self._head(x, arena, before_download=self._step_queued)
                if self.accounting_only:
                    self._step_queued()
            else:
                self.ops.decode_step(works)
                logits = None if self.accounting_only else self._head(x, arena)
                self._sample()
        finally:
            _close(arena)
        self.stats.decode_tokens += 1
        if self.progress:
            self.progress("decode", 1)
        return logits


    def decode_greedy(self, token: int, steps: int, tokens: list[int]) -> np.ndarray:
        """`steps` greedy decode steps from `token` with the device busy across them; the last step's logits [V].

        Every token the host reads is appended to `tokens` (first `token`, then each step's), the same tokens as
        decode_step's loop with np.argmax. Each step's token is the argmax of its logits on the device, the next
        step's residual is that token's embedding row gathered on the device, and the next step is queued before
        the host reads the token: the host reads each step's token (a few page-locked bytes) and counts its
        experts in the cache (the ops' decode_done, the cache's tick first) one step behind. Only the last step's
        logits come back whole. Use when `pipelines_greedy`."""
        ops, table = self.ops, self._greedy_table
        tokens.append(int(token))
        if steps <= 0:
            raise ValueError("decode_greedy needs at least one step")
        ops.greedy_start(int(token), table)
        lg = None
        for i in range(int(steps)):
            arena = self._arena(None)
            x = arena.carve((1, self.hidden), np.float32)
            ops.greedy_embed(table, x)
            arena.fix()
            ops.decode_launch(self._decode_works(x, arena), defer=True)
            lg = self._head_queued(x, arena)
            ops.greedy_argmax(lg)
            if i > 0:
                ops.decode_done(keep=1)  # the step before this one: its tick and counts, then its token
                tokens.append(ops.greedy_token())
            self._sample()
            self.stats.decode_tokens += 1
            if self.progress:
                self.progress("decode", 1)
        ops.decode_done()
        tokens.append(ops.greedy_token())
        # the last step's logits are still in its arena's buffer: nothing was carved after it
        return np.asarray(self.dm.download(lg), dtype=np.float32)[-1]

    def _step_queued(self) -> None:
        """Once a launched decode step and its LM head are queued: count the step (the ops wait for its routed ids
        only) and sample the device memory (the step has taken all it takes), while the device runs the head, so
        neither lies between the logits' arrival and the next step's launch."""
        self.ops.decode_done()
        self._sample()


class _StepArena(Arena):
    """The decode steps' arena: each step carves the same buffers in the same places, so a carve's view is kept and
    handed out again for the same place, shape and dtype (making the view cost ~4 us of a cpu decode step, four
    times a step; the look-up ~0.3)."""

    #: views kept at most (a step carves a handful; the general path's shapes vary a little with its misses)
    KEEP = 64

    def __init__(self, dm: Any, extents: list[Any]):
        super().__init__(dm, extents)
        self._kept: dict[tuple, tuple[Any, tuple[int, ...]]] = {}

    def carve(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """See Arena.carve; the view made before at this place, of this shape and dtype, where there is one."""
        try:
            key = (tuple(self.used), shape, dtype)
            got = self._kept.get(key)
        except TypeError:  # an unhashable shape or dtype: nothing kept
            return super().carve(shape, dtype)
        if got is not None:
            self.used = list(got[1])
            return got[0]
        view = super().carve(shape, dtype)
        if len(self._kept) >= self.KEEP:
            self._kept.clear()
        self._kept[key] = (view, tuple(self.used))
        return view


def _runs(slots: np.ndarray) -> list[tuple[int, int]]:
    """[a, b) runs of adjacent slot numbers, in slot order."""
    s = np.sort(np.asarray(slots, dtype=np.int64))
    if len(s) == 0:
        return []
    cut = np.flatnonzero(np.diff(s) != 1) + 1
    return [(int(p[0]), int(p[-1]) + 1) for p in np.split(s, cut)]


def _sim_copy_seconds(dm: Any) -> float | None:
    """The simulated device's copy ledger (seconds), when the device keeps one."""
    inner = getattr(dm, "inner", dm)
    v = getattr(inner, "copy_seconds", None) if inner is not None else None
    return float(v) if isinstance(v, (int, float)) else None


def _close(arena: Any) -> None:
    """Free what a per-use arena still holds (a region arena holds nothing of its own)."""
    f = getattr(arena, "close", None)
    if f is not None:
        f()
