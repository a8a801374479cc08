"""The CPU share: runs beside the device on small chunks; when its page-locked buffer is refused it is off for the run,
with one line, and the request completes exactly as with the share off (seed #1756).

Backend used: the sim backend in real mode, with fault injection on page-locked allocations.
"""

from __future__ import annotations

import numpy as np

from strata_core.runtime.check import ReferenceCheck

from .engine_helpers import tiny_engine, tiny_weights

PROMPT = np.random.default_rng(7).integers(0, 2048, 300)


def _run(settings, faults=(), observer=None):
    eng, plan, log, dm = tiny_engine(settings=settings, faults=faults, observer=observer)
    res = eng.serve(PROMPT, decode_tokens=3)
    out = (eng, plan, log, res, eng.executor.stats.cpu_share_experts)
    eng.close()
    return out


def test_the_share_runs_beside_the_device_and_matches_the_reference():
    check = ReferenceCheck(tiny_weights())
    eng, plan, log, res, share_experts = _run({"prefill": {"cpu_share": "on"}}, observer=check)
    assert plan.cpu_share.enabled and res.chunk <= plan.cpu_share.max_chunk
    assert res.completed and share_experts > 0
    assert eng.share.enabled and eng.share_pool.allocations == [("cpu-share activations", eng.share.buffer_bytes)]
    assert check.report.passed, check.report.failures


def test_a_refused_share_buffer_turns_the_share_off_for_the_run_and_the_request_completes_identically():
    _, _, _, off, _ = _run({"prefill": {"cpu_share": "off"}})
    eng, plan, log, res, share_experts = _run({"prefill": {"cpu_share": "on"}}, faults=["pinned-alloc:every"])
    assert plan.cpu_share.enabled, "the plan armed the share; only the allocation fails"
    assert res.completed and share_experts == 0 and not eng.share.enabled
    share_lines = [f for f in log.fallbacks if f.what.startswith("CPU share")]
    assert len(share_lines) == 1 and "off for this run" in share_lines[0].why
    assert res.tokens == off.tokens, "the GPU-only path must give the share-off run's output"


def test_a_share_thread_that_fails_falls_back_to_the_device_path(monkeypatch):
    from strata_core.runtime import cpu_share

    def broken(*args):
        raise MemoryError("simulated failure inside the share")

    monkeypatch.setattr(cpu_share.CpuShare, "_work", staticmethod(broken))
    check = ReferenceCheck(tiny_weights())
    eng, _, log, res, _ = _run({"prefill": {"cpu_share": "on"}}, observer=check)
    assert res.completed and not eng.share.enabled
    assert len([f for f in log.fallbacks if f.what == "CPU share"]) == 1
    assert check.report.passed, "the share's experts must have run on the device path instead"
