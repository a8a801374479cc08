"""The layer ops' mutation self-test: `strata run --check` fails when a layer op is wrong, for every op and mutation.

The core's layer ops on the cpu device are wrapped by `strata_core.testing.mutations.MutatedLayerOps` (the output
update scaled by 1 + 1e-4, one token's update lost, two experts' slots swapped, a missed expert's upload skipped)
and `strata run --backend cpu --check --json` runs in-process; each must exit 1 with the check failed, while the
unmutated run passes (the control). The LayerOps protocol is introspected, so an op added to it without mutations
fails here.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from strata_core.api.kernels import LayerOps
from strata_core.cli import main
from strata_core.runtime.engine import Engine
from strata_core.testing.checks import protocol_kernels
from strata_core.testing.mutations import LAYER_OP_MUTATIONS, MutatedLayerOps

#: A prompt long enough to stream misses through the ring and a few decode steps that admit misses.
RUN = ["run", "--backend", "cpu", "--check", "--json", "--prompt-tokens", "300", "--decode-tokens", "6"]
CASES = [(op, m) for op in sorted(LAYER_OP_MUTATIONS) for m in sorted(LAYER_OP_MUTATIONS[op])]


def _run(monkeypatch, op: str | None = None, mutation: str | None = None) -> tuple[int, dict]:
    if op is not None:
        original = Engine.open

        def open_mutated(cls, *args, **kwargs):
            engine = original(*args, **kwargs)
            engine.executor.ops = MutatedLayerOps(engine.executor.ops, op, mutation)
            return engine
        monkeypatch.setattr(Engine, "open", classmethod(open_mutated))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(RUN)
    return rc, json.loads(out.getvalue())


def test_every_layer_op_of_the_protocol_has_mutations():
    """Every op LayerOps names has the scale, one-row, swapped-experts and stale-slot mutations."""
    ops = protocol_kernels(LayerOps)
    assert len(ops) >= 2, ops
    for op in ops:
        assert {"scale", "one_row_wrong", "two_experts_swapped", "stale_slot_read"} <= set(LAYER_OP_MUTATIONS.get(op, {})), op


def test_the_unmutated_layer_ops_pass_the_check(monkeypatch):
    """The control: the same run without a mutation passes, and streams and admits experts (so uploads matter)."""
    rc, out = _run(monkeypatch)
    assert rc == 0 and out["check"] == "passed", out["check_report"]
    assert out["experts_streamed"] > 0


@pytest.mark.parametrize("op,mutation", CASES, ids=[f"{o}-{m}" for o, m in CASES])
def test_the_check_fails_a_mutated_layer_op(monkeypatch, op, mutation):
    """The mutated op makes `strata run --check` exit 1 with the check failed."""
    rc, out = _run(monkeypatch, op, mutation)
    rep = out["check_report"]
    assert rc == 1 and out["check"] == "failed", (f"{op} with {mutation} passed --check: worst {rep['worst_rel_err']:.3g}"
                                                  f" at {rep['tolerance']:g}")
