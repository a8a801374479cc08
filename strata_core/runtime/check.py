"""`strata run --check`: the numpy reference (strata_core.kernels.reference) on the same inputs, layer by layer.

Every layer's MoE update (x_out - x_in) is compared with the reference's from the same x_in; tokens whose
reference top-k boundary is a near tie (the k-th and (k+1)-th router logits within `TIE_GAP`) are left out of the
comparison, since any rounding may route them either way. Each greedy token must be the reference's argmax of the
same input, or within `TIE_GAP` of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..kernels import reference as ref
from .weights import ModelWeights

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
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when nothing failed and something was compared."""
        return not self.failures and self.layers_checked > 0

    def to_json(self) -> dict:
        """The check block of `strata.run/1`."""
        return {"passed": self.passed, "layers_checked": self.layers_checked,
                "worst_rel_err": self.worst_rel_err, "bound": LAYER_REL_ERR, "near_ties": self.near_ties,
                "tokens_checked": self.tokens_checked, "failures": self.failures[:10]}


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
        """Compare one layer of the run with the reference."""
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

    def check_tokens(self, last_prompt_token: int, tokens: list[int]) -> None:
        """Each greedy token must be the reference's argmax (within TIE_GAP) given the token before it."""
        prev = last_prompt_token
        for i, tok in enumerate(tokens):
            lg = self.logits(prev)
            best = int(np.argmax(lg))
            self.report.tokens_checked += 1
            if tok != best and lg[best] - lg[tok] > TIE_GAP * max(1.0, abs(float(lg[best]))):
                self.report.failures.append(f"token {i}: the run chose {tok}, the reference {best} "
                                            f"(logits {lg[tok]:.4f} vs {lg[best]:.4f})")
            prev = tok
