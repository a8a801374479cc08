"""The executor against the numpy reference, layer by layer, with misses streamed through a ring lent from the cache.

Backend used: the sim backend in real mode (numpy arrays whose bytes count against a simulated 24 GiB device).
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.runtime.check import ReferenceCheck
from strata_core.runtime.loan import Loan

from .engine_helpers import tiny_engine, tiny_weights


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_prefill_with_a_lent_ring_and_decode_match_the_reference(dtype):
    check = ReferenceCheck(tiny_weights(dtype))
    eng, plan, log, dm = tiny_engine(dtype=dtype, observer=check)
    assert eng.cache.slots == plan.expert_cache.slots, "the pool is exactly the plan's slots"
    assert eng.pool_bytes == plan.vram.expert_cache_bytes
    prompt = np.random.default_rng(1).integers(0, eng.weights.vocab, 1100)
    res = eng.serve(prompt, decode_tokens=4)
    row = plan.loan_for(res.chunk)
    # the ring as planned; of the buffer slots only those the chunk's buffers are carved from (the rest keep caching)
    assert res.completed and 0 < row.ring_slots <= res.loan_slots <= row.loan_slots
    check.check_tokens(int(prompt[-1]), res.tokens)
    assert check.report.passed, check.report.failures
    assert check.report.layers_checked == plan.model.moe_layers * (1 + 4)
    assert check.report.tokens_checked == 1 + 4, "the LM head is checked after prefill and every decode step"
    # numpy on both sides: the independent reference trajectory is the run's
    assert check.report.trajectory_tokens_matching == len(res.tokens) == 5
    st = eng.executor.stats
    assert st.experts_streamed > 0 and st.ring_batches > 0, "misses must have streamed through the ring"
    assert eng.cache.slots_on_loan == 0, "the loan was given back"
    assert 0 < eng.cache.hits < eng.cache.lookups
    eng.cache.check()
    planned = (plan.vram.expert_cache_bytes + plan.vram.dense_bytes + plan.vram.workspace_bytes
               + plan.vram.kv_bytes)
    assert eng.device_bytes_allocated <= planned, "the runtime asked the device for more than the plan"
    assert eng.device_bytes_peak_estimate <= planned, "a chunk's buffers outgrew the plan's workspace"
    eng.close()
    assert dm.live_allocations == 0, "every device array the runtime allocated was freed"


def test_ring_slots_are_the_lent_cache_slots():
    eng, plan, _, _ = tiny_engine()
    seen = []
    orig = eng.executor.source.upload
    eng.executor.source.upload = lambda row, slot, stream: (seen.append(slot), orig(row, slot, stream))
    loans = []
    orig_lend = eng.loans.lend
    eng.loans.lend = lambda n, **kw: loans.append(orig_lend(n, **kw)) or loans[-1]
    eng.serve(np.arange(1100) % eng.weights.vocab, decode_tokens=0)
    assert isinstance(loans[0], Loan)
    assert set(seen) <= set(loans[0].ring.tolist()), "prefill misses are copied into the lent ring slots only"
    eng.close()


def test_a_check_with_a_wrong_expert_fails():
    w = tiny_weights("f16")
    check = ReferenceCheck(w)
    eng, _, _, _ = tiny_engine(observer=check)
    # corrupt one cached expert on the device: the layer that uses it must disagree with the reference (one of the
    # first layer, which the prompt reaches before any miss can evict it; the warm-up places by popularity)
    held = eng.cache.expert_in
    slot = int(np.flatnonzero((held >= 0) & (held < eng.cache.experts_per_layer))[0])
    eng.device_pool.arrays["w_down"][slot] *= 3
    eng.serve(np.arange(300) % w.vocab, decode_tokens=0)
    assert not check.report.passed and check.report.failures
    eng.close()


def test_a_prompt_longer_than_the_context_is_refused_before_it_starts():
    eng, plan, _, _ = tiny_engine(settings={"kv": {"max_context": 512}})
    res = eng.serve(np.zeros(600, dtype=np.int64), decode_tokens=2)
    assert not res.completed and "kv.max_context" in res.refused_reason
    assert eng.executor.stats.prefill_tokens == 0 and eng.loans.loans == 0
    eng.close()


def test_a_chunk_whose_buffers_do_not_fit_the_plans_regions_is_read_again_with_half_the_chunk():
    check = ReferenceCheck(tiny_weights())
    eng, plan, log, dm = tiny_engine(observer=check)
    chunk = plan.request_chunk(3000)
    # a workspace that no longer holds the chunk's residual stream, and no buffer slots lent beside it
    ws = eng.executor.regions["workspace"]
    eng.executor.regions["workspace"] = ws[: chunk * plan.model.hidden * 4 - 1]
    eng.loans.buffer_need = lambda c, planned: 0
    res = eng.serve(np.arange(3000) % eng.weights.vocab, decode_tokens=2)
    assert res.completed
    assert res.chunk <= chunk // 2 and res.halvings >= 1 and eng.loans.halvings >= 1
    assert log.lines_matching("reads again with chunks of")
    assert check.report.passed, check.report.failures
    assert eng.cache.slots_on_loan == 0
    eng.executor.regions["workspace"] = ws
    eng.close()


def test_elastic_slots_trim_idle_slots_between_requests():
    eng, plan, log, _ = tiny_engine(settings={"memory": {"elastic_slots_gib": 0.005}})
    cap = int(0.005 * (1 << 30)) // plan.model.slot_bytes
    eng.serve(np.arange(8), decode_tokens=1)  # a short request leaves most cached experts idle
    trimmed = int(eng.cache.trimmed.sum())
    assert 0 < trimmed <= cap
    assert (eng.cache.expert_in[eng.cache.trimmed] == -1).all(), "a trimmed slot holds no expert"
    res = eng.serve(np.arange(1100) % eng.weights.vocab, decode_tokens=1)
    assert res.completed and eng.cache.slots_on_loan == 0
    eng.cache.check()
    eng.close()


def test_no_elastic_trimming_by_default():
    eng, _, _, _ = tiny_engine()
    eng.serve(np.arange(8), decode_tokens=1)
    assert int(eng.cache.trimmed.sum()) == 0
    eng.close()


def test_experts_the_arena_could_not_pin_stream_through_page_locked_staging():
    check = ReferenceCheck(tiny_weights())
    eng, plan, log, _ = tiny_engine(faults=["arena-register:above=1MiB"], observer=check)
    assert eng.budget.exhausted and eng.store.pinned_fraction < 1.0
    assert eng.staging.enabled
    want = (max(r.ring_slots for r in plan.prompt.loans) + 1) // 2 * eng.store.row_bytes
    assert eng.staging_pool.allocations == [("copy staging", want)], "one staging buffer, sized once"
    res = eng.serve(np.arange(1100) % eng.weights.vocab, decode_tokens=2)
    assert res.completed and eng.executor.stats.experts_streamed > 0
    assert check.report.passed, check.report.failures
    eng.close()


def test_without_staging_memory_misses_copy_from_pageable_memory_after_one_line():
    eng, _, log, _ = tiny_engine(faults=["arena-register:above=1MiB", "pinned-alloc:every"])
    assert not eng.staging.enabled
    assert len([f for f in log.fallbacks if f.what == "copy staging"]) == 1
    res = eng.serve(np.arange(1100) % eng.weights.vocab, decode_tokens=2)
    assert res.completed
    eng.close()


def test_the_checks_time_is_outside_the_prefill_and_decode_timings():
    import time

    calls = []

    def slow_observer(phase, layer, x_in, x_out):
        calls.append(phase)
        time.sleep(0.05)

    eng, plan, _, _ = tiny_engine(observer=slow_observer)
    t0 = time.perf_counter()
    res = eng.serve(np.arange(200) % eng.weights.vocab, decode_tokens=3)
    wall = time.perf_counter() - t0
    assert res.completed and len(calls) == plan.model.moe_layers * 4 + 4  # layers of 1 chunk + 3 steps, 4 heads
    slept = 0.05 * len(calls)
    assert eng.executor.observer_s >= slept
    # the observer's sleeps are in the wall time and out of the request's own timings
    assert res.prefill_s + res.decode_s <= wall - slept
    assert res.prefill_cpu_s >= 0 and res.decode_cpu_s >= 0
    eng.close()
