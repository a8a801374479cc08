"""The kit's kernel checks: each drives one kernel of a device through its DeviceMemory and compares the result
with the float64 reference (`strata_core.testing.reference64`) at the bound of the kernel's declared precision
path (`strata_core.testing.tolerance`).

A check is a plain function `check(memory, kernels, rng, seed)` that raises AssertionError (naming the seed) when
the kernel is wrong. The conformance suite runs them as pytest tests; the mutation self-test
(tests/kit/test_mutations.py) runs them against perturbed kernels and requires every one of those to fail.
`CHECKS` maps every kernel of the KernelSet protocol to its checks.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from strata_core.api.kernels import ExpertFormat, ExpertPool, KernelSet
from strata_core.reference import kernels as oracle
from strata_core.reference import quants
from strata_core.testing import reference64 as r64
from strata_core.testing.tolerance import bound_of, precision_of


@dataclass(frozen=True)
class Check:
    """One check of one kernel: which kernel, which variant, the function that runs it, and the expert formats a
    device must advertise (DeviceCaps.expert_formats) for the check to apply to it."""

    kernel: str
    variant: str
    run: Callable[[Any, Any, np.random.Generator, int], None]
    formats: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        """kernel[-variant], the name a test id and a mutation refer to it by."""
        return self.kernel + (f"-{self.variant}" if self.variant else "")


def protocol_kernels(protocol: type = KernelSet) -> list[str]:
    """The kernels a protocol names: its public methods (introspected, so a new kernel appears here by itself)."""
    return sorted(n for n, v in vars(protocol).items() if not n.startswith("_") and inspect.isfunction(v))


def poison(mem: Any, shape: tuple[int, ...], dtype: Any) -> None:
    """Leave NaN (or -1) in freed device memory of an output's size, so a kernel that skips writes shows it."""
    fill = np.nan if np.issubdtype(np.dtype(dtype), np.floating) else -1
    mem.free(mem.to_device(np.full(shape, fill, dtype=dtype)))


def _takes_out(fn: Callable) -> bool:
    """True when a kernel takes an `out=` buffer (the contract's no-allocation form)."""
    try:
        return "out" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def call(mem: Any, kernels: Any, name: str, *args: Any, out_shape=None, out_dtype=None) -> Any:
    """Call a single-output kernel; when it takes `out=`, hand it a NaN-filled buffer and read that buffer back."""
    fn = getattr(kernels, name)
    if out_shape is not None and _takes_out(fn):
        out = mem.to_device(np.full(out_shape, np.nan, dtype=out_dtype))
        got = fn(*args, out=out)
        return out if got is None else got
    if out_shape is not None:
        poison(mem, out_shape, out_dtype)
    return fn(*args)


def assert_close(name: str, out: np.ndarray, want: np.ndarray, dtype: Any, bound: float, path: str,
                 seed: int) -> None:
    """Shape, the contract's dtype, and relative error against the float64 reference below the path's bound."""
    assert out.shape == want.shape, f"{name}: shape {out.shape}, the reference gives {want.shape} (seed {seed})"
    assert out.dtype == np.dtype(dtype), f"{name}: dtype {out.dtype}, the contract says {np.dtype(dtype)} (seed {seed})"
    err = r64.relative_error(out, want)
    assert err <= bound, (f"{name}: relative error {err:.3g} against the float64 reference, above the {path} bound "
                          f"{bound:g} (seed {seed})")


def _bound(kernels: Any, kernel: str) -> tuple[float, str]:
    path = precision_of(kernels, kernel)
    return bound_of(path), path


# ---- the checks -------------------------------------------------------------------------------------------------

def check_route_topk(mem, k, rng, seed) -> None:
    """Top-k ids equal the reference's (descending, ties to the lower id); the softmax weights within the bound."""
    logits = rng.standard_normal((37, 16)).astype(np.float32)
    want_ids, want_w = r64.route_topk(logits, 4)
    poison(mem, want_ids.shape, np.int32)
    poison(mem, want_w.shape, np.float32)
    ids, w = k.route_topk(mem.to_device(logits), 4)
    ids, w = mem.download(ids), mem.download(w)
    assert ids.shape == want_ids.shape and ids.dtype == np.int32, f"route_topk ids {ids.shape} {ids.dtype} (seed {seed})"
    wrong = np.flatnonzero((ids != want_ids).any(axis=1))
    assert wrong.size == 0, f"route_topk: top-k ids differ from the reference in rows {wrong[:5].tolist()} (seed {seed})"
    assert_close("route_topk weights", w, want_w, np.float32, *_bound(k, "route_topk"), seed)


def check_gather(mem, k, rng, seed) -> None:
    """gather picks exactly the reference's rows, repeats included (a copy: bit-exact)."""
    x = rng.standard_normal((37, 64)).astype(np.float32)
    rows = np.concatenate([rng.integers(0, 37, size=47), [3, 3, 36]]).astype(np.int32)
    want = r64.gather(x, rows)
    out = mem.download(call(mem, k, "gather", mem.to_device(x), mem.to_device(rows),
                            out_shape=want.shape, out_dtype=np.float32))
    assert out.shape == want.shape and out.dtype == want.dtype, f"gather: {out.shape} {out.dtype} (seed {seed})"
    wrong = np.flatnonzero(~(out == want).all(axis=1))
    assert wrong.size == 0, f"gather: rows {wrong[:5].tolist()} differ from x[rows] (seed {seed})"


def check_scatter_add(mem, k, rng, seed) -> None:
    """scatter_add adds (never overwrites) into a non-zero output, duplicate rows included."""
    base = rng.standard_normal((37, 64)).astype(np.float32)
    rows = np.concatenate([rng.integers(0, 37, size=40), [5, 5, 5]]).astype(np.int32)
    y = rng.standard_normal((rows.size, 64)).astype(np.float32)
    scale = rng.random(rows.size).astype(np.float32)
    want = r64.scatter_add(base, rows, y, scale)
    out = mem.to_device(base)
    k.scatter_add(out, mem.to_device(rows), mem.to_device(y), mem.to_device(scale))
    assert_close("scatter_add", mem.download(out), want, np.float32, *_bound(k, "scatter_add"), seed)


def check_rmsnorm(mem, k, rng, seed) -> None:
    """rmsnorm matches the reference within the bound of its path."""
    x = (rng.standard_normal((37, 128)) * 3).astype(np.float32)
    w = rng.standard_normal(128).astype(np.float32)
    want = r64.rmsnorm(x, w, 1e-6)
    out = call(mem, k, "rmsnorm", mem.to_device(x), mem.to_device(w), 1e-6, out_shape=want.shape,
               out_dtype=np.float32)
    assert_close("rmsnorm", mem.download(out), want, np.float32, *_bound(k, "rmsnorm"), seed)


def _check_linear(wdtype: str):
    def check_linear(mem, k, rng, seed) -> None:
        """linear matches the reference within the bound of its path (weights are exact in float64)."""
        x = rng.standard_normal((37, 128)).astype(np.float32)
        w = (rng.standard_normal((96, 128)) * 0.1).astype(wdtype)
        want = r64.linear(x, w)
        out = call(mem, k, "linear", mem.to_device(x), mem.to_device(w), out_shape=want.shape, out_dtype=np.float32)
        assert_close(f"linear ({wdtype} weights)", mem.download(out), want, np.float32, *_bound(k, "linear"), seed)
    return check_linear


def check_dequantize_q8_0(mem, k, rng, seed) -> None:
    """Q8_0 blocks dequantize to the exact q * d rounded once to f16 (an f32 path gets those bits)."""
    qs, d = oracle.quantize_q8_0(rng.standard_normal((48, 256)).astype(np.float32))
    want = r64.dequantize_q8_0(qs, d)
    out = call(mem, k, "dequantize_q8_0", mem.to_device(qs), mem.to_device(d), out_shape=want.shape,
               out_dtype=np.float16)
    assert_close("dequantize_q8_0", mem.download(out), want, np.float16, *_bound(k, "dequantize_q8_0"), seed)


def expert_pool(rng: np.random.Generator, fmt: Any, slots: int, hidden: int, ffn: int) -> ExpertPool:
    """A host ExpertPool of random SwiGLU experts: 'f16', 'q8_0', or a 'gguf' pool of one ExpertFormat."""
    gate_up = (rng.standard_normal((slots, 2 * ffn, hidden)) / np.sqrt(hidden)).astype(np.float32)
    down = (rng.standard_normal((slots, hidden, ffn)) / np.sqrt(ffn)).astype(np.float32)
    if fmt == "f16":
        return ExpertPool("f16", {"w_gate_up": gate_up.astype(np.float16), "w_down": down.astype(np.float16)})
    if fmt == "q8_0":
        guq, gud = oracle.quantize_q8_0(gate_up)
        dq, dd = oracle.quantize_q8_0(down)
        return ExpertPool("q8_0", {"gate_up_q": guq, "gate_up_d": gud, "down_q": dq, "down_d": dd})
    blob = np.zeros((slots, fmt.nbytes), dtype=np.uint8)
    for s in range(slots):
        parts = [quants.quantize(fmt.gate_up, gate_up[s]).reshape(-1), quants.quantize(fmt.down, down[s]).reshape(-1)]
        if fmt.bias:
            parts.append((rng.standard_normal(2 * ffn + hidden) * 0.1).astype("<f4").view(np.uint8))
        blob[s] = np.concatenate(parts)
    return ExpertPool("gguf", {"blob": blob}, (fmt,))


#: The grouped FFN's groups: an empty group, a one-row group, a slot used twice, slots out of order.
GROUP_SIZES = (7, 0, 12, 1, 9, 4)
GROUP_SLOTS = (3, 1, 0, 4, 3, 2)
HIDDEN, FFN, POOL_SLOTS = 128, 96, 5
#: 'gguf' pools need whole 256-weight K blocks along both H and F.
GGUF_HIDDEN, GGUF_FFN = 256, 256
#: The 'gguf' pools the kit checks: name -> ExpertFormat (Q4_K_M's mix, Q5_K, bf16, gpt-oss's MXFP4 with biases).
GGUF_POOLS = {
    "gguf-q4_k-q6_k": ExpertFormat("q4_k", "q6_k", GGUF_HIDDEN, GGUF_FFN),
    "gguf-q5_k": ExpertFormat("q5_k", "q5_k", GGUF_HIDDEN, GGUF_FFN),
    "gguf-bf16": ExpertFormat("bf16", "bf16", GGUF_HIDDEN, GGUF_FFN),
    "gguf-mxfp4-bias": ExpertFormat("mxfp4", "mxfp4", GGUF_HIDDEN, GGUF_FFN, bias=True),
}


def _grouped_ffn(mem, k, x, offsets, slots, dev_pool):
    return mem.download(call(mem, k, "moe_grouped_ffn", mem.to_device(x), mem.to_device(offsets),
                             mem.to_device(slots), dev_pool, out_shape=x.shape, out_dtype=np.float32))


def _check_grouped_ffn(fmt: Any, label: str):
    def check_moe_grouped_ffn(mem, k, rng, seed) -> None:
        """SwiGLU experts over token groups match the float64 reference on exactly dequantized weights; a slot
        rewritten between two calls is read fresh by the second."""
        hidden, ffn = (HIDDEN, FFN) if isinstance(fmt, str) else (fmt.hidden, fmt.ffn)
        host = expert_pool(rng, fmt, POOL_SLOTS, hidden, ffn)
        offsets = np.concatenate([[0], np.cumsum(GROUP_SIZES)]).astype(np.int32)
        slots = np.array(GROUP_SLOTS, dtype=np.int32)
        x = rng.standard_normal((int(offsets[-1]), hidden)).astype(np.float32)
        dev = host.with_arrays({name: mem.to_device(a) for name, a in host.arrays.items()})
        bound, path = _bound(k, "moe_grouped_ffn")
        first = _grouped_ffn(mem, k, x, offsets, slots, dev)
        assert_close(f"moe_grouped_ffn ({label})", first, r64.moe_grouped_ffn(x, offsets, slots, host), np.float32,
                     bound, path, seed)
        # the cache admits a new expert into slot 3 (used by two groups) between layers: the kernel must read it
        fresh = expert_pool(rng, fmt, POOL_SLOTS, hidden, ffn)
        for name, a in host.arrays.items():
            a[3] = fresh.arrays[name][3]
            mem.upload(dev.arrays[name], a)
        mem.synchronize()
        second = _grouped_ffn(mem, k, x, offsets, slots, dev)
        assert_close(f"moe_grouped_ffn ({label}, slot 3 rewritten)", second,
                     r64.moe_grouped_ffn(x, offsets, slots, host), np.float32, bound, path, seed)
    return check_moe_grouped_ffn


def _gguf_formats(fmt: ExpertFormat) -> tuple[str, ...]:
    return tuple(sorted({fmt.gate_up, fmt.down}))


CHECKS: dict[str, list[Check]] = {
    "route_topk": [Check("route_topk", "", check_route_topk)],
    "gather": [Check("gather", "", check_gather)],
    "scatter_add": [Check("scatter_add", "", check_scatter_add)],
    "rmsnorm": [Check("rmsnorm", "", check_rmsnorm)],
    "linear": [Check("linear", "f32", _check_linear("float32")), Check("linear", "f16", _check_linear("float16"))],
    "dequantize_q8_0": [Check("dequantize_q8_0", "", check_dequantize_q8_0)],
    "moe_grouped_ffn": [Check("moe_grouped_ffn", "f16", _check_grouped_ffn("f16", "f16"), ("f16",)),
                        Check("moe_grouped_ffn", "q8_0", _check_grouped_ffn("q8_0", "q8_0"), ("q8_0",))]
    + [Check("moe_grouped_ffn", name, _check_grouped_ffn(fmt, name), _gguf_formats(fmt))
       for name, fmt in GGUF_POOLS.items()],
}


def all_checks() -> list[Check]:
    """Every kernel check, in the protocol's order."""
    return [c for name in protocol_kernels() for c in CHECKS.get(name, [])]
