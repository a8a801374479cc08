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

Architectures are read by `general.architecture` as llama.cpp's converter writes them: qwen3moe, olmoe, llama
(mixtral: a llama with expert tensors), qwen2moe (a shared expert, `ffn_*_shexp`), deepseek2 (shared experts and
`leading_dense_block_count` dense FFN blocks before the MoE ones), gpt-oss (MXFP4 experts with f32 biases
`ffn_*_exps.bias`; its FFN norm is `post_attention_norm`). Attention tensors are read past. The MoE layers are the
blocks with expert tensors, in block order. Shared experts (`ffn_{gate,up,down}_shexp`, qwen2moe's sigmoid gate
`ffn_gate_inp_shexp`) and dense FFN blocks (`ffn_{gate,up,down}` of a block without experts) are read as one-slot
pools of the file's own rows (`DenseFfn`) and computed by strata_core.runtime.dense_ffn; a router bias
(`ffn_gate_inp.bias`, gpt-oss) is added to the router's logits before the top k. What the engine reads but does not
compute (deepseek's `exp_probs_b` selection bias) `moe_file_notes` names in one line.

Expert tensors stay in their file's bytes: all-Q8_0 experts make a 'q8_0' pool, all-F16 ones an 'f16' pool,
anything else (Q4_K, Q5_K, Q6_K, MXFP4, BF16, F32, mixes such as Q4_K_M's) a 'gguf' pool whose slots hold the GGUF
rows as they are (strata_core.api.kernels.ExpertFormat), so a BF16 or F32 file is no longer rounded to f16. A tensor the engine reads in a type outside SUPPORTED_TYPES (the
IQ formats, ...) is refused when the file is read, before anything is allocated.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from strata_core.api.kernels import ExpertFormat, ExpertPool
from strata_core.errors import BadInput
from strata_core.reference import quants
from strata_core.reference.kernels import QK8_0, quantize_q8_0
from strata_core.models.presets import expert_types
from strata_core.models.spec import ModelSpec, prompt_bytes_for, shared_expert_bytes_per_token
from strata_core.models.weights import DenseFfn

GGUF_MAGIC = b"GGUF"
TINY_ARCH = "strata-moe"
TINY_DTYPES = ("F16", "BF16", "Q8_0")

#: A tensor belongs to the experts when its name has an `_exps` part (gate, up, down, fused gate_up, their biases).
_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_[a-z_]+_exps\.")
#: Tensors of a shared expert or a dense FFN block (computed as dense weights: strata_core.runtime.dense_ffn).
_DENSE_FFN_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)(_shexp)?\.weight$|^blk\.(\d+)\.ffn_gate_inp_shexp\.weight$")
#: GGUF tensor types the engine computes (expert tensors and the dense tensors it reads); others are refused.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
#: Architectures this module reads (general.architecture as llama.cpp's converter writes it; mixtral is 'llama').
ARCHITECTURES = ("qwen3moe", "qwen2moe", "llama", "deepseek2", "gpt-oss", "olmoe", TINY_ARCH)
#: The FFN norm of a block, first name present wins (gpt-oss has no ffn_norm: its post_attention_norm is that norm).
_NORM_NAMES = ("ffn_norm", "post_attention_norm", "attn_norm")

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


def _type_name(t) -> str:
    """A tensor's GGUF type name ('Q4_K', 'IQ2_XXS', ...)."""
    return t.tensor_type.name


def moe_blocks(tensors: dict[str, Any]) -> list[int]:
    """The block ids that hold expert tensors (the MoE layers), ascending."""
    return sorted(int(m.group(1)) for n in tensors
                  if (m := re.match(r"^blk\.(\d+)\.ffn_gate_exps\.weight$", n)))


def _block_tensor(tensors: dict[str, Any], block: int, names: tuple[str, ...]) -> Any:
    """The first of blk.{block}.{name}.weight present, or None."""
    for n in names:
        t = tensors.get(f"blk.{block}.{n}.weight")
        if t is not None:
            return t
    return None


def _read_tensor_names(tensors: dict[str, Any], blocks: list[int]) -> list[str]:
    """Every tensor the engine reads: expert tensors, embedding, head, final norm, each MoE block's norm and router."""
    names = [n for n in tensors if _EXPERT_TENSOR.match(n)]
    names += [n for n in ("token_embd.weight", "output.weight", "output_norm.weight") if n in tensors]
    for b in blocks:
        for t in (_block_tensor(tensors, b, _NORM_NAMES), tensors.get(f"blk.{b}.ffn_gate_inp.weight")):
            if t is not None:
                names.append(t.name)
    names += [n for n in tensors if _DENSE_FFN_TENSOR.match(n)]
    return names


def check_tensor_types(path: Path, tensors: dict[str, Any], blocks: list[int]) -> None:
    """BadInput naming the first tensor the engine reads whose type it does not compute (IQ formats, ...)."""
    for name in _read_tensor_names(tensors, blocks):
        kind = _type_name(tensors[name])
        if kind not in SUPPORTED_TYPES:
            raise BadInput(f"{path}: tensor '{name}' is {kind}, a type Strata Core does not run (supported: "
                           f"{', '.join(SUPPORTED_TYPES)})")


def expert_layout(path: Path, tensors: dict[str, Any], blocks: list[int],
                  experts: int) -> tuple[str, tuple[ExpertFormat, ...]]:
    """(pool dtype, one ExpertFormat per MoE layer for a 'gguf' pool, else ()) of a file's expert tensors."""
    if any(n.endswith("ffn_gate_up_exps.weight") for n in tensors):
        raise BadInput(f"{path}: fused ffn_gate_up_exps expert tensors are not read (llama.cpp's converter writes "
                       "ffn_gate_exps and ffn_up_exps)")
    formats = []
    for b in blocks:
        g, u, d = (tensors.get(f"blk.{b}.ffn_{k}_exps.weight") for k in ("gate", "up", "down"))
        if u is None or d is None:
            raise BadInput(f"{path}: block {b} has ffn_gate_exps but no ffn_{'up' if u is None else 'down'}_exps")
        if _type_name(g) != _type_name(u):
            raise BadInput(f"{path}: block {b}: ffn_gate_exps is {_type_name(g)} but ffn_up_exps {_type_name(u)}; "
                           "gate and up rows must share a type")
        e, ffn, hidden = _numpy_shape(g)
        if e != experts or _numpy_shape(u) != (e, ffn, hidden) or _numpy_shape(d) != (e, hidden, ffn):
            raise BadInput(f"{path}: block {b}: expert tensor shapes {_numpy_shape(g)}, {_numpy_shape(u)}, "
                           f"{_numpy_shape(d)} do not make {experts} experts of [ffn, hidden] / [hidden, ffn]")
        bias = [f"blk.{b}.ffn_{k}_exps.bias" in tensors for k in ("gate", "up", "down")]
        if any(bias) and not all(bias):
            raise BadInput(f"{path}: block {b} has biases for some expert tensors only")
        try:
            formats.append(ExpertFormat(_type_name(g).lower(), _type_name(d).lower(), hidden, ffn, all(bias)))
            formats[-1].nbytes  # noqa: B018  (raises for rows that are not whole blocks)
        except ValueError as err:
            raise BadInput(f"{path}: block {b}: {err}") from None
    types = {f.gate_up for f in formats} | {f.down for f in formats}
    if not any(f.bias for f in formats):
        if types == {"q8_0"}:
            return "q8_0", ()
        if types == {"f16"}:
            return "f16", ()
    return "gguf", tuple(formats)


def model_from_gguf(path: str | Path) -> ModelSpec:
    """The ModelSpec of an MoE GGUF file, with the exact bytes of its expert and dense tensors.

    Refuses (BadInput) a tensor the engine reads in a type it does not compute, before anything is allocated. A
    'gguf' pool's slot bytes are its largest layer's expert (a layer of smaller rows leaves the rest of its slot
    unused), which is what the host store, the cache slots and the ring hold.
    """
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
    tensors = {t.name: t for t in reader.tensors}
    blocks = moe_blocks(tensors)
    check_tensor_types(path, tensors, blocks)

    per_layer_bytes: dict[int, int] = defaultdict(int)
    dense = 0
    quant_count: dict[str, int] = defaultdict(int)
    ffn = 0
    hidden = int(_field(reader, f"{arch}.embedding_length") or 0)
    vocab = 0
    for t in reader.tensors:
        m = _EXPERT_TENSOR.match(t.name)
        if m:
            per_layer_bytes[int(m.group(1))] += int(t.n_bytes)
            if t.name.endswith(".weight"):
                quant_count[t.tensor_type.name] += 1
            if not ffn and t.name.endswith("ffn_gate_exps.weight"):
                ffn = _numpy_shape(t)[1]
        else:
            dense += int(t.n_bytes)
            if t.name == "token_embd.weight":
                vocab, emb_hidden = _numpy_shape(t)[:2]
                hidden = hidden or emb_hidden
    if not per_layer_bytes or not blocks:
        raise BadInput(f"{path}: not an MoE model: no expert tensors (blk.N.ffn_*_exps)")
    if not hidden:
        raise BadInput(f"{path}: no '{arch}.embedding_length' key and no token_embd tensor to read the hidden size")
    # a file without every block's up and down tensors is planned from its bytes; loading it refuses (read_moe_tensors)
    complete = all(f"blk.{b}.ffn_{k}_exps.weight" in tensors for b in blocks for k in ("up", "down"))
    kind, formats = expert_layout(path, tensors, blocks, experts) if complete else ("", ())

    blobs = [-(-b // experts) for b in per_layer_bytes.values()]
    total_expert_bytes = sum(per_layer_bytes.values())
    moe_layers = len(blocks)
    slot_bytes = -(-total_expert_bytes // (moe_layers * experts))
    if kind == "gguf":
        slot_bytes = ExpertPool.slot_bytes(kind, hidden, ffn, formats)
    quant = max(quant_count, key=lambda q: (quant_count[q], q))
    spec = ModelSpec(
        name=str(_field(reader, "general.name") or path.stem), moe_layers=moe_layers, experts_per_layer=experts,
        top_k=int(top_k), hidden=hidden,
        slot_bytes=slot_bytes, largest_blob_bytes=max(max(blobs), slot_bytes),
        prompt_bytes_per_token=prompt_bytes_for(hidden, experts, int(top_k), ffn)
        + (shared_expert_bytes_per_token(hidden) if any(n.endswith("_shexp.weight") for n in tensors) else 0),
        dense_bytes=dense, kv_bytes_per_token=_kv_bytes_per_token_f16(reader, arch, hidden),
        expert_ffn=ffn, quant=quant, vocab=int(vocab or _field(reader, f"{arch}.vocab_size") or 0),
        source=f"gguf:{path}", expert_pool=kind,
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


#: What write_moe_gguf puts in a file of each architecture beside its routed experts (llama.cpp's tensor names).
ARCH_EXTRAS: dict[str, dict[str, Any]] = {
    "qwen3moe": {}, "olmoe": {}, "llama": {},
    "qwen2moe": {"shared": True},
    "deepseek2": {"shared": True, "leading_dense": 1},
    "gpt-oss": {"bias": True, "norm": "post_attention_norm"},
}


def q4_k_m_down_types(layers: int) -> list[str]:
    """The down type per layer of a llama.cpp Q4_K_M file: Q6_K where use_more_bits(i, n) holds, else Q4_K."""
    return [expert_types("Q4_K_M", i, layers)[1].lower() for i in range(layers)]


def write_moe_gguf(path: str | Path, *, arch: str = "qwen3moe", layers: int = 2, experts: int = 8, top_k: int = 2,
                   hidden: int = 256, ffn: int = 256, vocab: int = 64, gate_up: str = "q4_k",
                   down: str | list[str] = "q6_k", embed_type: str = "q4_k", head_type: str = "q6_k",
                   seed: int = 0, zero_ffns: bool = False) -> Path:
    """Write a real MoE GGUF of architecture `arch` as llama.cpp's converter names it, quantized by
    strata_core.reference.quants into raw GGUF tensors (Q4_K_M-style by default: gate/up Q4_K, down Q6_K).

    `down` may be one type per MoE layer. Attention tensors (small, to be read past), the architecture's shared
    experts, leading dense FFN blocks and biases (ARCH_EXTRAS) are written too. `zero_ffns`: the shared experts' and
    dense blocks' down rows are zero (they add nothing; every other tensor is the same draw). Returns the path.
    """
    gguf = _gguf()
    if arch not in ARCH_EXTRAS:
        raise BadInput(f"write_moe_gguf: arch '{arch}' is not one of {', '.join(ARCH_EXTRAS)}")
    extra = ARCH_EXTRAS[arch]
    downs = [down] * layers if isinstance(down, str) else list(down)
    if len(downs) != layers:
        raise BadInput(f"write_moe_gguf: {len(downs)} down types for {layers} layers")
    lead = int(extra.get("leading_dense", 0))
    rng = np.random.default_rng(seed)

    def matrix(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(np.float32)

    path = Path(path)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"strata test {arch} {layers}x{experts} top{top_k} h{hidden} f{ffn} {gate_up}/{downs[0]}")
    w.add_block_count(layers + lead)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(2 * ffn)
    w.add_expert_feed_forward_length(ffn)
    w.add_expert_count(experts)
    w.add_expert_used_count(top_k)
    heads = max(1, hidden // 64)
    w.add_head_count(heads)
    w.add_head_count_kv(max(1, heads // 2))
    w.add_vocab_size(vocab)
    w.add_layer_norm_rms_eps(1e-6)
    if lead:
        w.add_leading_dense_block_count(lead)
    if extra.get("shared"):
        w.add_expert_shared_count(1)
        w.add_expert_shared_feed_forward_length(ffn)

    def add(name: str, arr: np.ndarray, kind: str = "f32") -> None:
        if kind == "f32":
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        else:
            w.add_tensor(name, quants.quantize(kind, arr), raw_dtype=gguf.GGMLQuantizationType[kind.upper()])

    add("token_embd.weight", matrix(vocab, hidden), embed_type)
    for b in range(layers + lead):
        add(f"blk.{b}.attn_norm.weight", np.ones(hidden, np.float32))
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            add(f"blk.{b}.{t}.weight", matrix(hidden, hidden), "q8_0")
        add(f"blk.{b}.{extra.get('norm', 'ffn_norm')}.weight",
            (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        if b < lead:
            add(f"blk.{b}.ffn_gate.weight", matrix(2 * ffn, hidden), gate_up)
            add(f"blk.{b}.ffn_up.weight", matrix(2 * ffn, hidden), gate_up)
            add(f"blk.{b}.ffn_down.weight", matrix(hidden, 2 * ffn) * (0 if zero_ffns else 1), "q6_k")
            continue
        i = b - lead
        add(f"blk.{b}.ffn_gate_inp.weight", matrix(experts, hidden))
        add(f"blk.{b}.ffn_gate_exps.weight", matrix(experts, ffn, hidden), gate_up)
        add(f"blk.{b}.ffn_up_exps.weight", matrix(experts, ffn, hidden), gate_up)
        add(f"blk.{b}.ffn_down_exps.weight", matrix(experts, hidden, ffn), downs[i])
        if extra.get("bias"):
            add(f"blk.{b}.ffn_gate_inp.bias", 0.1 * rng.standard_normal(experts).astype(np.float32))
            add(f"blk.{b}.ffn_gate_exps.bias", 0.1 * rng.standard_normal((experts, ffn)).astype(np.float32))
            add(f"blk.{b}.ffn_up_exps.bias", 0.1 * rng.standard_normal((experts, ffn)).astype(np.float32))
            add(f"blk.{b}.ffn_down_exps.bias", 0.1 * rng.standard_normal((experts, hidden)).astype(np.float32))
            add(f"blk.{b}.attn_sinks.weight", np.zeros(heads, np.float32))
        if extra.get("shared"):
            add(f"blk.{b}.ffn_gate_shexp.weight", matrix(ffn, hidden), gate_up)
            add(f"blk.{b}.ffn_up_shexp.weight", matrix(ffn, hidden), gate_up)
            add(f"blk.{b}.ffn_down_shexp.weight", matrix(hidden, ffn) * (0 if zero_ffns else 1), "q6_k")
            if arch == "qwen2moe":
                add(f"blk.{b}.ffn_gate_inp_shexp.weight", matrix(1, hidden))
    add("output_norm.weight", np.ones(hidden, np.float32))
    add("output.weight", matrix(vocab, hidden), head_type)
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


def tensor_f32(t) -> np.ndarray:
    """A GGUF tensor of any SUPPORTED_TYPES type as float32 in numpy order (for dense tensors: small, host side)."""
    shape = _numpy_shape(t)
    kind = _type_name(t)
    if kind == "F32":
        return np.array(t.data, dtype=np.float32).reshape(shape)
    raw = np.ascontiguousarray(np.asarray(t.data)).view(np.uint8).reshape(-1)
    n = shape[-1]
    return quants.dequantize(kind.lower(), raw.reshape(-1, quants.row_bytes(kind.lower(), n)), n).reshape(shape)


def _expert_bytes(t, experts: int) -> np.ndarray:
    """An expert tensor's bytes as they are in the file, one row of bytes per expert [E, bytes]."""
    return np.ascontiguousarray(np.asarray(t.data)).view(np.uint8).reshape(experts, -1)


@dataclass
class MoeTensors:
    """What the engine reads of an MoE GGUF file: the host expert pool, the dense tensors, and what it leaves out."""

    experts: ExpertPool
    expert_ffn: int
    embed: np.ndarray
    lm_head: np.ndarray
    final_norm: np.ndarray
    norms: list[np.ndarray]
    routers: list[np.ndarray]
    blocks: list[int]
    notes: list[str] = field(default_factory=list)
    #: shared experts and dense FFN blocks, in the order they run
    ffns: list[DenseFfn] = field(default_factory=list)
    #: per MoE layer, the router's f32 bias [E] (gpt-oss's ffn_gate_inp.bias), or None
    router_biases: list[np.ndarray | None] = field(default_factory=list)


def _expert_pool(path: Path, tensors: dict[str, Any], blocks: list[int], experts: int, kind: str,
                 formats: tuple[ExpertFormat, ...]) -> ExpertPool:
    """The host pool of every MoE layer's experts (row = layer * experts + expert), in the file's bytes."""
    ts = [[tensors[f"blk.{b}.ffn_{k}_exps.weight"] for k in ("gate", "up", "down")] for b in blocks]
    if kind == "q8_0":
        parts = []
        for g, u, d in ts:
            (gq, gd), (uq, ud), (dq, dd) = (_q8_0_unpack(np.asarray(t.data), _numpy_shape(t)) for t in (g, u, d))
            parts.append((np.concatenate([gq, uq], axis=1), np.concatenate([gd, ud], axis=1), dq, dd))
        names = ("gate_up_q", "gate_up_d", "down_q", "down_d")
        return ExpertPool("q8_0", {n: np.ascontiguousarray(np.concatenate([p[j] for p in parts]))
                                   for j, n in enumerate(names)})
    if kind == "f16":
        gu = np.concatenate([np.concatenate([tensor_f32(g), tensor_f32(u)], axis=1).astype(np.float16)
                             for g, u, _ in ts])
        down = np.concatenate([tensor_f32(d).astype(np.float16) for _, _, d in ts])
        return ExpertPool("f16", {"w_gate_up": np.ascontiguousarray(gu), "w_down": np.ascontiguousarray(down)})
    slot = ExpertPool.slot_bytes("gguf", 0, 0, formats)
    blob = np.zeros((len(blocks) * experts, slot), dtype=np.uint8)
    for i, (b, (g, u, d), fmt) in enumerate(zip(blocks, ts, formats)):
        rows = blob[i * experts:(i + 1) * experts]
        half = fmt.down_offset // 2
        rows[:, :half] = _expert_bytes(g, experts)
        rows[:, half:fmt.down_offset] = _expert_bytes(u, experts)
        rows[:, fmt.down_offset:fmt.bias_offset] = _expert_bytes(d, experts)
        if fmt.bias:
            bias = np.concatenate([tensor_f32(tensors[f"blk.{b}.ffn_{k}_exps.bias"]).reshape(experts, -1)
                                   for k in ("gate", "up", "down")], axis=1).astype("<f4")
            rows[:, fmt.bias_offset:fmt.nbytes] = bias.view(np.uint8)
    return ExpertPool("gguf", {"blob": blob}, formats)


def _raw_bytes(t) -> np.ndarray:
    """A tensor's bytes as the file stores them, flat."""
    return np.ascontiguousarray(np.asarray(t.data)).view(np.uint8).reshape(-1)


def _ffn_format(path: Path, where: str, g, u, d) -> ExpertFormat:
    """The one-slot layout of an FFN's gate [F,H], up [F,H] and down [H,F] tensors: the file's row types (gate
    and up of different types as f32 rows, since a slot's gate and up rows share one type)."""
    ffn, hidden = _numpy_shape(g)
    if _numpy_shape(u) != (ffn, hidden) or _numpy_shape(d) != (hidden, ffn):
        raise BadInput(f"{path}: {where}: gate/up/down shapes {_numpy_shape(g)}, {_numpy_shape(u)}, "
                       f"{_numpy_shape(d)} do not make one FFN of [ffn, hidden] / [hidden, ffn]")
    tg, tu, td = (_type_name(t).lower() for t in (g, u, d))
    try:
        fmt = ExpertFormat(tg if tg == tu else "f32", td, hidden, ffn)
        fmt.nbytes  # noqa: B018  (raises for rows that are not whole blocks)
    except ValueError as err:
        raise BadInput(f"{path}: {where}: {err}") from None
    return fmt


def _ffn_pool(path: Path, where: str, g, u, d) -> ExpertPool:
    """One FFN's gate, up and down tensors as a one-slot 'gguf' pool of the file's own rows (the routed experts'
    slot layout, `_ffn_format`)."""
    fmt = _ffn_format(path, where, g, u, d)
    if _type_name(g) == _type_name(u):
        gu = np.concatenate([_raw_bytes(g), _raw_bytes(u)])
    else:
        gu = np.concatenate([tensor_f32(g), tensor_f32(u)]).astype("<f4").view(np.uint8).reshape(-1)
    blob = np.zeros((1, fmt.nbytes), dtype=np.uint8)
    blob[0, :fmt.down_offset] = gu
    blob[0, fmt.down_offset:] = _raw_bytes(d)
    return ExpertPool("gguf", {"blob": blob}, (fmt,))


def _dense_ffn_tensors(path: Path, tensors: dict[str, Any], blocks: list[int]) -> list[tuple[int, bool, tuple]]:
    """(block, is a shared expert, (gate, up, down) tensors) of every shared expert and dense FFN block, by block."""
    moe = set(blocks)
    ids = sorted({int(m.group(1) or m.group(4)) for n in tensors if (m := _DENSE_FFN_TENSOR.match(n))})
    out = []
    for b in ids:
        shared = b in moe
        suffix = "_shexp" if shared else ""
        gud = tuple(tensors.get(f"blk.{b}.ffn_{k}{suffix}.weight") for k in ("gate", "up", "down"))
        if any(t is None for t in gud):
            if not shared and all(t is None for t in gud):
                continue
            raise BadInput(f"{path}: block {b} has some of ffn_gate{suffix}, ffn_up{suffix}, ffn_down{suffix} only")
        out.append((b, shared, gud))
    return out


def dense_ffn_device_bytes(path: str | Path) -> int:
    """Device bytes of a file's shared experts and dense FFN blocks as the runtime uploads them (`DenseFfn`: one
    slot of the file's rows each, a shared gate [H] or a block's norm [H] in f32), from the header only."""
    path = Path(path)
    tensors = {t.name: t for t in _open_reader(path).tensors}
    total = 0
    for b, shared, (g, u, d) in _dense_ffn_tensors(path, tensors, moe_blocks(tensors)):
        fmt = _ffn_format(path, f"block {b}", g, u, d)
        has_vector = (f"blk.{b}.ffn_gate_inp_shexp.weight" in tensors) if shared else True
        total += fmt.nbytes + (4 * fmt.hidden if has_vector else 0)
    return total


def read_dense_ffns(path: Path, tensors: dict[str, Any], blocks: list[int]) -> list[DenseFfn]:
    """The file's shared experts and dense FFN blocks as DenseFfn, in the order they run."""
    moe = {b: i for i, b in enumerate(blocks)}
    out = []
    for b, shared, (g, u, d) in _dense_ffn_tensors(path, tensors, blocks):
        where = f"block {b} {'shared expert' if shared else 'dense FFN'}"
        pool = _ffn_pool(path, where, g, u, d)
        hidden = pool.formats[0].hidden
        if shared:
            gate_t = tensors.get(f"blk.{b}.ffn_gate_inp_shexp.weight")
            gate = None if gate_t is None else tensor_f32(gate_t).reshape(1, hidden)
            out.append(DenseFfn("shared", moe[b], b, pool, gate=gate))
        else:
            norm = _block_tensor(tensors, b, _NORM_NAMES)
            if norm is None:
                raise BadInput(f"{path}: {where} lacks its FFN norm ({' or '.join(_NORM_NAMES)})")
            layer = sum(1 for m in blocks if m < b)
            out.append(DenseFfn("dense", layer, b, pool, norm=tensor_f32(norm).reshape(-1)))
    # a dense block runs before the shared expert of the MoE layer it precedes; blocks in file order otherwise
    out.sort(key=lambda f: (f.layer, f.kind != "dense", f.block))
    return out


def moe_file_notes(path: Path, arch: str, tensors: dict[str, Any], blocks: list[int]) -> list[str]:
    """One line naming what of the file's FFN tensors this engine reads but does not compute (deepseek's
    `exp_probs_b` expert-selection bias, shared-expert biases), or no line. Shared experts, dense FFN blocks and
    gpt-oss's router bias are computed."""
    left = [n for n in ("exp_probs_b.bias", "_shexp.bias") if any(t.endswith(n) for t in tensors)]
    if not left:
        return []
    return [f"{path.name} ({arch}): not computed: {', '.join(left)} (run as if zero)"]


def read_moe_tensors(path: str | Path, spec: ModelSpec | None = None) -> MoeTensors:
    """The tensors the engine runs of an MoE GGUF file (experts in their own bytes; see the module docstring)."""
    path = Path(path)
    reader = _open_reader(path)
    arch = str(_field(reader, "general.architecture") or "")
    tensors = {t.name: t for t in reader.tensors}
    blocks = moe_blocks(tensors)
    if not blocks:
        raise BadInput(f"{path}: not an MoE model: no expert tensors (blk.N.ffn_*_exps)")
    check_tensor_types(path, tensors, blocks)
    first_gate = tensors[f"blk.{blocks[0]}.ffn_gate_exps.weight"]
    experts = int(_field(reader, f"{arch}.expert_count") or _numpy_shape(first_gate)[0])
    if spec is not None and spec.moe_layers != len(blocks):
        raise BadInput(f"{path}: {len(blocks)} MoE blocks, the model spec says {spec.moe_layers}")
    for n in ("token_embd.weight", "output_norm.weight"):
        if n not in tensors:
            raise BadInput(f"{path}: missing tensor {n}")
    kind, formats = expert_layout(path, tensors, blocks, experts)
    pool = _expert_pool(path, tensors, blocks, experts, kind, formats)
    norms, routers, router_biases = [], [], []
    for b in blocks:
        norm, router = _block_tensor(tensors, b, _NORM_NAMES), tensors.get(f"blk.{b}.ffn_gate_inp.weight")
        if norm is None or router is None:
            raise BadInput(f"{path}: block {b} lacks its FFN norm ({' or '.join(_NORM_NAMES)}) or router "
                           "(ffn_gate_inp)")
        norms.append(tensor_f32(norm).reshape(-1))
        routers.append(tensor_f32(router))
        bias = tensors.get(f"blk.{b}.ffn_gate_inp.bias")
        router_biases.append(None if bias is None else tensor_f32(bias).reshape(-1))
    embed = tensor_f32(tensors["token_embd.weight"])
    head = tensor_f32(tensors["output.weight"]) if "output.weight" in tensors else embed  # tied embeddings
    ffn = _numpy_shape(tensors[f"blk.{blocks[0]}.ffn_gate_exps.weight"])[1]
    return MoeTensors(experts=pool, expert_ffn=int(ffn), embed=embed.astype(np.float16),
                      lm_head=head.astype(np.float16), final_norm=tensor_f32(tensors["output_norm.weight"]).reshape(-1),
                      norms=norms, routers=routers, blocks=blocks, notes=moe_file_notes(path, arch, tensors, blocks),
                      ffns=read_dense_ffns(path, tensors, blocks), router_biases=router_biases)
