"""The weights the executor runs: dense (embeddings, per-layer RMSNorm and router, final norm, LM head) and experts.

Experts of every MoE layer sit in one host `ExpertPool` of layers x experts rows (row = layer * experts + expert),
f16 or Q8_0. The model has no attention (out of scope for Strata Core): each MoE layer is
x += sum_k w_k * expert_k(rmsnorm(x)), routed by softmax over the router's top k.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from strata_core.errors import BadInput
from strata_core.reference.kernels import ExpertPool, dequantize_q8_0
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

    @property
    def vocab(self) -> int:
        """Vocabulary size."""
        return int(self.dense.embed.shape[0]) if self.dense is not None else self.spec.vocab


def _as_f16(w: Any) -> np.ndarray:
    """A dense weight as f16 (Q8_0 pairs dequantized)."""
    if isinstance(w, tuple):
        return dequantize_q8_0(*w)
    return np.asarray(w).astype(np.float16)


def weights_from_gguf(path: str | Path, spec: ModelSpec) -> ModelWeights:
    """Load a GGUF MoE model's weights (F16, BF16 and Q8_0 experts; BF16 becomes f16 for the pool)."""
    from strata_core.models.gguf import layer_expert_pool_arrays, load_gguf_weights
    w = load_gguf_weights(path)
    need = ["token_embd.weight", "output_norm.weight"]
    missing = [n for n in need if n not in w]
    if missing:
        raise BadInput(f"{path}: missing tensor(s) {', '.join(missing)}")
    layers = []
    dtype = None
    for i in range(spec.moe_layers):
        try:
            d, arrays = layer_expert_pool_arrays(w, i)
        except KeyError as e:
            raise BadInput(f"{path}: layer {i} has no expert tensor {e}") from None
        if dtype not in (None, d):
            raise BadInput(f"{path}: layer {i} experts are {d}, earlier layers {dtype}: mixed expert types")
        dtype = d
        layers.append(arrays)
    experts = ExpertPool(dtype=dtype, arrays={k: np.ascontiguousarray(np.concatenate([a[k] for a in layers]))
                                              for k in layers[0]})
    ffn = int(experts.arrays["w_down" if dtype == "f16" else "down_q"].shape[2])
    norms, routers = [], []
    for i in range(spec.moe_layers):
        norm = w.get(f"blk.{i}.ffn_norm.weight", w.get(f"blk.{i}.attn_norm.weight"))
        router = w.get(f"blk.{i}.ffn_gate_inp.weight")
        if norm is None or router is None:
            raise BadInput(f"{path}: layer {i} lacks its ffn_norm or router (ffn_gate_inp) tensor")
        norms.append(np.asarray(norm, dtype=np.float32))
        routers.append(np.asarray(router, dtype=np.float32) if not isinstance(router, tuple) else
                       dequantize_q8_0(*router).astype(np.float32))
    head = w.get("output.weight", w["token_embd.weight"])  # tied embeddings when there is no output tensor
    dense = DenseWeights(embed=_as_f16(w["token_embd.weight"]), norms=norms, routers=routers,
                         final_norm=np.asarray(w["output_norm.weight"], dtype=np.float32), lm_head=_as_f16(head))
    return ModelWeights(spec=spec, dense=dense, experts=experts, expert_ffn=ffn)
