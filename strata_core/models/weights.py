"""The weights the executor runs: dense (embeddings, per-layer RMSNorm and router, final norm, LM head) and experts.

Experts of every MoE layer sit in one host `ExpertPool` of layers x experts rows (row = layer * experts + expert),
f16, Q8_0, or 'gguf' (a GGUF file's own rows: Q4_K, Q5_K, Q6_K, MXFP4 and their mixes, never converted).
The model has no attention (out of scope for Strata Core): each MoE layer is
x += sum_k w_k * expert_k(xn) + s(xn) * shared(xn) with xn = rmsnorm(x), routed by softmax over the router's top k
(plus its bias where the file has one), the shared term only where the file has a shared expert (`DenseFfn`); a
dense FFN block (deepseek2's first blocks) is x += ffn(rmsnorm(x)) before the MoE layer that follows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
import numpy as np

from strata_core.reference.kernels import ExpertFormat, ExpertPool
from strata_core.models.spec import ModelSpec


@dataclass(frozen=True)
class DenseFfn:
    """An FFN every token runs: a shared expert of an MoE layer, or a dense FFN block (deepseek2's first blocks).

    Its weights are one expert slot in the file's own bytes (`pool`, a one-slot host ExpertPool: 'gguf' rows as
    the file stores them, the same layout as the routed experts'). A shared expert reads its MoE layer's normed
    input and adds `scale * ffn(xn)` with scale = sigmoid(xn . gate) where the file has a shared-expert gate
    (qwen2moe's `ffn_gate_inp_shexp`), else 1. A dense block has its own FFN norm and adds ffn(rmsnorm(x)) before
    MoE layer `layer` (`layer` == the MoE layer count: after the last one).
    """

    kind: str                       # "shared" or "dense"
    layer: int                      # the MoE layer it belongs to (shared) or runs before (dense)
    block: int                      # its block in the file
    pool: ExpertPool                # one slot, the file's rows
    gate: np.ndarray | None = None  # [1, H] f32: the shared expert's sigmoid gate, or None (scale 1)
    norm: np.ndarray | None = None  # [H] f32: a dense block's FFN norm

    @property
    def key(self) -> str:
        """Its name among the dense device arrays: 'ffn.shared.3', 'ffn.dense.0'."""
        return f"ffn.{self.kind}.{self.block}"

    @property
    def fmt(self) -> ExpertFormat | None:
        """Its slot's format ('gguf' pools), None for an f16 pool."""
        return self.pool.formats[0] if self.pool.formats else None

    @property
    def device_arrays(self) -> dict[str, np.ndarray]:
        """name -> host array of what the device holds of it: the slot's arrays, then the gate or the norm."""
        out = {f"{self.key}.{n}": a for n, a in self.pool.arrays.items()}
        if self.gate is not None:
            out[f"{self.key}.gate"] = self.gate
        if self.norm is not None:
            out[f"{self.key}.norm"] = self.norm
        return out


@dataclass
class DenseWeights:
    """Non-expert weights, host side: embed [V,H], norms [L][H] f32, routers [L][E,H], final_norm [H], lm_head [V,H]."""

    embed: np.ndarray
    norms: list[np.ndarray]
    routers: list[np.ndarray]
    final_norm: np.ndarray
    lm_head: np.ndarray
    #: shared experts and dense FFN blocks, in the order they run (strata_core.runtime.dense_ffn computes them)
    ffns: list[DenseFfn] = field(default_factory=list)
    #: per MoE layer, the router's f32 bias [E] added to its logits before the top k (gpt-oss), or None; host side:
    #: the layer op uploads it tiled over the chunk's tokens, with its other per-chunk buffers
    router_biases: list[np.ndarray | None] = field(default_factory=list)

    @property
    def device_arrays(self) -> dict[str, np.ndarray]:
        """name -> host array of every dense weight the device holds (the embedding stays on the host)."""
        out = {f"norm.{i}": w for i, w in enumerate(self.norms)}
        out.update({f"router.{i}": w for i, w in enumerate(self.routers)})
        out["final_norm"] = self.final_norm
        out["lm_head"] = self.lm_head
        for f in self.ffns:
            out.update(f.device_arrays)
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
    #: lines a run prints about what of the model file it does not compute (router biases' kind, ...)
    notes: list[str] = field(default_factory=list)

    @property
    def vocab(self) -> int:
        """Vocabulary size."""
        return int(self.dense.embed.shape[0]) if self.dense is not None else self.spec.vocab


def weights_from_gguf(path: str | Path, spec: ModelSpec) -> ModelWeights:
    """Load a GGUF MoE model's weights: experts in their file's bytes (F16/BF16 files as an f16 pool), dense f32/f16."""
    from strata_core.models.gguf import read_moe_tensors
    t = read_moe_tensors(path, spec)
    dense = DenseWeights(embed=t.embed, norms=t.norms, routers=t.routers, final_norm=t.final_norm, lm_head=t.lm_head,
                         ffns=list(t.ffns), router_biases=list(t.router_biases))
    return ModelWeights(spec=spec, dense=dense, experts=t.experts, expert_ffn=t.expert_ffn, notes=list(t.notes))
