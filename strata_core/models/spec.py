"""ModelSpec: the shape and byte sizes of an MoE model, from presets, GGUF files or a scenario's inline block."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from strata_core.errors import BadInput


#: Bounds far above any published MoE model: a count beyond them is a corrupt file or a typo, not a model.
MODEL_LIMITS = {"moe_layers": 4096, "experts_per_layer": 1 << 16, "top_k": 1 << 10, "hidden": 1 << 18,
                "expert_ffn": 1 << 20, "vocab": 1 << 24, "slot_bytes": 1 << 40, "largest_blob_bytes": 1 << 40}


@dataclass(frozen=True)
class ModelSpec:
    """What the planner and runtime need to know of an MoE model. Bytes are ints."""

    name: str
    moe_layers: int
    experts_per_layer: int
    top_k: int
    hidden: int
    slot_bytes: int                 # average expert blob (all of one expert's tensors in one layer)
    largest_blob_bytes: int         # the largest such blob (a slot must hold it when streamed)
    prompt_bytes_per_token: int     # prompt-path device buffers per token of chunk
    dense_bytes: int = 0            # non-expert weights kept on the device
    kv_bytes_per_token: int = 0     # KV cache bytes per token of context kept on the device
    expert_ffn: int = 0             # expert FFN width (0 when unknown)
    arena_bytes: int = 0            # host arena holding every expert (0: experts_total_bytes)
    quant: str = "F16"
    vocab: int = 0
    source: str = "inline"          # 'preset', 'gguf:PATH', 'inline', 'tiny'
    expert_pool: str = ""           # the pool its experts load into: 'f16', 'q8_0', 'gguf' ('': as quant implies)

    @property
    def experts_total(self) -> int:
        """Experts over all MoE layers."""
        return self.moe_layers * self.experts_per_layer

    @property
    def experts_total_bytes(self) -> int:
        """Bytes of every expert blob."""
        return self.experts_total * self.slot_bytes

    @property
    def host_arena_bytes(self) -> int:
        """Bytes of the host arena that holds the experts."""
        return self.arena_bytes or self.experts_total_bytes

    def to_json(self) -> dict:
        """The inline model block of scenarios and plans."""
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict, where: str = "model") -> "ModelSpec":
        """Build from a scenario's inline `model` block, naming the missing field on bad input."""
        if not isinstance(d, dict):
            raise BadInput(f"{where}: expected an object")
        required = ("moe_layers", "experts_per_layer", "top_k", "hidden", "slot_bytes",
                    "largest_blob_bytes", "prompt_bytes_per_token")
        for k in required:
            if k not in d:
                raise BadInput(f"{where}: missing field '{k}'")
        for k in (*required, "dense_bytes", "kv_bytes_per_token", "expert_ffn", "arena_bytes", "vocab"):
            v = d.get(k, 0)
            if isinstance(v, bool) or not isinstance(v, int):  # int() would round 2.5 and read true as 1
                raise BadInput(f"{where}: '{k}' must be a whole number, got {v!r}")
        try:
            spec = cls(
                name=str(d.get("name", "inline")),
                moe_layers=int(d["moe_layers"]), experts_per_layer=int(d["experts_per_layer"]),
                top_k=int(d["top_k"]), hidden=int(d["hidden"]), slot_bytes=int(d["slot_bytes"]),
                largest_blob_bytes=int(d["largest_blob_bytes"]),
                prompt_bytes_per_token=int(d["prompt_bytes_per_token"]),
                dense_bytes=int(d.get("dense_bytes", 0)), kv_bytes_per_token=int(d.get("kv_bytes_per_token", 0)),
                expert_ffn=int(d.get("expert_ffn", 0)), arena_bytes=int(d.get("arena_bytes", 0)),
                quant=str(d.get("quant", "F16")), vocab=int(d.get("vocab", 0)),
                source=str(d.get("source", "inline")), expert_pool=str(d.get("expert_pool", "")),
            )
        except (TypeError, ValueError) as e:
            raise BadInput(f"{where}: {e}") from None
        spec.validate(where)
        return spec

    def validate(self, where: str = "model") -> None:
        """Raise BadInput on absurd values (non-positive counts, top-k above the expert count)."""
        for k in ("moe_layers", "experts_per_layer", "top_k", "hidden", "slot_bytes", "largest_blob_bytes"):
            if getattr(self, k) <= 0:
                raise BadInput(f"{where}: '{k}' must be positive, got {getattr(self, k)}")
        for k, most in MODEL_LIMITS.items():
            if getattr(self, k) > most:
                raise BadInput(f"{where}: '{k}' is {getattr(self, k):,}, beyond any MoE model (at most {most:,})")
        if self.top_k > self.experts_per_layer:
            raise BadInput(f"{where}: top_k {self.top_k} exceeds experts_per_layer {self.experts_per_layer}")
        if self.largest_blob_bytes < self.slot_bytes:
            raise BadInput(f"{where}: largest_blob_bytes {self.largest_blob_bytes} is below slot_bytes {self.slot_bytes}")
        for k in ("prompt_bytes_per_token", "dense_bytes", "kv_bytes_per_token", "expert_ffn", "arena_bytes"):
            if getattr(self, k) < 0:
                raise BadInput(f"{where}: '{k}' must not be negative")


#: Hidden-sized f32 activation buffers the prompt path keeps per token of chunk: the residual stream, its normed
#: copy, the attention output and the MoE accumulator.
ACTIVATION_BUFFERS = 4
F32_BYTES = 4

#: KV element cost relative to f16, as (numerator, denominator) so the math stays in ints. q8_0 carries one f16 scale
#: per 32 values (ggml's block_q8_0: 34 bytes per 32 values); int8 is one byte a value (its per-row scales are
#: negligible). The planner reads KV bytes through kv_bytes_per_token below.
KV_DTYPE_RATIO = {"f32": (4, 2), "f16": (1, 1), "bf16": (1, 1), "q8_0": (34, 64), "int8": (1, 2)}


def prompt_bytes_for(hidden: int, experts: int, top_k: int, expert_ffn: int) -> int:
    """Device bytes the prompt path needs per token of chunk (the formula is in the body, term by term).

    - ACTIVATION_BUFFERS x hidden f32 activations;
    - the router: experts f32 logits, then top_k (int32 id, f32 weight) pairs;
    - per routed row (top_k of them): the gathered input row and the expert's output row (hidden f32 each) and
      the gate and up intermediates (2 x expert_ffn f32).
    """
    activations = ACTIVATION_BUFFERS * hidden * F32_BYTES
    routing = experts * F32_BYTES + top_k * (4 + F32_BYTES)
    routed_rows = top_k * (2 * hidden + 2 * expert_ffn) * F32_BYTES
    return activations + routing + routed_rows


def shared_expert_bytes_per_token(hidden: int) -> int:
    """Device bytes a token of chunk adds where the MoE layers have a shared expert (strata_core.runtime.dense_ffn):
    the shared output (hidden f32), its row index (int32) and scale (f32), kept while the layer op runs."""
    return hidden * F32_BYTES + 4 + F32_BYTES


def kv_bytes_per_token(spec: ModelSpec, dtype: str) -> int:
    """KV bytes per token of context for a KV dtype; `spec.kv_bytes_per_token` is always counted at f16."""
    try:
        num, den = KV_DTYPE_RATIO[dtype.lower()]
    except KeyError:
        raise BadInput(f"kv.dtype: unknown KV dtype '{dtype}' (known: {', '.join(KV_DTYPE_RATIO)})") from None
    return -(-spec.kv_bytes_per_token * num // den)
