"""FastMoE.prefetch_misses on a real GPU: a streamed layer's first copy group queued before the layer routes.

A prefetch the routing confirms is used (its group is not copied again), one it contradicts is spent (copied again,
its bytes counted), and either way the layer's output has the bits of the same layer without a prefetch. Two
consecutive layers through one small ring check the prefetch's wait for the previous layer's readers of its slots.
Skipped with "no CUDA device" where there is none.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.reference import kernels as ref

from .test_fast_paths import (E, K, _cuda_device_count, cp, device_pool, experts_f16, fast_moes, host_pool,  # noqa: F401
                              place, rng, run_prefill, sha)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_device_count() == 0, reason="no CUDA device")]

RING = 12  # fewer than the misses: the ring wraps within a layer


@pytest.fixture(scope="module")
def moe(cp):
    """One FastMoE in the default GEMM mode."""
    return next(iter(fast_moes(["classes", "loop"]).values()))


def layer(cp, rng, dtype: str, cached_share: float):
    """Inputs of one layer, its host experts, a device pool with some experts cached, and its misses (ascending)."""
    t = 384
    x = rng.standard_normal((t, 256)).astype(np.float32)
    logits = rng.standard_normal((t, E)).astype(np.float32)
    hp = host_pool(cp, dtype, *experts_f16(rng, E))
    pool = device_pool(cp, hp, E + RING)
    cached = rng.permutation(E)[: int(E * cached_share)]
    slot_of = np.full(E, -1, dtype=np.int64)
    slot_of[cached] = rng.permutation(E)[: cached.size]
    if cached.size:
        place(cp, pool, hp, cached, slot_of[cached])
    ids, _ = ref.route_topk(logits, K)
    routed = np.zeros(E, dtype=bool)
    routed[np.unique(ids)] = True
    misses = np.flatnonzero(routed & (slot_of < 0))
    return x, logits, hp, pool, slot_of, misses


def with_prefetch(cp, moe, x, logits, pool, slot_of, hp, uncached, after_previous_layer=False):
    """prefetch_misses then the layer: (output, bytes the prefetch queued)."""
    ring = np.arange(E, E + RING, dtype=np.int64)
    moe.compute_stream = cp.cuda.get_current_stream()
    queued = moe.prefetch_misses(pool, hp, uncached, ring, after_previous_layer=after_previous_layer)
    return run_prefill(cp, moe, x, logits, pool, slot_of, hp, (E, RING)), queued


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_a_confirmed_prefetch_is_used_and_gives_the_same_bits(cp, moe, rng, dtype):
    x, logits, hp, pool, slot_of, misses = layer(cp, rng, dtype, 0.5)
    assert misses.size > RING, f"too few misses to wrap the ring (seed {rng.seed_value})"
    plain = run_prefill(cp, moe, x, logits, pool, slot_of, hp, (E, RING))
    streamed_plain = moe.stats.bytes_streamed
    out, queued = with_prefetch(cp, moe, x, logits, pool, slot_of, hp, misses)
    assert queued > 0 and moe.stats.prefetch == "used", (moe.stats, rng.seed_value)
    assert moe.stats.bytes_streamed == streamed_plain, "a used prefetch replaces its group's copy, not adds to it"
    assert sha(out) == sha(plain), f"the prefetched layer gave other bits (seed {rng.seed_value})"


def test_a_contradicted_prefetch_is_spent_counted_and_changes_nothing(cp, moe, rng):
    x, logits, hp, pool, slot_of, misses = layer(cp, rng, "f16", 0.5)
    plain = run_prefill(cp, moe, x, logits, pool, slot_of, hp, (E, RING))
    streamed_plain = moe.stats.bytes_streamed
    cached = np.flatnonzero(slot_of >= 0)
    wrong = np.sort(np.concatenate([cached[:1], misses[1:]]))  # a cached expert where the first miss should be
    out, queued = with_prefetch(cp, moe, x, logits, pool, slot_of, hp, wrong)
    assert queued > 0 and moe.stats.prefetch == "spent", (moe.stats, rng.seed_value)
    assert moe.stats.bytes_streamed == streamed_plain + queued, "a spent prefetch's bytes crossed the link too"
    assert sha(out) == sha(plain), f"a spent prefetch changed the output (seed {rng.seed_value})"


def test_the_next_layer_prefetch_waits_for_the_previous_layer_reads_of_the_ring(cp, moe, rng):
    """Two streamed layers through one ring, queued without a host wait between them: layer 2's prefetch into the
    ring's first slots must wait for layer 1's groups that read them, or layer 1 computes with layer 2's experts."""
    layers = [layer(cp, rng, "f16", 0.0) for _ in range(2)]
    pool = layers[0][3]  # one pool (the cache's) and one ring for both, as a chunk's layers have
    cold = np.full(E, -1, dtype=np.int64)
    want = [run_prefill(cp, moe, x, lg, pool, cold, hp, (E, RING)) for x, lg, hp, _, _, _ in layers]
    ring = np.arange(E, E + RING, dtype=np.int64)
    for rep in range(3):
        moe.compute_stream = cp.cuda.get_current_stream()
        outs = []
        for i, (x, lg, hp, _, _, misses) in enumerate(layers):
            out = cp.full((x.shape[0], x.shape[1]), np.nan, dtype=cp.float32)
            moe.prefetch_misses(pool, hp, misses, ring, after_previous_layer=i > 0)
            moe.prefill_layer(cp.asarray(x), cp.asarray(lg), pool, cold, hp, (E, RING), out=out)
            assert moe.stats.prefetch == "used", (i, moe.stats, rng.seed_value)
            outs.append(out)
        moe.compute_stream.synchronize()
        for i, out in enumerate(outs):
            assert sha(out.get()) == sha(want[i]), f"layer {i + 1}, run {rep} (seed {rng.seed_value})"
