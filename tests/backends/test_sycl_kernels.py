"""The sycl KernelSet against the numpy oracle, run for real on the first SYCL device (here opencl:cpu:0).

Every output buffer is poisoned (all bits set: NaN for floats, -1 for ints) when the kernel set allocates it, so an
element a kernel forgot to write shows up as NaN (relative_error is then inf) or as -1.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_core.reference import kernels as ref

pytest.importorskip("dpctl", reason="the [sycl] extra (dpctl) is not installed")

from strata_sycl import backend as sycl  # noqa: E402
from sycl_fixtures import device, mem, session  # noqa: E402,F401 (fixtures)
from strata_sycl.kernels import SyclKernels  # noqa: E402
from strata_sycl.memory import SyclDeviceMemory  # noqa: E402

FP32_BOUND = 1e-5
FP16_BOUND = 2e-3
HYP = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class PoisonedMemory(SyclDeviceMemory):
    """Device memory whose fresh allocations are filled with 0xFF bytes before anything is written to them."""

    def alloc(self, shape, dtype):
        """A poisoned UsmArray."""
        arr = super().alloc(shape, dtype)
        if arr is not None:
            arr.mem.memset(0xFF)
        return arr




@pytest.fixture(scope="module")
def ks(device, mem):
    return SyclKernels(mem.session, memory=PoisonedMemory(mem.session))


def _all_written(a: np.ndarray) -> bool:
    if a.dtype.kind == "f":
        return bool(np.all(np.isfinite(a)))
    return bool(np.all(a != -1))


def test_the_sessions_kernel_set_shares_the_device_memory(session, mem):
    k = session.kernels
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = mem.download(k.gather(mem.to_device(x), mem.to_device(np.array([2, 0], np.int32))))
    np.testing.assert_array_equal(out, x[[2, 0]])


@HYP
@given(seed=st.integers(0, 2**32 - 1), t=st.integers(1, 40), e=st.integers(1, 64), data=st.data(),
       ties=st.booleans())
def test_route_topk(ks, mem, seed, t, e, data, ties):
    k = data.draw(st.integers(1, min(8, e)))
    rng = np.random.default_rng(seed)
    # Small integer logits make ties common, which must go to the lower expert id.
    logits = (rng.integers(-3, 3, (t, e)) if ties else rng.standard_normal((t, e))).astype(np.float32)
    ids, w = ks.route_topk(mem.to_device(logits), k)
    ids, w = mem.download(ids), mem.download(w)
    rids, rw = ref.route_topk(logits, k)
    assert _all_written(ids) and _all_written(w)
    np.testing.assert_array_equal(ids, rids)
    assert ref.relative_error(w, rw) < FP32_BOUND


@HYP
@given(seed=st.integers(0, 2**32 - 1), t=st.integers(1, 30), h=st.integers(1, 70), n=st.integers(1, 60),
       dtype=st.sampled_from([np.float32, np.float16, np.int32]))
def test_gather(ks, mem, seed, t, h, n, dtype):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, h)) * 100).astype(dtype)
    rows = rng.integers(0, t, n).astype(np.int32)
    out = mem.download(ks.gather(mem.to_device(x), mem.to_device(rows)))
    np.testing.assert_array_equal(out, ref.gather(x, rows))


@HYP
@given(seed=st.integers(0, 2**32 - 1), t=st.integers(1, 30), h=st.integers(1, 70), n=st.integers(1, 90))
def test_scatter_add_matches_and_is_deterministic(ks, mem, seed, t, h, n):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((t, h)).astype(np.float32)
    rows = rng.integers(0, t, n).astype(np.int32)  # repeated rows: several experts add into one token
    y = rng.standard_normal((n, h)).astype(np.float32)
    scale = rng.random(n).astype(np.float32)
    expect = base.copy()
    ref.scatter_add(expect, rows, y, scale)
    results = []
    for _ in range(2):
        out = mem.to_device(base)
        ks.scatter_add(out, mem.to_device(rows), mem.to_device(y), mem.to_device(scale))
        results.append(mem.download(out))
    assert ref.relative_error(results[0], expect) < FP32_BOUND
    np.testing.assert_array_equal(results[0], results[1])


def test_scatter_add_into_a_host_array_updates_it_in_place(ks):
    rng = np.random.default_rng()
    out = rng.standard_normal((6, 5)).astype(np.float32)
    rows = np.array([1, 1, 4, 0, 1], np.int32)
    y = rng.standard_normal((5, 5)).astype(np.float32)
    scale = rng.random(5).astype(np.float32)
    expect = out.copy()
    ref.scatter_add(expect, rows, y, scale)
    same_object = out
    ks.scatter_add(out, rows, y, scale)
    assert out is same_object
    assert ref.relative_error(out, expect) < FP32_BOUND


def _groups(rng: np.random.Generator, n: int, g: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-decreasing offsets (empty groups allowed, rows before the first and after the last in no group)."""
    cuts = np.sort(rng.integers(0, n + 1, g + 1)).astype(np.int32)
    return cuts, rng.integers(0, slots, g).astype(np.int32)


@HYP
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 24), g=st.integers(0, 5), s=st.integers(1, 4),
       h=st.sampled_from([8, 32, 48]), f=st.sampled_from([16, 40]))
def test_moe_grouped_ffn_f16(ks, mem, seed, n, g, s, h, f):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h)).astype(np.float32)
    pool = ref.ExpertPool("f16", {"w_gate_up": (rng.standard_normal((s, 2 * f, h)) * 0.2).astype(np.float16),
                                  "w_down": (rng.standard_normal((s, h, f)) * 0.2).astype(np.float16)})
    offsets, slots = _groups(rng, n, g, s)
    dpool = ref.ExpertPool("f16", {k: mem.to_device(v) for k, v in pool.arrays.items()})
    y = mem.download(ks.moe_grouped_ffn(mem.to_device(x), mem.to_device(offsets), mem.to_device(slots), dpool))
    expect = ref.moe_grouped_ffn(x, offsets, slots, pool)
    assert _all_written(y)
    assert ref.relative_error(y, expect) < FP16_BOUND
    outside = np.ones(n, bool)
    if g:
        outside[offsets[0]:offsets[-1]] = False
    assert np.all(y[outside] == 0.0)


@HYP
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 24), g=st.integers(1, 5), s=st.integers(1, 4),
       h=st.sampled_from([32, 64]), f=st.sampled_from([32, 96]))
def test_moe_grouped_ffn_q8_0(ks, mem, seed, n, g, s, h, f):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h)).astype(np.float32)
    gq, gd = ref.quantize_q8_0(rng.standard_normal((s, 2 * f, h)) * 0.2)
    dq, dd = ref.quantize_q8_0(rng.standard_normal((s, h, f)) * 0.2)
    pool = ref.ExpertPool("q8_0", {"gate_up_q": gq, "gate_up_d": gd, "down_q": dq, "down_d": dd})
    offsets, slots = _groups(rng, n, g, s)
    dpool = ref.ExpertPool("q8_0", {k: mem.to_device(v) for k, v in pool.arrays.items()})
    y = mem.download(ks.moe_grouped_ffn(mem.to_device(x), mem.to_device(offsets), mem.to_device(slots), dpool))
    assert _all_written(y)
    assert ref.relative_error(y, ref.moe_grouped_ffn(x, offsets, slots, pool)) < FP16_BOUND


def test_moe_grouped_ffn_zeroes_rows_of_a_slot_outside_the_pool(ks, mem):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    pool = {"w_gate_up": mem.to_device(np.ones((1, 8, 8), np.float16)),
            "w_down": mem.to_device(np.ones((1, 8, 4), np.float16))}
    y = mem.download(ks.moe_grouped_ffn(mem.to_device(x), mem.to_device(np.array([0, 2, 4], np.int32)),
                                        mem.to_device(np.array([0, 5], np.int32)), ref.ExpertPool("f16", pool)))
    assert np.all(y[2:] == 0.0) and np.all(y[:2] != 0.0)


@HYP
@given(seed=st.integers(0, 2**32 - 1), r=st.integers(1, 20), blocks=st.integers(1, 6))
def test_dequantize_q8_0(ks, mem, seed, r, blocks):
    rng = np.random.default_rng(seed)
    q, d = ref.quantize_q8_0(rng.standard_normal((r, blocks * ref.QK8_0)) * 3)
    out = mem.download(ks.dequantize_q8_0(mem.to_device(q), mem.to_device(d)))
    expect = ref.dequantize_q8_0(q, d)
    assert out.dtype == np.float16 and _all_written(out)
    assert ref.relative_error(out, expect) < FP16_BOUND


@HYP
@given(seed=st.integers(0, 2**32 - 1), t=st.integers(1, 20), h=st.integers(1, 300),
       wdtype=st.sampled_from([np.float32, np.float16]))
def test_rmsnorm(ks, mem, seed, t, h, wdtype):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, h)) * 3).astype(np.float32)
    w = rng.standard_normal(h).astype(wdtype)
    out = mem.download(ks.rmsnorm(mem.to_device(x), mem.to_device(w), eps=1e-6))
    assert _all_written(out)
    assert ref.relative_error(out, ref.rmsnorm(x, w, 1e-6)) < FP32_BOUND


@HYP
@given(seed=st.integers(0, 2**32 - 1), t=st.integers(1, 40), h=st.integers(1, 80), o=st.integers(1, 50),
       wdtype=st.sampled_from([np.float32, np.float16]))
def test_linear(ks, mem, seed, t, h, o, wdtype):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, h)).astype(np.float32)
    w = rng.standard_normal((o, h)).astype(wdtype)
    out = mem.download(ks.linear(mem.to_device(x), mem.to_device(w)))
    assert out.shape == (t, o) and _all_written(out)
    assert ref.relative_error(out, ref.linear(x, w)) < FP32_BOUND


def test_kernels_accept_numpy_inputs_and_return_device_arrays(ks, mem):
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = ks.linear(x, np.eye(3, dtype=np.float32))
    assert type(out).__name__ == "UsmArray"
    np.testing.assert_array_equal(mem.download(out), x)


def test_route_topk_refuses_k_larger_than_the_experts(ks, mem):
    with pytest.raises(ValueError, match="k=5"):
        ks.route_topk(mem.to_device(np.zeros((2, 4), np.float32)), 5)


def test_wrong_dtype_device_input_is_refused_by_name(ks, mem):
    with pytest.raises(TypeError, match="float32"):
        ks.rmsnorm(mem.to_device(np.zeros((2, 4), np.float64)), mem.to_device(np.ones(4, np.float32)))


def test_poisoned_allocations_read_back_as_nan(ks):
    # Guards the harness itself: without the poison, an unwritten output could pass as zeros.
    arr = ks.memory.alloc((3, 5), np.float32)
    assert np.all(np.isnan(ks.memory.download(arr)))


@pytest.mark.parametrize("wdtype", [np.float32, np.float16])
def test_linear_untiled_kernel_for_small_work_groups(mem, wdtype):
    # Devices whose work-groups hold fewer than 16 x 16 items run the plain kernel; it must agree as well.
    k = SyclKernels(mem.session, memory=PoisonedMemory(mem.session))
    k._tiled = False
    rng = np.random.default_rng()
    x = rng.standard_normal((19, 33)).astype(np.float32)
    w = rng.standard_normal((21, 33)).astype(wdtype)
    out = mem.download(k.linear(mem.to_device(x), mem.to_device(w)))
    assert _all_written(out)
    assert ref.relative_error(out, ref.linear(x, w)) < FP32_BOUND


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "plain"])
@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_moe_grouped_ffn_large_groups_on_both_kernel_paths(mem, tiled, dtype):
    # Groups of tens of rows: several tiles per group (the last one partial) in the one-pass tiled kernel, an empty
    # group, rows before the first group and after the last (zeroed); the plain kernels take every row on its own.
    k = SyclKernels(mem.session, memory=PoisonedMemory(mem.session))
    k._tiled = tiled
    rng = np.random.default_rng()
    s, h, f = 3, 64, 96
    gate_up = rng.standard_normal((s, 2 * f, h)) / np.sqrt(h)
    down = rng.standard_normal((s, h, f)) / np.sqrt(f)
    if dtype == "f16":
        arrays = {"w_gate_up": gate_up.astype(np.float16), "w_down": down.astype(np.float16)}
    else:
        (gq, gd), (dq, dd) = ref.quantize_q8_0(gate_up), ref.quantize_q8_0(down)
        arrays = {"gate_up_q": gq, "gate_up_d": gd, "down_q": dq, "down_d": dd}
    pool = ref.ExpertPool(dtype, arrays)
    offsets = np.array([3, 43, 43, 76, 93], np.int32)  # rows 0..2 and 93.. are in no group
    slots = np.array([2, 0, 1, 2], np.int32)
    x = rng.standard_normal((100, h)).astype(np.float32)
    dpool = ref.ExpertPool(dtype, {n: mem.to_device(a) for n, a in arrays.items()})
    y = mem.download(k.moe_grouped_ffn(mem.to_device(x), mem.to_device(offsets), mem.to_device(slots), dpool))
    assert _all_written(y)
    assert ref.relative_error(y, ref.moe_grouped_ffn(x, offsets, slots, pool)) < FP16_BOUND
    assert np.all(y[:3] == 0.0) and np.all(y[93:] == 0.0)


def test_the_one_pass_tiled_ffn_gives_the_plain_two_pass_kernels_bits(mem):
    # Both sum every output's terms in ascending order (f16 weights: no block scales), so they agree to the bit
    # although the tiled kernel keeps its intermediates in local memory and adds its down projection chunk by chunk.
    rng = np.random.default_rng(11)
    s, h, f = 3, 64, 96
    arrays = {"w_gate_up": (rng.standard_normal((s, 2 * f, h)) / np.sqrt(h)).astype(np.float16),
              "w_down": (rng.standard_normal((s, h, f)) / np.sqrt(f)).astype(np.float16)}
    dpool = ref.ExpertPool("f16", {n: mem.to_device(a) for n, a in arrays.items()})
    offsets, slots = np.array([0, 37, 37, 70, 90], np.int32), np.array([1, 0, 2, 1], np.int32)
    x = mem.to_device(rng.standard_normal((90, h)).astype(np.float32))
    ys = []
    for tiled in (True, False):
        k = SyclKernels(mem.session, memory=mem)
        k._tiled = tiled
        ys.append(mem.download(k.moe_grouped_ffn(x, mem.to_device(offsets), mem.to_device(slots), dpool)))
    assert _all_written(ys[0]) and np.array_equal(ys[0], ys[1])
