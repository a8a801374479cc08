"""The executor's pipelined greedy decode (Executor.decode_greedy) through layer ops that offer the greedy capability
(as the cuda session's CudaLayerOps do): each step is queued (embedding from the device's token, the step deferred,
the LM head, the argmax) before the host counts the previous step and reads its token; the tokens, the cache's
counts and frequencies and the last logits are the step loop's. Ops without the capability (the core's own, the
sim and cpu backends') keep the step loop. Backend used: the sim backend (numpy), the core's layer ops inside a
double that plays the device's part on the host.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.runtime.executor import GREEDY_CAPABILITY

from .engine_helpers import tiny_engine

PROMPT = np.arange(300)
STEPS = 6


class Greedy:
    """The core's layer ops behind decode_launch(defer) / decode_done(keep) and the greedy capability; the "device"
    runs each step at launch (its cache tick first when deferred, as the real ops tick before counting), records
    when the executor counts it and reads its token."""

    takes_reused_works = True

    def __init__(self, inner, events: list):
        self.inner, self.events = inner, events
        self.launched: list[int] = []
        self.queued: list[int] = []
        self.tok = -1
        self.steps = 0
        self.read = 0

    def prefill_layer(self, work):
        """The inner op's prefill (every launched step counted first)."""
        self.decode_done()
        self.inner.prefill_layer(work)

    def decode_step(self, works):
        """Never called by an executor that pipelines."""
        self.events.append("decode_step")
        self.inner.decode_step(works)

    def decode_launch(self, works, defer=False):
        """Run the inner step now (the tick it owes first), record it as launched and not counted."""
        if not defer:
            self.decode_done()
        self.events.append(("launch", self.steps, defer))
        if defer:
            works[0].slots.tick()
        self.inner.decode_step(works)
        self.launched.append(self.steps)
        self.steps += 1

    def decode_done(self, keep=0):
        """Record the counting of launched steps, oldest first, until `keep` are left."""
        while len(self.launched) > keep:
            self.events.append(("done", self.launched.pop(0)))

    def greedy_table(self, embed):
        """The host's table (the sim's device memory is host memory)."""
        self.events.append(("table",))
        return embed

    def greedy_release(self):
        """Recorded (the executor's close)."""
        self.events.append(("release",))

    def greedy_start(self, token, table):
        """The first token onto the "device"."""
        self.events.append(("start", int(token)))
        self.tok = int(token)

    def greedy_embed(self, table, x):
        """x = the table's row of the device's token, widened."""
        self.events.append(("embed", self.steps))
        np.asarray(x)[...] = np.asarray(table[[self.tok]], dtype=np.float32)

    def greedy_argmax(self, logits):
        """The device's token = np.argmax of the last row; queued for the host."""
        self.events.append(("argmax", self.steps - 1))
        self.tok = int(np.argmax(np.asarray(logits)[-1]))
        self.queued.append(self.tok)

    def greedy_token(self):
        """The oldest queued token."""
        self.events.append(("token", self.read))
        self.read += 1
        return self.queued.pop(0)


def _serve(greedy: bool, monkeypatch, events: list | None = None):
    eng, _, _, _ = tiny_engine()
    ex = eng.executor
    if greedy:
        ex.ops = Greedy(ex.ops, events)
        ex._reuse_works = True  # as the constructor sets it for ops that say takes_reused_works
    last = {}
    step, pipe = ex.decode_step, ex.decode_greedy

    def keep_step(tok):
        last["logits"] = step(tok)
        return last["logits"]

    def keep_pipe(*a):
        last["logits"] = pipe(*a)
        return last["logits"]
    monkeypatch.setattr(ex, "decode_step", keep_step)
    monkeypatch.setattr(ex, "decode_greedy", keep_pipe)
    vocab = int(eng.weights.vocab)
    logits_downloads = []
    download = ex.dm.download
    monkeypatch.setattr(ex.dm, "download", lambda a, *r, **k: (
        logits_downloads.append(1) if tuple(np.shape(a))[-1:] == (vocab,) else None, download(a, *r, **k))[1])
    res = eng.serve(PROMPT % eng.weights.vocab, decode_tokens=STEPS)
    out = dict(tokens=res.tokens, steps=res.decode_steps, hits=eng.cache.hits, lookups=eng.cache.lookups,
               freq=eng.cache.freq.copy(), slot_of=eng.cache.slot_of.copy(), logits=last["logits"],
               logits_downloads=len(logits_downloads), pipelined=ex.pipelines_greedy)
    eng.close()
    return out


def test_the_core_layer_ops_keep_the_step_loop(monkeypatch):
    eng, _, _, _ = tiny_engine()
    assert not eng.executor.pipelines_greedy
    eng.close()
    assert set(GREEDY_CAPABILITY) == {"greedy_table", "greedy_start", "greedy_embed", "greedy_argmax", "greedy_token"}


def test_pipelined_greedy_decode_gives_the_step_loops_tokens_counts_and_last_logits(monkeypatch):
    plain = _serve(False, monkeypatch)
    events: list = []
    piped = _serve(True, monkeypatch, events)
    assert not plain["pipelined"] and piped["pipelined"]
    assert piped["tokens"] == plain["tokens"] and len(piped["tokens"]) == STEPS + 1
    assert piped["steps"] == plain["steps"] == STEPS
    assert (piped["hits"], piped["lookups"]) == (plain["hits"], plain["lookups"])
    assert np.array_equal(piped["freq"], plain["freq"]) and np.array_equal(piped["slot_of"], plain["slot_of"])
    assert np.array_equal(piped["logits"], plain["logits"])
    # the step loop downloads the prompt's and every step's logits; the pipeline the prompt's and the last step's
    assert plain["logits_downloads"] == STEPS + 1 and piped["logits_downloads"] == 2
    assert "decode_step" not in events
    assert events[0] == ("table",) and ("start", plain["tokens"][0]) in events
    assert events[-1] == ("release",), "the engine's close gives the table back"


def test_each_step_is_queued_before_the_host_counts_the_previous_one_and_reads_its_token(monkeypatch):
    events: list = []
    _serve(True, monkeypatch, events)
    ev = events
    at = {e: i for i, e in enumerate(ev)}
    assert len(at) == len(ev), "every event once"
    for i in range(STEPS):
        # a step: its embedding from the device's token, queued deferred, then its argmax
        assert at[("embed", i)] < at[("launch", i, True)] < at[("argmax", i)], (i, ev)
        if i > 0:
            assert at[("argmax", i - 1)] < at[("embed", i)]
            # step i is queued before step i-1 is counted, and counted before its token is read
            assert at[("argmax", i)] < at[("done", i - 1)] < at[("token", i - 1)], (i, ev)
        if i + 1 < STEPS:
            # counted and read one step behind: after the next step is queued
            assert at[("launch", i + 1, True)] < at[("done", i)] < at[("token", i)], (i, ev)
    assert at[("done", STEPS - 1)] < at[("token", STEPS - 1)]
    assert len([e for e in ev if e[0] == "launch"]) == STEPS


def test_greedy_pipeline_off_keeps_the_step_loop_with_the_same_ops(monkeypatch):
    eng, _, _, _ = tiny_engine()
    ex = eng.executor
    events: list = []
    ex.ops = Greedy(ex.ops, events)
    ex._reuse_works = True
    assert ex.pipelines_greedy
    ex.greedy_pipeline = False
    assert not ex.pipelines_greedy
    res = eng.serve(PROMPT % eng.weights.vocab, decode_tokens=3)
    eng.close()
    assert res.decode_steps == 3 and not [e for e in events if e[0] in ("embed", "argmax", "token")]
    assert [e for e in events if e[0] == "launch"] == [("launch", i, False) for i in range(3)]


def test_decode_greedy_refuses_zero_steps(monkeypatch):
    eng, _, _, _ = tiny_engine()
    ex = eng.executor
    ex.ops = Greedy(ex.ops, [])
    with pytest.raises(ValueError):
        ex.decode_greedy(1, 0, [])
    eng.close()
