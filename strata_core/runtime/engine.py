"""The engine: builds the runtime objects from a proven Plan and a backend's hooks, then serves requests.

Start-up allocates exactly what the plan says: the expert cache pool as `plan.expert_cache.slots` slots of the
model's slot bytes, the dense weights, and (per chunk) buffers within the plan's prompt figures. A request that cannot
run at all is refused before it starts, with the reason; every optional path that fails becomes a fallback.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strata_core.api.backend import PinnedBudget
from strata_core.errors import StrataError
from strata_core.reference.kernels import ExpertPool
from strata_core.runtime.cache import ExpertCache
from strata_core.runtime.cpu_share import CpuShare
from strata_core.runtime.devmem import PlanMemory
from strata_core.runtime.executor import DeviceFull, Executor, LayerObserver
from strata_core.runtime.layer_ops import synthetic_popularity
from strata_core.planner.chunks import halve
from strata_core.runtime.loan import PromptLoan
from strata_core.runtime.pinned import PinnedPool
from strata_core.runtime.runlog import Fallback, RunLog
from strata_core.runtime.staging import CopyStaging
from strata_core.runtime.store import ExpertStore, phantom_pool_of_bytes
from strata_core.models.weights import ModelWeights

GIB = 1 << 30


@dataclass
class RequestResult:
    """What happened to one request."""

    prompt_tokens: int
    chunk: int = 0
    loan_slots: int = 0
    halvings: int = 0
    larger_than_auto: bool = False
    completed: bool = False
    refused_reason: str | None = None
    fallbacks: list[Fallback] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    #: cache hits and lookups during this request's prefill and its decode
    #: process CPU seconds of the prefill and of the decode (steadier than wall time on a shared machine)
    prefill_cpu_s: float = 0.0
    decode_cpu_s: float = 0.0
    prefill_hits: int = 0
    prefill_lookups: int = 0
    decode_hits: int = 0
    decode_lookups: int = 0

    def to_json(self) -> dict:
        """One request of `strata.simulation/1`."""
        return {"prompt_tokens": self.prompt_tokens, "chunk": self.chunk, "loan_slots": self.loan_slots,
                "halvings": self.halvings, "larger_than_auto": self.larger_than_auto, "completed": self.completed,
                "refused_reason": self.refused_reason, "fallbacks": [f.to_json() for f in self.fallbacks]}


#: Vocabulary rows whose routing estimates the experts' popularity for the warm-up.
POPULARITY_SAMPLE_TOKENS = 256


def warm_order(popularity: np.ndarray) -> np.ndarray:
    """Store rows (layer * E + expert) most popular first; equal popularity keeps expert-major order (expert 0 of
    every layer, then expert 1, ...), the warm-up's order before popularity."""
    L, E = popularity.shape
    rows = (np.arange(L)[None, :] * E + np.arange(E)[:, None]).reshape(-1)  # expert-major
    share = np.asarray(popularity, dtype=np.float64).reshape(-1)[rows]
    return rows[np.argsort(-share, kind="stable")]


def warm_frequency(popularity: np.ndarray, top_k: int,
                   sample_tokens: int = POPULARITY_SAMPLE_TOKENS) -> tuple[np.ndarray, np.ndarray]:
    """(store rows, routed rows) the popularity estimate stands for: the cache's starting frequencies.

    As many routed rows as the estimate's sample of tokens makes (share * top_k * sample_tokens): a prompt's own
    counts soon outweigh it, but until a layer is reached its popular experts are warmer than its unpopular ones
    and than empty slots.
    """
    pop = np.asarray(popularity, dtype=np.float64)
    rows = np.arange(pop.size, dtype=np.int64)
    return rows, pop.reshape(-1) * float(top_k) * float(sample_tokens)


class Engine:
    """The runtime objects of one run: store, pinned pool, cache, loans, CPU share and executor."""

    def __init__(self, plan: Any, *, dm: Any, allocator: Any, kernels: Any, budget: PinnedBudget,
                 weights: ModelWeights | None, log: RunLog, accounting_only: bool = False, seed: int = 0,
                 observer: LayerObserver | None = None, layer_ops: Any = None, strict_memory: bool = False):
        self.plan = plan
        self.log = log
        self.budget = budget
        # every device byte is a plan line taken here; strict (tests): a later allocation raises, else it is refused
        self.dm = PlanMemory(dm, strict=strict_memory, on_outside=log.fallback)
        self.allocator = allocator
        self.kernels = kernels
        self.weights = weights
        self.accounting_only = accounting_only
        self.seed = int(seed)
        model = plan.model
        self.limits = plan.limits
        if allocator is None:
            log.fallback("page-locked memory", "the backend offers no PinnedAllocator: every copy is pageable")
        host_pool = weights.experts if weights is not None else phantom_pool_of_bytes(model.experts_total,
                                                                                      model.slot_bytes)
        self.store = ExpertStore(host_pool, model.moe_layers, model.experts_per_layer)
        self.store.pin(allocator, budget, plan.pinned.arena_bytes, log, plan.pinned.registration_slice_bytes)
        self.arena_pinned_bytes = self.store.pinned_bytes
        # the plan's rounding line stands for one block holding every line (the driver rounds it once)
        if getattr(plan.vram, "alloc_rounding_bytes", 0) and not accounting_only:
            self.dm.reserve(plan.vram.regions_bytes + plan.vram.alloc_rounding_bytes)
        # the fixed lines first: the cache pool is the one that can shrink when the device is short at start
        self.regions = self._take_regions()
        self.dm.region("expert_cache")
        self.device_pool = self._alloc_pool(plan.expert_cache.slots)
        self.cache = ExpertCache(self._pool_slots, model.moe_layers, model.experts_per_layer)
        self.dm.region("dense")
        self.dense_dev = self._upload_dense()
        self.dense_device_bytes = sum(int(a.nbytes) for a in self.dense_dev.values())
        self._warm()
        self.share_pool = PinnedPool(allocator, budget, log, from_floor=True, name="CPU share")
        self.share = CpuShare(plan, self.share_pool, log, model.hidden)
        self.share.prepare(budget.exhausted)
        # staging comes after the share: the plan kept the floor for the share first
        self.staging_pool = PinnedPool(allocator, budget, log, from_floor=True, name="copy staging")
        self.staging = CopyStaging(self.store, self.staging_pool, log, self._staging_slots())
        self.loans = PromptLoan(plan, self.cache, log)
        self.executor = Executor(dm=self.dm, kernels=kernels, cache=self.cache, store=self.store,
                                 device_pool=self.device_pool, weights=weights, dense_dev=self.dense_dev,
                                 share=self.share, log=log, top_k=model.top_k, hidden=model.hidden,
                                 workspace_bytes=plan.vram.workspace_bytes, accounting_only=accounting_only,
                                 seed=seed, observer=observer, staging=self.staging, layer_ops=layer_ops,
                                 regions=self.regions)
        if not accounting_only:
            self.loans.buffer_need = self.executor.buffer_slots_needed
        self.dm.seal()
        if accounting_only and getattr(self, "_regions_refused", None):
            log.fallback("device memory (regions)", self._regions_refused)
        if not self.executor.carves:
            # the regions cannot be viewed: give them back, buffers are allocated per use as before API 2.0
            for name in [n for n in self.regions if n != "kv"]:
                self.dm.free(self.regions.pop(name))
            self.executor.regions = self.regions
            self.dm.allow_outside(getattr(self, "_regions_refused", None) or
                                  f"{type(dm).__name__} has no DeviceMemory.view: buffers are allocated per use, "
                                  "outside the plan's regions")
        self.engine_exits = 0

    @classmethod
    def open(cls, target: Any, plan: Any, weights: ModelWeights | None, log: RunLog, **kw: Any) -> "Engine":
        """An engine on the target's device: `target.device.open(plan)` gives the session it drives (and closes)."""
        session = target.device.open(plan)
        try:
            engine = cls(plan, dm=session.memory, allocator=session.pinned, kernels=session.kernels,
                         budget=session.budget, weights=weights, log=log, layer_ops=session.layer_ops, **kw)
        except BaseException:
            session.close()
            raise
        engine.session = session
        return engine

    # --- start-up ------------------------------------------------------------------------------------------

    def _staging_slots(self) -> int:
        """Half the widest ring of the plan's loans: one ring half is copied while the other computes."""
        rings = [r.ring_slots for r in self.plan.prompt.loans]
        return (max(rings) + 1) // 2 if rings else 0

    def _pool_specs(self, slots: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        pool = self.store.pool
        if pool.dtype == "raw":
            return {"blob": ((slots, self.plan.model.slot_bytes), np.uint8)}
        ffn = self.weights.expert_ffn
        return ExpertPool.array_specs(pool.dtype, slots, self.plan.model.hidden, ffn, pool.formats)

    def _alloc_pool(self, slots: int) -> ExpertPool:
        """The device cache pool of exactly the plan's slots; fewer (halving, with a fallback line) if refused."""
        planned = slots
        while slots >= self.plan.model.top_k:
            arrays: dict[str, Any] = {}
            for name, (shape, dtype) in self._pool_specs(slots).items():
                a = self.dm.alloc(shape, dtype)
                if a is None:
                    break
                arrays[name] = a
            else:
                if slots != planned:
                    self.log.fallback("expert cache", f"the plan's {planned} slots did not fit the device at "
                                      f"start (free VRAM changed since planning): running with {slots}")
                self._pool_slots = slots
                return self.store.pool.with_arrays(arrays)
            for a in arrays.values():
                self.dm.free(a)
            slots //= 2
        raise StrataError(f"the device refused the expert cache pool ({planned} slots of "
                          f"{self.plan.model.slot_bytes} bytes, or even {self.plan.model.top_k}); "
                          "free VRAM changed since planning: raise memory.vram_reserve_mib")

    def _upload_dense(self) -> dict[str, Any]:
        if self.weights is None or self.weights.dense is None or self.accounting_only:
            return {}
        out = {}
        host = bool(getattr(getattr(self.dm, "inner", self.dm), "host_arrays", False))
        for name, arr in self.weights.dense.device_arrays.items():
            d = self.dm.to_device(np.ascontiguousarray(arr))
            if d is None:
                raise StrataError(f"the device refused the dense weight '{name}' ({arr.nbytes} bytes)")
            if host and isinstance(d, np.ndarray):
                d.flags.writeable = False  # never written after start: a host kernel may keep a derived form
            out[name] = d
        return out

    def _warm(self) -> None:
        """Fill the cache with the most popular experts first (`expert_popularity`), uploading their weights, and seed
        the cache's frequencies from the same estimate (`warm_frequency`)."""
        try:
            popularity = self.expert_popularity()
        except (ValueError, TypeError, IndexError) as e:  # a model file whose dense tensors do not route here
            self.log.trace(f"warm-up: no popularity estimate ({type(e).__name__}: {e}); experts in id order")
            E = self.cache.experts_per_layer
            popularity = np.full((self.cache.layers, E), 1.0 / E)
        order = warm_order(popularity)
        placed = self.cache.place(order[: self.cache.slots])
        self.cache.seed_frequency(*warm_frequency(popularity, self.plan.model.top_k))
        if not self.accounting_only:
            for slot, row in zip(placed, order[: len(placed)]):
                for name, src in self.store.expert(int(row)).items():
                    self.dm.upload(self.device_pool.arrays[name][int(slot)], src, self.executor_stream())
            self.dm.synchronize()

    def expert_popularity(self) -> np.ndarray:
        """[L, E] share of each layer's routed rows every expert is expected to take (each row sums to 1).

        With weights: the routers' own choice over a sample of the vocabulary's embeddings (rmsnorm, router,
        router bias, top k), the first layer's input standing in for every layer's. In accounting mode: the
        synthetic routing law the composed layer ops draw from (the same seed, the same hot sets).
        """
        L, E, k = self.cache.layers, self.cache.experts_per_layer, self.plan.model.top_k
        d = self.weights.dense if self.weights is not None else None
        if self.accounting_only or d is None or len(getattr(d, "routers", ()) or ()) < L:
            return np.stack(synthetic_popularity(np.random.default_rng(self.seed), E, L))
        V = int(d.embed.shape[0])
        rows = np.random.default_rng(self.seed).choice(V, POPULARITY_SAMPLE_TOKENS, replace=False) \
            if V > POPULARITY_SAMPLE_TOKENS else np.arange(V)
        x = np.asarray(d.embed[np.sort(rows)], dtype=np.float32)
        biases = list(getattr(d, "router_biases", ()) or ())
        out = np.zeros((L, E))
        for layer in range(L):
            xn = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + 1e-6) * np.asarray(d.norms[layer], np.float32)
            logits = xn @ np.asarray(d.routers[layer], dtype=np.float32).T
            if layer < len(biases) and biases[layer] is not None:
                logits = logits + np.asarray(biases[layer], np.float32)
            top = np.argpartition(-logits, min(k, E) - 1, axis=1)[:, :k]
            counts = np.bincount(top.reshape(-1), minlength=E).astype(np.float64)
            out[layer] = counts / counts.sum()
        return out

    def _take_regions(self) -> dict[str, Any]:
        """The plan's other device lines, one flat region each: workspace, owned prompt buffers, KV (if planned)."""
        v = self.plan.vram
        out: dict[str, Any] = {}
        for name, nbytes in (("workspace", v.workspace_bytes), ("owned_prompt", getattr(v, "owned_prompt_bytes", 0)),
                             ("kv", v.kv_bytes)):
            if int(nbytes) <= 0:
                continue
            region = self.dm.take(name, int(nbytes))
            if region is None:
                # the device will not give the line as one block: buffers come per use instead (a fallback, said)
                self._regions_refused = (f"the device refused the plan's {name} region ({int(nbytes)} bytes) as one "
                                         "block: buffers are allocated per use, outside the plan's regions")
                for r in out.values():
                    self.dm.free(r)
                return {}
            out[name] = region
        return out

    def executor_stream(self) -> Any:
        """The copy stream of start-up uploads (the executor makes its own)."""
        if not hasattr(self, "_warm_stream"):
            self._warm_stream = self.dm.new_stream()
        return self._warm_stream

    # --- requests ------------------------------------------------------------------------------------------

    @property
    def device_bytes_allocated(self) -> int:
        """Peak bytes the runtime asked DeviceMemory for (pool, dense weights, per-chunk buffers)."""
        return self.dm.peak_bytes

    def device_bytes_peak_measured(self) -> tuple[int, str]:
        """(peak device bytes, source) read from the backend itself (its ledger, pool or driver; host: regions)."""
        return self.dm.peak_measured()

    @property
    def device_bytes_planned(self) -> int:
        """Every device line of the plan: cache, dense weights, workspace, KV, owned prompt buffers, and the driver's
        lines (its rounding of the start-up block, the page tables of pinned memory)."""
        v = self.plan.vram
        return (v.expert_cache_bytes + v.dense_bytes + v.workspace_bytes + v.kv_bytes
                + getattr(v, "owned_prompt_bytes", 0) + getattr(v, "alloc_rounding_bytes", 0)
                + getattr(v, "pinned_map_bytes", 0))

    @property
    def device_bytes_peak_estimate(self) -> int:
        """Pool, dense weights and the peak of a chunk's buffers (kernel outputs included, from their shapes)."""
        return self.pool_bytes + self.dense_device_bytes + self.executor.stats.workspace_peak_bytes

    @property
    def pool_bytes(self) -> int:
        """Bytes of the device cache pool."""
        return self._pool_slots * self.plan.model.slot_bytes

    def refuse_reason(self, prompt_tokens: int) -> str | None:
        """Why a request cannot run at all (checked before it starts), or None."""
        return self.plan.refuse_reason(prompt_tokens)

    def serve(self, prompt: int | np.ndarray, decode_tokens: int = 0) -> RequestResult:
        """Prefill a prompt (token ids, or a length in accounting mode) in its loan's chunks, then decode greedily."""
        n = int(prompt) if np.isscalar(prompt) else len(prompt)
        res = RequestResult(prompt_tokens=n)
        res.refused_reason = self.refuse_reason(n)
        if res.refused_reason:
            return res
        before = len(self.log.fallbacks)
        t0, obs0, c0 = time.perf_counter(), self.executor.observer_s, time.process_time()
        oc0 = self.executor.observer_cpu_s
        h0, l0 = self.cache.hits, self.cache.lookups
        max_chunk: int | None = None
        extra_halvings = 0
        while True:
            loan = self.loans.lend(n, max_chunk=max_chunk)
            self.cache.untrim()
            res.chunk, res.halvings = loan.chunk_tokens, loan.halvings + extra_halvings
            res.loan_slots, res.larger_than_auto = loan.loan_slots, loan.larger_than_auto
            try:
                logits = self.executor.prefill(prompt, loan)
                break
            except DeviceFull as e:
                # no attention, no KV: the prompt can be read again from the start with smaller chunks
                if loan.chunk_tokens <= 1:
                    self.loans.give_back(loan)
                    res.refused_reason = (f"the device has no room for the prompt's buffers even for 1-token "
                                          f"chunks ({e})")
                    res.fallbacks = list(self.log.fallbacks[before:])
                    self.log.say(f"request of {n} tokens refused: {res.refused_reason}")
                    return res
                max_chunk = halve(loan.chunk_tokens, self.plan.prompt.grid_tokens)
                extra_halvings += 1
                self.loans.halvings += 1
                self.log.say(f"prompt buffers: {e} for a chunk of {loan.chunk_tokens} tokens: this request reads "
                             f"again with chunks of {max_chunk} tokens", once=("device-halved", loan.chunk_tokens))
            finally:
                if self.loans.outstanding is loan:
                    self.loans.give_back(loan)
        self.dm.synchronize()
        # --check's downloads and comparisons happen inside the layers: their time is taken out of the timings
        res.prefill_s = time.perf_counter() - t0 - (self.executor.observer_s - obs0)
        res.prefill_hits, res.prefill_lookups = self.cache.hits - h0, self.cache.lookups - l0
        res.prefill_cpu_s = time.process_time() - c0 - (self.executor.observer_cpu_s - oc0)
        t0, obs0, c0 = time.perf_counter(), self.executor.observer_s, time.process_time()
        oc0 = self.executor.observer_cpu_s
        h0, l0 = self.cache.hits, self.cache.lookups
        try:
            if logits is not None and decode_tokens > 0 and self.executor.pipelines_greedy:
                # the device picks each token and embeds it for the next step (the same tokens as the loop below)
                try:
                    logits = self.executor.decode_greedy(int(np.argmax(logits)), decode_tokens, res.tokens)
                finally:
                    res.decode_steps = max(0, len(res.tokens) - 1)
            elif logits is not None:
                tok = int(np.argmax(logits))
                for _ in range(decode_tokens):
                    res.tokens.append(tok)
                    logits = self.executor.decode_step(tok)
                    res.decode_steps += 1
                    tok = int(np.argmax(logits))
                res.tokens.append(tok)
            else:
                for _ in range(decode_tokens):
                    self.executor.decode_step(0)
                    res.decode_steps += 1
        except DeviceFull as e:
            # decode's buffers live in the plan's workspace: a device that took it back ends this request's decode
            res.refused_reason = f"decode stopped after {res.decode_steps} tokens: {e}"
            res.fallbacks = list(self.log.fallbacks[before:])
            self.log.say(f"request of {n} tokens: {res.refused_reason}")
            return res
        self.dm.synchronize()
        res.decode_s = time.perf_counter() - t0 - (self.executor.observer_s - obs0)
        res.decode_hits, res.decode_lookups = self.cache.hits - h0, self.cache.lookups - l0
        res.decode_cpu_s = time.process_time() - c0 - (self.executor.observer_cpu_s - oc0)
        self._trim_when_quiet()
        res.completed = True
        res.fallbacks = list(self.log.fallbacks[before:])
        return res

    def _trim_when_quiet(self) -> None:
        """Elastic slots: between requests, trim idle slots up to memory.elastic_slots_gib."""
        elastic_bytes = self.limits.elastic_slots_bytes
        if elastic_bytes > 0:
            trimmed = self.cache.trim_idle(elastic_bytes // self.plan.model.slot_bytes)
            if len(trimmed):
                self.log.trace(f"elastic slots: {len(trimmed)} idle slots trimmed")

    def close(self) -> None:
        """Wait for the device, then release pinned memory and device arrays."""
        # copies queued on side streams (a decode admission's, a top-up's) may still read page-locked rows or write
        # device slots: unlocking or freeing them first is an illegal access (seen once on the H200, 2026-12-03)
        self.dm.synchronize()
        self.executor.close()
        self.share_pool.close()
        self.staging_pool.close()
        self.store.close()
        for a in (list(self.device_pool.arrays.values()) + list(self.dense_dev.values())
                  + list(self.regions.values())):
            self.dm.free(a)
        session = getattr(self, "session", None)  # set by Engine.open: the backend's own resources go last
        if session is not None:
            session.close()
