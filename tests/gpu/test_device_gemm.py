"""FastMoE's device-table path (strata_cuda.triton_moe: Triton grouped GEMMs reading the routing counts on the
device) on a real GPU, against the float64 reference and against the cuBLAS class path on the same inputs.

A warm f16 layer takes it; the counts reach on_counts only at flush_counts (none before), equal to the routing's;
the layer allocates nothing once warm (cupy's pool, torch's allocator and the driver's free memory unchanged);
a layer with a miss takes the class path. Skipped with "no CUDA device" where there is none, and with "no Triton"
where Triton or torch does not import (the product then runs the cuBLAS modes only: test_available_on_this_gpu
fails instead where both import but the path is not built).
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.reference import kernels as ref

from .test_fast_paths import (E, F, FP16_PATH, H, K, cp, device_pool, experts_f16, host_pool,  # noqa: F401
                              place, poisoned, reference, rel, rng, routing, sha, _cuda_device_count)


def _imports_triton() -> bool:
    try:
        import torch
        import triton  # noqa: F401
        return bool(torch.cuda.is_available())
    except Exception:  # no Triton or no torch with CUDA: the path cannot be built here
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_device_count() == 0, reason="no CUDA device"),
              pytest.mark.skipif(not _imports_triton(), reason="no Triton (or torch with CUDA)")]


@pytest.fixture(scope="module")
def pair(cp):
    """(device-table FastMoE, the same with the path off: cuBLAS classes)."""
    from strata_cuda.fast import FastMoE
    dev, cls = FastMoE(E, K, H, F), FastMoE(E, K, H, F)
    cls.set_device_gemm("off")
    return dev, cls


def test_available_on_this_gpu(pair):
    from strata_cuda import triton_moe
    assert triton_moe.available()
    assert pair[0].device_gemm is not None and pair[1].device_gemm is None


def _warm(cp, rng, t: int, skew: bool):
    x = rng.standard_normal((t, H)).astype(np.float32)
    logits = routing(rng, t, skew)
    hp = host_pool(cp, "f16", *experts_f16(rng, E))
    pool = device_pool(cp, hp, E + 3)
    slots = rng.permutation(E + 3)[:E]  # scattered slots, some left empty (NaN), so a wrong slot shows
    place(cp, pool, hp, np.arange(E), slots)
    return x, logits, hp, pool, slots.astype(np.int64)


def _run(cp, moe, x, logits, pool, slot_of, on_counts=None):
    out = poisoned(cp, (x.shape[0], H))
    moe.prefill_layer(cp.asarray(x), cp.asarray(logits), pool, slot_of, out=out, on_counts=on_counts)
    moe.compute_stream.synchronize()
    return out.get()


@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("t", [1, 7, 384, 1000])
def test_matches_the_reference_and_the_class_path(cp, pair, rng, skew, t):
    dev, cls = pair
    x, logits, hp, pool, slot_of = _warm(cp, rng, t, skew)
    want = reference(x, logits, hp)
    got = _run(cp, dev, x, logits, pool, slot_of)
    assert dev.stats.device_table
    err = rel(got, want)
    assert err < FP16_PATH, f"device t={t}: relative error {err:.2e} (seed {rng.seed_value})"
    assert sha(_run(cp, dev, x, logits, pool, slot_of)) == sha(got), f"two runs differ (seed {rng.seed_value})"
    base = _run(cp, cls, x, logits, pool, slot_of)
    assert not cls.stats.device_table
    # both round the same f32 sums to f16 at different points (the fused SwiGLU skips the gate|up rounding)
    assert rel(got, base.astype(np.float64)) < FP16_PATH, f"against classes (seed {rng.seed_value})"


def test_counts_reach_on_counts_at_the_flush(cp, pair, rng):
    dev, _ = pair
    t = 500
    x, logits, hp, pool, slot_of = _warm(cp, rng, t, True)
    seen: list = []

    def on_counts(c):
        seen.append(np.array(c))
        return slot_of

    for _ in range(3):
        _run(cp, dev, x, logits, pool, slot_of, on_counts)
    assert len(seen) < 3  # at most the landed ones were handed on at the next layer's start: none of the last
    assert dev.flush_counts() == 0
    assert len(seen) == 3
    ids, _ = ref.route_topk(logits, K)
    want = np.bincount(ids.reshape(-1), minlength=E)
    for c in seen:
        assert c.tolist() == want.tolist()


def test_more_layers_than_the_staging_rotates_over(cp, pair, rng):
    """More layers queued than DEFERRED_COUNTS, no sync between them: each layer's slot map and counts stay its own.
    Two expert sets live in the pool, each in slots of its own; layers alternate between them, routing differently."""
    from strata_cuda.fast import DEFERRED_COUNTS
    dev, _ = pair
    t = 64
    x = rng.standard_normal((t, H)).astype(np.float32)
    sets = [host_pool(cp, "f16", *experts_f16(rng, E)) for _ in range(2)]
    pool = device_pool(cp, sets[0], 2 * E)
    perm = rng.permutation(2 * E)
    maps = [perm[:E].astype(np.int64), perm[E:].astype(np.int64)]
    for hp, m in zip(sets, maps):
        place(cp, pool, hp, np.arange(E), m)
    n = 3 * DEFERRED_COUNTS + 1
    seen: dict = {}
    outs = []
    x_d = cp.asarray(x)
    for i in range(n):
        lg = routing(rng, t, bool(i % 3 == 0))
        out = poisoned(cp, (t, H))
        dev.prefill_layer(x_d, cp.asarray(lg), pool, maps[i % 2], out=out,
                          on_counts=lambda c, i=i: seen.setdefault(i, np.array(c)))
        outs.append((out, lg))
    dev.flush_counts()
    dev.compute_stream.synchronize()
    for i, (out, lg) in enumerate(outs):
        ids, _ = ref.route_topk(lg, K)
        assert seen[i].tolist() == np.bincount(ids.reshape(-1), minlength=E).tolist(), i
        err = rel(out.get(), reference(x, lg, sets[i % 2]))
        assert err < FP16_PATH, f"layer {i}: {err:.2e} (seed {rng.seed_value})"


def test_a_warm_layer_allocates_nothing(cp, pair, rng):
    import torch
    dev, _ = pair
    x, logits, hp, pool, slot_of = _warm(cp, rng, 777, True)
    x_d, lg_d = cp.asarray(x), cp.asarray(logits)
    out = cp.empty((777, H), cp.float32)
    dev.prefill_layer(x_d, lg_d, pool, slot_of, out=out)
    dev.compute_stream.synchronize()
    mp = cp.get_default_memory_pool()
    before = (mp.used_bytes(), mp.total_bytes(), torch.cuda.memory_allocated(), cp.cuda.runtime.memGetInfo()[0])
    for _ in range(3):
        dev.prefill_layer(x_d, lg_d, pool, slot_of, out=out)
    dev.compute_stream.synchronize()
    after = (mp.used_bytes(), mp.total_bytes(), torch.cuda.memory_allocated(), cp.cuda.runtime.memGetInfo()[0])
    assert after == before


def test_a_layer_with_a_miss_takes_the_class_path(cp, pair, rng):
    dev, _ = pair
    t = 256
    x = rng.standard_normal((t, H)).astype(np.float32)
    logits = routing(rng, t, False)
    hp = host_pool(cp, "f16", *experts_f16(rng, E))
    pool = device_pool(cp, hp, E + 3)
    slot_of = rng.permutation(E).astype(np.int64)  # slots E.. are the ring
    place(cp, pool, hp, np.arange(E), slot_of)
    slot_of[5] = -1
    out = poisoned(cp, (t, H))
    dev.prefill_layer(cp.asarray(x), cp.asarray(logits), pool, slot_of, hp, (E, 3), out=out)
    dev.compute_stream.synchronize()
    assert not dev.stats.device_table
    assert rel(out.get(), reference(x, logits, hp)) < FP16_PATH


@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("t", [7, 1000])
def test_a_q8_0_pool_decodes_its_quants_in_the_k_loop(cp, pair, rng, skew, t):
    """A warm Q8_0 layer on the device-table path: within the f16 path's bound of the float64 reference, and bit for
    bit the f16 launches over the same weights dequantized (ref.dequantize_q8_0, the scratch path's rounding)."""
    dev, cls = pair
    x = rng.standard_normal((t, H)).astype(np.float32)
    logits = routing(rng, t, skew)
    hq = host_pool(cp, "q8_0", *experts_f16(rng, E))
    a = hq.arrays
    hf = host_pool(cp, "f16", ref.dequantize_q8_0(a["gate_up_q"], a["gate_up_d"]),
                   ref.dequantize_q8_0(a["down_q"], a["down_d"]))
    slots = rng.permutation(E + 3)[:E]
    pools = []
    for hp in (hq, hf):
        pools.append(device_pool(cp, hp, E + 3))
        place(cp, pools[-1], hp, np.arange(E), slots)
    slot_of = slots.astype(np.int64)
    got = _run(cp, dev, x, logits, pools[0], slot_of)
    assert dev.stats.device_table
    err = rel(got, reference(x, logits, hq))
    assert err < FP16_PATH, f"q8_0 device t={t}: relative error {err:.2e} (seed {rng.seed_value})"
    same = sha(_run(cp, dev, x, logits, pools[1], slot_of)) == sha(got)
    assert same, f"q8_0 and its f16 differ (seed {rng.seed_value})"
    base = _run(cp, cls, x, logits, pools[0], slot_of)
    assert not cls.stats.device_table and rel(base, reference(x, logits, hq)) < FP16_PATH
