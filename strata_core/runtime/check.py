"""`strata run --check`: the numpy reference (strata_core.reference.kernels) on the same inputs, layer by layer.

Every layer's MoE update (x_out - x_in) is compared with the reference's from the same x_in; tokens whose
reference top-k boundary is a near tie (the k-th and (k+1)-th router logits within `TIE_GAP`) are left out of the
comparison, since any rounding may route them either way. The LM head is checked the same way on the run's own
last hidden state: its logits within the bound, and the greedy token the reference's argmax (or within `TIE_GAP`
of it). An independent reference trajectory from the prompt's last token is also decoded and how many tokens it
shares with the run is reported; it is not a failure when they part, since a near tie anywhere may route either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strata_core.reference import kernels as ref
from strata_core.models.weights import ModelWeights

#: Relative error bound of a layer's update with f16 (or Q8_0) expert weights.
LAYER_REL_ERR = 2e-3
#: Router logits (and LM-head logits) closer than this are a tie any rounding may break either way.
TIE_GAP = 1e-3


@dataclass
class CheckReport:
    """What --check compared and what failed."""

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
        """The check block of `strata.run/1`."""
        return {"passed": self.passed, "layers_checked": self.layers_checked,
                "worst_rel_err": self.worst_rel_err, "bound": LAYER_REL_ERR, "near_ties": self.near_ties,
                "tokens_checked": self.tokens_checked,
                "trajectory_tokens_matching": self.trajectory_tokens_matching, "failures": self.failures[:10]}


class ReferenceCheck:
    """Observes the executor's layers and compares each with the reference computed on host weights."""

    def __init__(self, weights: ModelWeights, bound: float = LAYER_REL_ERR):
        self.w = weights
        self.bound = bound
        self.report = CheckReport()
        self.k = weights.spec.top_k
        self.E = weights.spec.experts_per_layer

    def layer_update(self, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The reference's MoE update of one layer for x [T,H], and a mask of tokens not at a routing near-tie."""
        d = self.w.dense
        xn = ref.rmsnorm(x, d.norms[layer])
        logits = ref.linear(xn, d.routers[layer])
        ids, wts = ref.route_topk(logits, self.k)
        top = np.sort(logits, axis=1)[:, ::-1]
        clear = (top[:, self.k - 1] - top[:, self.k]) > TIE_GAP if self.E > self.k else np.ones(len(x), bool)
        out = np.zeros_like(x, dtype=np.float32)
        flat = ids.reshape(-1)
        order = np.argsort(flat, kind="stable")
        experts, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
        rows_all = order // self.k
        scales_all = wts.reshape(-1)[order]
        base = layer * self.E
        for e, s, n in zip(experts, starts, counts):
            rows = rows_all[s:s + n]
            y = ref.moe_grouped_ffn(xn[rows], np.array([0, n]), np.array([base + int(e)]), self.w.experts)
            ref.scatter_add(out, rows, y, scales_all[s:s + n])
        return out, clear

    def __call__(self, phase: str, layer: int, x_in: np.ndarray, x_out: np.ndarray) -> None:
        """Compare one layer (or the LM head) of the run with the reference."""
        if phase == "head":
            self._check_head(x_in, x_out[0])
            return
        want, clear = self.layer_update(layer, x_in)
        got = x_out - x_in
        self.report.near_ties += int((~clear).sum())
        err = ref.relative_error(got[clear], want[clear]) if clear.any() else 0.0
        self.report.layers_checked += 1
        self.report.worst_rel_err = max(self.report.worst_rel_err, err)
        if not err <= self.bound:
            self.report.failures.append(f"{phase} layer {layer}: relative error {err:.3g} above {self.bound:g}")

    def logits(self, token: int) -> np.ndarray:
        """The reference's logits of one token through every layer."""
        d = self.w.dense
        x = d.embed[[token]].astype(np.float32)
        for layer in range(self.w.spec.moe_layers):
            upd, _ = self.layer_update(layer, x)
            x = x + upd
        return ref.linear(ref.rmsnorm(x, d.final_norm), d.lm_head)[0]

    def _check_head(self, x_last: np.ndarray, logits: np.ndarray) -> None:
        """The run's logits of its own last hidden state against the reference's, and the greedy pick."""
        d = self.w.dense
        want = ref.linear(ref.rmsnorm(x_last, d.final_norm), d.lm_head)[0]
        err = ref.relative_error(logits, want)
        self.report.tokens_checked += 1
        self.report.worst_rel_err = max(self.report.worst_rel_err, err)
        if not err <= self.bound:
            self.report.failures.append(f"LM head {self.report.tokens_checked}: relative error {err:.3g} above "
                                        f"{self.bound:g}")
        tok, best = int(np.argmax(logits)), int(np.argmax(want))
        if tok != best and want[best] - want[tok] > TIE_GAP * max(1.0, abs(float(want[best]))):
            self.report.failures.append(f"LM head {self.report.tokens_checked}: the run's greedy token {tok}, the "
                                        f"reference's {best} (logits {want[tok]:.4f} vs {want[best]:.4f})")

    def check_tokens(self, last_prompt_token: int, tokens: list[int]) -> None:
        """Decode the reference's own trajectory with the run's tokens as inputs; count the tokens they share."""
        prev = last_prompt_token
        for tok in tokens:
            if int(np.argmax(self.logits(prev))) == tok:
                self.report.trajectory_tokens_matching += 1
            prev = tok
