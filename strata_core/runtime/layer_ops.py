"""The core's default layer ops, composed from a session's primitive KernelSet (used when `session.layer_ops` is None).

Per layer: route on the device (rmsnorm, linear, route_topk), download the ids (small) and group tokens by expert on
the host; run the cached experts over the cache pool's slots while the misses stream into the ring (slots lent from
the same pool) on a copy stream, double-buffered with events; when armed, the CPU share runs some misses on host
weights in a thread at the same time. Decode reads hits from the cache and admits its misses (evicting the coldest
slots). A decode step is its layers in order.

In accounting-only mode (`strata simulate`) there are no weights: routing is drawn from a seeded popularity per
layer and every decision (hits, misses, the ring, the CPU share's arming and buffers) runs as it would, with the
bytes counted and no kernel launched.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from strata_core.api.kernels import ExpertPool, LayerWork
from strata_core.errors import StrataError
from strata_core.models.spec import ACTIVATION_BUFFERS, F32_BYTES
from strata_core.runtime.cache import EMPTY
from strata_core.runtime.devmem import DeviceFull, nbytes_of

#: A grouped-FFN call takes at least this many routed rows, however small the workspace.
MIN_ROWS_PER_CALL = 64
#: A grouped kernel may hold scratch beside the buffers the contract names (padded f16 copies of the rows, staged
#: expert weights): a call is sized as if its buffers took this many times their contract bytes. 3 kept the cuda
#: backend's memory pool at 93-97% of the plan's device figures on an H200 for prompts of 300 to 6000 tokens (2 let
#: a 300-token prompt go 0.4% above).
KERNEL_SCRATCH_FACTOR = 3

#: The counters a layer op adds to (LayerWork.stats); the executor keeps one such dict for the run.
COUNTERS = ("experts_streamed", "bytes_streamed", "experts_admitted", "cpu_share_experts", "ring_batches",
            "workspace_peak_bytes")


def synthetic_popularity(rng: np.random.Generator, experts_per_layer: int, layers: int) -> list[np.ndarray]:
    """Accounting mode's routing law: a Zipf-like popularity per layer (rank^-0.8), a different hot set each layer."""
    base = 1.0 / np.arange(1, int(experts_per_layer) + 1) ** 0.8
    return [rng.permutation(base / base.sum()) for _ in range(int(layers))]


def new_counters() -> dict[str, int]:
    """A zeroed counter dict of the names a layer op adds to."""
    return {k: 0 for k in COUNTERS}


@dataclass
class Routing:
    """One layer's routing of T tokens, grouped by expert on the host."""

    experts: np.ndarray      # [G] expert ids of the layer, ascending
    counts: np.ndarray       # [G] tokens each
    starts: np.ndarray       # [G] start of each group in rows/scales
    rows: np.ndarray | None  # [N] token index of each routed row, grouped by expert
    scales: np.ndarray | None  # [N] routing weight of each routed row

    def group(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, scales) of group g."""
        s, n = int(self.starts[g]), int(self.counts[g])
        return self.rows[s:s + n], self.scales[s:s + n]


class StoreSource:
    """ExpertSource over the host store (or its page-locked staging copy), counting what it streams."""

    def __init__(self, dm: Any, pool: ExpertPool, store: Any, staging: Any, stats: dict, accounting_only: bool):
        self.dm = dm
        self.pool = pool
        self.store = store
        self.staging = staging
        self.stats = stats
        self.accounting_only = accounting_only
        #: host seconds inside the upload calls (the copies themselves on a synchronous backend)
        self.copy_s = 0.0
        #: (device arrays, store arrays, [(device array, store array)] by name): the pairs a copy goes through,
        #: made again when either dict is replaced (a decode miss's host work, ~2 us less a copy)
        self._pairs: tuple[Any, Any, list] = (None, None, [])

    def upload(self, row: int, slot: int, stream: Any) -> None:
        """Copy expert `row` of the host store into device slot `slot` on `stream`."""
        if not self.accounting_only:
            t0 = time.perf_counter()
            staged = (self.staging.stage(row, lambda: self.dm.synchronize(stream))
                      if self.staging is not None and self.staging.enabled else None)
            if not staged:
                # straight from the store's arrays: the same copies as through store.expert(row), without its dict
                dst, src = self.pool.arrays, self.store.pool.arrays
                pairs = self._pairs
                if pairs[0] is not dst or pairs[1] is not src:
                    pairs = self._pairs = (dst, src, [(dst[name], a) for name, a in src.items()])
                upload = self.dm.upload
                for d, a in pairs[2]:
                    upload(d[slot], a[row], stream)
            else:
                for name, src in staged.items():
                    self.dm.upload(self.pool.arrays[name][slot], src, stream)
            self.copy_s += time.perf_counter() - t0
        self.stats["experts_streamed"] += 1
        self.stats["bytes_streamed"] += self.store.row_bytes


class ComposedLayerOps:
    """LayerOps composed from primitive kernels: route, group, hits, ring streaming or admission, CPU share."""

    name = "composed"

    def __init__(self, *, dm: Any, kernels: Any, store: Any, share: Any, hidden: int, expert_ffn: int,
                 experts_per_layer: int, layers: int, workspace_bytes: int = 0, accounting_only: bool = False,
                 seed: int = 0):
        self.dm = dm
        self.k = kernels
        self.store = store
        self.share = share
        self.hidden = int(hidden)
        self.ffn = int(expert_ffn)
        self.E = int(experts_per_layer)
        #: The plan's device workspace: a chunk's buffers beyond the lent slots stay within it where they can.
        self.workspace_bytes = int(workspace_bytes)
        self.accounting_only = accounting_only
        #: Does the layer in progress keep its routed rows in routing order (see _run_groups)?
        self._ordered = False
        self._rng = np.random.default_rng(seed)
        self._popularity = synthetic_popularity(self._rng, self.E, int(layers))
        #: Which primitives take an `out` buffer (a backend written before 2.0 allocates its results itself).
        self._takes_out = {name: _takes_out(getattr(kernels, name, None))
                           for name in ("rmsnorm", "linear", "route_topk", "gather", "moe_grouped_ffn")}
        self._zeros_host = np.zeros(0, np.float32)
        #: (rows, ffn) -> the intermediate's shape a kernel set's grouped FFN needs as `scratch`, or None (a
        #: two-pass FFN on small work-groups: the buffer is carved from the workspace, inside the plan)
        self._ffn_scratch = getattr(kernels, "ffn_scratch_shape", None)
        #: (tokens, top_k, rows, groups) -> does one ordered call fit the workspace (sizes only: computed once)
        self._direct_fits: dict[tuple, bool] = {}
        self._direct_peak: dict[tuple, int] = {}
        self._host_consts: dict[int, tuple] = {}
        #: The device is the host (numpy arrays, synchronous calls) and every kernel takes its output buffer: a
        #: decode step runs as `_decode_host`, its buffers carved once a step and the index arrays used in place.
        self._host = (not accounting_only and bool(getattr(getattr(dm, "inner", dm), "host_arrays", False))
                      and all(self._takes_out.values()) and self._ffn_scratch is None)

    # --- the contract --------------------------------------------------------------------------------------

    def prefill_layer(self, work: LayerWork) -> None:
        """Run one MoE layer of a prompt chunk in place on work.x."""
        self._layer(work)

    def decode_step(self, works: list[LayerWork]) -> None:
        """Run every MoE layer of one decode token in order."""
        if self._host and works and works[0].tokens == 1 and not len(works[0].ring) and not self.share.armed_for(1):
            self._decode_host(works)
            return
        for w in works:
            self._layer(w)

    # --- device helpers ------------------------------------------------------------------------------------

    def _put(self, w: LayerWork, host: np.ndarray) -> Any:
        """Host -> a device view carved from the work's workspace; DeviceFull when the plan's buffers are spent."""
        host = np.ascontiguousarray(host)
        arr = w.workspace.carve(host.shape, host.dtype)
        self.dm.upload(arr, host)
        return arr

    def _out(self, w: LayerWork, kernel: str, shape: tuple[int, ...], dtype: Any) -> Any:
        """An output buffer for `kernel` carved from the workspace, or None when the kernel allocates its own."""
        return w.workspace.carve(shape, dtype) if self._takes_out[kernel] else None

    def _zeros(self, w: LayerWork, shape: tuple[int, ...]) -> Any:
        """A zeroed f32 device view carved from the workspace (uploaded from one host buffer kept for the run)."""
        n = int(np.prod(shape))
        if self._zeros_host.size < n:
            self._zeros_host = np.zeros(n, np.float32)
        arr = w.workspace.carve(shape, np.float32)
        self.dm.upload(arr, self._zeros_host[:n])
        return arr

    def _ffn(self, w: LayerWork, xg: Any, offsets: Any, slots: Any, n: int) -> Any:
        """moe_grouped_ffn of n gathered rows into a carved output, its scratch carved after it when it needs one."""
        out = self._out(w, "moe_grouped_ffn", (n, self.hidden), np.float32)
        shape = self._ffn_scratch(n, self.ffn) if self._ffn_scratch is not None else None
        if not shape:
            return self._k("moe_grouped_ffn", xg, offsets, slots, w.pool, out=out)
        return self.k.moe_grouped_ffn(xg, offsets, slots, w.pool, out=out,
                                      scratch=w.workspace.carve(tuple(shape), np.float32))

    def _k(self, kernel: str, *args: Any, out: Any = None) -> Any:
        """Call a primitive, with its output buffer when it takes one."""
        f = getattr(self.k, kernel)
        return f(*args) if out is None else f(*args, out=out)

    # --- routing -------------------------------------------------------------------------------------------

    def _route(self, w: LayerWork, xn: Any) -> Routing:
        """Route on the device and group on the host (or draw a routing in accounting mode)."""
        k, tokens, layer = w.top_k, w.tokens, w.layer
        if self.accounting_only:
            counts = self._rng.multinomial(tokens * k, self._popularity[layer])
            experts = np.flatnonzero(counts)
            counts = counts[experts]
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]]) if len(counts) else counts
            return Routing(experts, counts, starts, None, None)
        logits = self._k("linear", xn, w.router_w, out=self._out(w, "linear", (tokens, self.E), np.float32))
        bias = w.extras.get("router_bias")  # gpt-oss's [E] host bias, before the top k (runtime.dense_ffn sets it)
        if bias is not None:
            mark = w.workspace.mark()
            self.k.scatter_add(logits, self._put(w, np.arange(tokens, dtype=np.int32)),
                               self._put(w, np.broadcast_to(bias, (tokens, self.E))),
                               self._put(w, np.ones(tokens, np.float32)))
            w.workspace.release(mark)
        out = ((w.workspace.carve((tokens, k), np.int32), w.workspace.carve((tokens, k), np.float32))
               if self._takes_out["route_topk"] else None)
        ids_d, w_d = self._k("route_topk", logits, k, out=out)
        ids = np.asarray(self.dm.download(ids_d)).reshape(-1)
        wts = np.asarray(self.dm.download(w_d), dtype=np.float32).reshape(-1)
        order = np.argsort(ids, kind="stable")
        srt = ids[order]
        # np.unique's groups (starts, counts) without its extra passes: decode pays this every layer
        first = np.empty(len(srt), dtype=bool)
        first[:1] = True
        np.not_equal(srt[1:], srt[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        counts = np.diff(np.append(starts, len(srt)))
        return Routing(srt[starts].astype(np.int64), counts, starts, (order // k).astype(np.int32), wts[order])

    # --- sizes ---------------------------------------------------------------------------------------------

    def _token_part_bytes(self, w: LayerWork) -> int:
        """Device bytes of a chunk's per-token buffers (activations, router logits, top-k), as the plan counts them."""
        base = ACTIVATION_BUFFERS * self.hidden * F32_BYTES + self.E * F32_BYTES + w.top_k * 8
        return w.tokens * (base + (self._ordered_row_bytes(w) if self._ordered else 0))

    def _ordered_row_bytes(self, w: LayerWork) -> int:
        """Per token: every routed row's output kept in routing order (hidden f32), its token index and weight."""
        return w.top_k * (self.hidden * F32_BYTES + 8)

    def _ordered_fits(self, w: LayerWork) -> bool:
        """Can this chunk keep its routed rows in routing order within the plan's workspace?"""
        if not self.workspace_bytes:
            return True
        per_token = (ACTIVATION_BUFFERS * self.hidden * F32_BYTES + self.E * F32_BYTES + w.top_k * 8
                     + self._ordered_row_bytes(w))
        return w.tokens * per_token + MIN_ROWS_PER_CALL * KERNEL_SCRATCH_FACTOR * self._row_bytes() \
            <= self.workspace_bytes

    def _row_bytes(self) -> int:
        """Device bytes of one routed row: its gathered input, its output, the gate and up intermediates, its index."""
        return (2 * self.hidden + 2 * self.ffn) * F32_BYTES + 8

    def _staged_slot_bytes(self) -> int:
        """Bytes a grouped kernel may stage per group: the expert's weights, dequantized to f16 where quantized."""
        return max(self.store.row_bytes, 6 * self.hidden * self.ffn)

    def _call_budget(self, w: LayerWork) -> int:
        """Bytes one grouped-FFN call may take so the chunk's buffers stay within the plan's workspace."""
        if not self.workspace_bytes:
            return 1 << 62
        return max(MIN_ROWS_PER_CALL * self._row_bytes(), self.workspace_bytes - self._token_part_bytes(w))

    def worst_carves(self, tokens: int, vocab: int, top_k: int | None = None) -> list:
        """The carves of a chunk's worst layer after its residual, in the order `_layer` makes them.

        Items are (shape, dtype) or "fix" / "mark" / "release" / "reset"; the executor replays them on a dry arena
        to lend only the buffer slots a chunk needs.
        """
        k = int(top_k if top_k is not None else getattr(self, "top_k", 1))
        from types import SimpleNamespace
        w = SimpleNamespace(tokens=int(tokens), top_k=k)
        T, H, N = int(tokens), self.hidden, int(tokens) * k
        f32, i32 = np.float32, np.int32
        saved = self._ordered
        try:
            self._ordered = ordered = self._ordered_fits(w)
            budget = self._call_budget(w)
        finally:
            self._ordered = saved
        row_b = KERNEL_SCRATCH_FACTOR * self._row_bytes()
        n = max(1, min(N, max((budget - KERNEL_SCRATCH_FACTOR * self._staged_slot_bytes()) // row_b,
                              budget // row_b)))
        g = max(1, min(n, self.E))
        out = ["fix"]
        if self._takes_out["rmsnorm"]:
            out.append(((T, H), f32))
        if self._takes_out["linear"]:
            out.append(((T, self.E), f32))
        if self._takes_out["route_topk"]:
            out += [((T, k), i32), ((T, k), f32)]
        if ordered:
            out.append(((N, H), f32))
        out += ["mark", ((n,), i32)]
        if self._takes_out["gather"]:
            out.append(((n, H), f32))
        out += [((g + 1,), i32), ((g,), i32)]
        if self._takes_out["moe_grouped_ffn"]:
            out.append(((n, H), f32))
        scratch = self._ffn_scratch(n, self.ffn) if self._ffn_scratch is not None else None
        if scratch:
            out.append((tuple(scratch), f32))
        out += [((n,), i32), ((n,), f32)] if ordered else [((n,), f32)]
        out.append("release")
        c = int(self.share.rows_capacity) if self.share.armed_for(T) else 0
        if c:
            out += [((c,), i32), ((c, H), f32), ((c,), f32)]
        if ordered:
            out += [((N,), i32), ((N,), f32)]
        out.append("reset")
        if self._takes_out["rmsnorm"]:
            out.append(((1, H), f32))
        if self._takes_out["linear"] and vocab:
            out.append(((1, int(vocab)), f32))
        return out

    # --- grouped calls -------------------------------------------------------------------------------------

    def _run_groups(self, w: LayerWork, r: Routing, groups: np.ndarray, slots: np.ndarray, xn: Any,
                    out: Any) -> None:
        """Run these groups' experts, each from its device slot, on their rows of xn, into `out`.

        When the layer keeps its rows in routing order (`self._ordered`), `out` is that [N,H] buffer and each row's
        output lands at its position, so the layer adds them to the residual in one fixed order whichever experts
        hit, missed or ran in which call (the bits do not depend on the cache's contents). When that buffer would
        not fit the workspace (a large chunk), `out` is the residual itself and rows add as their calls finish.
        A call's cost is its routed rows' buffers plus one slot's bytes per group, since a grouped kernel may stage
        each group's expert weights; a call never exceeds what the workspace has left beside the chunk's buffers.
        """
        if self.accounting_only or len(groups) == 0:
            return
        budget = self._call_budget(w)
        row_b, slot_b = KERNEL_SCRATCH_FACTOR * self._row_bytes(), KERNEL_SCRATCH_FACTOR * self._staged_slot_bytes()
        cap = max(1, (budget - slot_b) // row_b)
        pieces: list[tuple] = []  # (rows, positions, scales, slot), a group split where too long
        for g, slot in zip(groups, slots):
            rows, scales = r.group(int(g))
            start = int(r.starts[g])
            positions = np.arange(start, start + len(rows), dtype=np.int32)
            for i in range(0, len(rows), cap):
                pieces.append((rows[i:i + cap], positions[i:i + cap], scales[i:i + cap], int(slot)))
        call: list[tuple] = []
        cost = 0
        for piece in pieces + [None]:
            more = 0 if piece is None else len(piece[0]) * row_b + slot_b
            if piece is None or (call and cost + more > budget):
                self._grouped_call(w, call, xn, out)
                call, cost = [], 0
            if piece is not None:
                call.append(piece)
                cost += more

    def _grouped_call(self, w: LayerWork, call: list, xn: Any, out: Any) -> None:
        """One moe_grouped_ffn over these (rows, positions, scales, slot) groups into `out`; buffers freed after."""
        if not call:
            return
        ws = w.workspace
        mark = ws.mark()
        try:
            rows = np.concatenate([p[0] for p in call]).astype(np.int32)
            offsets = np.concatenate([[0], np.cumsum([len(p[0]) for p in call])]).astype(np.int32)
            rows_d = self._put(w, rows)
            n = len(rows)
            xg = self._k("gather", xn, rows_d, out=self._out(w, "gather", (n, self.hidden), np.float32))
            y = self._ffn(w, xg, self._put(w, offsets), self._put(w, np.array([p[3] for p in call], np.int32)), n)
            if self._ordered:
                # out starts at zero and each position is written once: 0 + y is y, bit for bit
                positions = np.concatenate([p[1] for p in call]).astype(np.int32)
                self.k.scatter_add(out, self._put(w, positions), y, self._put(w, np.ones(n, np.float32)))
            else:
                scales = np.concatenate([p[2] for p in call]).astype(np.float32)
                self.k.scatter_add(out, rows_d, y, self._put(w, scales))
            del xg, y
        finally:
            ws.release(mark)
        w.stats["workspace_peak_bytes"] = max(w.stats["workspace_peak_bytes"], self._token_part_bytes(w)
                                              + len(rows) * self._row_bytes() + len(call) * self._staged_slot_bytes())

    # --- misses --------------------------------------------------------------------------------------------

    def _stream_through_ring(self, w: LayerWork, r: Routing, groups: np.ndarray, xn: Any, out: Any) -> None:
        """Stream missed experts into the ring's two halves in turn: copy one half while the other computes."""
        if len(groups) == 0:
            return
        ring = w.ring
        halves = [ring[: len(ring) // 2], ring[len(ring) // 2:]] if len(ring) >= 2 else [ring]
        width = min(len(h) for h in halves)
        ready: list[Any] = [None] * len(halves)
        for b, i0 in enumerate(range(0, len(groups), width)):
            batch = groups[i0:i0 + width]
            h = b % len(halves)
            slots = halves[h][:len(batch)]
            if ready[h] is not None:
                self.dm.wait(w.copy_stream, ready[h])  # the compute of two batches ago is done with this half
            # Python ints from two tolist() calls, not numpy scalars per expert: under tracemalloc (the soak) each
            # allocation is traced, and this loop runs ~7e5 times in 20 soak requests
            row, layer, upload, stream = w.slots.row, w.layer, w.source.upload, w.copy_stream
            for e, slot in zip(np.asarray(r.experts)[batch].tolist(), np.asarray(slots).tolist()):
                upload(int(row(layer, e)), slot, stream)
            copied = self.dm.new_event()
            self.dm.record(copied, w.copy_stream)
            self.dm.wait(None, copied)
            self._run_groups(w, r, batch, slots, xn, out)
            done = self.dm.new_event()
            self.dm.record(done, None)
            ready[h] = done
            w.stats["ring_batches"] += 1

    def _run_misses(self, w: LayerWork, r: Routing, groups: np.ndarray, keep: np.ndarray, xn: Any, out: Any) -> None:
        """Run missed experts: streamed through the lent ring when the chunk has one, else admitted into the cache."""
        if w.ring is not None and len(w.ring):
            self._stream_through_ring(w, r, groups, xn, out)
        else:
            self._admit_and_run(w, r, groups, keep, xn, out)

    def _admit_and_run(self, w: LayerWork, r: Routing, groups: np.ndarray, keep: np.ndarray, xn: Any,
                       out: Any) -> None:
        """Misses without a ring (decode, short prompts): admit them into the cache, evicting the coldest, and run.

        The first pass keeps this step's hits (the hot set); when the cache is too small for every miss, later passes
        may reuse any slot, after a fence that orders their copies behind the kernels already launched.
        """
        todo = groups
        layer = w.layer
        while len(todo):
            slots = w.slots.admit(layer, r.experts[todo], keep=keep)
            ok = slots != EMPTY
            if not ok.any():
                if len(keep) == 0:
                    raise StrataError(f"layer {layer}: no cache slot can take a missed expert "
                                      f"({getattr(w.slots, 'slots_on_loan', '?')} of "
                                      f"{getattr(w.slots, 'slots', '?')} slots on loan)")
                self._fence_copies(w)
                keep = keep[:0]
                continue
            for g, slot in zip(todo[ok], slots[ok]):
                w.source.upload(int(w.slots.row(layer, int(r.experts[g]))), int(slot), w.copy_stream)
            w.stats["experts_admitted"] += int(ok.sum())
            copied = self.dm.new_event()
            self.dm.record(copied, w.copy_stream)
            self.dm.wait(None, copied)
            self._run_groups(w, r, todo[ok], slots[ok], xn, out)
            keep = np.concatenate([keep, slots[ok]])
            todo = todo[~ok]

    def _fence_copies(self, w: LayerWork) -> None:
        """Order later copies on the copy stream behind every kernel launched so far."""
        fence = self.dm.new_event()
        self.dm.record(fence, None)
        self.dm.wait(w.copy_stream, fence)

    def _direct(self, w: LayerWork, r: Routing, slots: np.ndarray, hits: np.ndarray, misses: np.ndarray,
                xn: Any) -> bool:
        """Decode and short chunks in one grouped call: misses admitted in one pass, then every group in routing order.

        Taken only where the general path would keep routing order and fit one call (no ring, no CPU share, one
        admission pass, the call within the workspace budget); its rows then add to the residual in the same order,
        to the same bits, with a fifth of the host's calls. False: nothing was done, the general path runs.
        """
        if self.accounting_only or len(w.ring) or self.share.armed_for(w.tokens):
            return False
        usable = getattr(w.slots, "usable_slots", None)
        if usable is None or (len(misses) and usable() - len(hits) < len(misses)):
            return False
        n, g = len(r.rows), len(r.experts)
        key = (w.tokens, w.top_k, n, g)
        if not self._one_call_fits(w, key):
            return False
        self._ordered = True
        layer = w.layer
        if len(misses):
            got = w.slots.admit(layer, r.experts[misses], keep=slots[hits])
            slots = slots.copy()
            slots[misses] = got
            for e, slot in zip(r.experts[misses].tolist(), got.tolist()):
                w.source.upload(int(w.slots.row(layer, e)), slot, w.copy_stream)
            w.stats["experts_admitted"] += len(misses)
            copied = self.dm.new_event()
            self.dm.record(copied, w.copy_stream)
            self.dm.wait(None, copied)
        ints = np.empty(n + 2 * g + 1, np.int32)
        ints[:n] = r.rows
        ints[n] = 0
        np.cumsum(r.counts, out=ints[n + 1:n + g + 1])
        ints[n + g + 1:] = slots
        ints_d = self._put(w, ints)
        rows_d, offs_d, slots_d = ints_d[:n], ints_d[n:n + g + 1], ints_d[n + g + 1:]
        xg = self._k("gather", xn, rows_d, out=self._out(w, "gather", (n, self.hidden), np.float32))
        y = self._ffn(w, xg, offs_d, slots_d, n)
        self.k.scatter_add(w.x, rows_d, y, self._put(w, r.scales))
        peak = self._direct_peak_bytes(w, key)
        if peak > w.stats["workspace_peak_bytes"]:
            w.stats["workspace_peak_bytes"] = peak
        return True

    def _one_call_fits(self, w: LayerWork, key: tuple) -> bool:
        """Do `key`'s (tokens, top_k, rows, groups) keep routing order and fit one grouped call? (sizes only: once)"""
        ok = self._direct_fits.get(key)
        if ok is None:
            self._ordered = True
            n, g = key[2], key[3]
            ok = self._ordered_fits(w) and (n * KERNEL_SCRATCH_FACTOR * self._row_bytes() + g * KERNEL_SCRATCH_FACTOR
                                            * self._staged_slot_bytes() <= self._call_budget(w))
            self._direct_fits[key] = ok
        return ok

    def _direct_peak_bytes(self, w: LayerWork, key: tuple) -> int:
        """The workspace peak of one ordered call of `key`'s shape (from the sizes: computed once)."""
        peak = self._direct_peak.get(key)
        if peak is None:
            self._ordered = True
            peak = self._direct_peak[key] = (self._token_part_bytes(w) + key[2] * self._row_bytes()
                                             + key[3] * self._staged_slot_bytes())
        return peak

    # --- decode on the host --------------------------------------------------------------------------------

    def _decode_host(self, works: list[LayerWork]) -> None:
        """A decode token's layers where the device is the host: `_direct`'s work and bits, fewer host calls.

        One token routes to top_k distinct experts, so its routing is known without grouping: experts ascending,
        one row each, every row reading token 0. The step's buffers are carved once, after the residual, and serve
        every layer; index arrays are host arrays used in place (the device is the host). A layer `_direct` would
        not take (a router bias, a cache too small for its misses in one pass, a call over the workspace budget)
        runs the general path from the same routing, and the step's buffers are carved again after it.
        """
        w0 = works[0]
        k, H, E = int(w0.top_k), self.hidden, self.E
        key = (1, k, k, k)
        consts = self._host_consts.get(k)
        if consts is None:
            # ones (lookup's tokens), zero rows (every row reads token 0), offsets and starts (one row a group)
            consts = self._host_consts[k] = (np.ones(k, np.int64), np.zeros(k, np.int32),
                                             np.arange(k + 1, dtype=np.int32), np.arange(k, dtype=np.int64))
        ones_k, rows, offsets, starts = consts
        fits = self._one_call_fits(w0, key)
        kern = self.k
        row_step = getattr(kern, "row_step", None)
        if row_step is not None:
            self._decode_rows(works, key, fits, ones_k, starts, rows)
            return
        rmsnorm, linear, route_topk, gather, ffn, scatter_add = (kern.rmsnorm, kern.linear, kern.route_topk,
                                                                 kern.gather, kern.moe_grouped_ffn, kern.scatter_add)
        bufs = mark = None
        ran = False
        ks = range(k)
        for w in works:
            ws = w.workspace
            if not fits or w.extras.get("router_bias") is not None:
                if bufs is not None:
                    ws.release(mark)
                    bufs = None
                self._layer(w)
                continue
            if bufs is None:
                # one f32 block and one int32 block for the step (views of them: two carves, not seven)
                mark = ws.mark()
                fb, ib = ws.carve((H + E + k + 2 * k * H,), np.float32), ws.carve((2 * k,), np.int32)
                bufs = (fb[:H].reshape(1, H), fb[H:H + E].reshape(1, E), ib[:k].reshape(1, k),
                        fb[H + E:H + E + k].reshape(1, k), fb[H + E + k:H + E + k + k * H].reshape(k, H),
                        fb[H + E + k + k * H:].reshape(k, H), ib[k:])
                xn, logits, ids, wts, xg, y, slots32 = bufs
                topk_out, ids0, wts0 = (ids, wts), ids[0], wts[0]
            layer, x, cache = w.layer, w.x, w.slots
            observer = w.extras.get("observer")
            x_in = np.array(x) if observer is not None else None
            rmsnorm(x, w.norm_w, out=xn)
            linear(xn, w.router_w, out=logits)
            route_topk(logits, k, out=topk_out)
            # k Python ints: sorting, the lookup and the admission of a handful of experts cost less as scalars
            # than as array calls (each of which costs a microsecond or more here)
            id_l = ids0.tolist()
            order = sorted(ks, key=id_l.__getitem__)
            experts = [id_l[i] for i in order]
            if len(set(experts)) < k:
                # a top k with repeats (outside the kernel contract): the general path, from this layer's input
                ws.release(mark)
                bufs = None
                self._layer(w)
                continue
            scales = wts0.take(order)
            slots = cache.lookup_distinct(layer, experts)
            if EMPTY in slots and not self._admit_token_misses(w, experts, slots):
                # more misses than free slots beside the hits: the general path takes it from the lookup
                r = Routing(np.array(experts, np.int64), ones_k, starts, rows, scales)
                ws.release(mark)
                bufs = None
                try:
                    self._after_lookup(w, r, np.array(slots, np.int64),
                                       rmsnorm(x, w.norm_w, out=ws.carve((1, H), np.float32)), x_in)
                finally:
                    ws.reset()
                continue
            slots32[:] = slots
            gather(xn, rows, out=xg)
            scatter_add(x, rows, ffn(xg, offsets, slots32, w.pool, out=y), scales)
            ran = True
            if x_in is not None:
                observer(w.phase, layer, x_in, np.array(x))
        self._end_direct_step(works, key, mark if bufs is not None else None, ran)

    def _admit_token_misses(self, w: LayerWork, experts: list[int], slots: list[int]) -> bool:
        """Admit one decode token's missed experts of w's layer (`slots` from lookup_distinct: EMPTY marks a miss),
        queue their uploads on w's copy stream and write their slots into `slots`; False, with nothing changed, when
        the usable slots beside the hits are fewer than the misses."""
        cache, layer = w.slots, w.layer
        miss = [i for i, s in enumerate(slots) if s == EMPTY]
        got = cache.admit_distinct(layer, [experts[i] for i in miss], [s for s in slots if s != EMPTY])
        if got is None:
            return False
        base = cache.row(layer, 0)
        upload = w.source.upload
        for i, slot in zip(miss, got):
            slots[i] = slot
            upload(base + experts[i], slot, w.copy_stream)
        w.stats["experts_admitted"] += len(miss)
        return True

    def _end_direct_step(self, works: list[LayerWork], key: tuple, mark: Any, ran: bool) -> None:
        """After a direct decode step: release its block (`mark`, None when none is held), record the step's
        workspace peak when a layer ran on the direct path, and note that the host path's order holds."""
        if mark is not None:
            works[-1].workspace.release(mark)
        w0 = works[0]
        if ran:
            peak = self._direct_peak_bytes(w0, key)
            if peak > w0.stats["workspace_peak_bytes"]:
                w0.stats["workspace_peak_bytes"] = peak
        self._ordered = True

    def _decode_rows(self, works: list[LayerWork], key: tuple, fits: bool, ones_k: np.ndarray, starts: np.ndarray,
                     rows: np.ndarray) -> None:
        """`_decode_host` over a kernel set's one-row layer (`row_step`, `route_row`, `experts_row`: the cpu
        backend's, the bits of its primitives in about half their host calls); the same cache traffic and fallbacks."""
        w0 = works[0]
        k, H, E = int(w0.top_k), self.hidden, self.E
        kern = self.k
        route_row, experts_row = kern.route_row, kern.experts_row
        n = kern.row_step_size(H, E, k)
        st = mark = None
        ran = False
        for w in works:
            ws = w.workspace
            if not fits or w.extras.get("router_bias") is not None:
                if st is not None:
                    ws.release(mark)
                    st = None
                self._layer(w)
                continue
            x = w.x
            if st is None or st.x is not x:
                if st is not None:
                    ws.release(mark)
                mark = ws.mark()
                st = kern.row_step(x, k, E, ws.carve((n,), np.float32))
                if st is None:
                    ws.release(mark)
                    self._layer(w)
                    continue
            layer, cache = w.layer, w.slots
            observer = w.extras.get("observer")
            x_in = np.array(x) if observer is not None else None
            experts = route_row(st, w.norm_w, w.router_w)
            if experts is None:
                # a NaN atop the logits or a top k with repeats: the general path, from this layer's input
                ws.release(mark)
                st = None
                self._layer(w)
                continue
            slots = cache.lookup_distinct(layer, experts)
            if EMPTY in slots and not self._admit_token_misses(w, experts, slots):
                # more misses than free slots beside the hits: the general path takes it from the lookup
                r = Routing(np.array(experts, np.int64), ones_k, starts, rows, st.weights_by_id())
                ws.release(mark)
                st = None
                try:
                    self._after_lookup(w, r, np.array(slots, np.int64),
                                       self.k.rmsnorm(x, w.norm_w, out=ws.carve((1, H), np.float32)), x_in)
                finally:
                    ws.reset()
                continue
            experts_row(st, slots, w.pool)
            ran = True
            if x_in is not None:
                observer(w.phase, layer, x_in, np.array(x))
        self._end_direct_step(works, key, mark if st is not None else None, ran)

    def _share_split(self, r: Routing, misses: np.ndarray, tokens: int) -> np.ndarray:
        """The misses the CPU takes: the half with the fewest tokens (cheap on the CPU, costly to stream), as many
        as its buffer's rows hold."""
        if not self.share.armed_for(tokens) or len(misses) < 2:
            return misses[:0]
        by_size = misses[np.argsort(r.counts[misses], kind="stable")][: len(misses) // 2]
        fits = np.cumsum(r.counts[by_size]) <= self.share.rows_capacity
        return np.sort(by_size[fits])

    # --- one MoE layer -------------------------------------------------------------------------------------

    def _layer(self, w: LayerWork) -> None:
        """One MoE layer in place on the residual w.x [T,H] (a device array; None in accounting mode)."""
        layer, tokens, x = w.layer, w.tokens, w.x
        if self.accounting_only:
            self._layer_body(w, None)
            return
        try:
            xn = self._k("rmsnorm", x, w.norm_w, out=self._out(w, "rmsnorm", (tokens, self.hidden), np.float32))
            self._layer_body(w, xn)
        finally:
            w.workspace.reset()

    def _layer_body(self, w: LayerWork, xn: Any) -> None:
        """The layer after its rmsnorm: route, hits, misses, the CPU share, the ordered sum; buffers from w.workspace."""
        layer, x = w.layer, w.x
        observer = w.extras.get("observer")
        x_in = None
        if observer is not None and not self.accounting_only:
            x_in = np.asarray(self.dm.download(x))
        r = self._route(w, xn)
        # copies into ring or evicted slots must not overtake kernels of earlier layers that still read those slots;
        # this layer's own hits never sit in them, so their compute still overlaps the copies
        self._fence_copies(w)
        slots = w.slots.lookup(layer, r.experts, r.counts)
        self._after_lookup(w, r, slots, xn, x_in)

    def _after_lookup(self, w: LayerWork, r: Routing, slots: np.ndarray, xn: Any, x_in: np.ndarray | None) -> None:
        """The layer once its experts are looked up: hits, misses, the CPU share, the ordered sum."""
        layer, tokens, x = w.layer, w.tokens, w.x
        observer = w.extras.get("observer")
        hit = slots != EMPTY
        hits = np.flatnonzero(hit)
        misses = np.flatnonzero(~hit)
        if self._direct(w, r, slots, hits, misses, xn):
            if x_in is not None:
                observer(w.phase, layer, x_in, np.asarray(self.dm.download(x)))
            return
        cpu = self._share_split(r, misses, tokens)
        job = out = None
        cpu_rows = int(r.counts[cpu].sum()) if len(cpu) else 0
        if len(cpu):
            out = self.share.output(cpu_rows)
            if out is None:
                cpu = cpu[:0]
        if len(cpu):
            w.stats["cpu_share_experts"] += len(cpu)
            if not self.accounting_only:
                xh = np.asarray(self.dm.download(xn), dtype=np.float32)
                groups = [(self.store.expert(int(w.slots.row(layer, int(r.experts[g])))), r.group(int(g))[0])
                          for g in cpu]
                job = self.share.start(xh, groups, out, self.store.pool.for_layer(layer))
        device_misses = np.setdiff1d(misses, cpu, assume_unique=True)
        try:
            routed = None
            self._ordered = not self.accounting_only and self._ordered_fits(w)
            if self._ordered:
                routed = self._zeros(w, (len(r.rows), self.hidden))
            elif not self.accounting_only:
                routed = x
            self._run_groups(w, r, hits, slots[hits], xn, routed)
            self._run_misses(w, r, device_misses, slots[hits], xn, routed)
        except BaseException:
            if job is not None:
                job.join()  # the share writes into a buffer the next attempt reuses: let it finish first
            raise
        if job is not None:
            err = job.join()
            if err is None:
                # the share's rows go to their routing positions, so they add to the residual in the same order
                # (and to the same bits) as rows the device ran
                if self._ordered:
                    positions = np.concatenate([np.arange(int(r.starts[g]), int(r.starts[g] + r.counts[g]))
                                                for g in cpu]).astype(np.int32)
                    self.k.scatter_add(routed, self._put(w, positions), self._put(w, out),
                                       self._put(w, np.ones(cpu_rows, np.float32)))
                else:
                    rows = np.concatenate([r.group(int(g))[0] for g in cpu]).astype(np.int32)
                    scales = np.concatenate([r.group(int(g))[1] for g in cpu]).astype(np.float32)
                    self.k.scatter_add(x, self._put(w, rows), self._put(w, out), self._put(w, scales))
            else:
                # the share's result is lost: turn it off for the run and run its experts on the device path
                self.share.turn_off(f"its thread failed ({type(err).__name__}: {err}); off for this run")
                self._run_misses(w, r, cpu, slots[hits], xn, routed)
        if self._ordered:
            # every routed row's weighted output into the residual, in routing order (experts ascending)
            self.k.scatter_add(x, self._put(w, r.rows), routed, self._put(w, r.scales))
        if x_in is not None:
            observer(w.phase, layer, x_in, np.asarray(self.dm.download(x)))


def _takes_out(f: Any) -> bool:
    """Does this kernel accept an `out` buffer?"""
    if f is None:
        return False
    try:
        return "out" in inspect.signature(f).parameters
    except (TypeError, ValueError):
        return False
