"""MoE models in GGUF files (through the gguf package): read a ModelSpec, load weights, write tiny test models.

Tensor names follow llama.cpp: `token_embd`, per layer `blk.N.attn_norm`, `blk.N.ffn_norm`, `blk.N.ffn_gate_inp`
(the router), `blk.N.ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps` (every expert of the layer stacked), then
`output_norm` and `output`, each with a `.weight` suffix. GGUF stores shapes in ggml order (fastest axis first);
everything this module returns is numpy order (row-major), which is the reverse:

    token_embd.weight          [vocab, hidden]
    blk.N.attn_norm.weight     [hidden]                 f32
    blk.N.ffn_norm.weight      [hidden]                 f32
    blk.N.ffn_gate_inp.weight  [experts, hidden]        f32 (llama.cpp never quantizes the router)
    blk.N.ffn_gate_exps.weight [experts, ffn, hidden]
    blk.N.ffn_up_exps.weight   [experts, ffn, hidden]
    blk.N.ffn_down_exps.weight [experts, hidden, ffn]
    output_norm.weight         [hidden]                 f32
    output.weight              [vocab, hidden]
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from strata_core.errors import BadInput
from strata_core.reference.kernels import QK8_0, quantize_q8_0
from strata_core.models.spec import ModelSpec, prompt_bytes_for

GGUF_MAGIC = b"GGUF"
TINY_ARCH = "strata-moe"
TINY_DTYPES = ("F16", "BF16", "Q8_0")

#: A tensor belongs to the experts when its name has an `_exps` part (gate, up, down, fused gate_up, their biases).
_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_[a-z_]+_exps\.")

Weight = Any  # np.ndarray, or (qs int8, d f16) for Q8_0


def _gguf():
    """The gguf package (a core dependency), imported where GGUF is used."""
    import gguf
    return gguf


def _open_reader(path: Path):
    """A GGUFReader for path, or BadInput saying why the file cannot be one."""
    gguf = _gguf()
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise BadInput(f"{path}: cannot read ({e.strerror or e})") from None
    if magic != GGUF_MAGIC:
        raise BadInput(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader reports truncation as ValueError, IndexError or struct errors
        raise BadInput(f"{path}: truncated or corrupt GGUF ({type(e).__name__}: {e})") from None
    size_bytes = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + int(t.n_bytes) > size_bytes:
            raise BadInput(f"{path}: truncated GGUF: tensor '{t.name}' ends at byte {t.data_offset + int(t.n_bytes)}"
                           f" of a {size_bytes}-byte file")
    return reader


def _field(reader, key: str) -> Any:
    """A scalar or string metadata value, or None when the key is absent."""
    f = reader.get_field(key)
    if f is None:
        return None
    v = f.contents()
    return v


def _numpy_shape(t) -> tuple[int, ...]:
    """A tensor's shape in numpy order (GGUF stores ggml order, fastest axis first)."""
    return tuple(int(d) for d in reversed(list(t.shape)))


def model_from_gguf(path: str | Path) -> ModelSpec:
    """The ModelSpec of an MoE GGUF file, with the exact bytes of its expert and dense tensors."""
    path = Path(path)
    reader = _open_reader(path)
    arch = _field(reader, "general.architecture")
    if not arch:
        raise BadInput(f"{path}: no 'general.architecture' key")
    experts = _field(reader, f"{arch}.expert_count")
    if not experts:
        raise BadInput(f"{path}: not an MoE model: no '{arch}.expert_count' key")
    experts = int(experts)
    top_k = _field(reader, f"{arch}.expert_used_count")
    if not top_k:
        raise BadInput(f"{path}: not an MoE model: no '{arch}.expert_used_count' key")

    per_layer_bytes: dict[int, int] = defaultdict(int)
    dense = 0
    quant_count: dict[str, int] = defaultdict(int)
    ffn = int(_field(reader, f"{arch}.expert_feed_forward_length") or 0)
    hidden = int(_field(reader, f"{arch}.embedding_length") or 0)
    vocab = 0
    for t in reader.tensors:
        m = _EXPERT_TENSOR.match(t.name)
        if m:
            per_layer_bytes[int(m.group(1))] += int(t.n_bytes)
            quant_count[t.tensor_type.name] += 1
            if not ffn and t.name.endswith("ffn_gate_exps.weight"):
                ffn = _numpy_shape(t)[1]
        else:
            dense += int(t.n_bytes)
            if t.name == "token_embd.weight":
                vocab, emb_hidden = _numpy_shape(t)[:2]
                hidden = hidden or emb_hidden
    if not per_layer_bytes:
        raise BadInput(f"{path}: not an MoE model: no expert tensors (blk.N.ffn_*_exps)")
    if not hidden:
        raise BadInput(f"{path}: no '{arch}.embedding_length' key and no token_embd tensor to read the hidden size")

    blobs = [-(-b // experts) for b in per_layer_bytes.values()]
    total_expert_bytes = sum(per_layer_bytes.values())
    moe_layers = len(per_layer_bytes)
    quant = max(quant_count, key=lambda q: (quant_count[q], q))
    spec = ModelSpec(
        name=str(_field(reader, "general.name") or path.stem), moe_layers=moe_layers, experts_per_layer=experts,
        top_k=int(top_k), hidden=hidden,
        slot_bytes=-(-total_expert_bytes // (moe_layers * experts)), largest_blob_bytes=max(blobs),
        prompt_bytes_per_token=prompt_bytes_for(hidden, experts, int(top_k), ffn),
        dense_bytes=dense, kv_bytes_per_token=_kv_bytes_per_token_f16(reader, arch, hidden),
        expert_ffn=ffn, quant=quant, vocab=int(vocab or _field(reader, f"{arch}.vocab_size") or 0),
        source=f"gguf:{path}",
    )
    spec.validate(str(path))
    return spec


def _kv_bytes_per_token_f16(reader, arch: str, hidden: int) -> int:
    """KV bytes per token of context at f16 from the attention keys (0 when the file gives no attention shape)."""
    layers = int(_field(reader, f"{arch}.block_count") or 0)
    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv")
    if not layers or not heads:
        return 0
    heads = int(np.max(heads))
    # head_count_kv may be one value or one per layer (hybrid models)
    kv_per_layer = np.broadcast_to(np.asarray(kv_heads if kv_heads is not None else heads), (layers,))
    key_len = int(_field(reader, f"{arch}.attention.key_length") or hidden // heads)
    value_len = int(_field(reader, f"{arch}.attention.value_length") or hidden // heads)
    return int(sum(int(k) for k in kv_per_layer)) * (key_len + value_len) * 2


def _q8_0_pack(w: np.ndarray) -> np.ndarray:
    """float [.., C] -> ggml Q8_0 bytes [.., C/32*34] (per block: f16 scale, then 32 int8), via the reference quantizer."""
    q, d = quantize_q8_0(w)
    blocks = q.reshape(*q.shape[:-1], q.shape[-1] // QK8_0, QK8_0)
    packed = np.concatenate([d[..., None].view(np.uint8).reshape(*d.shape, 2), blocks.view(np.uint8)], axis=-1)
    return np.ascontiguousarray(packed.reshape(*q.shape[:-1], -1))


def _q8_0_unpack(raw: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """ggml Q8_0 bytes -> (qs int8 [shape], d f16 [.., C/32]) in the layout of strata_core.reference.kernels."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(*shape[:-1], shape[-1] // QK8_0, 2 + QK8_0)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    qs = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(shape)
    return qs, np.ascontiguousarray(d)


def write_tiny_moe_gguf(path: str | Path, *, layers: int = 2, experts: int = 8, top_k: int = 2, hidden: int = 64,
                        ffn: int = 128, vocab: int = 256, dtype: str = "F16", seed: int = 0) -> Path:
    """Write a real MoE GGUF (arch 'strata-moe') with deterministic random weights; returns the path.

    Weights are drawn from N(0, 1/sqrt(fan_in)) so activations stay O(1) through the layers; norms are 1.
    """
    gguf = _gguf()
    dtype = dtype.upper()
    if dtype not in TINY_DTYPES:
        raise BadInput(f"dtype: '{dtype}' is not one of {', '.join(TINY_DTYPES)}")
    if min(layers, experts, top_k, hidden, ffn, vocab) <= 0 or top_k > experts:
        raise BadInput("write_tiny_moe_gguf: counts must be positive and top_k <= experts")
    if dtype == "Q8_0" and (hidden % QK8_0 or ffn % QK8_0):
        raise BadInput(f"Q8_0 needs hidden and ffn to be multiples of {QK8_0} (got {hidden}, {ffn})")
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[dtype]

    def matrix(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)

    path = Path(path)
    w = gguf.GGUFWriter(path, TINY_ARCH)
    w.add_name(f"strata tiny moe {layers}x{experts} top{top_k} h{hidden} f{ffn} {dtype}")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_expert_feed_forward_length(ffn)
    w.add_expert_count(experts)
    w.add_expert_used_count(top_k)
    w.add_head_count(max(1, hidden // 16))
    w.add_head_count_kv(max(1, hidden // 32))
    w.add_vocab_size(vocab)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type({"F16": 1, "BF16": 32, "Q8_0": 7}[dtype])

    def add(name: str, arr: np.ndarray, typed: bool) -> None:
        if not typed:
            w.add_tensor(name, arr.astype(np.float32))
        elif dtype == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        elif dtype == "BF16":
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, _q8_0_pack(arr), raw_dtype=qtype)

    add("token_embd.weight", matrix(vocab, hidden), True)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32), False)
        add(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32), False)
        add(f"blk.{i}.ffn_gate_inp.weight", matrix(experts, hidden), False)
        add(f"blk.{i}.ffn_gate_exps.weight", matrix(experts, ffn, hidden), True)
        add(f"blk.{i}.ffn_up_exps.weight", matrix(experts, ffn, hidden), True)
        add(f"blk.{i}.ffn_down_exps.weight", matrix(experts, hidden, ffn), True)
    add("output_norm.weight", np.ones(hidden, np.float32), False)
    add("output.weight", matrix(vocab, hidden), True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_gguf_weights(path: str | Path) -> dict[str, Weight]:
    """Every tensor of a GGUF file by name, in numpy order (see the module docstring), copied out of the file.

    F32 and F16 stay as they are; BF16 becomes f32; Q8_0 stays quantized as (qs int8 [.., C], d f16 [.., C/32]),
    the layout of strata_core.reference.kernels; any other quant type is dequantized to f32 by the gguf package.
    """
    gguf = _gguf()
    path = Path(path)
    reader = _open_reader(path)
    T = gguf.GGMLQuantizationType
    out: dict[str, Weight] = {}
    for t in reader.tensors:
        shape = _numpy_shape(t)
        if t.tensor_type in (T.F32, T.F16):
            out[t.name] = np.array(t.data).reshape(shape)
        elif t.tensor_type == T.Q8_0:
            out[t.name] = _q8_0_unpack(np.array(t.data), shape)
        else:
            out[t.name] = np.asarray(gguf.quants.dequantize(np.array(t.data), t.tensor_type),
                                     dtype=np.float32).reshape(shape)
    return out


def layer_expert_pool_arrays(weights: dict[str, Weight], layer: int) -> tuple[str, dict[str, np.ndarray]]:
    """One layer's experts as an ExpertPool's (dtype, arrays): gate and up stacked as w_gate_up [E, 2F, H].

    Q8_0 tensors give a 'q8_0' pool; every other type a 'f16' pool (BF16 and f32 are rounded to f16).
    """
    gate, up, down = (weights[f"blk.{layer}.ffn_{k}_exps.weight"] for k in ("gate", "up", "down"))
    if isinstance(gate, tuple):
        return "q8_0", {"gate_up_q": np.concatenate([gate[0], up[0]], axis=1),
                        "gate_up_d": np.concatenate([gate[1], up[1]], axis=1),
                        "down_q": down[0], "down_d": down[1]}
    return "f16", {"w_gate_up": np.concatenate([gate, up], axis=1).astype(np.float16),
                   "w_down": np.asarray(down).astype(np.float16)}
