"""The cpu backend's one-row decode layer (HostKernels.row_step / route_row / experts_row) gives the bits of the
primitives it stands for: rmsnorm, linear, route_topk, gather, moe_grouped_ffn and scatter_add of one token; and the
executor's decode arena hands out the same view for the same carve."""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.api.kernels import ExpertPool
from strata_core.builtin.cpu import ROW_COMBINE_MAX_K, HostKernels
from strata_core.reference.kernels import ReferenceKernels
from strata_core.runtime.devmem import Arena
from strata_core.runtime.executor import _StepArena

REF = ReferenceKernels()


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def _case(seed: int):
    rng = np.random.default_rng(seed)
    H, F = int(rng.choice([16, 64, 128])), int(rng.choice([8, 32]))
    E = int(rng.choice([8, 64, 256]))
    k = int(rng.choice([1, 2, 3, 4, 6, 7, 8])) if seed % 5 else ROW_COMBINE_MAX_K + int(rng.integers(0, 3))
    k = min(k, E - 1)
    S = 2 * k + 3
    x = (rng.standard_normal((1, H)) * rng.choice([1e-3, 1.0, 40.0])).astype(np.float32)
    if seed % 4 == 0:  # signed zeros in the residual: the sum keeps or drops their sign as scatter_add does
        x[0, rng.random(H) < 0.3] = -0.0
    norm_w = rng.standard_normal(H).astype(np.float32)
    router = rng.standard_normal((E, H)).astype(np.float16 if seed % 2 else np.float32)
    if seed % 6 == 1:  # infinite logits (inf - inf in the softmax: NaN weights, as the reference's)
        router[rng.integers(0, E, 3), int(rng.integers(0, H))] = np.inf  # one column: logits of +-inf, no NaN
    elif seed % 6 == 3:  # ties among the top logits: the lower id first
        router[: E // 2] = router[E // 2:] = np.round(router[: E // 2] * 2) / 2
    router.flags.writeable = False  # the engine's dense weights: linear keeps an f32 copy of an f16 one
    pool = ExpertPool("f16", {"w_gate_up": (rng.standard_normal((S, 2 * F, H)) * 0.2).astype(np.float16),
                              "w_down": (rng.standard_normal((S, H, F)) * 0.2).astype(np.float16)})
    slots = [int(s) for s in rng.permutation(S)[:k]]
    return x, norm_w, router, pool, k, E, slots


def _primitives(x, norm_w, router, pool, k, E, slots):
    """One decode token through the reference primitives, as the general composed path runs it."""
    np.seterr(invalid="ignore", over="ignore")
    x = x.copy()
    xn = np.empty_like(x)
    REF.rmsnorm(x, norm_w, out=xn)
    logits = np.empty((1, E), np.float32)
    REF.linear(xn, router, out=logits)
    ids, wts = np.empty((1, k), np.int32), np.empty((1, k), np.float32)
    REF.route_topk(logits, k, out=(ids, wts))
    order = np.argsort(ids[0], kind="stable")
    experts, scales = ids[0][order].tolist(), wts[0][order]
    rows = np.zeros(k, np.int32)
    xg = REF.gather(xn, rows, out=np.empty((k, x.shape[1]), np.float32))
    y = REF.moe_grouped_ffn(xg, np.arange(k + 1, dtype=np.int32), np.array(slots, np.int32), pool,
                            out=np.empty_like(xg))
    REF.scatter_add(x, rows, y, scales)
    return x, xn, experts, scales


def _row(kern, x, norm_w, router, pool, k, E, slots, block=None):
    x = x.copy()
    if block is None:
        block = np.full(kern.row_step_size(x.shape[1], E, k), np.nan, np.float32)
    st = kern.row_step(x, k, E, block)
    experts = kern.route_row(st, norm_w, router)
    assert experts is not None
    xg = st.xg.copy()
    weights = st.weights_by_id()
    kern.experts_row(st, slots, pool)
    return x, xg, experts, weights


@pytest.mark.parametrize("seed", range(60))
def test_row_layer_is_the_primitives_bit_for_bit(seed):
    x, norm_w, router, pool, k, E, slots = _case(seed)
    want_x, want_xn, want_experts, want_scales = _primitives(x, norm_w, router, pool, k, E, slots)
    got_x, got_xg, got_experts, got_weights = _row(HostKernels(), x, norm_w, router, pool, k, E, slots)
    assert got_experts == want_experts
    assert np.array_equal(_bits(got_weights), _bits(want_scales))
    assert all(np.array_equal(_bits(r), _bits(want_xn[0])) for r in got_xg), "a gathered row is not rmsnorm(x)"
    assert np.array_equal(_bits(got_x), _bits(want_x)), f"k={k}: the residual's bits differ"


def test_a_reused_row_step_sets_its_constant_again():
    x, norm_w, router, pool, k, E, slots = _case(3)
    kern = HostKernels()
    block = np.zeros(kern.row_step_size(x.shape[1], E, k), np.float32)
    want = _row(kern, x, norm_w, router, pool, k, E, slots, block)[0].copy()
    st = kern._row_step
    xs = st.x
    block[:] = 7.0  # another buffer carved over the block between steps (the LM head's)
    xs[...] = x
    assert kern.row_step(xs, k, E, block) is st
    assert kern.route_row(st, norm_w, router) is not None
    kern.experts_row(st, slots, pool)
    assert np.array_equal(_bits(xs), _bits(want))


@pytest.mark.parametrize("kind", ["nan", "repeat", "f16-norm"])
def test_route_row_declines_what_the_general_path_decides(kind):
    x, norm_w, router, pool, k, E, slots = _case(8)
    assert k >= 2
    x, norm_w = np.abs(x) + 0.5, np.abs(norm_w) + 0.5  # rmsnorm(x) > 0: an infinite weight gives that sign
    kern = HostKernels()
    st = kern.row_step(x.copy(), k, E, np.zeros(kern.row_step_size(x.shape[1], E, k), np.float32))
    before = st.x.copy()
    r = np.array(router, np.float32)
    if kind == "nan":
        r[3] = np.nan  # logit 3 is NaN: argmax takes it first, the stable sort last
    elif kind == "repeat":
        r[k - 1:] = -np.inf  # k - 1 finite logits, then -inf: the last argmax meets a taken id again
    r.flags.writeable = False
    got = kern.route_row(st, norm_w.astype(np.float16) if kind == "f16-norm" else norm_w, r)
    assert got is None
    assert np.array_equal(_bits(st.x), _bits(before)), "the residual changed before the general path ran"


def test_step_arena_hands_out_the_same_view_for_the_same_carve():
    region = np.zeros(1 << 16, np.uint8)
    fresh, kept = Arena(None, [region]), _StepArena(None, [region])
    seq = [((1, 16), np.float32), ((40,), np.float32), ((3,), np.int32), ((1, 16), np.float32)]
    first = []
    for a in (fresh, kept):
        a.fix()
    for shape, dt in seq:
        first.append(kept.carve(shape, dt))
        want = fresh.carve(shape, dt)
        assert kept.used == fresh.used and np.shares_memory(first[-1], want) and first[-1].shape == want.shape
    kept.reset()
    again = [kept.carve(shape, dt) for shape, dt in seq]
    assert all(a is b for a, b in zip(first, again)) and kept.used == fresh.used
    kept.reset()
    other = kept.carve((2, 16), np.float32)  # another shape at the same place: its own view
    assert other is not first[0] and other.shape == (2, 16)
    for i in range(_StepArena.KEEP + 1):
        kept.reset()
        kept.carve((i + 1,), np.float32)
    assert len(kept._kept) <= _StepArena.KEEP


@pytest.mark.parametrize("where", ["subclass", "instance"])
def test_a_replaced_primitive_turns_the_row_layer_off(where):
    x, norm_w, router, pool, k, E, slots = _case(4)

    def route_topk(self_or_logits, *a, **kw):
        raise AssertionError("not called here")

    if where == "subclass":
        kern = type("Own", (HostKernels,), {"route_topk": route_topk})()
    else:
        kern = HostKernels()
        kern.route_topk = route_topk
    block = np.zeros(kern.row_step_size(x.shape[1], E, k), np.float32)
    assert kern.row_step(x.copy(), k, E, block) is None, "the row layer would bypass a kernel set's own route_topk"
    assert HostKernels().row_step(x.copy(), k, E, block) is not None
