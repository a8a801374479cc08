"""A layer op reports an optional path it turned off through work.extras["fallback"] (the cuda ops do so when the
fused quant GEMM did not build): the run lists it once among its fallbacks, however many layers and chunks said it,
and its tokens are the plain run's. Backend used: the sim backend (numpy), the core's own layer ops inside a double.
"""

from __future__ import annotations

import numpy as np

from .engine_helpers import tiny_engine


class Reporting:
    """The core's layer ops, reporting one optional path as turned off on every prefill layer."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def prefill_layer(self, work):
        """Report, then run the inner op's prefill."""
        self.calls += 1
        work.extras["fallback"]("fused test GEMM", f"not built (layer {work.layer})")
        self.inner.prefill_layer(work)

    def decode_step(self, works):
        """The inner op's decode step."""
        self.inner.decode_step(works)


def _serve(wrap: bool):
    eng, _, log, _ = tiny_engine({"prefill": {"chunk": "128"}})
    ops = None
    if wrap:
        ops = eng.executor.ops = Reporting(eng.executor.ops)
    res = eng.serve(np.arange(300) % eng.weights.vocab, decode_tokens=3)
    eng.close()
    return res, log, ops


def test_a_layer_op_fallback_is_listed_once_and_the_tokens_are_unchanged():
    plain, _, _ = _serve(False)
    res, log, ops = _serve(True)
    assert ops.calls > 1  # several layers (and chunks) said it
    said = [f for f in res.fallbacks if f.what == "fused test GEMM"]
    assert len(said) == 1 and said[0].why == "not built (layer 0)"
    assert len(log.lines_matching("fused test GEMM")) == 1
    assert res.tokens == plain.tokens
    assert not [f for f in plain.fallbacks if f.what == "fused test GEMM"]
