"""ModelSpec: the shape and byte sizes of an MoE model, from presets, GGUF files or a scenario's inline block."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import BadInput


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
                source=str(d.get("source", "inline")),
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
        if self.top_k > self.experts_per_layer:
            raise BadInput(f"{where}: top_k {self.top_k} exceeds experts_per_layer {self.experts_per_layer}")
        if self.largest_blob_bytes < self.slot_bytes:
            raise BadInput(f"{where}: largest_blob_bytes {self.largest_blob_bytes} is below slot_bytes {self.slot_bytes}")
        for k in ("prompt_bytes_per_token", "dense_bytes", "kv_bytes_per_token", "expert_ffn", "arena_bytes"):
            if getattr(self, k) < 0:
                raise BadInput(f"{where}: '{k}' must not be negative")
