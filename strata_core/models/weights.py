"""The weights the executor runs: dense (embeddings, per-layer RMSNorm and router, final norm, LM head) and experts.

Experts of every MoE layer sit in one host `ExpertPool` of layers x experts rows (row = layer * experts + expert),
f16, Q8_0, or 'gguf' (a GGUF file's own rows: Q4_K, Q5_K, Q6_K, MXFP4 and their mixes, never converted).
The model has no attention (out of scope for Strata Core): each MoE layer is
x += sum_k w_k * expert_k(rmsnorm(x)), routed by softmax over the router's top k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
import numpy as np

from strata_core.reference.kernels import ExpertPool
from strata_core.models.spec import ModelSpec


@dataclass
class DenseWeights:
    """Non-expert weights, host side: embed [V,H], norms [L][H] f32, routers [L][E,H], final_norm [H], lm_head [V,H]."""

    embed: np.ndarray
    norms: list[np.ndarray]
    routers: list[np.ndarray]
    final_norm: np.ndarray
    lm_head: np.ndarray

    @property
    def device_arrays(self) -> dict[str, np.ndarray]:
        """name -> host array of every dense weight the device holds (the embedding stays on the host)."""
        out = {f"norm.{i}": w for i, w in enumerate(self.norms)}
        out.update({f"router.{i}": w for i, w in enumerate(self.routers)})
        out["final_norm"] = self.final_norm
        out["lm_head"] = self.lm_head
        return out

    @property
    def device_bytes(self) -> int:
        """Bytes of the dense weights on the device."""
        return sum(int(a.nbytes) for a in self.device_arrays.values())


@dataclass
class ModelWeights:
    """A model the executor can run: its spec, dense weights and every expert in one host pool."""

    spec: ModelSpec
    dense: DenseWeights | None
    experts: ExpertPool
    expert_ffn: int
    #: lines a run prints about what of the model file it does not compute (shared experts, dense FFN blocks)
    notes: list[str] = field(default_factory=list)

    @property
    def vocab(self) -> int:
        """Vocabulary size."""
        return int(self.dense.embed.shape[0]) if self.dense is not None else self.spec.vocab


def weights_from_gguf(path: str | Path, spec: ModelSpec) -> ModelWeights:
    """Load a GGUF MoE model's weights: experts in their file's bytes (F16/BF16 files as an f16 pool), dense f32/f16."""
    from strata_core.models.gguf import read_moe_tensors
    t = read_moe_tensors(path, spec)
    dense = DenseWeights(embed=t.embed, norms=t.norms, routers=t.routers, final_norm=t.final_norm, lm_head=t.lm_head)
    return ModelWeights(spec=spec, dense=dense, experts=t.experts, expert_ffn=t.expert_ffn, notes=list(t.notes))
