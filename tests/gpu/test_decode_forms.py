"""The decode stack's kernel forms and launch kinds on a real GPU (strata_cuda.fast.FastMoE.decode_form, decode_pdl):
every combination against the float64 reference through the session's layer ops, the same bits on a second step,
the second down kernel bit for bit the first, the third forms against float64 at several shapes (mapped misses,
unresolved misses as NaN, the rank routing giving warp_topk's ids and weights bit for bit under ties and NaN), the
second norm/router kernel and the LM-head GEMV against float64, and NaN router logits routed to valid experts (no read
outside the slot map). Skipped where there is no CUDA device.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from strata_core.reference import kernels as ref

from strata_cuda.fast import DECODE_THIRD, Q8_DECODE_VARIANTS

from .test_fast_paths import (SeededGenerator, _cuda_device_count, device_pool, experts_f16, host_pool, pinned, place,
                              poisoned, reference, rel)
from .test_layer_ops import BOUND, H as LH, model, untied_token, works

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_device_count() == 0, reason="no CUDA device")]

E, K, H, F = 64, 4, 256, 128
FP32 = 1e-5  # f32 sums of exact products (f16 weights widened exactly): the f32 bound


@pytest.fixture(scope="module")
def cp():
    """cupy, imported only where a GPU is present."""
    import cupy
    return cupy


@pytest.fixture
def rng():
    """A fresh generator per test; its seed is in every assertion message."""
    return SeededGenerator(secrets.randbits(32))


@pytest.fixture(scope="module")
def moe(cp):
    """One FastMoE at the test shape."""
    from strata_cuda.fast import FastMoE
    return FastMoE(E, K, H, F)


THIRD_FORMS = sorted(DECODE_THIRD)


@pytest.mark.parametrize("form", [1, 2, *THIRD_FORMS])
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_every_form_and_launch_kind_decodes_like_the_reference_and_repeats_its_bits(cp, rng, monkeypatch, form, pdl):
    from strata_cuda import fast
    from strata_cuda.kernels import CupyKernels
    from strata_cuda.layer_ops import CudaLayerOps
    monkeypatch.setattr(fast, "DECODE_FORM", form)
    monkeypatch.setattr(fast, "DECODE_PDL", pdl)
    m = model(cp, rng, "f16")
    op = CudaLayerOps(m.dm, CupyKernels(0))
    op.decode_admit_bytes = 0  # the cache stays as placed: both steps read the same slots and host rows
    x0, want = untied_token(m, rng)
    x = cp.empty((1, LH), cp.float32)
    got = []
    for step in range(2):
        x.set(x0)
        op.decode_step(works(cp, m, "decode", x, np.zeros(0, np.int32), cp.cuda.Stream(non_blocking=True)))
        cp.cuda.Device().synchronize()
        out = x.get()
        err = rel(out - x0, want - x0)
        assert err < BOUND, f"form {form} pdl {pdl} step {step}: {err:.2e} (seed {rng.seed_value})"
        got.append(out)
    assert np.array_equal(got[0], got[1]), f"form {form} pdl {pdl}: two steps differ (seed {rng.seed_value})"
    f = next(iter(op._fast.values()))
    assert (f.decode_form, f.decode_pdl) == (form, pdl)
    if pdl:
        assert f._pdl is not None and f._pdl.available(), "the driver should have cuLaunchKernelEx (CUDA >= 12)"
    assert op.counts["decode_graph_steps"] == 2 and m.cache.misses > 0, op.counts


@pytest.mark.parametrize("misses", [0, 2])
def test_the_second_down_kernel_gives_the_first_ones_bits(cp, moe, rng, misses):
    """Same products summed in the same order: form 2 (batched loads) and programmatic launches change no bit."""
    x = rng.standard_normal((1, H)).astype(np.float32)
    logits = rng.standard_normal((1, E)).astype(np.float32)
    hp = host_pool(cp, "f16", *experts_f16(rng, E))
    ids, _ = ref.route_topk(logits, K)
    slot_of = rng.permutation(E).astype(np.int32)
    slot_of[ids[0, :misses]] = -1
    pool = device_pool(cp, hp, E)
    cached = np.flatnonzero(slot_of >= 0)
    place(cp, pool, hp, cached, slot_of[cached])
    outs = {}
    for form in (1, 2):
        for pdl in (False, True):
            moe.decode_form, moe.decode_pdl = form, pdl
            moe._graphs.clear()
            out = poisoned(cp, (1, H))
            moe.decode_layer(cp.asarray(x), cp.asarray(logits), pool, cp.asarray(slot_of), out=out, host_pool=hp)
            moe.compute_stream.synchronize()
            outs[(form, pdl)] = out.get()
    from strata_cuda import fast
    moe.decode_form, moe.decode_pdl = fast.DECODE_FORM, fast.DECODE_PDL
    base = outs[(1, False)]
    assert rel(base, reference(x, logits, hp)) < FP32, f"seed {rng.seed_value}"
    for k, v in outs.items():
        assert np.array_equal(v.view(np.uint32), base.view(np.uint32)), f"{k} differs (seed {rng.seed_value})"


_SHAPED: dict = {}


def shaped_moe(e: int, k: int, h: int, f: int):
    """One FastMoE per shape, kept for the module (each compiles nothing new: cupy caches the module)."""
    from strata_cuda.fast import FastMoE
    if (e, k, h, f) not in _SHAPED:
        _SHAPED[(e, k, h, f)] = FastMoE(e, k, h, f)
    return _SHAPED[(e, k, h, f)]


_EXPERTS: dict = {}


def shaped_experts(cp, e: int, h: int, f: int):
    """(w13, w2, page-locked host pool, seed) of e experts at this shape, made once per module: 8 random experts,
    expert i the (i % 8)-th scaled by 1 + i / e (every expert's weights differ, so a read of the wrong expert shows),
    as Qwen3-30B-A3B's 128 x 9.4 MB drawn fresh per test cost seconds each."""
    if (e, h, f) not in _EXPERTS:
        seed = secrets.randbits(32)
        g = np.random.default_rng(seed)
        b13 = g.standard_normal((8, 2 * f, h), dtype=np.float32) / np.float32(np.sqrt(h))
        b2 = g.standard_normal((8, h, f), dtype=np.float32) / np.float32(np.sqrt(f))
        scale = (1 + np.arange(e, dtype=np.float32) / e)[:, None, None]
        hp = ref.ExpertPool("f16", {"w_gate_up": pinned(cp, (e, 2 * f, h), np.float16),
                                    "w_down": pinned(cp, (e, h, f), np.float16)})
        for i in range(e):
            hp.arrays["w_gate_up"][i] = b13[i % 8] * scale[i]
            hp.arrays["w_down"][i] = b2[i % 8] * scale[i]
        _EXPERTS[(e, h, f)] = (hp.arrays["w_gate_up"], hp.arrays["w_down"], hp, seed)
    return _EXPERTS[(e, h, f)]


def f64_layer(x, logits, w13, w2, k):
    """float64 MoE layer of one token over the top-k of the logits (experts indexed by id)."""
    ids, w = ref.route_topk(logits, k)
    f = w13.shape[1] // 2
    y = np.zeros(w2.shape[1])
    for r, e in enumerate(ids[0]):
        gu = w13[e].astype(np.float64) @ x[0].astype(np.float64)
        y += float(w[0, r]) * (w2[e].astype(np.float64) @ (gu[:f] / (1 + np.exp(-gu[:f])) * gu[f:]))
    return y[None, :]


# Qwen3-30B-A3B's decode shape; F/8 = 20 chunks (under a warp, not a multiple of it) with K = 6 over SPLIT 4 (an
# empty last quarter) and H = 288 (a lane group past H); the test module's shape
THIRD_SHAPES = [(128, 8, 2048, 768), (60, 6, 288, 160), (E, K, H, F)]


_Q8: dict = {}


def shaped_q8_experts(cp, e: int, h: int, f: int):
    """shaped_experts' experts as a page-locked Q8_0 host pool, and their exact weights (q x d in float64, what the
    Q8_0 decode kernels compute from), made once per module."""
    if (e, h, f) not in _Q8:
        w13, w2, _, seed = shaped_experts(cp, e, h, f)
        hq = host_pool(cp, "q8_0", np.asarray(w13), np.asarray(w2))
        _Q8[(e, h, f)] = (_ExactQ8(hq, 0), _ExactQ8(hq, 1), hq, seed)
    return _Q8[(e, h, f)]


class _ExactQ8:
    """Expert i's gate|up (which 0) or down (1) matrix of a Q8_0 pool as q x d in float64, made when indexed (the
    layer reads K experts; all of Qwen3-30B-A3B's in float64 would be 4.8 GB)."""

    def __init__(self, hq, which: int):
        self.hq, self.which = hq, which
        q = hq.arrays["gate_up_q" if which == 0 else "down_q"]
        self.shape = q.shape

    def __getitem__(self, i):
        from .test_fast_paths import dense_f64
        return dense_f64(self.hq, int(i), exact=True)[self.which]


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("form", THIRD_FORMS)
@pytest.mark.parametrize("shape", THIRD_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("misses", [0, 2])
def test_the_third_forms_match_float64_with_mapped_misses_and_repeat_their_bits(cp, rng, form, shape, misses, dtype):
    """f16 pools (strata_fast_decode_gate_up3 and the form's down kernel) and Q8_0 pools (the third-form Q8_0 pair,
    against q x d exactly): float64's layer within the f32 bound, warp_topk's ids and weights, the routed slots
    published, misses read from mapped host memory, and the same bits with programmatic launches."""
    e, k, h, f = shape
    moe = shaped_moe(e, k, h, f)
    x = rng.standard_normal((1, h)).astype(np.float32)
    logits = rng.standard_normal((1, e)).astype(np.float32)
    w13, w2, hp, wseed = (shaped_experts if dtype == "f16" else shaped_q8_experts)(cp, e, h, f)
    ids, w = ref.route_topk(logits, k)
    slot_of = rng.permutation(e).astype(np.int32)
    # the first and the second-last rank: the gate/up kernels compute misses first (STRATA_MISSES_FIRST), so a
    # block's expert index is not its rank and a late-ranked miss moves
    slot_of[ids[0, [0, k - 2][:misses]]] = -1
    pool = device_pool(cp, hp, e)
    cached = np.flatnonzero(slot_of >= 0)
    place(cp, pool, hp, cached, slot_of[cached])
    want = f64_layer(x, logits, w13, w2, k)
    outs = []
    for pdl in (False, True):
        moe.decode_form, moe.decode_pdl = form, pdl
        moe._graphs.clear()
        b = moe.decode_buffers()
        b["slots"].fill(-7)
        out = poisoned(cp, (1, h))
        moe.decode_layer(cp.asarray(x), cp.asarray(logits), pool, cp.asarray(slot_of), out=out, host_pool=hp)
        moe.compute_stream.synchronize()
        err = rel(out.get(), want)
        assert err < FP32, (f"{dtype} form {form} pdl {pdl} {shape} misses {misses}: {err:.2e} "
                            f"(seeds {rng.seed_value}, {wseed})")
        assert np.array_equal(b["ids"].get(), ids[0]), f"ids (seed {rng.seed_value})"
        assert np.abs(b["w"].get() - w[0]).max() < 1e-6, f"weights (seed {rng.seed_value})"
        assert np.array_equal(b["slots"].get(), slot_of[ids[0]]), f"published slots (seed {rng.seed_value})"
        outs.append(out.get())
    from strata_cuda import fast
    moe.decode_form, moe.decode_pdl = fast.DECODE_FORM, fast.DECODE_PDL
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), f"pdl changed bits (seed {rng.seed_value})"


_Q8_VARIANT_MOE: dict = {}


# past the fourth Q8_0 pair's limits: H / 16 > 128 x chunks (its gate/up falls back to the third), K * F / 16 > 384
# down pairs (its down falls back)
Q8_FALLBACK_SHAPES = [(16, 2, 4096, 64), (16, 8, 256, 1024)]


@pytest.mark.parametrize("variant", sorted(Q8_DECODE_VARIANTS))
@pytest.mark.parametrize("shape", THIRD_SHAPES + Q8_FALLBACK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_q8_decode_variant_matches_float64_and_the_int8_casts_bits_in_its_order(cp, rng, variant, shape):
    """Each Q8_0 decode variant (the byte-permute widening or the int8 cast; the third pair or the fourth, whose lanes
    keep their activations in registers; fast.Q8_DECODE_VARIANTS), with two misses read from mapped host memory and
    with none: float64's layer within the f32 bound, and the same output bits as the int8 cast's kernels that sum in
    the same order ("cast" for the third pair, "cast_reg" for the fourth: the same products in the same order)."""
    from strata_cuda import fast
    from strata_cuda.fast import FastMoE
    e, k, h, f = shape
    base = "cast" if variant in fast.Q8_DECODE_CHUNK_ORDER else "cast_reg"
    for v in (base, variant):
        if (v, shape) not in _Q8_VARIANT_MOE:
            _Q8_VARIANT_MOE[(v, shape)] = FastMoE(e, k, h, f, q8_decode=v)
    x = rng.standard_normal((1, h)).astype(np.float32)
    logits = rng.standard_normal((1, e)).astype(np.float32)
    w13, w2, hp, wseed = shaped_q8_experts(cp, e, h, f)
    ids, _ = ref.route_topk(logits, k)
    want = f64_layer(x, logits, w13, w2, k)
    for misses in (0, 2):
        slot_of = rng.permutation(e).astype(np.int32)
        slot_of[ids[0, [0, k - 2][:misses]]] = -1
        pool = device_pool(cp, hp, e)
        cached = np.flatnonzero(slot_of >= 0)
        place(cp, pool, hp, cached, slot_of[cached])
        outs = {}
        for v in (base, variant):
            moe = _Q8_VARIANT_MOE[(v, shape)]
            moe.decode_form, moe.decode_pdl = fast.DECODE_FORM, fast.DECODE_PDL
            moe._graphs.clear()
            out = poisoned(cp, (1, h))
            moe.decode_layer(cp.asarray(x), cp.asarray(logits), pool, cp.asarray(slot_of), out=out, host_pool=hp)
            moe.compute_stream.synchronize()
            outs[v] = out.get()
        err = rel(outs[variant], want)
        assert err < FP32, f"{variant} {shape} misses {misses}: {err:.2e} (seeds {rng.seed_value}, {wseed})"
        assert np.array_equal(outs[variant].view(np.uint32), outs[base].view(np.uint32)), (
            f"{variant} {shape} misses {misses}: bits differ from {base}'s (seeds {rng.seed_value}, {wseed})")


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("form", THIRD_FORMS)
@pytest.mark.parametrize("shape", THIRD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_a_third_form_writes_each_landing_miss_into_its_reserved_slot_and_keeps_its_bits(cp, rng, form, shape, dtype):
    """Two misses with landing slots (land[e] >= 0) and one without: after one decode every array of each landing
    slot holds its expert's host bytes exactly, the slot of the miss without one and every other spare slot keep
    their poison, the cached slots are unchanged, and the output is the same bits as a decode without landing."""
    e, k, h, f = shape
    moe = shaped_moe(e, k, h, f)
    x = rng.standard_normal((1, h)).astype(np.float32)
    logits = rng.standard_normal((1, e)).astype(np.float32)
    hp = (shaped_experts if dtype == "f16" else shaped_q8_experts)(cp, e, h, f)[2]
    ids, _ = ref.route_topk(logits, k)
    missed = ids[0, [0, k - 2, k - 1]]
    slot_of = rng.permutation(e).astype(np.int32)
    slot_of[missed] = -1
    spare = [e, e + 1, e + 2]  # slots past the experts: landing targets and a control that must stay poisoned
    pool = device_pool(cp, hp, e + 3)
    cached = np.flatnonzero(slot_of >= 0)
    place(cp, pool, hp, cached, slot_of[cached])
    before = {n: a[cp.asarray(slot_of[cached])].get() for n, a in pool.arrays.items()}
    land = np.full(e, -1, np.int32)
    land[missed[:2]] = spare[:2]  # the third miss has no landing slot
    land[cached[:3]] = spare[2]  # a cached expert's entry is never used
    moe.decode_form, moe.decode_pdl = form, True
    outs = []
    for table in (None, land):
        moe._graphs.clear()
        out = poisoned(cp, (1, h))
        moe.decode_layer(cp.asarray(x), cp.asarray(logits), pool, cp.asarray(slot_of), out=out, host_pool=hp,
                         land=None if table is None else cp.asarray(table))
        moe.compute_stream.synchronize()
        outs.append(out.get())
    from strata_cuda import fast
    moe.decode_form, moe.decode_pdl = fast.DECODE_FORM, fast.DECODE_PDL
    assert np.isfinite(outs[1]).all(), f"seed {rng.seed_value}"
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), f"landing changed bits ({rng.seed_value})"
    for name, a in pool.arrays.items():
        for ex, slot in zip(missed[:2], spare[:2]):
            got, want = a[slot].get(), np.asarray(hp.arrays[name][ex])
            bad = np.flatnonzero(got.view(np.uint8).ravel() != want.view(np.uint8).ravel())
            assert bad.size == 0, (f"{dtype} form {form} {shape}: {name} of expert {ex} in slot {slot}: {bad.size} "
                                   f"bytes differ, first at {bad[:4]} (seed {rng.seed_value})")
        assert (a[spare[2]].get().view(np.uint8) == 0xFF).all(), f"{name}: the unreserved spare slot was written"
        assert np.array_equal(a[cp.asarray(slot_of[cached])].get(), before[name]), f"{name}: a cached slot changed"


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("form", THIRD_FORMS)
def test_a_third_form_writes_nan_for_a_miss_it_cannot_read(cp, moe, rng, form, dtype):
    """No host pool and a routed expert not cached: every output is NaN (a check catches it), none left unwritten
    or computed from slot -1's address; f16 and Q8_0 pools."""
    x = rng.standard_normal((1, H)).astype(np.float32)
    logits = rng.standard_normal((1, E)).astype(np.float32)
    hp = host_pool(cp, dtype, *experts_f16(rng, E))
    ids, _ = ref.route_topk(logits, K)
    slot_of = np.arange(E, dtype=np.int32)
    slot_of[ids[0, 1]] = -1
    pool = device_pool(cp, hp, E)
    place(cp, pool, hp, np.arange(E), np.arange(E))
    moe.decode_form, moe.decode_pdl = form, False
    moe._graphs.clear()
    out = cp.zeros((1, H), cp.float32)
    moe.decode_layer(cp.asarray(x), cp.asarray(logits), pool, cp.asarray(slot_of), out=out)
    moe.compute_stream.synchronize()
    from strata_cuda import fast
    moe.decode_form = fast.DECODE_FORM
    assert np.isnan(out.get()).all(), f"form {form}: {np.isnan(out.get()).sum()} of {H} NaN (seed {rng.seed_value})"


@pytest.mark.parametrize("form", THIRD_FORMS)
def test_the_rank_routing_gives_warp_topks_ids_and_weights_bit_for_bit(cp, moe, rng, form):
    """Logits of few distinct values (ties everywhere) and some NaN: the third gate/up kernel's rank routing picks the
    same ids in the same order and the same softmax bits as the first form's warp_topk, and the reference's ids."""
    x = rng.standard_normal((1, H)).astype(np.float32)
    hp = host_pool(cp, "f16", *experts_f16(rng, E))
    pool = device_pool(cp, hp, E)
    place(cp, pool, hp, np.arange(E), np.arange(E))
    slot_map = cp.asarray(np.arange(E, dtype=np.int32))
    for trial in range(4):
        logits = (rng.integers(-3, 3, (1, E)) / 2).astype(np.float32)
        logits[0, rng.choice(E, 5, replace=False)] = np.nan
        got = {}
        for fm in (1, form):
            moe.decode_form = fm
            moe._graphs.clear()
            moe.decode_layer(cp.asarray(x), cp.asarray(logits), pool, slot_map, out=poisoned(cp, (1, H)), host_pool=hp)
            moe.compute_stream.synchronize()
            b = moe.decode_buffers()
            got[fm] = (b["ids"].get(), b["w"].get())
        assert np.array_equal(got[1][0], got[form][0]), f"trial {trial}: {got} (seed {rng.seed_value})"
        assert np.array_equal(got[1][1].view(np.uint32), got[form][1].view(np.uint32)), f"trial {trial} weights"
        clean = np.where(np.isnan(logits), -np.inf, logits)
        assert np.array_equal(got[form][0], ref.route_topk(clean, K)[0][0]), f"trial {trial} vs reference"
    from strata_cuda import fast
    moe.decode_form = fast.DECODE_FORM


@pytest.mark.parametrize("e,h", [(128, 2048), (60, 256), (128, 2560)])
def test_the_second_norm_router_kernel_matches_float64(cp, moe, rng, e, h):
    """E off the 4-expert blocks (the last block's idle warps), H at, under and over the 16 prefetched chunks."""
    x = rng.standard_normal((1, h)).astype(np.float32)
    nw = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    r = (rng.standard_normal((e, h)) / np.sqrt(h)).astype(np.float32)
    xn, lg = poisoned(cp, (1, h)), poisoned(cp, (1, e))
    for pdl in (False, True):
        moe.decode_pdl = pdl
        xn.fill(np.nan)
        lg.fill(np.nan)
        moe._dlaunch("strata_fast_decode_norm_route2", ((e + 3) // 4,), (128,),
                     (cp.asarray(x), cp.asarray(nw), cp.asarray(r), np.int32(e), np.int32(h), np.float32(1e-6), xn, lg))
        cp.cuda.Device().synchronize()
        x64 = x.astype(np.float64)
        want_xn = x64 / np.sqrt((x64 ** 2).mean() + 1e-6) * nw
        assert rel(xn.get(), want_xn) < FP32, f"xn pdl {pdl} (seed {rng.seed_value})"
        assert rel(lg.get(), want_xn @ r.T.astype(np.float64)) < FP32, f"logits pdl {pdl} (seed {rng.seed_value})"
    from strata_cuda import fast
    moe.decode_pdl = fast.DECODE_PDL


@pytest.mark.parametrize("t,o,h", [(1, 151936 + 5, 2048), (3, 1003, 264), (8, 17, 520)])
def test_the_lm_head_gemv_matches_float64(cp, moe, rng, t, o, h):
    """Qwen3-30B-A3B's head (151936 x 2048 f16, 5 rows past the 16-row blocks) and small shapes whose H leaves
    lanes without a chunk (264, 520), several rows of x; each row against float64 at the f32 bound."""
    x = rng.standard_normal((t, h)).astype(np.float32)
    w = (rng.standard_normal((o, h), dtype=np.float32) * 0.05).astype(np.float16)
    w[0, :4] = np.array([6.0e-8, -3.0e-5, 0.0, -0.0], dtype=np.float16)  # subnormal and signed-zero weights
    xd, wd = cp.asarray(x), cp.asarray(w)
    want = np.concatenate([x.astype(np.float64) @ w[a:a + 16384].astype(np.float64).T for a in range(0, o, 16384)],
                          axis=1)
    for pdl in (False, True):
        moe.decode_pdl = pdl
        out = poisoned(cp, (t, o))
        moe.gemv_f16w(xd, wd, out)
        cp.cuda.Device().synchronize()
        got = out.get()
        assert np.isfinite(got).all(), f"unwritten rows (seed {rng.seed_value})"
        err = float(np.abs(got - want).max() / np.abs(want).max())
        assert err < FP32, f"lm head gemv t={t} o={o} h={h} pdl {pdl}: {err:.3g} (seed {rng.seed_value})"
    from strata_cuda import fast
    moe.decode_pdl = fast.DECODE_PDL


def test_nan_router_logits_route_to_valid_experts(cp, moe, rng):
    """NaN logits (a NaN residual) rank as -inf: the K ids stay experts of the slot map, the kernel reads no
    address outside the pool (before, K NaN rounds left ids past E: a read far outside the slot map)."""
    x = rng.standard_normal((1, H)).astype(np.float32)
    logits = np.full((1, E), np.nan, dtype=np.float32)
    logits[0, 5] = 1.0
    hp = host_pool(cp, "f16", *experts_f16(rng, E))
    pool = device_pool(cp, hp, E)
    place(cp, pool, hp, np.arange(E), np.arange(E))
    out = poisoned(cp, (1, H))
    moe.decode_layer(cp.asarray(x), cp.asarray(logits), pool, cp.asarray(np.arange(E, dtype=np.int32)), out=out)
    moe.compute_stream.synchronize()
    ids = moe.decode_buffers()["ids"].get()
    assert ids[0] == 5 and ((ids >= 0) & (ids < E)).all() and len(set(ids.tolist())) == K, ids
    # the NaN-ranked experts are the lowest ids after 5, in order (ties to the lower id)
    assert ids.tolist() == [5] + [i for i in range(E) if i != 5][:K - 1], ids


def test_an_error_inside_a_capture_ends_it_and_the_stream_serves_the_next_capture(cp, moe):
    """A launch that raises while a decode graph is captured (a driver error, a bad argument) must not leave the
    capture stream capturing: every later call on it would fail with cudaErrorStreamCaptureUnsupported and hide
    the first error (seen on the H200 when the programmatic launcher raised inside a capture)."""
    def broken():
        raise RuntimeError("planted")

    with pytest.raises(RuntimeError, match="planted"):
        moe._capture(broken)
    x = cp.ones(1024, dtype=cp.float32)
    x *= 2  # the kernel compiled and loaded outside the capture
    cp.cuda.Device().synchronize()
    g = moe._capture(lambda: x.__imul__(2))
    g.launch(moe.compute_stream)
    moe.compute_stream.synchronize()
    assert float(x.get().min()) == 4.0 and float(x.get().max()) == 4.0
