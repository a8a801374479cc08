"""The built-in tiny MoE model: `strata run` with no arguments runs it on any machine in seconds.

Its shape is chosen so the prompt path really borrows from the cache: the seed ring policy gives chunks up to
4096 tokens a fixed 384-slot ring, so a cache must hold well over 512 slots before anything can be lent (it keeps
min_keep_slots for decode). 8 layers x 256 experts of hidden 128 and FFN 64 (48 KiB an f16 expert, 96 MiB in all)
give `strata run`'s default cache of half the experts (1024 slots) room to lend a 2560-token chunk's loan, and keep
a 3000-token prompt to a few GFLOP.
Weights are deterministic from a seed; there is no attention (out of scope for Strata Core).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from strata_core.api.kernels import GGUF_BLOCKS, ExpertFormat
from strata_core.reference import quants
from strata_core.reference.kernels import (QK8_0, ExpertPool, expert_matrices, linear, moe_grouped_ffn,
                                           quantize_q8_0, rmsnorm, route_topk, scatter_add)
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
               dtype: str = "f16", source: str = "tiny", formats: tuple[ExpertFormat, ...] = (),
               quant: str = "") -> ModelSpec:
    """The ModelSpec of a generated model of this shape (f16 or q8_0 experts, or 'gguf' ones of `formats`, a
    slot the largest of them; `quant` names a 'gguf' model's types)."""
    slot = ExpertPool.slot_bytes(dtype, hidden, ffn, formats)
    return ModelSpec(name=name, moe_layers=layers, experts_per_layer=experts, top_k=top_k, hidden=hidden,
                     slot_bytes=slot, largest_blob_bytes=slot,
                     prompt_bytes_per_token=prompt_bytes_for(hidden, experts, top_k, ffn),
                     dense_bytes=device_dense_bytes(layers, experts, hidden, vocab), kv_bytes_per_token=0,
                     expert_ffn=ffn, quant={"f16": "F16", "q8_0": "Q8_0"}.get(dtype, quant or dtype.upper()),
                     vocab=vocab, source=source, expert_pool=dtype)


def generated_expert_formats(quant: str, layers: int, hidden: int, ffn: int) -> tuple[tuple[ExpertFormat, ...],
                                                                                    list[str]]:
    """(one ExpertFormat per MoE layer, notes) of generated experts at a preset quant whose types the kernels
    compute (Q4_K, Q4_K_M, Q5_K, Q5_K_M, Q6_K, MXFP4; a mix's types per layer as llama.cpp picks them), or ((),
    []) for the others. A row that is not whole blocks of its type takes llama.cpp's fallback where the kernels
    compute it, else Q8_0 (said in a note)."""
    from strata_core.models.presets import ROW_FALLBACK, expert_types
    q = str(quant).upper()
    if q not in ("Q4_K", "Q4_K_M", "Q5_K", "Q5_K_M", "Q6_K", "MXFP4"):
        return (), []
    notes: list[str] = []

    def fitted(t: str, row_weights: int, what: str) -> str:
        if row_weights % GGUF_BLOCKS[t.lower()][0] == 0:
            return t.lower()
        want = ROW_FALLBACK.get(t, "Q8_0")
        got = want.lower() if want.lower() in GGUF_BLOCKS and row_weights % GGUF_BLOCKS[want.lower()][0] == 0 \
            else "q8_0"
        note = (f"generated experts: {what} rows of {row_weights} weights are not whole {t} blocks: "
                f"{got.upper()}" + ("" if got == want.lower() else f" (llama.cpp would write {want}, which the "
                                                                  f"kernels do not compute)"))
        if note not in notes:
            notes.append(note)
        return got

    formats = []
    for layer in range(layers):
        gate_up, down = expert_types(q, layer, layers)
        formats.append(ExpertFormat(fitted(gate_up, hidden, "gate/up"), fitted(down, ffn, "down"), hidden, ffn))
    return tuple(formats), notes


def tiny_model_spec() -> ModelSpec:
    """The tiny model's ModelSpec (source 'tiny')."""
    return model_spec("strata-tiny", TINY_LAYERS, TINY_EXPERTS, TINY_TOP_K, TINY_HIDDEN, TINY_FFN, TINY_VOCAB)


def tiny_cache_slots(spec: ModelSpec) -> int:
    """The default expert cache of `strata run`'s tiny model: about half its experts."""
    return max(spec.top_k, int(spec.experts_total * TINY_CACHE_FRACTION))


#: Elements of the random source sequence beyond the largest matrix: experts are windows of it at offsets in this range.
SOURCE_SPAN = 1 << 20
#: Rows generated per task of the thread pool (one task writes this many experts' arrays).
ROWS_PER_TASK = 8
#: With a popularity skew, the residual's last coordinate holds this many times the other coordinates' rms, so the
#: router's last column can add a per-expert bias to the logits (the model has no router bias of its own).
SKEW_CARRIER = 8.0
#: Tokens of the Monte Carlo estimate of what one MoE layer adds to the residual (skewed weights only).
SKEW_PROBE_TOKENS = 64
#: With a popularity skew, this FFN unit of every expert carries the skew's carrier: its gate and up rows are equal, so
#: its activation silu(z) * z is never negative, and its down weight into the carrier coordinate grows the carrier
#: layer by layer as the rest of the residual grows.
SKEW_UNIT = 0


def layer_growth(experts: ExpertPool, router: np.ndarray, top_k: int, hidden: int, ffn: int,
                 rng: np.random.Generator, tokens: int = SKEW_PROBE_TOKENS) -> tuple[float, float]:
    """(per-coordinate variance one MoE layer adds to the residual's other coordinates, the routed mean of the
    carrier unit's activation): layer 0's experts (rows 0..E-1) and `router` over `tokens` random unit-rms inputs.
    Every layer's experts are drawn alike and the skew keeps every layer's routing alike, so one layer tells all."""
    xn = rng.standard_normal((tokens, hidden), dtype=np.float32)
    ids, wts = route_topk(xn @ router.T, top_k)
    y = np.zeros((tokens, hidden), np.float32)
    unit = np.zeros(tokens, np.float64)
    for e in np.unique(ids).tolist():
        gu, dn = expert_matrices(experts, e)
        rows, ks = np.nonzero(ids == e)
        h = xn[rows] @ gu.T
        act = h[:, :ffn] / (1 + np.exp(-h[:, :ffn])) * h[:, ffn:]
        y[rows] += wts[rows, ks, None] * (act @ dn.T)
        np.add.at(unit, rows, wts[rows, ks] * act[:, SKEW_UNIT])
    return float(np.mean(y[:, : hidden - 1].astype(np.float64) ** 2)), float(unit.mean())


def popular_half_shares(weights: ModelWeights, tokens: np.ndarray) -> list[float]:
    """Share of each MoE layer's routed rows that its most popular half of experts takes, for `tokens` run through
    the layers as the runtime computes them (reference kernels: rmsnorm, router, top k, experts, residual add; no
    attention): how strongly a model's routing is skewed at each depth."""
    spec, d, pool = weights.spec, weights.dense, weights.experts
    e_n, k = spec.experts_per_layer, spec.top_k
    x = np.asarray(d.embed[np.asarray(tokens)], dtype=np.float32)
    shares = []
    for layer in range(spec.moe_layers):
        xn = rmsnorm(x, d.norms[layer])
        ids, wts = route_topk(linear(xn, d.routers[layer]), k)
        counts = np.bincount(ids.ravel(), minlength=e_n)
        shares.append(float(np.sort(counts)[::-1][: e_n // 2].sum() / counts.sum()))
        order = np.argsort(ids.ravel(), kind="stable")
        experts, starts = np.unique(ids.ravel()[order], return_index=True)
        rows = order // k
        y = moe_grouped_ffn(xn[rows], np.append(starts, order.size), layer * e_n + experts, pool.for_layer(layer))
        scatter_add(x, rows, y, wts.ravel()[order])
    return shares


GenerateProgress = Callable[[int, int], None]


def _sources(rng: np.random.Generator, n: int) -> np.ndarray:
    """A random N(0,1) f32 sequence of SOURCE_SPAN + n values whose windows of n at any offset < SOURCE_SPAN are
    the matrices (drawn once: drawing every expert's values is what made large presets slow)."""
    return rng.standard_normal(SOURCE_SPAN + n, dtype=np.float32)


def _quantized_source(rng: np.random.Generator, ggml_type: str, fan_in: int, n_weights: int) -> np.ndarray:
    """The bytes of SOURCE_SPAN + n_weights N(0, 1/fan_in) values quantized to ggml_type block by block: any run of
    whole blocks in it is a matrix of that type (K-quant super-blocks are quantized alone)."""
    bw = GGUF_BLOCKS[ggml_type][0]
    src = _sources(rng, -(-n_weights // bw) * bw) / np.float32(np.sqrt(fan_in))
    return quants.quantize(ggml_type, src.reshape(-1, bw)).reshape(-1)


def _gguf_jobs(rng: np.random.Generator, blob: np.ndarray, formats: tuple[ExpertFormat, ...],
               experts: int) -> Callable[[int, int], None]:
    """The copier of generated 'gguf' slots: rows r0..r1 of blob get their layer's gate|up and down rows, each a
    window of whole blocks of one quantized source per (matrix, type) at the row's own seeded block offset."""
    #: (matrix, type) -> (the quantized source, each row's byte offset in it: whole blocks)
    sources: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
    rows = blob.shape[0]
    for fmt in dict.fromkeys(formats):
        for kind, t, fan_in, n in (("gate_up", fmt.gate_up, fmt.hidden, 2 * fmt.ffn * fmt.hidden),
                                   ("down", fmt.down, fmt.ffn, fmt.hidden * fmt.ffn)):
            if (kind, t) not in sources:
                bw, bb = GGUF_BLOCKS[t]
                data = _quantized_source(rng, t, fan_in, n)
                sources[kind, t] = (data, rng.integers(0, SOURCE_SPAN // bw, rows) * bb)

    def copy(r0: int, r1: int) -> None:
        for r in range(r0, r1):
            fmt = formats[r // experts]
            gu, gu_at = sources["gate_up", fmt.gate_up]
            dn, dn_at = sources["down", fmt.down]
            a, b = int(gu_at[r]), int(dn_at[r])
            blob[r, :fmt.down_offset] = gu[a:a + fmt.down_offset]
            blob[r, fmt.down_offset:fmt.bias_offset] = dn[b:b + fmt.bias_offset - fmt.down_offset]
            blob[r, fmt.bias_offset:] = 0  # biases (a generated expert adds none) and a smaller layer's spare bytes

    return copy


def _carrier_row_at(fmt: ExpertFormat) -> int:
    """Byte offset in a 'gguf' slot of the down row that writes the skew's carrier (the residual's last coordinate)."""
    return fmt.down_offset + (fmt.hidden - 1) * fmt.down_row_bytes


def _tile_rows(dst: np.ndarray, src: np.ndarray, offsets: np.ndarray, r0: int, r1: int, step: int = 1,
               d_dst: np.ndarray | None = None, d_src: np.ndarray | None = None) -> None:
    """dst[r] = the window of src at offsets[r] for rows r0..r1-1 (and the Q8_0 scales' windows at offset / 32)."""
    n = int(np.prod(dst.shape[1:]))
    for r in range(r0, r1):
        o = int(offsets[r]) * step
        dst[r].reshape(-1)[:] = src[o:o + n]
        if d_dst is not None:
            nd = n // QK8_0
            d_dst[r].reshape(-1)[:] = d_src[o // QK8_0:o // QK8_0 + nd]


def generate_weights(spec: ModelSpec, seed: int = 0, dtype: str = "f16", popularity_skew: float = 0.0,
                     progress: GenerateProgress | None = None, threads: int | None = None,
                     formats: tuple[ExpertFormat, ...] = ()) -> ModelWeights:
    """Deterministic weights of spec's shape, fast enough for real presets (several GB/s).

    What it does: one N(0,1) source sequence per matrix kind is drawn once (a few MB) and scaled by 1/sqrt(fan_in),
    cast to f16 (or quantized once to Q8_0, or for dtype 'gguf' to each of `formats`' types, one format per MoE
    layer: a Q4_K_M model's down rows Q6_K in some layers and Q4_K in the others); each expert's matrix is then a
    window of that sequence at its own seeded offset (whole blocks of a quantized one), copied by a pool of threads
    straight into the (later page-locked) host arrays. Experts differ by offset, so routing and every check work as
    with independent draws; the cost is one memory copy per byte.
    popularity_skew > 0 reproduces the cache sweep's skewed routing: in each layer the expert of popularity rank r
    (a seeded permutation) gets about popularity_skew * -ln(1+r) added to its router logit, carried by the
    residual's last coordinate, SKEW_CARRIER x the spread of the others. The other coordinates grow layer by layer,
    so the experts grow the carrier with them (SKEW_UNIT: a unit whose activation is never negative writes it, with
    a per-layer weight from layer_growth's measurement on layer 0): after rmsnorm the carrier, and so the bias, is
    about the same in every layer, as the sweep applies it, and the embedding's routing stands for every layer's.
    progress(bytes_done, bytes_total) is called as experts land.
    """
    if spec.expert_ffn <= 0:
        raise ValueError("generate_weights needs the model's expert_ffn")
    if dtype not in ("f16", "q8_0", "gguf"):
        raise ValueError(f"generate_weights: unknown expert dtype {dtype!r}")
    rng = np.random.default_rng(seed)
    L, E, H, F, V = spec.moe_layers, spec.experts_per_layer, spec.hidden, spec.expert_ffn, max(spec.vocab, 2)
    if dtype == "gguf" and (len(formats) != L or any((f.hidden, f.ffn) != (H, F) for f in formats)):
        raise ValueError(f"generate_weights: 'gguf' experts need one ExpertFormat of hidden {H}, ffn {F} per MoE "
                         f"layer ({L}), not {len(formats)}")
    rows = L * E
    specs = ExpertPool.array_specs(dtype, rows, H, F, tuple(formats))
    arrays = {k: np.empty(shape, dt) for k, (shape, dt) in specs.items()}
    jobs = []  # (values array, scales array or None, source values, source scales or None, offsets, step)
    gguf_copy = _gguf_jobs(rng, arrays["blob"], tuple(formats), E) if dtype == "gguf" else None
    for key, fan_in, n in (("gate_up", H, 2 * F * H), ("down", F, H * F)) if gguf_copy is None else ():
        src = _sources(rng, n) / np.float32(np.sqrt(fan_in))
        if dtype == "f16":
            jobs.append((arrays["w_gate_up" if key == "gate_up" else "w_down"], None, src.astype(np.float16), None,
                         rng.integers(0, SOURCE_SPAN, rows), 1))
        else:
            q, d = quantize_q8_0(src[: (src.size // QK8_0) * QK8_0])
            jobs.append((arrays[f"{key}_q"], arrays[f"{key}_d"], q, d,
                         rng.integers(0, SOURCE_SPAN // QK8_0, rows), QK8_0))
    total = sum(int(a.nbytes) for a in arrays.values())
    done = [0]
    lock = threading.Lock()
    per_row = total // rows

    def task(r0: int) -> None:
        r1 = min(rows, r0 + ROWS_PER_TASK)
        for dst, d_dst, src, d_src, offsets, step in jobs:
            _tile_rows(dst, src, offsets, r0, r1, step, d_dst, d_src)
        if gguf_copy is not None:
            gguf_copy(r0, r1)
        if progress is not None:
            with lock:
                done[0] += (r1 - r0) * per_row
                progress(done[0], total)

    workers = threads or min(32, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(task, range(0, rows, ROWS_PER_TASK)))
    experts = ExpertPool(dtype, arrays, tuple(formats) if dtype == "gguf" else ())

    def matrix(*shape: int, scale: float = 1.0, dtype=np.float32) -> np.ndarray:
        """A random [.., fan_in] matrix of N(0, scale^2/fan_in) values (windows of one source, like the experts)."""
        n = int(np.prod(shape))
        chunk = min(n, 1 << 22)
        src = (_sources(rng, chunk) * np.float32(scale / np.sqrt(shape[-1]))).astype(dtype)
        out = np.empty(n, dtype)
        starts = list(range(0, n, chunk))
        offsets = rng.integers(0, SOURCE_SPAN, len(starts))

        def fill(j: int) -> None:
            i, o = starts[j], int(offsets[j])
            m = min(n - i, chunk)
            out[i:i + m] = src[o:o + m]

        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(fill, range(len(starts))))
        return out.reshape(shape)

    routers = [matrix(E, H) for _ in range(L)]
    embed = matrix(V, H, scale=4.0, dtype=np.float16)
    if popularity_skew > 0:
        sigma = 4.0 / np.sqrt(H)  # the embedding's per-coordinate spread
        carrier = SKEW_CARRIER * sigma
        embed[:, H - 1] = np.float16(carrier)
        xn_last = SKEW_CARRIER / np.sqrt((SKEW_CARRIER ** 2 + H - 1) / H)  # after rmsnorm with unit weights
        for r in routers:
            rank = rng.permutation(E)
            r[:, H - 1] = (-popularity_skew * np.log1p(rank) / xn_last).astype(np.float32)
        # the carrier unit: up row = gate row, so its activation silu(z) * z >= 0; no other unit writes the carrier
        if dtype == "gguf":
            blob = arrays["blob"]
            for layer, fmt in enumerate(formats):
                lr, rb, at = slice(layer * E, (layer + 1) * E), fmt.gate_up_row_bytes, _carrier_row_at(fmt)
                blob[lr, (F + SKEW_UNIT) * rb:(F + SKEW_UNIT + 1) * rb] = blob[lr, SKEW_UNIT * rb:(SKEW_UNIT + 1) * rb]
                blob[lr, at:at + fmt.down_row_bytes] = quants.quantize(fmt.down, np.zeros((1, F), np.float32))[0]
        elif dtype == "f16":
            arrays["w_gate_up"][:, F + SKEW_UNIT, :] = arrays["w_gate_up"][:, SKEW_UNIT, :]
            arrays["w_down"][:, H - 1, :] = 0
        else:
            for name in ("gate_up_q", "gate_up_d"):
                arrays[name][:, F + SKEW_UNIT, :] = arrays[name][:, SKEW_UNIT, :]
            arrays["down_q"][:, H - 1, :] = 0
            arrays["down_d"][:, H - 1, :] = 0
        # its own generator: the draws after this one (the LM head) stay those of the seed
        grow, unit_mean = layer_growth(experts.for_layer(0), routers[0], spec.top_k, H, F,
                                       np.random.default_rng([seed, 1]))
        for layer in range(L):
            # the carrier stays SKEW_CARRIER x the others' spread: o_l^2 = sigma^2 + l * grow
            step = SKEW_CARRIER * (np.sqrt(sigma ** 2 + (layer + 1) * grow) - np.sqrt(sigma ** 2 + layer * grow))
            weight = step / max(unit_mean, 1e-6)
            rows = slice(layer * E, (layer + 1) * E)
            if dtype == "gguf":
                fmt, row = formats[layer], np.zeros((1, F), np.float32)
                row[0, SKEW_UNIT] = weight
                at = _carrier_row_at(fmt)
                arrays["blob"][rows, at:at + fmt.down_row_bytes] = quants.quantize(fmt.down, row)[0]
            elif dtype == "f16":
                arrays["w_down"][rows, H - 1, SKEW_UNIT] = np.float16(weight)
            else:
                row = np.zeros((1, F), np.float32)
                row[0, SKEW_UNIT] = weight
                q, d = quantize_q8_0(row)
                arrays["down_q"][rows, H - 1, :] = q[0]
                arrays["down_d"][rows, H - 1, :] = d[0]
    dense = DenseWeights(embed=embed, norms=[np.ones(H, np.float32) for _ in range(L)], routers=routers,
                         final_norm=np.ones(H, np.float32), lm_head=matrix(V, H, dtype=np.float16))
    return ModelWeights(spec=spec, dense=dense, experts=experts, expert_ffn=F)
