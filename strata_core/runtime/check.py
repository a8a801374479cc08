"""`strata run --check`: every layer output and token against the float64 reference, and a hash of them all.

Every layer's MoE update (x_out - x_in) is compared with the float64 reference's (`strata_core.testing.reference64`)
from the same x_in, quantized experts dequantized exactly; tokens whose reference top-k boundary is a near tie (the
k-th and (k+1)-th router logits within `TIE_GAP`) are left out of the comparison, since any rounding may route them
either way. The bound is the one the kit applies (`strata_core.testing.tolerance`): the coarsest precision path the
device's kernels and layer ops declare for the steps of a layer (f32 accumulation 1e-5, f16 intermediates 1e-3),
reported as `check_report.tolerance` with `check_report.precision`. The LM head is checked the same way on the
run's own last hidden state: its logits within the bound, and the greedy token the reference's argmax (or within
`TIE_GAP` of it). An independent reference trajectory from the prompt's last token is also decoded and how many
tokens it shares with the run is reported; it is not a failure when they part, since a near tie anywhere may route
either way.

A model's other FFNs (`strata_core.runtime.dense_ffn`) are checked the same way: a dense FFN block's update
(phase 'prefill.dense' / 'decode.dense') against the reference's ffn(rmsnorm(x)), and a MoE layer with its shared
expert ('prefill.shared' / 'decode.shared', from the layer's input to its output) against the reference's routed
plus shared update; the router's logits carry the file's router bias where it has one. The reference trajectory
runs them all.

`outputs_sha256` is a SHA-256 over every observed layer output and LM-head logits (phase, layer, shape, dtype and
bytes, in the order the run produced them) and the run's tokens: two runs with the same inputs on the same device
give the same hash exactly when they give the same bits. The executor times the observer and leaves its time out
of the request's timings.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strata_core.models.weights import ModelWeights
from strata_core.testing import reference64 as r64
from strata_core.testing.tolerance import REFERENCE_PRECISION, bound_of, path_precision

#: Router logits (and LM-head logits) closer than this are a tie any rounding may break either way.
TIE_GAP = 1e-3
#: The kernels one MoE layer runs through the composed layer ops, and the layer ops themselves.
LAYER_KERNELS = ("rmsnorm", "linear", "route_topk", "gather", "moe_grouped_ffn", "scatter_add")
LAYER_OPS = ("prefill_layer", "decode_step")
#: The kernels of the LM head.
HEAD_KERNELS = ("rmsnorm", "linear")


@dataclass
class CheckReport:
    """What --check compared, at which bound, and what failed."""

    precision: str = REFERENCE_PRECISION
    tolerance: float = bound_of(REFERENCE_PRECISION)
    layers_checked: int = 0
    worst_rel_err: float = 0.0
    near_ties: int = 0
    tokens_checked: int = 0
    trajectory_tokens_matching: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when nothing failed and something was compared."""
        return not self.failures and self.layers_checked > 0

    def to_json(self) -> dict:
        """The check block of `strata.run/1` (`bound` is the same figure as `tolerance`, kept for old readers)."""
        return {"passed": self.passed, "precision": self.precision, "tolerance": self.tolerance,
                "reference": "float64", "layers_checked": self.layers_checked,
                "worst_rel_err": self.worst_rel_err, "bound": self.tolerance, "near_ties": self.near_ties,
                "tokens_checked": self.tokens_checked,
                "trajectory_tokens_matching": self.trajectory_tokens_matching, "failures": self.failures[:10]}


class OutputDigest:
    """A running SHA-256 of a run's outputs: each array with its phase, layer, shape and dtype, then the tokens."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def add(self, phase: str, layer: int, arr: np.ndarray) -> None:
        """Absorb one output array (C order bytes, with what it is, so equal bytes of other shapes differ)."""
        a = np.ascontiguousarray(arr)
        self._h.update(f"{phase}:{layer}:{a.shape}:{a.dtype.str};".encode())
        self._h.update(a.tobytes())

    def add_tokens(self, tokens: list[int]) -> None:
        """Absorb the run's generated tokens."""
        self._h.update(b"tokens;" + np.asarray(tokens, dtype=np.int64).tobytes())

    def hexdigest(self) -> str:
        """The hash so far, as 64 hex digits."""
        return self._h.hexdigest()


class ReferenceCheck:
    """Observes the executor's layers, compares each with the float64 reference on host weights, hashes them."""

    def __init__(self, weights: ModelWeights, kernels: Any = None, layer_ops: Any = None):
        self.w = weights
        self.report = CheckReport()
        self.digest = OutputDigest()
        self.k = weights.spec.top_k
        self.E = weights.spec.experts_per_layer
        self._tokens_absorbed = False
        ffns = list(getattr(weights.dense, "ffns", ()) or ()) if weights.dense is not None else []
        #: MoE layer -> its shared expert; MoE layer -> the dense blocks before it; block id -> dense block
        self.shared = {f.layer: f for f in ffns if f.kind == "shared"}
        self.before: dict[int, list] = {}
        for f in ffns:
            if f.kind == "dense":
                self.before.setdefault(f.layer, []).append(f)
        self.dense_blocks = {f.block: f for f in ffns if f.kind == "dense"}
        self._last_moe: tuple | None = None  # (layer, x_in, update, clear) of the last routed check
        #: (part, layer) -> observations: '' a routed layer, 'shared' with its shared expert, 'dense' a dense block
        self._seen: dict[tuple[str, int], int] = {}
        self.bind(kernels, layer_ops)

    def bind(self, kernels: Any, layer_ops: Any = None) -> None:
        """Take the bound from the precision paths the device's kernels and layer ops declare (before the run)."""
        self.report.precision = path_precision([(kernels, LAYER_KERNELS), (layer_ops, LAYER_OPS)])
        self.report.tolerance = bound_of(self.report.precision)

    @property
    def bound(self) -> float:
        """The relative error bound applied to every layer and LM head."""
        return self.report.tolerance

    @property
    def outputs_sha256(self) -> str:
        """The SHA-256 of every layer output and token the run produced (tokens once `check_tokens` ran)."""
        return self.digest.hexdigest()

    def layer_update(self, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The float64 reference's MoE update of one layer for x [T,H], and a mask of tokens not at a near-tie."""
        d = self.w.dense
        xn = r64.rmsnorm(x, d.norms[layer])
        logits = r64.linear(xn, d.routers[layer])
        biases = getattr(d, "router_biases", None) or []
        if layer < len(biases) and biases[layer] is not None:
            logits = logits + np.asarray(biases[layer], dtype=np.float64)
        ids, wts = r64.route_topk(logits, self.k)
        top = np.sort(logits, axis=1)[:, ::-1]
        clear = (top[:, self.k - 1] - top[:, self.k]) > TIE_GAP if self.E > self.k else np.ones(len(x), bool)
        out = np.zeros(x.shape, dtype=np.float64)
        base = layer * self.E
        pool = self.w.experts.for_layer(layer)
        for e in np.unique(ids):
            tok, pos = np.nonzero(ids == e)
            out[tok] += wts[tok, pos][:, None] * r64.expert_ffn(pool, base + int(e), xn[tok])
        return out, clear

    def shared_update(self, layer: int, x: np.ndarray) -> np.ndarray:
        """The float64 reference's shared-expert term of one MoE layer for x [T,H]: s * ffn(rmsnorm(x)), s the
        sigmoid of its gate (1 where the file has none)."""
        f = self.shared[layer]
        xn = r64.rmsnorm(x, self.w.dense.norms[layer])
        y = r64.expert_ffn(f.pool, 0, xn)
        if f.gate is None:
            return y
        return y / (1.0 + np.exp(-r64.linear(xn, f.gate)))

    @staticmethod
    def dense_update(f: Any, x: np.ndarray) -> np.ndarray:
        """The float64 reference's update of a dense FFN block: ffn(rmsnorm(x, its norm))."""
        return r64.expert_ffn(f.pool, 0, r64.rmsnorm(x, f.norm))

    def _routed(self, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """layer_update, reused when the same layer input was just checked (the routed part of a shared check)."""
        last = self._last_moe
        if last is not None and last[0] == layer and last[1].shape == x.shape and np.array_equal(last[1], x):
            return last[2], last[3]
        want, clear = self.layer_update(layer, x)
        self._last_moe = (layer, np.array(x, copy=True), want, clear)
        return want, clear

    def _want(self, phase: str, layer: int, x_in: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The reference update of one observed step and the tokens it compares."""
        part = phase.partition(".")[2]
        if part == "dense":
            return self.dense_update(self.dense_blocks[layer], x_in), np.ones(len(x_in), bool)
        want, clear = self._routed(layer, x_in)
        if part == "shared":
            want = want + self.shared_update(layer, x_in)
        return want, clear

    def __call__(self, phase: str, layer: int, x_in: np.ndarray, x_out: np.ndarray) -> None:
        """Hash one layer output (or the LM head's logits) of the run and compare it with the reference."""
        self.digest.add(phase, layer, x_out)
        if phase == "head":
            self._check_head(x_in, x_out[0])
            return
        key = (phase.partition(".")[2], int(layer))
        self._seen[key] = self._seen.get(key, 0) + 1
        want, clear = self._want(phase, layer, x_in)
        got = np.asarray(x_out, dtype=np.float64) - np.asarray(x_in, dtype=np.float64)
        self.report.near_ties += int((~clear).sum())
        err = r64.relative_error(got[clear], want[clear]) if clear.any() else 0.0
        self.report.layers_checked += 1
        self.report.worst_rel_err = max(self.report.worst_rel_err, err)
        if not err <= self.bound:
            self.report.failures.append(f"{phase} layer {layer}: relative error {err:.3g} above the "
                                        f"{self.report.precision} bound {self.bound:g}")

    def logits(self, token: int) -> np.ndarray:
        """The float64 reference's logits of one token through every layer."""
        d = self.w.dense
        x = d.embed[[token]].astype(np.float64)
        layers = self.w.spec.moe_layers
        for layer in range(layers):
            for f in self.before.get(layer, ()):
                x = x + self.dense_update(f, x)
            upd, _ = self.layer_update(layer, x)
            if layer in self.shared:
                upd = upd + self.shared_update(layer, x)
            x = x + upd
        for f in self.before.get(layers, ()):
            x = x + self.dense_update(f, x)
        return r64.linear(r64.rmsnorm(x, d.final_norm), d.lm_head)[0]

    def _check_head(self, x_last: np.ndarray, logits: np.ndarray) -> None:
        """The run's logits of its own last hidden state against the reference's, and the greedy pick."""
        d = self.w.dense
        want = r64.linear(r64.rmsnorm(x_last, d.final_norm), d.lm_head)[0]
        err = r64.relative_error(logits, want)
        self.report.tokens_checked += 1
        self.report.worst_rel_err = max(self.report.worst_rel_err, err)
        if not err <= self.bound:
            self.report.failures.append(f"LM head {self.report.tokens_checked}: relative error {err:.3g} above the "
                                        f"{self.report.precision} bound {self.bound:g}")
        tok, best = int(np.argmax(logits)), int(np.argmax(want))
        if tok != best and want[best] - want[tok] > TIE_GAP * max(1.0, abs(float(want[best]))):
            self.report.failures.append(f"LM head {self.report.tokens_checked}: the run's greedy token {tok}, the "
                                        f"reference's {best} (logits {want[tok]:.4f} vs {want[best]:.4f})")

    def check_coverage(self) -> None:
        """A failure for every shared expert or dense block the run did not report once per pass over the layers
        (a run that skipped one would pass every layer it did report)."""
        passes = max(self._seen.values(), default=0)
        wanted = [("shared", layer, "the shared expert of MoE layer") for layer in self.shared]
        wanted += [("dense", block, "the dense FFN block") for block in self.dense_blocks]
        for part, n, what in wanted:
            got = self._seen.get((part, n), 0)
            if got != passes:
                self.report.failures.append(f"{what} {n}: observed {got} times in {passes} passes over the layers")

    def check_tokens(self, last_prompt_token: int, tokens: list[int]) -> None:
        """Hash the run's tokens; decode the reference's trajectory with them as inputs and count those it shares;
        check that every shared expert and dense block was reported (check_coverage)."""
        if not self._tokens_absorbed:
            self.digest.add_tokens(tokens)
            self._tokens_absorbed = True
            self.check_coverage()
        prev = last_prompt_token
        for tok in tokens:
            if int(np.argmax(self.logits(prev))) == tok:
                self.report.trajectory_tokens_matching += 1
            prev = tok
