"""The built-in tiny MoE model: `strata run` with no arguments runs it on any machine in seconds.

Its shape is chosen so the prompt path really borrows from the cache: the seed ring policy gives chunks up to
4096 tokens a fixed 384-slot ring, so a cache must hold well over 512 slots before anything can be lent (it keeps
min_keep_slots for decode). 8 layers x 256 experts of hidden 128 and FFN 64 (48 KiB an f16 expert, 96 MiB in all)
give `strata run`'s default cache of half the experts (1024 slots) room to lend a 2560-token chunk's loan, and keep
a 3000-token prompt to a few GFLOP.
Weights are deterministic from a seed; there is no attention (out of scope for Strata Core).
"""

from __future__ import annotations

import numpy as np

from strata_core.reference.kernels import ExpertPool, quantize_q8_0
from strata_core.models.spec import ModelSpec, prompt_bytes_for
from strata_core.models.weights import DenseWeights, ModelWeights

TINY_LAYERS = 8
TINY_EXPERTS = 256
TINY_TOP_K = 4
TINY_HIDDEN = 128
TINY_FFN = 64
TINY_VOCAB = 2048
#: `strata run` gives the tiny model a cache of this fraction of its experts unless memory.expert_cache is set,
#: so misses, loans and the ring run every time even where every expert would fit.
TINY_CACHE_FRACTION = 0.5


def device_dense_bytes(layers: int, experts: int, hidden: int, vocab: int) -> int:
    """Device bytes of the dense weights: f32 norms and routers per layer, f32 final norm, f16 LM head."""
    return layers * (hidden * 4 + experts * hidden * 4) + hidden * 4 + vocab * hidden * 2


def model_spec(name: str, layers: int, experts: int, top_k: int, hidden: int, ffn: int, vocab: int,
               dtype: str = "f16", source: str = "tiny") -> ModelSpec:
    """The ModelSpec of a generated model of this shape (f16 or q8_0 experts)."""
    slot = ExpertPool.slot_bytes(dtype, hidden, ffn)
    return ModelSpec(name=name, moe_layers=layers, experts_per_layer=experts, top_k=top_k, hidden=hidden,
                     slot_bytes=slot, largest_blob_bytes=slot,
                     prompt_bytes_per_token=prompt_bytes_for(hidden, experts, top_k, ffn),
                     dense_bytes=device_dense_bytes(layers, experts, hidden, vocab), kv_bytes_per_token=0,
                     expert_ffn=ffn, quant="F16" if dtype == "f16" else "Q8_0", vocab=vocab, source=source)


def tiny_model_spec() -> ModelSpec:
    """The tiny model's ModelSpec (source 'tiny')."""
    return model_spec("strata-tiny", TINY_LAYERS, TINY_EXPERTS, TINY_TOP_K, TINY_HIDDEN, TINY_FFN, TINY_VOCAB)


def tiny_cache_slots(spec: ModelSpec) -> int:
    """The default expert cache of `strata run`'s tiny model: about half its experts."""
    return max(spec.top_k, int(spec.experts_total * TINY_CACHE_FRACTION))


def generate_weights(spec: ModelSpec, seed: int = 0, dtype: str = "f16") -> ModelWeights:
    """Deterministic weights of spec's shape: N(0, 1/sqrt(fan_in)) matrices, unit norms, f16 or q8_0 experts."""
    if spec.expert_ffn <= 0:
        raise ValueError("generate_weights needs the model's expert_ffn")
    rng = np.random.default_rng(seed)
    L, E, H, F, V = spec.moe_layers, spec.experts_per_layer, spec.hidden, spec.expert_ffn, max(spec.vocab, 2)

    def matrix(*shape: int) -> np.ndarray:
        """A random [.., fan_in] matrix scaled by 1/sqrt(fan_in), so activations stay O(1)."""
        return rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1]))

    rows = L * E
    gate_up = np.empty((rows, 2 * F, H), np.float16)
    down = np.empty((rows, H, F), np.float16)
    for r0 in range(0, rows, 256):  # in blocks so the f32 temporaries stay small for large presets
        r1 = min(rows, r0 + 256)
        gate_up[r0:r1] = matrix(r1 - r0, 2 * F, H)
        down[r0:r1] = matrix(r1 - r0, H, F)
    if dtype == "f16":
        experts = ExpertPool("f16", {"w_gate_up": gate_up, "w_down": down})
    else:
        gq, gd = quantize_q8_0(gate_up)
        dq, dd = quantize_q8_0(down)
        experts = ExpertPool("q8_0", {"gate_up_q": gq, "gate_up_d": gd, "down_q": dq, "down_d": dd})
    routers = [matrix(E, H) for _ in range(L)]
    dense = DenseWeights(embed=matrix(V, H).astype(np.float16) * np.float16(4.0),
                         norms=[np.ones(H, np.float32) for _ in range(L)], routers=routers,
                         final_norm=np.ones(H, np.float32), lm_head=matrix(V, H).astype(np.float16))
    return ModelWeights(spec=spec, dense=dense, experts=experts, expert_ffn=F)
