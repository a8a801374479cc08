"""Shared experts, dense FFN blocks and router biases, computed on the device around the session's layer ops.

A model file may have, beside its routed experts, FFNs every token runs (`strata_core.models.weights.DenseFfn`):
qwen2moe's shared expert (scaled by a sigmoid gate) and deepseek2's shared experts read the MoE layer's normed
input and add to the residual with the routed experts; deepseek2's first blocks are dense FFN blocks with their own
norm. Their weights are uploaded once at start with the other dense weights (the plan's dense line, in the file's
own bytes: a one-slot 'gguf' pool each), and are computed with the session's primitives only, every buffer carved
from the work's workspace:

    dense block:   x += ffn(rmsnorm(x, norm))                     rmsnorm, moe_grouped_ffn, scatter_add
    shared expert: y = ffn(xn), s = sigmoid(xn . gate) or 1      rmsnorm, moe_grouped_ffn, linear
                   (the MoE layer op: x += sum_k w_k expert_k(xn))
                   x += s * y                                     scatter_add

The kernel contract has no sigmoid, so the gate's T logits come to the host and the scales go back (T floats a
layer). The shared output is carved, and fixed, before the layer op runs: a layer op resets the workspace to its
fixed mark at the end of its layer, so what the shared expert computed survives it and is released after the add.

`wrap(ops, ...)` gives the executor layer ops that do this around the session's own (`DenseFfnLayerOps`), or the
session's ops unchanged for a model without such FFNs, so those runs keep their bits. A decode step of a model with
them runs its layers one `decode_step([work])` at a time, since the shared expert is added between layers.

Router biases (gpt-oss's `ffn_gate_inp.bias`) are handed to the layer op in `work.extras["router_bias"]` (that
layer's [E] f32 host array), which the composed layer op adds to the router logits before the top k.

With --check the observer sees, besides each MoE layer the layer op reports, every dense block (phase
'prefill.dense' / 'decode.dense', its block id) and every MoE layer with its shared expert ('prefill.shared' /
'decode.shared', the MoE layer, from the layer's input to its output after the shared expert).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from strata_core.api.kernels import ExpertPool, LayerWork
from strata_core.models.weights import DenseFfn
from strata_core.runtime.layer_ops import _takes_out


def wrap(ops: Any, weights: Any, dense_dev: dict[str, Any], dm: Any, kernels: Any, accounting_only: bool,
         layers: int) -> Any:
    """The layer ops the executor runs: `ops` around this model's shared experts, dense blocks and router biases,
    or `ops` itself when the model has none (or in accounting mode, which computes nothing)."""
    dense = getattr(weights, "dense", None) if weights is not None else None
    ffns = list(getattr(dense, "ffns", ()) or ()) if dense is not None else []
    biases = list(getattr(dense, "router_biases", ()) or ()) if dense is not None else []
    biased = any(b is not None for b in biases)
    if accounting_only or not (ffns or biased):
        return ops
    return DenseFfnLayerOps(ops, ffns, dense_dev, dm, kernels, layers, biases)


class DenseFfnLayerOps:
    """LayerOps that run a model's dense FFNs around another LayerOps (everything else is the inner op's)."""

    def __init__(self, inner: Any, ffns: list[DenseFfn], dense_dev: dict[str, Any], dm: Any, kernels: Any,
                 layers: int, router_biases: list[np.ndarray | None] = ()):
        self.inner = inner
        self.layers = int(layers)
        self.dm = dm
        self.k = kernels
        self.dense = dense_dev
        self.name = getattr(inner, "name", "layer ops")
        #: MoE layer -> the dense blocks that run before it, and its shared expert (or None)
        self.before: dict[int, list[DenseFfn]] = {}
        self.shared: dict[int, DenseFfn] = {}
        for f in ffns:
            if f.kind == "dense":
                self.before.setdefault(f.layer, []).append(f)
            else:
                self.shared[f.layer] = f
        self.pools = {f.key: self._device_pool(f) for f in ffns}
        self.hidden = int(ffns[0].pool.formats[0].hidden if ffns and ffns[0].pool.formats
                          else getattr(inner, "hidden", 0) or 0)
        self.router_bias = {i: np.ascontiguousarray(b, dtype=np.float32) for i, b in enumerate(router_biases)
                            if b is not None}
        self._takes_out = {n: _takes_out(getattr(kernels, n, None))
                           for n in ("rmsnorm", "linear", "moe_grouped_ffn")}
        #: (rows, ffn) -> the intermediate a kernel set's grouped FFN needs as `scratch`, or None (opencl/sycl's
        #: two-pass FFN on small work-groups): carved from the workspace after the FFN's output, inside the plan
        self._ffn_scratch = getattr(kernels, "ffn_scratch_shape", None)
        #: the widest FFN of these blocks (the dry replay carves the largest scratch any of them takes)
        self._ffn_width = max((_ffn_width(f.pool) for f in ffns), default=0)

    def __getattr__(self, name: str) -> Any:
        """Everything but the two layer ops is the inner op's (its precision, counters, `_takes_out`...)."""
        inner = self.__dict__["inner"]
        if name == "worst_carves":
            getattr(inner, name)  # AttributeError where the inner op has none: then every planned slot is lent
            return self._worst_carves
        return getattr(inner, name)

    def _device_pool(self, f: DenseFfn) -> ExpertPool:
        """The FFN's one-slot pool over its device arrays (uploaded with the dense weights)."""
        return f.pool.with_arrays({n: self.dense[f"{f.key}.{n}"] for n in f.pool.arrays})

    # --- the contract --------------------------------------------------------------------------------------

    def prefill_layer(self, work: LayerWork) -> None:
        """One MoE layer of a prompt chunk with the dense blocks before it and its shared expert."""
        self._around(work, lambda: self.inner.prefill_layer(work))

    def decode_step(self, works: list[LayerWork]) -> None:
        """Every MoE layer of one decode token; one layer a call, the dense FFNs between them."""
        for w in works:
            self._around(w, lambda w=w: self.inner.decode_step([w]))

    # --- the FFNs ------------------------------------------------------------------------------------------

    def _around(self, w: LayerWork, layer_op) -> None:
        """Dense blocks before layer w.layer, the layer with its router bias and shared expert, and after the last
        MoE layer the dense blocks that follow it."""
        for f in self.before.get(w.layer, ()):
            self._dense_block(w, f)
        bias = self.router_bias.get(w.layer)
        if bias is not None:
            w.extras["router_bias"] = bias
        else:
            w.extras.pop("router_bias", None)
        f = self.shared.get(w.layer)
        if f is None:
            layer_op()
        else:
            self._with_shared(w, f, layer_op)
        if w.layer == self.layers - 1:
            for f in self.before.get(self.layers, ()):
                self._dense_block(w, f)

    def _carve(self, w: LayerWork, kernel: str, shape: tuple[int, ...], dtype: Any) -> Any:
        """An output buffer of `kernel` from the workspace, or None where the kernel allocates its own."""
        return w.workspace.carve(shape, dtype) if self._takes_out[kernel] else None

    def _call(self, kernel: str, *args: Any, out: Any = None) -> Any:
        """A primitive, given its output buffer where it takes one."""
        f = getattr(self.k, kernel)
        return f(*args) if out is None else f(*args, out=out)

    def _put(self, w: LayerWork, host: np.ndarray) -> Any:
        """A host array's copy carved from the workspace."""
        host = np.ascontiguousarray(host)
        arr = w.workspace.carve(host.shape, host.dtype)
        self.dm.upload(arr, host)
        return arr

    def _ffn(self, w: LayerWork, f: DenseFfn, xn: Any, out: Any) -> Any:
        """ffn(xn) [T,H] f32 through moe_grouped_ffn (into `out`): every token one group of the FFN's one slot;
        the kernel's scratch, where it needs one, carved after the offsets and slot."""
        offsets = self._put(w, np.array([0, w.tokens], np.int32))
        slots = self._put(w, np.zeros(1, np.int32))
        shape = self._scratch_shape(w.tokens, _ffn_width(f.pool))
        if shape is None:
            return self._call("moe_grouped_ffn", xn, offsets, slots, self.pools[f.key], out=out)
        return self.k.moe_grouped_ffn(xn, offsets, slots, self.pools[f.key], out=out,
                                      scratch=w.workspace.carve(shape, np.float32))

    def _scratch_shape(self, rows: int, ffn: int) -> tuple[int, ...] | None:
        """The grouped FFN's scratch shape for `rows` rows of an FFN `ffn` wide, or None where it needs none."""
        shape = self._ffn_scratch(int(rows), int(ffn)) if self._ffn_scratch is not None else None
        return tuple(shape) if shape else None

    def _observe(self, w: LayerWork, phase: str, layer: int, x_in: np.ndarray | None) -> None:
        """Hand the observer (--check) this step's input and output residual."""
        if x_in is not None:
            w.extras["observer"](f"{w.phase}.{phase}", layer, x_in, np.asarray(self.dm.download(w.x)))

    def _x_in(self, w: LayerWork) -> np.ndarray | None:
        """The residual on the host before a step, where an observer wants it."""
        return np.asarray(self.dm.download(w.x)).copy() if w.extras.get("observer") is not None else None

    def _dense_block(self, w: LayerWork, f: DenseFfn) -> None:
        """x += ffn(rmsnorm(x, the block's norm)), its buffers released after."""
        ws = w.workspace
        x_in = self._x_in(w)
        mark = ws.mark()
        try:
            T, H = w.tokens, int(w.x.shape[1])
            xn = self._call("rmsnorm", w.x, self.dense[f"{f.key}.norm"], out=self._carve(w, "rmsnorm", (T, H),
                                                                                         np.float32))
            y = self._ffn(w, f, xn, self._carve(w, "moe_grouped_ffn", (T, H), np.float32))
            self.k.scatter_add(w.x, self._put(w, np.arange(T, dtype=np.int32)), y,
                               self._put(w, np.ones(T, np.float32)))
        finally:
            ws.release(mark)
        self._observe(w, "dense", f.block, x_in)

    def _with_shared(self, w: LayerWork, f: DenseFfn, layer_op) -> None:
        """The shared expert on the layer's normed input, the layer op, then x += scale * shared."""
        ws = w.workspace
        x_in = self._x_in(w)
        T, H = w.tokens, int(w.x.shape[1])
        base = ws.mark()
        try:
            # what the add needs after the layer op: the output, its rows and scales (kept past the op's reset)
            y = self._carve(w, "moe_grouped_ffn", (T, H), np.float32)
            rows = self._put(w, np.arange(T, dtype=np.int32))
            scale = ws.carve((T,), np.float32)
            temps = ws.mark()
            xn = self._call("rmsnorm", w.x, w.norm_w, out=self._carve(w, "rmsnorm", (T, H), np.float32))
            y = self._ffn(w, f, xn, out=y)
            if f.gate is not None:
                logit = self._call("linear", xn, self.dense[f"{f.key}.gate"],
                                   out=self._carve(w, "linear", (T, 1), np.float32))
                s = _sigmoid(np.asarray(self.dm.download(logit), dtype=np.float64).reshape(-1)).astype(np.float32)
            else:
                s = np.ones(T, np.float32)
            self.dm.upload(scale, s)
            ws.release(temps)
            ws.fix()
            layer_op()
            self.k.scatter_add(w.x, rows, y, scale)
        finally:
            ws.release(base)
            ws.fix()
        self._observe(w, "shared", w.layer, x_in)

    # --- sizes ---------------------------------------------------------------------------------------------

    def _worst_carves(self, tokens: int, vocab: int, top_k: int | None = None) -> list:
        """The inner op's worst carves with this model's dense FFN buffers before them (the executor sizes a
        loan's buffer slots from them)."""
        inner = self.inner.worst_carves(tokens, vocab, top_k)
        T = int(tokens)
        f32, i32 = np.float32, np.int32
        H = self.hidden
        steps: list = ["fix"]
        scratch = self._scratch_shape(T, self._ffn_width)
        ffn_steps = [((2,), i32), ((1,), i32)] + ([(scratch, f32)] if scratch else [])
        if self.before:
            steps += ["mark", ((T, H), f32), ((T, H), f32), *ffn_steps, ((T,), i32), ((T,), f32), "release"]
        if self.shared:
            steps += [((T, H), f32), ((T,), i32), ((T,), f32), "mark", ((T, H), f32), *ffn_steps,
                      ((T, 1), f32), "release", "fix"]
        return steps + (inner[1:] if inner and inner[0] == "fix" else inner)


def _ffn_width(pool: ExpertPool) -> int:
    """The FFN width of a one-slot pool: its format's, else its gate-up rows / 2 ('f16' w_gate_up, 'q8_0'
    gate_up_q: [slots, 2 * ffn, hidden])."""
    if pool.formats:
        return int(pool.formats[0].ffn)
    a = pool.arrays.get("w_gate_up", pool.arrays.get("gate_up_q"))
    return int(a.shape[1]) // 2 if a is not None else 0


def _sigmoid(z: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-z), on the host (the kernel contract has no sigmoid)."""
    return 1.0 / (1.0 + np.exp(-z))
