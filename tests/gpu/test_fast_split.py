"""FastMoE prefill with hot experts split into GEMM pieces (FastMoE.split_rows, grouping.gemm_pieces) on a real GPU,
against the float64 reference on every token: warm, mixed (hits and streamed misses) and cold, f16 and Q8_0 pools,
skewed routing, piece sizes small enough that most groups split. Outputs start poisoned; the same inputs run twice
give the same bits. Skipped with "no CUDA device" where there is none.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.reference import kernels as ref

from .test_fast_paths import (E, F, FP16_PATH, H, K, cp, device_pool, experts_f16, fast_moes, host_pool,  # noqa: F401
                              place, reference, rel, rng, routing, run_prefill, sha)
from .test_fast_paths import pytestmark  # noqa: F401  (gpu mark, skipped without a device)


@pytest.fixture(scope="module")
def split_moes(cp):
    """FastMoE in each class mode this device's cuBLAS offers (the modes that split)."""
    from strata_cuda.fast import CLASS_MODES
    return fast_moes(CLASS_MODES)


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("case", ["warm", "mixed", "cold"])
@pytest.mark.parametrize("piece", [16, 40])
def test_split_groups_match_the_reference_on_every_token(cp, split_moes, rng, dtype, case, piece):
    t = 512
    x = rng.standard_normal((t, H)).astype(np.float32)
    logits = routing(rng, t, True)
    hp = host_pool(cp, dtype, *experts_f16(rng, E))
    want = reference(x, logits, hp)
    ring_slots = 12
    cached = {"warm": np.arange(E), "cold": np.arange(0), "mixed": rng.permutation(E)[: E // 2]}[case]
    pool = device_pool(cp, hp, E + ring_slots)
    slot_of = np.full(E, -1, dtype=np.int64)
    slots = rng.permutation(E)[: cached.size]
    slot_of[cached] = slots
    if cached.size:
        place(cp, pool, hp, cached, slots)
    ring = (E, ring_slots) if case != "warm" else None
    for mode, moe in split_moes.items():
        moe.split_rows = piece
        try:
            out = run_prefill(cp, moe, x, logits, pool, slot_of, hp, ring)
            problems = moe.stats.gemm_problems
            used = moe.stats.experts_used
            again = run_prefill(cp, moe, x, logits, pool, slot_of, hp, ring)
        finally:
            moe.split_rows = 0
        err = rel(out, want)
        assert err < FP16_PATH, f"{mode} piece {piece} {case}: relative error {err:.2e} (seed {rng.seed_value})"
        assert sha(again) == sha(out), f"{mode} {case}: two runs gave other bits (seed {rng.seed_value})"
        # skewed 512 tokens x top-4: the hot experts hold hundreds of rows, so they ran as several pieces
        assert problems > used + 8, (mode, problems, used)
        whole = run_prefill(cp, moe, x, logits, pool, slot_of, hp, ring)
        assert moe.stats.gemm_problems == moe.stats.experts_used
        assert rel(out, whole) < FP16_PATH


@pytest.mark.parametrize("case", ["warm", "mixed"])
@pytest.mark.parametrize("floor", [32, 64])
def test_a_class_floor_keeps_every_token_and_lays_the_stack_as_the_host_does(cp, split_moes, rng, case, floor):
    """FastMoE.class_floor lifts the small groups' stack rows on the device (stack_cap) and the host (class_rows)
    alike: any disagreement puts a group's rows where its GEMM does not read them."""
    from strata_cuda.fast import CLASS_FLOOR_ROWS, StackLayout
    t = 512
    x = rng.standard_normal((t, H)).astype(np.float32)
    logits = routing(rng, t, True)
    hp = host_pool(cp, "f16", *experts_f16(rng, E))
    want = reference(x, logits, hp)
    cached = np.arange(E) if case == "warm" else rng.permutation(E)[: E // 2]
    pool = device_pool(cp, hp, E + 12)
    slot_of = np.full(E, -1, dtype=np.int64)
    slot_of[cached] = rng.permutation(E)[: cached.size]
    place(cp, pool, hp, cached, slot_of[cached])
    ring = (E, 12) if case != "warm" else None
    for mode, moe in split_moes.items():
        moe.split_rows, moe.class_floor = 128, floor
        try:
            out = run_prefill(cp, moe, x, logits, pool, slot_of, hp, ring)
            rows = moe.stats.stack_rows
        finally:
            moe.split_rows, moe.class_floor = 0, CLASS_FLOOR_ROWS
        err = rel(out, want)
        assert err < FP16_PATH, f"{mode} floor {floor} {case}: relative error {err:.2e} (seed {rng.seed_value})"
        ids, _ = ref.route_topk(logits, K)
        counts = np.bincount(ids.ravel(), minlength=E)
        counts = counts[counts > 0]
        assert rows == StackLayout.of(counts, mode, floor).rows > StackLayout.of(counts, mode).rows, \
            f"{mode}: the floor did not lift the small groups ({rows} stack rows)"
