"""The executor's decode step with layer ops that queue a step and count it later (decode_launch, decode_done, as
the cuda session's CudaLayerOps do): the LM head is queued between the two, the host waits for the logits only after
the step is counted, the same works come back every step when the ops take them reused, and the tokens are the
plain path's. Backend used: the sim backend (numpy), the core's own layer ops inside a launching double.
"""

from __future__ import annotations

import numpy as np

from .engine_helpers import tiny_engine


class Launching:
    """The core's layer ops behind decode_launch / decode_done (the step runs at launch, is recorded at done)."""

    takes_reused_works = True

    def __init__(self, inner, events: list):
        self.inner, self.events, self.launched, self.quiet = inner, events, None, False

    def prefill_layer(self, work):
        """The inner op's prefill."""
        self.inner.prefill_layer(work)

    def decode_step(self, works):
        """Never called by an executor that sees decode_launch."""
        self.events.append("decode_step")
        self.inner.decode_step(works)

    def decode_launch(self, works):
        """Run the inner step now, record the works' identity."""
        self.events.append(("launch", id(works)))
        self.quiet = True  # the inner step's own kernels and downloads are not the head's
        try:
            self.inner.decode_step(works)
        finally:
            self.quiet = False
        self.launched = works

    def decode_done(self):
        """Record the first call after a launch only (the executor's second call is a no-op)."""
        if self.launched is not None:
            self.events.append("done")
            self.launched = None


def _serve(ops_wrap=None, events=None, monkeypatch=None):
    eng, _, _, _ = tiny_engine()
    ex = eng.executor
    if ops_wrap is not None:
        ex.ops = ops_wrap(ex.ops)
        ex._reuse_works = True  # as the constructor sets it for ops that say takes_reused_works
        linear, download = ex.k.linear, ex.dm.download
        ops = ex.ops

        def note(name):
            if not ops.quiet:
                events.append(name)
        monkeypatch.setattr(ex.k, "linear", lambda *a, **k: (note("linear"), linear(*a, **k))[1])
        monkeypatch.setattr(ex.dm, "download", lambda *a, **k: (note("download"), download(*a, **k))[1])
    res = eng.serve(np.arange(300) % eng.weights.vocab, decode_tokens=5)
    lookups = eng.cache.lookups
    eng.close()
    return res.tokens, lookups


def test_a_launching_op_gets_the_head_queued_before_it_counts_and_the_same_works_every_step(monkeypatch):
    plain_tokens, plain_lookups = _serve()
    events: list = []
    tokens, lookups = _serve(lambda inner: Launching(inner, events), events, monkeypatch)
    assert tokens == plain_tokens and lookups == plain_lookups
    assert "decode_step" not in events
    launches = [i for i, e in enumerate(events) if isinstance(e, tuple)]
    assert len(launches) == 5, events  # every decode step
    for i in launches:
        # the head's linear queued, then the step counted, then the host waits for the logits
        tail = [e for e in events[i + 1:] if e in ("linear", "done", "download")][:3]
        assert tail == ["linear", "done", "download"], (i, events[i:i + 8])
    assert len({events[i][1] for i in launches}) == 1, "the same works list every step"


def test_session_ops_get_the_same_works_every_step_only_when_they_say_they_take_them_reused():
    from strata_core.api.backend import PinnedBudget
    from strata_core.builtin.sim import SimPinnedAllocator
    from strata_core.builtin.sim.memory import SimDeviceMemory
    from strata_core.reference.kernels import ReferenceKernels
    from strata_core.runtime.engine import Engine
    from strata_core.runtime.runlog import RunLog
    from .engine_helpers import tiny_weights
    from .plans import sim_plan
    from strata_core.models.synthetic import tiny_cache_slots

    class Keeps:
        """Session ops that may keep the works they are given (no flag)."""

    w = tiny_weights("f16")
    _, plan = sim_plan(w.spec, {"memory": {"expert_cache": tiny_cache_slots(w.spec)}})
    for ops, reused in ((Launching(None, []), True), (Keeps(), False)):
        budget = PinnedBudget(plan.pinned.limit_bytes, plan.pinned.floor_bytes)
        eng = Engine(plan, dm=SimDeviceMemory(plan.device.vram_free_bytes), allocator=SimPinnedAllocator(budget, None),
                     kernels=ReferenceKernels(), budget=budget, weights=w, log=RunLog(), layer_ops=ops)
        ex = eng.executor
        assert ex._reuse_works is reused
        first = ex._decode_works(None, None)
        assert (ex._decode_works(None, None) is first) is reused
        eng.close()
