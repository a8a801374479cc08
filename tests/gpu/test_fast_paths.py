"""The fused CUDA layer paths (strata_cuda.fast.FastMoE) on a real GPU, against a float64 numpy reference.

Prefill layers warm (every expert cached), cold (every expert streamed through a ring smaller than the misses, so
it wraps) and mixed, under uniform and skewed routing, f16 and Q8_0 pools, in every GEMM mode the device has;
decode steps with hits only, with misses read from mapped page-locked memory, and with misses copied into the ring.
Outputs start poisoned (NaN), inputs are fresh random data per test (the seed is in every message), and the same
inputs run twice must give the same bits (no atomics in any reduction). Skipped with "no CUDA device" where there
is none.
"""

from __future__ import annotations

import hashlib
import secrets

import numpy as np
import pytest

from strata_core.reference import kernels as ref
from strata_core.reference.kernels import ExpertPool


def _cuda_device_count() -> int:
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy, no driver, or a driver too old: no device this test can use
        return 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_device_count() == 0, reason="no CUDA device")]

E, K, H, F = 64, 4, 256, 128
FP16_PATH = 2e-3  # f16 activations and intermediates, f32 accumulation (measured 5e-4 to 7e-4 on the H200)


@pytest.fixture(scope="module")
def cp():
    """cupy, imported only where a GPU is present."""
    import cupy
    return cupy


def _modes():
    from strata_cuda.fast import GEMM_MODES
    return GEMM_MODES


def fast_moes(modes, device: bool = False) -> dict:
    """One FastMoE per mode of `modes` this device's cuBLAS offers (asserts at least one), each with the
    device-table path off, so a warm layer runs that mode; with `device`, also "device": the product's default
    FastMoE, whose warm layers take triton_moe's launches (where Triton is there: test_device_gemm.py says so)."""
    from strata_cuda.fast import FastMoE
    out = {}
    for mode in modes:
        try:
            out[mode] = FastMoE(E, K, H, F, gemm_mode=mode)
        except ValueError:
            continue
        out[mode].set_device_gemm("off")
    assert out, f"none of the GEMM modes {modes} is available"
    if device:
        moe = FastMoE(E, K, H, F)
        if moe.device_gemm is not None:
            out["device"] = moe
    return out


@pytest.fixture(scope="module")
def moes(cp):
    """One FastMoE per GEMM mode this device's cuBLAS offers, and the device-table one (built once: the module
    compiles at construction)."""
    return fast_moes(_modes(), device=True)


class SeededGenerator:
    """A numpy Generator that remembers its seed, for the failure messages."""

    def __init__(self, seed: int):
        self.seed_value = seed
        self._g = np.random.default_rng(seed)

    def __getattr__(self, name):
        return getattr(self._g, name)


@pytest.fixture
def rng():
    """A fresh generator per test; its seed is in every assertion message."""
    return SeededGenerator(secrets.randbits(32))


def workspace(cp, nbytes: int = 512 << 20):
    """The runtime's own Arena over one device buffer, as the executor hands a layer its workspace: carved views stay
    valid until reset (a carve of fresh cupy arrays that nothing keeps would hand the layer freed pool memory)."""
    from strata_core.runtime.devmem import Arena
    return Arena(None, extents=[cp.empty(int(nbytes), dtype=cp.uint8)])


def pinned(cp, shape, dtype) -> np.ndarray:
    """A page-locked (cudaHostAlloc) numpy array, so the device can copy from it asynchronously and map it."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    mem = cp.cuda.alloc_pinned_memory(n)
    a = np.frombuffer(mem, dtype=dtype, count=int(np.prod(shape))).reshape(shape)
    pinned.keep.append(mem)
    return a


pinned.keep = []


def experts_f16(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n random experts as f16 (w_gate_up [n,2F,H], w_down [n,H,F]), scaled so activations stay O(1)."""
    w13 = (rng.standard_normal((n, 2 * F, H), dtype=np.float32) / np.sqrt(H)).astype(np.float16)
    w2 = (rng.standard_normal((n, H, F), dtype=np.float32) / np.sqrt(F)).astype(np.float16)
    return w13, w2


def host_pool(cp, dtype: str, w13: np.ndarray, w2: np.ndarray) -> ExpertPool:
    """The experts in page-locked memory, indexed by expert id, in the pool's dtype."""
    if dtype == "f16":
        arrays = {"w_gate_up": w13, "w_down": w2}
    else:
        gq, gd = ref.quantize_q8_0(w13)
        dq, dd = ref.quantize_q8_0(w2)
        arrays = {"gate_up_q": gq, "gate_up_d": gd, "down_q": dq, "down_d": dd}
    out = {}
    for name, a in arrays.items():
        p = pinned(cp, a.shape, a.dtype)
        p[...] = a
        out[name] = p
    return ExpertPool(dtype, out)


def dense_f64(pool: ExpertPool, e: int, exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Expert e's matrices as float64 (Q8_0: its dequantization to f16, as the prefill path's scratch holds it; with
    `exact`, q x d itself, as the decode kernels compute it from the quants)."""
    a = pool.arrays
    if pool.dtype == "f16":
        return a["w_gate_up"][e].astype(np.float64), a["w_down"][e].astype(np.float64)
    if exact:
        def deq(q, d):
            b = q.reshape(*q.shape[:-1], -1, ref.QK8_0).astype(np.float64) * d.astype(np.float64)[..., None]
            return b.reshape(q.shape)
        return deq(a["gate_up_q"][e], a["gate_up_d"][e]), deq(a["down_q"][e], a["down_d"][e])
    return (ref.dequantize_q8_0(a["gate_up_q"][e], a["gate_up_d"][e]).astype(np.float64),
            ref.dequantize_q8_0(a["down_q"][e], a["down_d"][e]).astype(np.float64))


def reference(x: np.ndarray, logits: np.ndarray, hp: ExpertPool, exact: bool = False) -> np.ndarray:
    """float64 MoE layer: y[t] = sum_k w_k * SwiGLU_e(x[t]) over the top-k of the logits (`exact`: see dense_f64)."""
    ids, w = ref.route_topk(logits, K)
    x64 = x.astype(np.float64)
    y = np.zeros((x.shape[0], H))
    for e in np.unique(ids):
        rows, ks = np.nonzero(ids == e)
        w13, w2 = dense_f64(hp, int(e), exact)
        gu = x64[rows] @ w13.T
        y_e = (gu[:, :F] / (1 + np.exp(-gu[:, :F])) * gu[:, F:]) @ w2.T
        np.add.at(y, rows, w[rows, ks, None].astype(np.float64) * y_e)
    return y


def rel(out: np.ndarray, want: np.ndarray) -> float:
    """||out - want|| / ||want||; inf when out has a non-finite value (an unwritten, poisoned element)."""
    out = np.asarray(out, dtype=np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - want) / np.linalg.norm(want))


def routing(rng, t: int, skew: bool) -> np.ndarray:
    """[t,E] router logits; skewed: the expert of popularity rank r gets a bias of -ln(1+r) (the sweep's skew)."""
    logits = rng.standard_normal((t, E)).astype(np.float32)
    if skew:
        rank = rng.permutation(E)
        logits += (-np.log1p(rank)).astype(np.float32)
    return logits


def device_pool(cp, hp: ExpertPool, slots: int) -> ExpertPool:
    """An empty device pool of `slots` slots in hp's dtype, every byte 0xFF (NaN halves) until written."""
    arrays = {}
    for name, a in hp.arrays.items():
        d = cp.empty((slots, *a.shape[1:]), dtype=a.dtype)
        d.view(cp.uint8).fill(0xFF)
        arrays[name] = d
    # the fill ran on the legacy stream, which FastMoE's non-blocking streams do not wait for: without this a ring
    # copy could land first and be overwritten by the fill (NaN weights, a race seen once on the H200)
    cp.cuda.Device().synchronize()
    return ExpertPool(hp.dtype, arrays)


def place(cp, pool: ExpertPool, hp: ExpertPool, experts: np.ndarray, slots: np.ndarray) -> None:
    """Copy these experts into these slots of the device pool."""
    for name, a in hp.arrays.items():
        pool.arrays[name][cp.asarray(slots)] = cp.asarray(a[experts])
    cp.cuda.Device().synchronize()  # on the legacy stream too (see device_pool)


def poisoned(cp, shape) -> object:
    """A device f32 array full of NaN."""
    return cp.full(shape, np.nan, dtype=cp.float32)


def sha(a) -> str:
    """sha256 of an array's bytes."""
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def run_prefill(cp, moe, x, logits, pool, slot_of, hp, ring):
    """One prefill_layer into a poisoned output; the host result."""
    out = poisoned(cp, (x.shape[0], H))
    moe.prefill_layer(cp.asarray(x), cp.asarray(logits), pool, slot_of, hp, ring, out=out)
    moe.compute_stream.synchronize()
    return out.get()


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("case", ["warm", "cold", "mixed"])
def test_prefill_layer_matches_the_reference_and_repeats_its_bits(cp, moes, rng, dtype, skew, case):
    t = 384
    x = rng.standard_normal((t, H)).astype(np.float32)
    logits = routing(rng, t, skew)
    hp = host_pool(cp, dtype, *experts_f16(rng, E))
    want = reference(x, logits, hp)
    ring_slots = 12  # fewer than the misses: the ring wraps, so copies must wait for the compute that read a slot
    cached = {"warm": np.arange(E), "cold": np.arange(0), "mixed": rng.permutation(E)[: E // 2]}[case]
    pool = device_pool(cp, hp, E + ring_slots)
    slot_of = np.full(E, -1, dtype=np.int64)
    slots = rng.permutation(E)[: cached.size]  # cached experts in scattered slots, not in id order
    slot_of[cached] = slots
    if cached.size:
        place(cp, pool, hp, cached, slots)
    ring = (E, ring_slots) if case != "warm" else None
    for mode, moe in moes.items():
        out = run_prefill(cp, moe, x, logits, pool, slot_of, hp, ring)
        err = rel(out, want)
        assert err < FP16_PATH, f"{mode} {case}: relative error {err:.2e} (seed {rng.seed_value})"
        again = run_prefill(cp, moe, x, logits, pool, slot_of, hp, ring)
        assert sha(again) == sha(out), f"{mode} {case}: two runs gave other bits (seed {rng.seed_value})"
        assert moe.stats.device_table == (mode == "device" and case == "warm"), (mode, case)
        # a streamed Q8_0 layer's hits: one pair of device-table launches over the stack layout (_device_hits)
        assert moe.stats.device_hits == (mode == "device" and case == "mixed" and dtype == "q8_0"), (mode, case)
        if case != "warm":
            assert moe.stats.misses > 0 and moe.stats.bytes_streamed > 0
        if case == "cold":
            assert moe.stats.misses > ring_slots  # the ring wrapped


def test_the_compact_stack_does_not_pad_to_the_largest_group(cp, moes, rng):
    t = 512
    x = rng.standard_normal((t, H)).astype(np.float32)
    logits = routing(rng, t, True)
    ids, _ = ref.route_topk(logits, K)
    counts = np.bincount(ids.reshape(-1), minlength=E)
    hp = host_pool(cp, "f16", *experts_f16(rng, E))
    pool = device_pool(cp, hp, E)
    place(cp, pool, hp, np.arange(E), np.arange(E))
    for mode, moe in moes.items():
        run_prefill(cp, moe, x, logits, pool, np.arange(E), hp, None)
        if mode == "device":  # no stack layout on the host: test_device_gemm.py checks it pads to no class
            assert moe.stats.device_table
            continue
        padded = int((counts > 0).sum()) * int(counts.max())
        # the rows every group would take padded to the largest, against the stack's own rows
        assert moe.stats.stack_rows < 0.5 * padded, (mode, moe.stats.stack_rows, padded)
        assert moe.stats.stack_rows >= t * K


def test_routing_positions_are_in_token_order_and_repeat(cp, moes, rng):
    moe = next(iter(moes.values()))
    logits = routing(rng, 1000, True)
    ids, w, pos, counts = (a.get() for a in moe.route(cp.asarray(logits)))
    rid, rw = ref.route_topk(logits, K)
    assert np.array_equal(ids, rid)
    assert rel(w, rw) < 1e-6
    flat = ids.reshape(-1)
    want_pos = np.empty_like(flat)
    for e in range(E):
        where = np.flatnonzero(flat == e)
        want_pos[where] = np.arange(where.size)
    assert np.array_equal(pos.reshape(-1), want_pos)
    assert np.array_equal(counts, np.bincount(flat, minlength=E))
    again = moe.route(cp.asarray(logits))[2].get()
    assert np.array_equal(again, pos)


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("misses", [0, 1, 3])
def test_decode_layer_hits_and_mapped_misses(cp, moes, rng, misses, dtype):
    moe = next(iter(moes.values()))
    x = rng.standard_normal((1, H)).astype(np.float32)
    logits = rng.standard_normal((1, E)).astype(np.float32)
    hp = host_pool(cp, dtype, *experts_f16(rng, E))
    # the Q8_0 decode kernels sum x . (q x d) in f32 from the quants: against the f16-rounded dequantization the
    # H200 measured 3.5e-4..4.3e-4 (bench/results/g_h200/gpu_tests.log), a numpy f32 emulation 3.9e-4, and 2e-7
    # against the exact one
    want = reference(x, logits, hp, exact=dtype == "q8_0")
    ids, _ = ref.route_topk(logits, K)
    missed = ids[0, :misses]
    slot_of = rng.permutation(E).astype(np.int32)
    slot_of[missed] = -1
    pool = device_pool(cp, hp, E)
    cached = np.flatnonzero(slot_of >= 0)
    place(cp, pool, hp, cached, slot_of[cached])
    assert moe.host_device_ptrs(hp) is not None, "cudaHostAlloc memory should be mapped for the device"
    for graphs in (True, False):
        moe.decode_graphs = graphs
        out = poisoned(cp, (1, H))
        moe.decode_layer(cp.asarray(x), cp.asarray(logits), pool, cp.asarray(slot_of), out=out, host_pool=hp)
        moe.compute_stream.synchronize()
        err = rel(out.get(), want)
        assert err < 1e-5, f"{dtype} graphs={graphs} misses={misses}: {err:.2e} (seed {rng.seed_value})"
    moe.decode_graphs = True


def test_decode_layer_misses_through_the_ring(cp, moes, rng):
    moe = next(iter(moes.values()))
    x = rng.standard_normal((1, H)).astype(np.float32)
    logits = rng.standard_normal((1, E)).astype(np.float32)
    hp = host_pool(cp, "f16", *experts_f16(rng, E))
    want = reference(x, logits, hp)
    ids, _ = ref.route_topk(logits, K)
    slot_of = np.arange(E, dtype=np.int32)
    slot_of[ids[0, 1:3]] = -1
    pool = device_pool(cp, hp, E + K)
    cached = np.flatnonzero(slot_of >= 0)
    place(cp, pool, hp, cached, slot_of[cached])
    out = poisoned(cp, (1, H))
    moe.decode_layer_misses(cp.asarray(x), cp.asarray(logits), pool, slot_of, cp.asarray(slot_of), hp, (E, K),
                            out=out)
    moe.compute_stream.synchronize()
    assert moe.stats.misses == 2
    err = rel(out.get(), want)
    assert err < 1e-5, f"{err:.2e} (seed {rng.seed_value})"


def test_scatter_add_repeats_its_bits(cp, rng):
    from strata_cuda.kernels import CupyKernels
    k = CupyKernels(0)
    base = rng.standard_normal((300, 512)).astype(np.float32)
    rows = np.concatenate([rng.integers(0, 300, size=6000), [5] * 300]).astype(np.int32)
    y = rng.standard_normal((rows.size, 512)).astype(np.float32)
    s = rng.random(rows.size).astype(np.float32)
    outs = []
    for _ in range(3):
        out = cp.asarray(base)
        k.scatter_add(out, cp.asarray(rows), cp.asarray(y), cp.asarray(s))
        outs.append(sha(out.get()))
    want = base.copy()
    ref.scatter_add(want, rows, y, s)
    assert rel(cp.asnumpy(out), want.astype(np.float64)) < 1e-6
    assert len(set(outs)) == 1, f"scatter_add gave {len(set(outs))} different results (seed {rng.seed_value})"
