"""ExpertCache: which expert lives in which device slot, how often each is used, and which slots are on loan.

Frequencies decay by `decay` per tick (one chunk or one decode step), so eviction and lending pick the experts
that have been cold lately, not the ones that were cold at start. Slots on loan to the prompt path hold no expert
and are never looked up, admitted into or evicted until they are given back.
"""

from __future__ import annotations

import numpy as np

EMPTY = -1
#: An admit of at most this many positions takes its slots one argmin at a time (decode's few misses).
FEW_ROWS = 16


class ExpertCache:
    """Slot table (layer, expert) -> slot over `slots` device slots, with hit/miss counters and decayed frequencies."""

    def __init__(self, slots: int, layers: int, experts_per_layer: int, decay: float = 0.97):
        self.slots = int(slots)
        self.layers = int(layers)
        self.experts_per_layer = int(experts_per_layer)
        self.decay = float(decay)
        n = self.layers * self.experts_per_layer
        self.slot_of = np.full(n, EMPTY, dtype=np.int64)          # expert row -> slot
        self.expert_in = np.full(self.slots, EMPTY, dtype=np.int64)  # slot -> expert row
        #: freq is a view of the first n of n + 1 values; the last is -1.0, the heat of an empty slot, so that
        #: freq_with_empty[expert_in] is every slot's heat in one gather (EMPTY = -1 reads it)
        self._freq_with_empty = np.zeros(n + 1, dtype=np.float64)
        self._freq_with_empty[n] = -1.0
        self.freq = self._freq_with_empty[:n]
        #: the part of freq that seed_frequency put there, decayed alike (observed use is freq - seeded)
        self.seeded = np.zeros(n, dtype=np.float64)
        self.on_loan = np.zeros(self.slots, dtype=bool)
        self.trimmed = np.zeros(self.slots, dtype=bool)
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def row(self, layer: int, expert) -> np.ndarray | int:
        """The store row of (layer, expert): layer * experts_per_layer + expert."""
        return layer * self.experts_per_layer + expert

    # --- lookups -------------------------------------------------------------------------------------------

    def seed_frequency(self, rows: np.ndarray, weights: np.ndarray) -> None:
        """Add `weights` (routed rows expected, e.g. a popularity estimate's counts) to the frequency of `rows`.

        The warm-up calls it: without a start, every frequency is 0 until its layer is first looked up, so the loan
        and the first misses would evict the warmest experts of the layers not reached yet (ties go by slot number,
        and the most popular experts sit in the first slots).
        """
        rows = np.asarray(rows, dtype=np.int64)
        weights = np.asarray(weights, dtype=np.float64)
        if rows.shape != weights.shape or (weights < 0).any() or not np.isfinite(weights).all():
            raise ValueError("seed_frequency: rows and weights must have one shape, weights finite and >= 0")
        np.add.at(self.freq, rows, weights)
        np.add.at(self.seeded, rows, weights)

    def tick(self) -> None:
        """Decay every frequency by one step."""
        self.freq *= self.decay
        self.seeded *= self.decay

    def lookup(self, layer: int, experts: np.ndarray, tokens: np.ndarray | None = None) -> np.ndarray:
        """Slots of these experts of `layer` (EMPTY for a miss); counts hits and misses, adds `tokens` to frequency."""
        experts = np.asarray(experts, dtype=np.int64)
        rows = self.row(layer, experts)
        slots = self.slot_of[rows]
        n_hit = int(np.count_nonzero(slots != EMPTY))
        self.hits += n_hit
        self.misses += slots.size - n_hit
        self.freq[rows] += 1.0 if tokens is None else np.asarray(tokens, dtype=np.float64)
        return slots

    def lookup_distinct(self, layer: int, experts: list[int]) -> list[int]:
        """`lookup(layer, experts)` for distinct experts as Python ints (one decode token's top k): the same
        counts, frequencies (+1.0 each) and slots, without an array op per step of it (k is a handful)."""
        base = layer * self.experts_per_layer
        slot, freq = self.slot_of.item, self.freq
        heat = freq.item
        out = []
        hits = 0
        for e in experts:
            r = base + e
            s = slot(r)
            out.append(s)
            hits += s != EMPTY
            freq[r] = heat(r) + 1.0  # item() and a float: the f64 add of `freq[r] += 1.0`, without numpy scalars
        self.hits += hits
        self.misses += len(out) - hits
        return out

    @property
    def lookups(self) -> int:
        """Hits plus misses."""
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        """Hits over lookups (0 before any lookup)."""
        return self.hits / self.lookups if self.lookups else 0.0

    # --- placement -----------------------------------------------------------------------------------------

    def usable_slots(self) -> int:
        """How many slots may hold an expert now."""
        return self.slots - int(np.count_nonzero(self.on_loan | self.trimmed))

    def usable(self) -> np.ndarray:
        """Mask of slots that may hold an expert now (not on loan, not trimmed)."""
        return ~(self.on_loan | self.trimmed)

    def _coldness_order(self, mask: np.ndarray) -> np.ndarray:
        """Slots under `mask`, coldest first: empty slots, then by the decayed frequency of the expert they hold."""
        idx = np.flatnonzero(mask)
        held = self.expert_in[idx]
        heat = np.where(held == EMPTY, -1.0, self.freq[np.maximum(held, 0)])
        heat = np.where(self.trimmed[idx], -2.0, heat)
        # idx ascends, so a stable sort by heat breaks ties by slot number (what lexsort((idx, heat)) did, faster)
        return idx[np.argsort(heat, kind="stable")]

    def _coldest(self, mask: np.ndarray, n: int) -> np.ndarray:
        """The first n slots of `_coldness_order(mask)`, without sorting every slot (decode admits a few)."""
        idx = np.flatnonzero(mask)
        if n <= 0 or n >= len(idx):
            return self._coldness_order(mask)[: max(n, 0)]
        held = self.expert_in[idx]
        heat = np.where(held == EMPTY, -1.0, self.freq[np.maximum(held, 0)])
        heat = np.where(self.trimmed[idx], -2.0, heat)
        kth = np.partition(heat, n - 1)[n - 1]
        cand = heat <= kth  # the n coldest are among these, ties broken by slot number as the full order does
        ci, ch = idx[cand], heat[cand]
        return ci[np.argsort(ch, kind="stable")][:n]

    def place(self, rows: np.ndarray) -> np.ndarray:
        """Put experts (store rows) into slots without evicting: fills empty usable slots in order (warm-up)."""
        rows = np.asarray(rows, dtype=np.int64)
        free = np.flatnonzero(self.usable() & (self.expert_in == EMPTY))
        n = min(len(free), len(rows))
        self.expert_in[free[:n]] = rows[:n]
        self.slot_of[rows[:n]] = free[:n]
        return free[:n]

    def admit(self, layer: int, experts: np.ndarray, keep: np.ndarray | None = None) -> np.ndarray:
        """Slots for missed experts of `layer`, evicting the coldest unprotected slots; EMPTY where none is left.

        `keep` are slots that must not be evicted now (the hits of the same step).
        """
        rows = self.row(layer, np.asarray(experts, dtype=np.int64))
        out = self.slot_of[rows].copy()  # experts already resident keep their slot
        if len(rows) <= FEW_ROWS:
            return self._admit_few(rows, out, keep)
        mask = self.usable()
        if keep is not None and len(keep):
            mask[np.asarray(keep, dtype=np.int64)] = False
        mask[out[out != EMPTY]] = False
        order = self._coldest(mask, len(rows))
        # One pass in call order, as arrays: each distinct missing expert takes the next coldest slot at its first
        # occurrence, repeats share it, and the first distinct one left without a slot ends the pass (it and every
        # later missing position stay EMPTY, as a per-item loop that stops there leaves them).
        new = np.flatnonzero(out == EMPTY)
        if len(new) == 0:
            return out
        new_rows = rows[new]
        _, first = np.unique(new_rows, return_index=True)
        first.sort()
        m = min(len(first), len(order))
        slots, placed = order[:m], new_rows[first[:m]]
        old = self.expert_in[slots]
        old = old[old != EMPTY]
        self.slot_of[old] = EMPTY
        self.evictions += len(old)
        self.expert_in[slots] = placed
        self.slot_of[placed] = slots
        served = new[: first[m]] if m < len(first) else new
        out[served] = self.slot_of[rows[served]]
        return out

    def _slot_heat(self) -> np.ndarray:
        """A new array of every slot's heat: -1 for an empty slot, else its expert's decayed frequency."""
        held = self.expert_in
        if self.freq.base is self._freq_with_empty:
            return self._freq_with_empty[held]
        heat = self.freq[held]  # freq was replaced by another array: EMPTY reads its last value, overwritten
        heat[held == EMPTY] = -1.0
        return heat

    def _heat_blocked(self, *blocked_slots) -> tuple[np.ndarray, int]:
        """Every slot's coldness key for admission (empty -1, else its expert's decayed frequency; +inf for a slot
        on loan, trimmed or in one of `blocked_slots`) and how many slots are left to take."""
        heat = self._slot_heat()
        heat[self.on_loan | self.trimmed] = np.inf
        for b in blocked_slots:
            if b is not None and len(b):
                heat[b] = np.inf
        return heat, int(np.count_nonzero(heat < np.inf))

    def _take_coldest(self, heat: np.ndarray, row: int) -> int:
        """Put store row `row` into the coldest slot left under `heat` (argmin: ties to the lower slot, as the
        stable coldness order breaks them), evicting what it held; that slot, now blocked in `heat`."""
        s = int(heat.argmin())
        old = int(self.expert_in[s])
        if old != EMPTY:
            self.slot_of[old] = EMPTY
            self.evictions += 1
        self.expert_in[s] = row
        self.slot_of[row] = s
        heat[s] = np.inf
        return s

    def _admit_few(self, rows: np.ndarray, out: np.ndarray, keep) -> np.ndarray:
        """`admit` for a handful of positions (decode): the same pass, each distinct missing expert taking the
        coldest slot left by one argmin instead of a partition, a sort and np.unique over the slots."""
        new = [i for i, s in enumerate(out.tolist()) if s == EMPTY]
        if not new:
            return out
        # resident experts of the call keep their slot and are not evicted for its other experts
        heat, left = self._heat_blocked(None if keep is None else np.asarray(keep, dtype=np.int64),
                                        out[out != EMPTY])
        placed: dict[int, int] = {}
        for i in new:
            r = int(rows[i])
            s = placed.get(r)
            if s is None:
                if left <= 0:
                    break  # the first distinct expert without a slot ends the pass (later positions stay EMPTY)
                s = placed[r] = self._take_coldest(heat, r)
                left -= 1
            out[i] = s
        return out

    def top_up(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Place the hottest of `rows` (store rows) that are not resident and have been used (frequency > 0) into
        the empty usable slots, evicting nothing: (rows placed, their slots), hottest first. The decode calls it
        once a prompt's loan came back empty, so the slots it lent hold what the next steps are likeliest to read."""
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        free = np.flatnonzero(self.usable() & (self.expert_in == EMPTY))
        out = rows[(self.slot_of[rows] == EMPTY) & (self.freq[rows] > 0)]
        if free.size == 0 or out.size == 0:
            return rows[:0], free[:0]
        pick = out[np.argsort(-self.freq[out], kind="stable")][: free.size]
        slots = free[: pick.size]
        self.expert_in[slots] = pick
        self.slot_of[pick] = slots
        return pick, slots

    def worth_admitting(self, rows: np.ndarray) -> np.ndarray:
        """The prefix of `rows` (store rows not resident, hottest first) worth admitting now: the i-th goes in only
        while it is hotter than the i-th coldest usable slot (an empty slot always takes one), since admitting a
        colder expert evicts a hotter one and spends the link for a likelier miss (the ring's admission rule)."""
        rows = np.asarray(rows, dtype=np.int64)
        heat, left = self._heat_blocked()
        n = min(int(rows.size), left)
        if n <= 0:
            return rows[:0]
        cold = np.sort(np.partition(heat, n - 1)[:n])
        hotter = self.freq[rows[:n]] > cold
        return rows[:n] if hotter.all() else rows[: int(np.argmin(hotter))]

    def admit_distinct(self, layer: int, experts: list[int], keep: list[int]) -> list[int] | None:
        """`admit(layer, experts, keep)` for distinct experts that are not resident (a decode token's misses, as
        Python ints; `keep` its hits' slots): their slots, or None, with nothing changed, when the usable slots
        beside `keep` are fewer than the experts (the caller's general path decides then)."""
        heat = self._slot_heat()
        blocked = self.on_loan | self.trimmed
        heat[blocked] = np.inf
        if len(keep):
            heat[keep] = np.inf
        # keep's slots hold this step's hits: distinct, neither lent nor trimmed
        left = self.slots - int(np.count_nonzero(blocked)) - len(keep)
        if left < len(experts):
            return None
        base = layer * self.experts_per_layer
        return [self._take_coldest(heat, base + e) for e in experts]

    def reserve(self, layer: int, experts: np.ndarray, keep: np.ndarray | None = None) -> np.ndarray:
        """Slots set aside for experts of `layer` that are not resident, to be filled later (`fill`): each takes the
        coldest usable slot outside `keep`, evicting what it held, and is held as on loan (no lookup finds it and no
        admission or loan takes it) until filled or given back; EMPTY where no slot is left. Decode reserves the
        slots its misses are written into as they are read from host memory."""
        rows = self.row(layer, np.asarray(experts, dtype=np.int64)).reshape(-1)
        out = np.full(rows.shape, EMPTY, dtype=np.int64)
        heat, left = self._heat_blocked(None if keep is None else np.asarray(keep, dtype=np.int64))
        for i, r in enumerate(rows.tolist()):
            if left <= 0:
                break
            if self.slot_of[r] != EMPTY or r in rows[:i]:
                continue  # resident, or reserved already by this call
            s = int(heat.argmin())
            old = int(self.expert_in[s])
            if old != EMPTY:
                self.slot_of[old] = EMPTY
                self.evictions += 1
            self.expert_in[s] = EMPTY
            self.on_loan[s] = True
            heat[s] = np.inf
            left -= 1
            out[i] = s
        return out

    def fill(self, row: int, slot: int) -> None:
        """Put store row `row` into `slot`, reserved for it by `reserve` (its bytes are on the device now)."""
        row, slot = int(row), int(slot)
        if not (self.on_loan[slot] and self.expert_in[slot] == EMPTY and self.slot_of[row] == EMPTY):
            raise ValueError(f"fill: slot {slot} is not a reserved empty slot, or row {row} is resident")
        self.on_loan[slot] = False
        self.expert_in[slot] = row
        self.slot_of[row] = slot

    # --- loans ---------------------------------------------------------------------------------------------

    @property
    def available_slots(self) -> int:
        """Slots that could be lent now (trimmed ones included)."""
        return int((~self.on_loan).sum())

    def lend(self, n: int) -> np.ndarray | None:
        """Take the n coldest slots not on loan (trimmed first, then empty, then by decayed frequency); None if fewer.

        The experts they held become misses.
        """
        order = self._coldness_order(~self.on_loan)
        if n > len(order):
            return None
        taken = order[:n]
        held = self.expert_in[taken]
        self.slot_of[held[held != EMPTY]] = EMPTY
        self.expert_in[taken] = EMPTY
        self.on_loan[taken] = True
        self.trimmed[taken] = False
        return taken

    def lend_run(self, n: int) -> np.ndarray | None:
        """Take n adjacent slots not on loan, the run whose experts are coldest in sum; None if no such run.

        A loan's buffer slots are one run, so its buffers are contiguous bytes of the pool's arrays.
        """
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        held = self.expert_in
        # an empty slot is colder than any held expert (as in _coldness_order), also before any lookup, when
        # every frequency is 0: a run of empty slots is lent before one that evicts experts
        heat = np.where(held == EMPTY, -1.0, self.freq[np.maximum(held, 0)])
        heat = np.where(self.on_loan, np.inf, heat)
        if n > self.slots:
            return None
        c = np.concatenate([[0.0], np.cumsum(np.where(np.isinf(heat), 0.0, heat))])
        blocked = np.concatenate([[0], np.cumsum(np.isinf(heat))])
        starts = np.arange(self.slots - n + 1)
        ok = (blocked[starts + n] - blocked[starts]) == 0
        if not ok.any():
            return None
        cost = np.where(ok, c[starts + n] - c[starts], np.inf)
        a = int(np.argmin(cost))
        taken = np.arange(a, a + n, dtype=np.int64)
        old = self.expert_in[taken]
        self.slot_of[old[old != EMPTY]] = EMPTY
        self.expert_in[taken] = EMPTY
        self.on_loan[taken] = True
        self.trimmed[taken] = False
        return taken

    def give_back(self, slots: np.ndarray) -> None:
        """Return lent slots to the cache, empty."""
        slots = np.asarray(slots, dtype=np.int64)
        assert self.on_loan[slots].all(), "giving back a slot that was not on loan"
        self.on_loan[slots] = False

    @property
    def slots_on_loan(self) -> int:
        """How many slots are lent now."""
        return int(self.on_loan.sum())

    # --- elastic trimming ----------------------------------------------------------------------------------

    def trim_idle(self, max_slots: int, idle_below: float = 0.05) -> np.ndarray:
        """Empty up to max_slots slots whose expert has gone idle (decayed observed use below idle_below) or that are empty.

        Trimmed slots hold nothing and are the first ones lent; `untrim` makes them usable for experts again.
        """
        want = max(0, int(max_slots) - int(self.trimmed.sum()))
        if want == 0:
            return np.empty(0, dtype=np.int64)
        order = self._coldness_order(self.usable())
        held = self.expert_in[order]
        # idle is judged by use seen in this run: a popularity seed orders the candidates, it does not keep them
        used = self.freq - self.seeded
        heat = np.where(held == EMPTY, -1.0, used[np.maximum(held, 0)])
        cand = order[heat < idle_below][:want]
        old = self.expert_in[cand]
        self.slot_of[old[old != EMPTY]] = EMPTY
        self.expert_in[cand] = EMPTY
        self.trimmed[cand] = True
        return cand

    def untrim(self) -> None:
        """Make trimmed slots usable again."""
        self.trimmed[:] = False

    # --- checks --------------------------------------------------------------------------------------------

    def check(self) -> None:
        """Assert the slot table is consistent (tests and --check call it)."""
        held = np.flatnonzero(self.expert_in != EMPTY)
        assert not self.on_loan[held].any(), "a slot on loan holds an expert"
        assert (self.slot_of[self.expert_in[held]] == held).all(), "slot table and expert table disagree"
        assert int((self.slot_of != EMPTY).sum()) == len(held), "an expert points at a slot that does not hold it"
