"""Perturbed kernels for the kit's mutation self-test: each mutation is a small, plausible bug the kit must catch.

`MUTATIONS[kernel][name]()` gives a function `(base, *args) -> result` that calls the correct kernel on `base`
and spoils its answer the way a real bug would: the output scaled ten times the kernel's bound off (1 + 1e-4 on
an f32 path; 1 + 1e-2 on an f16 output, whose rounding swallows less), one row wrong, two experts swapped, a group
boundary off by one, a stale slot read, a lost update. It works on host (numpy) device arrays, so it wraps the
numpy reference on the cpu device. `mutated(base, kernel, name)` is a KernelSet that is `base` except for that one
kernel. tests/kit/test_mutations.py requires every check of a kernel to fail under every mutation of that kernel,
for several seeds, and a mutation for every kernel the KernelSet protocol names.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from strata_core.testing.tolerance import coarsest, mutation_scale, precision_of


def _scale(kernel: str):
    def scaled(base, *args):
        out = np.asarray(getattr(base, kernel)(*args))
        path = precision_of(base, kernel)
        # a factor below an f16 output's half ulp rounds back to the same bits: no kernel can show it there
        s = mutation_scale(coarsest([path, "f16"]) if out.dtype == np.float16 else path)
        return (out.astype(np.float32) * np.float32(s)).astype(out.dtype)
    return scaled


# ---- route_topk -------------------------------------------------------------------------------------------------

def _topk_scale(base, logits, k):
    ids, w = base.route_topk(logits, k)
    return ids, (w * np.float32(mutation_scale(precision_of(base, "route_topk")))).astype(np.float32)


def _topk_one_row_wrong(base, logits, k):
    ids, w = base.route_topk(logits, k)
    ids = ids.copy()
    r = len(ids) // 2
    # the row's last pick replaced by the next-best expert (an off-by-one in a selection loop)
    ids[r, -1] = np.argsort(-np.asarray(logits[r]), kind="stable")[k]
    return ids, w


def _topk_two_experts_swapped(base, logits, k):
    ids, w = base.route_topk(logits, k)
    ids = ids.copy()
    ids[0, [0, 1]] = ids[0, [1, 0]]  # the weights stay where they were: each expert gets the other's weight
    return ids, w


# ---- gather, scatter_add ----------------------------------------------------------------------------------------

def _gather_one_row_wrong(base, x, rows):
    out = np.array(base.gather(x, rows))
    r = len(out) // 2
    out[r] = np.asarray(x)[(int(rows[r]) + 1) % len(x)]
    return out


def _scatter_scale(base, out, rows, y, scale):
    base.scatter_add(out, rows, y, scale)
    out *= np.float32(mutation_scale(precision_of(base, "scatter_add")))


def _scatter_one_row_wrong(base, out, rows, y, scale):
    rows = np.array(rows)
    rows[0] = (rows[0] + 1) % len(out)
    base.scatter_add(out, rows, y, scale)


def _scatter_lost_update(base, out, rows, y, scale):
    # what an unsynchronised read-modify-write does to repeated rows: only the last contribution of each survives
    rows = np.asarray(rows)
    last = {int(r): i for i, r in enumerate(rows)}
    keep = np.array(sorted(last.values()), dtype=np.int64)
    base.scatter_add(out, rows[keep], np.asarray(y)[keep], np.asarray(scale)[keep])


# ---- rmsnorm, linear, dequantize ---------------------------------------------------------------------------------

def _rmsnorm_one_row_wrong(base, x, w, eps=1e-6):
    out = np.array(base.rmsnorm(x, w, eps))
    r = len(out) // 2
    out[r] = np.asarray(x)[r] * np.asarray(w)  # that row never normalized
    return out


def _linear_one_row_wrong(base, x, w):
    out = np.array(base.linear(x, w))
    r = len(out) // 2
    out[r] = base.linear(np.asarray(x)[[(r + 1) % len(out)]], w)[0]
    return out


def _dequantize_one_row_wrong(base, qs, d):
    d = np.array(d)
    d[len(d) // 2] = d[(len(d) // 2 + 1) % len(d)]  # one row scaled by its neighbour's block scales
    return base.dequantize_q8_0(qs, d)


# ---- moe_grouped_ffn --------------------------------------------------------------------------------------------

def _nonempty_groups(offsets) -> list[int]:
    offsets = np.asarray(offsets)
    return [g for g in range(len(offsets) - 1) if offsets[g + 1] > offsets[g]]


def _ffn_one_row_wrong(base, x, offsets, slots, pool):
    y = np.array(base.moe_grouped_ffn(x, offsets, slots, pool))
    g = _nonempty_groups(offsets)[0]
    y[int(offsets[g])] = 0.0  # one routed row never written
    return y


def _ffn_two_experts_swapped(base, x, offsets, slots, pool):
    slots = np.array(slots)
    groups = _nonempty_groups(offsets)
    a = groups[0]
    b = next(g for g in groups[1:] if slots[g] != slots[a])
    slots[[a, b]] = slots[[b, a]]
    return base.moe_grouped_ffn(x, offsets, slots, pool)


def _ffn_group_boundary_off_by_one(base, x, offsets, slots, pool):
    offsets = np.array(offsets)
    slots = np.asarray(slots)
    groups = _nonempty_groups(offsets)
    # the first boundary between two non-empty groups of different experts moves one row
    for a, b in zip(groups, groups[1:]):
        if b == a + 1 and slots[a] != slots[b]:
            offsets[b] += 1
            break
    return base.moe_grouped_ffn(x, offsets, slots, pool)


class _StaleSlots:
    """A grouped FFN that keeps the first weights it saw of each pool array (a weight cache never invalidated)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[Any, np.ndarray]] = {}

    def __call__(self, base, x, offsets, slots, pool):
        arrays = {}
        for name, a in pool.arrays.items():
            key = id(a)
            if key not in self.seen or self.seen[key][0] is not a:
                self.seen[key] = (a, np.array(a, copy=True))
            arrays[name] = self.seen[key][1]
        return base.moe_grouped_ffn(x, offsets, slots, pool.with_arrays(arrays))


MUTATIONS: dict[str, dict[str, Callable[..., Callable]]] = {
    "route_topk": {"scale": lambda: _topk_scale, "one_row_wrong": lambda: _topk_one_row_wrong,
                   "two_experts_swapped": lambda: _topk_two_experts_swapped},
    "gather": {"scale": lambda: _scale("gather"), "one_row_wrong": lambda: _gather_one_row_wrong},
    "scatter_add": {"scale": lambda: _scatter_scale, "one_row_wrong": lambda: _scatter_one_row_wrong,
                    "lost_update": lambda: _scatter_lost_update},
    "rmsnorm": {"scale": lambda: _scale("rmsnorm"), "one_row_wrong": lambda: _rmsnorm_one_row_wrong},
    "linear": {"scale": lambda: _scale("linear"), "one_row_wrong": lambda: _linear_one_row_wrong},
    "dequantize_q8_0": {"scale": lambda: _scale("dequantize_q8_0"),
                        "one_row_wrong": lambda: _dequantize_one_row_wrong},
    "moe_grouped_ffn": {"scale": lambda: _scale("moe_grouped_ffn"), "one_row_wrong": lambda: _ffn_one_row_wrong,
                        "two_experts_swapped": lambda: _ffn_two_experts_swapped,
                        "group_boundary_off_by_one": lambda: _ffn_group_boundary_off_by_one,
                        "stale_slot_read": _StaleSlots},
}


class _Mutated:
    """`base` with one kernel replaced by its mutation; every other attribute (precision included) is base's."""

    def __init__(self, base: Any, kernel: str, mutation: Callable):
        self._base, self._kernel, self._mutation = base, kernel, mutation
        self.name = f"{base.name}+{kernel}:{getattr(mutation, '__name__', type(mutation).__name__)}"

    def __getattr__(self, attr: str) -> Any:
        if attr == self._kernel:
            return lambda *args: self._mutation(self._base, *args)
        return getattr(self._base, attr)


def mutated(base: Any, kernel: str, name: str) -> Any:
    """A KernelSet that is `base` except for `kernel`, which carries mutation `name` (fresh state each call)."""
    return _Mutated(base, kernel, MUTATIONS[kernel][name]())


# ---- layer ops ----------------------------------------------------------------------------------------------------
# A layer op's bugs: its output scaled, one token's update lost, two experts' slots swapped, a missed expert's
# upload skipped (the ring slot still holds what it held: a stale slot read). They act on host (numpy) residuals,
# through the op's own LayerWork (its observer, slot table and expert source), so the op's output is wrong the way
# the op would make it wrong. tests/kit/test_layer_op_mutations.py requires `strata run --check` to fail each.

def _observing(mutate: Callable[[np.ndarray, np.ndarray], None]):
    def apply(work) -> None:
        observer = work.extras.get("observer")
        if observer is None:
            raise AssertionError("a layer-op mutation needs the --check observer in work.extras")

        def spoiled(phase, layer, x_in, x_out):
            mutate(work.x, x_in)  # the residual itself (host memory on cpu): the rest of the run carries it
            observer(phase, layer, x_in, np.array(work.x, copy=True))
        work.extras = {**work.extras, "observer": spoiled}
    return apply


def _update_scaled(x: np.ndarray, x_in: np.ndarray) -> None:
    x[...] = x_in + (x - x_in) * np.float32(mutation_scale("f32"))


def _one_token_lost(x: np.ndarray, x_in: np.ndarray) -> None:
    x[len(x) // 2] = x_in[len(x) // 2]


class _SwappedSlots:
    """A slot table whose lookups (both forms: the arrays of a chunk, the ints of one decode token) hand two hit
    experts each other's slots."""

    def __init__(self, table: Any):
        self._t = table

    def lookup(self, layer, experts, counts):
        """The table's slots with the first two hits exchanged."""
        slots = np.array(self._t.lookup(layer, experts, counts))
        hits = np.flatnonzero(slots >= 0)
        if len(hits) >= 2:
            slots[hits[:2]] = slots[hits[:2][::-1]]
        return slots

    def lookup_distinct(self, layer, experts):
        """The table's slots of one decode token's experts with the first two hits exchanged."""
        slots = list(self._t.lookup_distinct(layer, experts))
        hits = [i for i, s in enumerate(slots) if s >= 0][:2]
        if len(hits) == 2:
            a, b = hits
            slots[a], slots[b] = slots[b], slots[a]
        return slots

    def __getattr__(self, attr):
        return getattr(self._t, attr)


class _SkippedUploads:
    """An expert source that never copies: the slot keeps the expert it held before."""

    def __init__(self, source: Any):
        self._s = source

    def upload(self, row, slot, stream):
        """Nothing is copied."""

    def __getattr__(self, attr):
        return getattr(self._s, attr)


def _swap_slots(work) -> None:
    work.slots = _SwappedSlots(work.slots)


def _skip_uploads(work) -> None:
    work.source = _SkippedUploads(work.source)


#: op -> mutation name -> what it does to one LayerWork before the op runs.
LAYER_OP_MUTATIONS: dict[str, dict[str, Callable[[Any], None]]] = {
    op: {"scale": _observing(_update_scaled), "one_row_wrong": _observing(_one_token_lost),
         "two_experts_swapped": _swap_slots, "stale_slot_read": _skip_uploads}
    for op in ("prefill_layer", "decode_step")
}


class MutatedLayerOps:
    """`base` layer ops with one op's LayerWork spoiled by a mutation; everything else is base's."""

    def __init__(self, base: Any, op: str, name: str):
        self._base, self._op, self._apply = base, op, LAYER_OP_MUTATIONS[op][name]
        self.name = f"{getattr(base, 'name', type(base).__name__)}+{op}:{name}"

    def prefill_layer(self, work) -> None:
        """The base op, its work spoiled when it is the mutated op."""
        if self._op == "prefill_layer":
            self._apply(work)
        self._base.prefill_layer(work)

    def decode_step(self, works) -> None:
        """The base op, its works spoiled when it is the mutated op."""
        if self._op == "decode_step":
            for w in works:
                self._apply(w)
        self._base.decode_step(works)

    def __getattr__(self, attr):
        return getattr(self._base, attr)
