"""The SYCL KernelSet: strata_core's shared OpenCL C source (moe.cl) built and launched through dpctl.program.

Kernels run on the device's default in-order queue (the stream None of `SyclDeviceMemory`), so they are ordered
after uploads on that stream and before downloads from it. Numpy inputs are accepted and uploaded for the call;
outputs are always device arrays (UsmArray).
"""

from __future__ import annotations

import ctypes
from collections import deque
from typing import Any

import numpy as np

from strata_core.kernels import kernel_source
from strata_core.kernels.reference import QK8_0, ExpertPool

from .memory import SyclDeviceMemory, UsmArray
from .runtime import Session

_I32_MAX = 2**31 - 1
#: Side of the square work-group of the tiled kernels (LINEAR_TILE and FFN_TILE in moe.cl).
LINEAR_TILE = 16


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class SyclKernels:
    """KernelSet of one SYCL device; the contract is strata_core.kernels.reference."""

    name = "sycl-opencl-c"

    def __init__(self, session: Session, memory: SyclDeviceMemory | None = None):
        self.session = session
        self.memory = memory or SyclDeviceMemory(session)
        self._dpctl = session.dpctl
        # Arguments and temporaries of submitted work, kept referenced until their event completes (dpctl frees USM
        # on garbage collection, which would pull memory from under a running kernel).
        self._inflight: deque[tuple[Any, tuple]] = deque()
        self._kernels: dict[str, Any] = {}
        with session.lock:
            if session.program is None:
                session.program = self._dpctl.program.create_program_from_source(session.queue, kernel_source("moe.cl"))
        self._program = session.program
        wg = int(session.device.max_work_group_size)
        self._reduce_local = 1 << min(6, wg.bit_length() - 1)  # a power of two <= 64 for the tree reductions
        # The tiled kernels (linear, grouped FFN) need LINEAR_TILE^2 work-items in one group; smaller devices get
        # the plain ones.
        self._tiled = wg >= LINEAR_TILE * LINEAR_TILE

    # --------------------------------------------------------------------------------------------- launching

    def _kernel(self, name: str) -> Any:
        k = self._kernels.get(name)
        if k is None:
            k = self._kernels[name] = self._program.get_sycl_kernel(name)
        return k

    def _retire(self) -> None:
        # One in-order queue completes its kernels in order: the finished ones are at the front.
        while self._inflight and self._inflight[0][0].execution_status.name == "complete":
            self._inflight.popleft()

    def _launch(self, name: str, global_size: tuple[int, ...], local_size: tuple[int, ...] | None,
                args: list[Any], keep: tuple = ()) -> Any:
        """Submit kernel `name`; sizes in OpenCL order (dimension 0 first). `keep` stays alive until it completes."""
        conv = []
        for a in args:
            if isinstance(a, UsmArray):
                conv.append(a.mem)
            elif isinstance(a, np.int32):
                conv.append(ctypes.c_int32(int(a)))
            elif isinstance(a, np.float32):
                conv.append(ctypes.c_float(float(a)))
            elif isinstance(a, _Local):
                conv.append(self._dpctl.LocalAccessor("f4", (a.floats,)))
            else:
                raise TypeError(f"kernel argument of type {type(a).__name__}")
        # SYCL ranges list the slowest dimension first, the reverse of OpenCL's order.
        gs = list(reversed(global_size))
        ls = list(reversed(local_size)) if local_size is not None else None
        # submit_async, not submit: dpctl's submit waits for the kernel, which would serialize host and device.
        ev = self.session.queue.submit_async(self._kernel(name), conv, gs, ls)
        self._retire()
        # Every USM argument stays referenced until the kernel is done: a caller may drop an intermediate array
        # right after passing it on, and dpctl frees USM at once on garbage collection.
        self._inflight.append((ev, (conv, keep)))
        return ev

    def _input(self, a: Any, dtype: Any, what: str) -> tuple[UsmArray, tuple]:
        """A device array of `dtype` for an argument (numpy data is uploaded); the second item is what to keep alive."""
        dtype = np.dtype(dtype)
        if isinstance(a, UsmArray):
            if a.dtype != dtype:
                raise TypeError(f"{what}: expected a {dtype.name} device array, got {a.dtype.name}")
            return a, ()
        host = np.ascontiguousarray(np.asarray(a), dtype=dtype)
        dev = self.memory.to_device(host)
        if dev is None:
            raise MemoryError(f"sycl: no room on the device for {what} ({host.nbytes} bytes)")
        return dev, (dev,)

    def _empty(self, shape: tuple[int, ...], dtype: Any) -> UsmArray:
        arr = self.memory.alloc(shape, dtype)
        if arr is None:
            raise MemoryError(f"sycl: no room for an output of shape {shape} ({np.dtype(dtype).name})")
        return arr

    @staticmethod
    def _check_sizes(*sizes: int) -> None:
        for s in sizes:
            if s > _I32_MAX:
                raise ValueError(f"size {s} exceeds the kernels' 32-bit indexing")

    # --------------------------------------------------------------------------------------------- kernels

    def route_topk(self, logits, k):
        """[T,E] f32 router logits -> (ids [T,k] int32, weights [T,k] f32, softmax over the top k)."""
        lg, keep = self._input(logits, np.float32, "route_topk logits")
        t_rows, e_cols = lg.shape
        k = int(k)
        if not 1 <= k <= e_cols:
            raise ValueError(f"route_topk: k={k} must be in 1..{e_cols}")
        ids, w = self._empty((t_rows, k), np.int32), self._empty((t_rows, k), np.float32)
        if t_rows:
            self._launch("route_topk", (t_rows,), None,
                         [lg, np.int32(t_rows), np.int32(e_cols), np.int32(k), ids, w], keep)
        return ids, w

    def gather(self, x, rows):
        """x [T,H], rows [N] int32 -> x[rows] [N,H] (any 2- or 4-byte dtype)."""
        dt = x.dtype if isinstance(x, UsmArray) else np.asarray(x).dtype
        if dt.itemsize not in (2, 4):
            raise TypeError(f"gather: {dt.name} rows are not supported (2- or 4-byte elements)")
        xd, k1 = self._input(x, dt, "gather x")
        rd, k2 = self._input(rows, np.int32, "gather rows")
        t_rows, h = xd.shape
        n = rd.size
        out = self._empty((n, h), dt)
        if n and h:
            self._launch(f"gather_b{dt.itemsize}", (h, n), None,
                         [xd, rd, np.int32(n), np.int32(h), np.int32(t_rows), out], k1 + k2)
        return out

    def scatter_add(self, out, rows, y, scale):
        """out[rows[i]] += scale[i] * y[i] for i < N, in place, adding each row's terms in ascending i (deterministic)."""
        host_out = None
        if not isinstance(out, UsmArray):
            host_out = out
            out, _ = self._input(out, np.float32, "scatter_add out")
        elif out.dtype != np.float32:
            raise TypeError(f"scatter_add: out must be float32, got {out.dtype.name}")
        rd, k1 = self._input(rows, np.int32, "scatter_add rows")
        yd, k2 = self._input(y, np.float32, "scatter_add y")
        sd, k3 = self._input(scale, np.float32, "scatter_add scale")
        t_rows, h = out.shape
        n = rd.size
        self._check_sizes(out.size, yd.size)
        if n and h and t_rows:
            counts = self._empty((t_rows,), np.int32)
            cursor = self._empty((t_rows,), np.int32)
            starts = self._empty((t_rows + 1,), np.int32)
            idx = self._empty((n,), np.int32)
            tmp = (counts, cursor, starts, idx)
            keep = k1 + k2 + k3 + tmp + (out,)
            self._launch("fill_i32", (t_rows,), None, [counts, np.int32(t_rows), np.int32(0)])
            self._launch("fill_i32", (t_rows,), None, [cursor, np.int32(t_rows), np.int32(0)])
            self._launch("scatter_count", (n,), None, [rd, np.int32(n), np.int32(t_rows), counts])
            self._launch("scatter_scan", (1,), None, [counts, np.int32(t_rows), starts])
            self._launch("scatter_fill", (n,), None, [rd, np.int32(n), np.int32(t_rows), starts, cursor, idx])
            self._launch("scatter_sort", (t_rows,), None, [starts, np.int32(t_rows), idx])
            self._launch("scatter_apply", (h, t_rows), None,
                         [out, np.int32(t_rows), np.int32(h), starts, idx, yd, sd], keep)
        if host_out is not None:
            np.copyto(host_out, self.memory.download(out).reshape(np.shape(host_out)), casting="same_kind")

    def moe_grouped_ffn(self, x, offsets, slots, weights: ExpertPool):
        """SwiGLU experts over token groups: rows offsets[g]:offsets[g+1] of x run expert slot slots[g] -> [N,H] f32."""
        xd, k1 = self._input(x, np.float32, "moe_grouped_ffn x")
        od, k2 = self._input(offsets, np.int32, "moe_grouped_ffn offsets")
        sd, k3 = self._input(slots, np.int32, "moe_grouped_ffn slots")
        n, h = xd.shape
        g = sd.size
        if od.size != g + 1:
            raise ValueError(f"moe_grouped_ffn: {od.size} offsets for {g} groups (need groups + 1)")
        a = weights.arrays
        if weights.dtype == "f16":
            w13, kw1 = self._input(a["w_gate_up"], np.float16, "w_gate_up")
            w2, kw2 = self._input(a["w_down"], np.float16, "w_down")
            up_args, down_args = [w13], [w2]
            s_slots, two_f, hw = w13.shape
            kw = kw1 + kw2
            suffix = "f16"
        elif weights.dtype == "q8_0":
            gq, ka = self._input(a["gate_up_q"], np.int8, "gate_up_q")
            gd, kb = self._input(a["gate_up_d"], np.float16, "gate_up_d")
            dq, kc = self._input(a["down_q"], np.int8, "down_q")
            dd, kd = self._input(a["down_d"], np.float16, "down_d")
            up_args, down_args = [gq, gd], [dq, dd]
            s_slots, two_f, hw = gq.shape
            kw = ka + kb + kc + kd
            suffix = "q8_0"
            if h % QK8_0 or (two_f // 2) % QK8_0:
                raise ValueError(f"moe_grouped_ffn: Q8_0 needs hidden and ffn multiples of {QK8_0}")
        else:
            raise ValueError(f"moe_grouped_ffn: unknown expert dtype {weights.dtype!r}")
        if hw != h:
            raise ValueError(f"moe_grouped_ffn: x has hidden {h}, the experts {hw}")
        f = two_f // 2
        y = self._empty((n, h), np.float32)
        if n == 0 or h == 0:
            return y
        self._check_sizes(n * f, n * h, s_slots * two_f * h)
        act = self._empty((n, f), np.float32)
        sizes = [np.int32(g), np.int32(s_slots), np.int32(n), np.int32(h), np.int32(f)]
        keep = k1 + k2 + k3 + kw + (act,)
        if self._tiled:
            t = LINEAR_TILE
            self._launch(f"ffn_gate_up_{suffix}_tiled", (_round_up(f, t), _round_up(n, t)), (t, t),
                         [xd, od, sd, *sizes, *up_args, act])
            self._launch(f"ffn_down_{suffix}_tiled", (_round_up(h, t), _round_up(n, t)), (t, t),
                         [act, od, sd, *sizes, *down_args, y], keep)
        else:
            self._launch(f"ffn_gate_up_{suffix}", (f, n), None, [xd, od, sd, *sizes, *up_args, act])
            self._launch(f"ffn_down_{suffix}", (h, n), None, [act, od, sd, *sizes, *down_args, y], keep)
        return y

    def dequantize_q8_0(self, qs, d):
        """Q8_0 blocks (qs [..,C] int8, d [..,C/32] f16) -> [..,C] f16."""
        qd, k1 = self._input(qs, np.int8, "dequantize qs")
        dd, k2 = self._input(d, np.float16, "dequantize d")
        if qd.shape[-1] % QK8_0 or dd.size * QK8_0 != qd.size:
            raise ValueError(f"dequantize_q8_0: {qd.shape} quants do not match {dd.shape} scales")
        total = qd.size
        self._check_sizes(total)
        out = self._empty(qd.shape, np.float16)
        if total:
            self._launch("dequantize_q8_0", (total,), None, [qd, dd, np.int32(total), out], k1 + k2)
        return out

    def rmsnorm(self, x, w, eps=1e-6):
        """[T,H] f32, w [H] f32 or f16 -> x / rms(x) * w, f32."""
        xd, k1 = self._input(x, np.float32, "rmsnorm x")
        wdt = w.dtype if isinstance(w, UsmArray) else np.asarray(w).dtype
        wdt = np.dtype(np.float16) if wdt == np.float16 else np.dtype(np.float32)
        wd, k2 = self._input(w, wdt, "rmsnorm w")
        t_rows, h = xd.shape
        if wd.size != h:
            raise ValueError(f"rmsnorm: weight of {wd.size} for hidden {h}")
        out = self._empty((t_rows, h), np.float32)
        if t_rows and h:
            loc = self._reduce_local
            name = "rmsnorm_w_f16" if wdt == np.float16 else "rmsnorm_w_f32"
            self._launch(name, (t_rows * loc,), (loc,),
                         [xd, wd, np.int32(t_rows), np.int32(h), np.float32(eps), out, _Local(loc)], k1 + k2)
        return out

    def linear(self, x, w):
        """x [T,H] f32, w [O,H] f16 or f32 -> x w^T [T,O] f32."""
        xd, k1 = self._input(x, np.float32, "linear x")
        wdt = w.dtype if isinstance(w, UsmArray) else np.asarray(w).dtype
        wdt = np.dtype(np.float16) if wdt == np.float16 else np.dtype(np.float32)
        wd, k2 = self._input(w, wdt, "linear w")
        t_rows, h = xd.shape
        o, hw = wd.shape
        if hw != h:
            raise ValueError(f"linear: x has {h} columns, w has {hw}")
        self._check_sizes(t_rows * h, o * h, t_rows * o)
        out = self._empty((t_rows, o), np.float32)
        if t_rows and o:
            suffix = "w_f16" if wdt == np.float16 else "w_f32"
            args = [xd, wd, np.int32(t_rows), np.int32(h), np.int32(o), out]
            if self._tiled:
                gs = (_round_up(o, LINEAR_TILE), _round_up(t_rows, LINEAR_TILE))
                self._launch(f"linear_{suffix}", gs, (LINEAR_TILE, LINEAR_TILE), args, k1 + k2)
            else:
                self._launch(f"linear_plain_{suffix}", (o, t_rows), None, args, k1 + k2)
        return out


class _Local:
    """A __local float[floats] kernel argument."""

    __slots__ = ("floats",)

    def __init__(self, floats: int):
        self.floats = int(floats)
