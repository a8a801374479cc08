"""The 'cpu' backend: numpy on the host, the reference every other backend is checked against.

Its kernels are the reference's, with the one-token shapes of decode (rmsnorm, route_topk, scatter_add into one
row) computed by the same numpy operations in the same order without the reference's generic steps: the same bits
(tests/unit/test_host_kernels.py), fewer host calls. Its memory says `host_arrays`: device arrays are numpy arrays
and every call is synchronous, so the composed layer ops may run decode without uploads, events or per-layer
carves (`strata_core.runtime.layer_ops`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from strata_core import __version__
from strata_core.api import API_VERSION, EXPERT_FORMATS
from strata_core.api.backend import Backend, DeviceSession, PinnedBudget, PinnedBuffer, ProbeResult
from strata_core.api.facts import DeviceCaps, DeviceInfo, DeviceType, HostInfo, PlatformDefaults
from strata_core.api.hookspecs import hookimpl
from strata_core.hostinfo import probe_host
from strata_core.reference.kernels import ReferenceKernels

NAME = "cpu"

#: The host computes with numpy: no copy engine, no mapped memory, no graphs; the reference's expert formats.
CPU_CAPS = DeviceCaps(async_copies=False, host_mapped_memory=False, graph_capture=False, peer_copies=False,
                      fused_layer_ops=False, expert_formats=EXPERT_FORMATS)


@dataclass(frozen=True)
class CpuDevice:
    """The host as a device: numpy arrays in host RAM, the reference kernels, budgeted (not page-locked) buffers."""

    info: DeviceInfo

    def platform_defaults(self, host: HostInfo) -> PlatformDefaults:
        """Host defaults: no VRAM reserve beyond the OS's, chunk ceiling 4096, the share is moot (all of it is CPU)."""
        return PlatformDefaults(chunk_ceiling_tokens=4096, vram_reserve_mib=1024, cpu_share_default=False,
                                cpu_share_reason="the device is the CPU", source="cpu backend",
                                kernel_f32_copy_limit_bytes=F32_COPY_LIMIT_BYTES)

    def open(self, plan: Any) -> DeviceSession:
        """A session over host memory whose pinned allocator charges the plan's budget."""
        budget = PinnedBudget.for_plan(plan)
        return DeviceSession(memory=HostMemory(), kernels=HostKernels(), budget=budget,
                             pinned=HostPinnedAllocator(budget))


def host_device_info(host: HostInfo) -> DeviceInfo:
    """The DeviceInfo of the host as the cpu backend's device: its RAM stands for VRAM."""
    return DeviceInfo(backend=NAME, vendor="none", name=host.cpu.name, arch="host",
                      vram_total_bytes=host.ram_total_bytes, vram_free_bytes=host.ram_available_bytes,
                      driver_model="host", unified_memory=True, device_type=DeviceType.CPU, caps=CPU_CAPS)


def probe() -> ProbeResult:
    """Always available: the host itself is the device."""
    return ProbeResult(available=True, reason="numpy on the host", devices=(CpuDevice(host_device_info(probe_host())),),
                       score=10, version=f"numpy {np.__version__}")


def describe(info: DeviceInfo) -> CpuDevice:
    """A cpu device from a profile's facts (plans for that host; opening it computes on this one)."""
    return CpuDevice(replace(info, backend=NAME))


#: A read-only f16/bf16 weight matrix `linear` multiplies is kept as f32 up to this many bytes of f32 copy
#: (converting the tiny model's [2048,128] f16 LM head took 0.77-0.86 ms a token, most of a decode step's host time).
F32_COPY_LIMIT_BYTES = 64 << 20


#: reduceat's one segment (every routed row of a one-row residual adds into row 0; np.add.reduce over axis 0
#: sums in another order, other bits)
_ROW0 = np.zeros(1, dtype=np.intp)
#: a one-row scatter_add of at most this many rows sums them with adds (reduceat's order), more with reduceat
SEQUENTIAL_ROWS = 8
#: route_topk of one row takes up to this many argmaxes instead of a stable sort of the row
TOPK_BY_ARGMAX = 8
#: numpy adds a contiguous row of fewer than this many f32 in order (from 8 on, pairwise in 8 partial sums)
SEQUENTIAL_SUM = 8
_NEG_INF = np.float32(-np.inf)
_NEG_ZERO = np.float32(-0.0)
#: compared with an array's dtype (a dtype against a dtype: no conversion of np.float32 on every call)
_F32 = np.dtype(np.float32)
#: experts_row adds a token's k weighted expert rows and its residual in one reduction over k + 1 rows, which numpy
#: adds in order up to 7 rows (as pairwise_sum does below 8); from k = 7 on, scatter_add's own steps
ROW_COMBINE_MAX_K = 6


class RowStep:
    """One decode token's buffers for HostKernels.route_row and experts_row: views of one f32 block the layer op
    carves once a step (`HostKernels.row_step_size` elements), and of the token's residual x [1,H]."""

    def __init__(self, x: np.ndarray, k: int, experts: int, block: np.ndarray):
        h = x.shape[1]
        self.x, self.x0, self.k, self.h, self.block = x, x[0], k, h, block
        #: the combine's row order: the routed rows from the second expert on, then the first, then the residual
        #: (see experts_row)
        self.rotate = k <= ROW_COMBINE_MAX_K
        o = (2 * k + 2) * h
        rows = block[:o].reshape(2 * k + 2, h)  # views of one block: a view costs a few hundred ns, once a step
        self.xr, self.xr0 = rows[:1], rows[0]  # x*x, then x / rms(x): rmsnorm's steps
        self.xg, self.xn = rows[1:k + 1], rows[1:2]  # the FFN's k input rows, each rmsnorm(x) (a one-token gather)
        self.yb, self.y, self.ylast = rows[k + 1:], rows[k + 1:2 * k + 1], rows[2 * k + 1]  # its k outputs, x
        self.row = block[o:o + experts]
        self.logits = self.row.reshape(1, experts)
        o += experts
        self.col = block[o:o + k + 1].reshape(k + 1, 1)  # the groups' routing weights, 1.0 for the residual's row
        self.col[k, 0] = 1.0
        #: the routing weights in the FFN's group order (route_row writes them)
        self.scales = block[o:o + k]
        #: the FFN's group slots (int32: the same 4 bytes an element)
        self.slots = block[o + k + 1:o + 2 * k + 1].view(np.int32)

    def weights_by_id(self) -> np.ndarray:
        """The routing weights route_row wrote, experts ascending (a new array)."""
        sc = self.scales
        return np.concatenate((sc[-1:], sc[:-1])) if self.rotate else sc.copy()


class HostKernels(ReferenceKernels):
    """The reference kernels; one-row calls (decode) skip the reference's generic steps, to the same bits.

    `linear` keeps the f32 form of a read-only non-f32 weight (the engine makes the dense weights read-only on the
    host) up to F32_COPY_LIMIT_BYTES each: the reference converts it on every call, to the same values.
    `f32_copy_bytes` is the host RAM those copies take.
    """

    #: every kernel gives the reference's bits (tests/unit/test_host_kernels.py): the kit lists its lane as such
    same_bits_as_reference = True

    def __init__(self):
        self._f32: dict[int, tuple[Any, np.ndarray]] = {}
        self.f32_copy_bytes = 0
        self._row_step: RowStep | None = None

    def linear(self, x, w, out=None):
        """See the reference; a read-only f16 weight is converted to f32 once, not every call."""
        got = self._f32.get(id(w))
        if got is not None and got[0]() is w and out is not None and type(x) is np.ndarray and x.dtype == _F32 \
                and not w.flags.writeable:
            return np.matmul(x, got[2], out=out)  # a weight seen before (decode's router and LM head)
        if out is not None and type(w) is np.ndarray and w.dtype == _F32 and type(x) is np.ndarray \
                and x.dtype == _F32:
            return np.matmul(x, w.T, out=out)  # the reference's call, its no-op conversions left out
        if out is None or type(w) is not np.ndarray or w.dtype == _F32 or w.flags.writeable \
                or w.size * 4 > F32_COPY_LIMIT_BYTES:
            return super().linear(x, w, out=out)
        if got is None or got[0]() is not w:
            w32 = w.astype(np.float32)
            got = (weakref.ref(w), w32, w32.T)
            self._f32[id(w)] = got
            self.f32_copy_bytes += int(w32.nbytes)
        return np.matmul(np.asarray(x, dtype=np.float32), got[2], out=out)

    @staticmethod
    def row_step_size(hidden: int, experts: int, k: int) -> int:
        """The f32 elements of one decode token's RowStep block."""
        return (2 * k + 2) * hidden + experts + 2 * k + 1

    def row_step(self, x, k, experts, block):
        """A RowStep over a one-row f32 residual x and a block of row_step_size f32 elements; None where x is not one
        or a primitive it stands for is not HostKernels' own (a subclass's or a patched one: the layer op's general
        path runs it). The same x and block objects as the last call's (an arena that hands out the same views every
        step): the last RowStep again, its constant row set again."""
        cls, own = type(self), self.__dict__
        for name, f in _ROW_PRIMITIVES.items():
            if getattr(cls, name) is not f or name in own:
                return None
        last = self._row_step
        if last is not None and last.x is x and last.block is block and last.k == k:
            last.col[k, 0] = 1.0  # other buffers may have been carved over the block since
            return last
        if type(x) is not np.ndarray or x.ndim != 2 or x.shape[0] != 1 or x.dtype != _F32 \
                or not x.flags.c_contiguous or k < 1 or k >= experts:
            return None
        st = self._row_step = RowStep(x, int(k), int(experts), block)
        return st

    def route_row(self, st, norm_w, router_w, eps=1e-6):
        """A decode token's routing in the bits of rmsnorm, linear and route_topk: the k expert ids ascending (Python
        ints), rmsnorm(st.x) in every row of st.xg and the softmax weights in st.scales (the FFN's group order, see
        experts_row); None (st.x unchanged) where a NaN tops the logits, the top k repeats an id or norm_w is not f32."""
        if type(norm_w) is not np.ndarray or norm_w.dtype != _F32:
            return None
        x, xr = st.x, st.xr
        # rmsnorm's one-row steps (see rmsnorm), the last one writing every gathered row at once
        np.multiply(x, x, out=xr)
        m = np.float32(float(np.add.reduce(st.xr0)) / st.h)
        np.multiply(x, 1.0 / np.sqrt(m + eps), out=xr)
        np.multiply(xr, norm_w, out=st.xg)
        got = self._f32.get(id(router_w))
        if got is not None and got[0]() is router_w and not router_w.flags.writeable:
            np.matmul(st.xn, got[2], out=st.logits)  # linear's call for a weight seen before
        else:
            self.linear(st.xn, router_w, out=st.logits)
        # route_topk's k argmaxes (see there), the picks as Python ints
        row, k = st.row, st.k
        left = row.copy()
        pick = left.argmax
        picks = []
        for _ in range(k - 1):
            i = int(pick())
            picks.append(i)
            left[i] = _NEG_INF
        picks.append(int(pick()))
        top0 = row.item(picks[0])
        if top0 != top0 or len(set(picks)) < k:
            return None
        experts = sorted(picks)
        order = experts[1:] + experts[:1] if st.rotate else experts
        # route_topk's softmax elementwise, on the picks in the FFN's order (each element the same whatever its
        # place); the sum in the top k's order
        sc = st.scales
        # top - top[:1]: the difference of two f32 values in f64, rounded to f32 as it is stored, is the f32
        # subtraction's (f64's 53 bits leave the second rounding innocuous), without a take and a subtract call
        item = row.item
        sc[:] = [item(i) - top0 for i in order]
        np.exp(sc, out=sc)
        if k < SEQUENTIAL_SUM:
            # numpy's order below 8 elements (see route_topk), as f32 scalar adds
            e = dict(zip(order, sc.tolist()))
            s = np.float32(e[picks[0]])
            for p in picks[1:]:
                s = s + e[p]
        else:
            s = np.add.reduce(sc.take([order.index(p) for p in picks]))
        np.divide(sc, s, out=sc)
        return experts

    def experts_row(self, st, slots, pool):
        """A decode token's experts after route_row: moe_grouped_ffn of st.xg's rows over `slots` (of route_row's
        experts, ascending) and their weighted sum added into st.x, in the bits of gather, moe_grouped_ffn and
        scatter_add of one row."""
        k = st.k
        if not st.rotate:
            st.slots[:] = slots
            y = self.moe_grouped_ffn(st.xg, _offsets(k), st.slots, pool, out=st.y)
            self.scatter_add(st.x, _zero_rows(k), y, st.scales)
            return
        # scatter_add of one row sums x0 + (t0 + ((t1 + t2) + ...)) (t = weighted rows; see scatter_add); a sum is
        # the same in either order, so that is (((t1 + t2) + ...) + t0) + x0: one ordered reduction over the rows
        # [t1 .. t(k-1), t0, x0], the FFN's groups given in that order (each row is its own expert's, wherever it
        # lies) and x0 scaled by 1.0 (exact)
        st.slots[:] = slots[1:] + slots[:1]
        y = self.moe_grouped_ffn(st.xg, _offsets(k), st.slots, pool, out=st.y)
        if y is not st.y:
            st.y[...] = y
        yb = st.yb
        st.ylast[...] = st.x0
        np.multiply(yb, st.col, out=yb)
        np.add.reduce(yb, 0, None, st.x, True, _NEG_ZERO)

    def rmsnorm(self, x, w, eps=1e-6, out=None):
        """See the reference; f32 arrays into `out`: np.mean's own sum and divide, spelled out."""
        if out is None or type(x) is not np.ndarray or type(w) is not np.ndarray or x.ndim != 2 \
                or x.dtype != _F32 or w.dtype != _F32:
            return super().rmsnorm(x, w, eps, out=out)
        if x.shape[0] == 1 and not np.may_share_memory(x, out):
            # one row: np.mean's f32 sum / intp count (computed in f64, cast to f32), + eps, sqrt and 1/ on the f32
            # scalar: each an IEEE-rounded f32 operation, the same bits as the (1, 1) arrays give, without their
            # calls; x * x and x * r go through `out` (no temporaries)
            np.multiply(x, x, out=out)
            m = np.float32(float(np.add.reduce(out[0])) / x.shape[1])
            np.multiply(x, 1.0 / np.sqrt(m + eps), out=out)
            return np.multiply(out, w, out=out)
        s = np.add.reduce(x * x, 1, None, None, True)
        np.true_divide(s, np.intp(x.shape[1]), out=s, casting="unsafe")
        return np.multiply(x * (1.0 / np.sqrt(s + eps)), w, out=out)

    def route_topk(self, logits, k, out=None):
        """See the reference; one row of f32 logits into `out`: the same sort, exp and sum on the row itself."""
        if out is None or type(logits) is not np.ndarray or logits.dtype != _F32 or logits.shape[0] != 1:
            return super().route_topk(logits, k, out=out)
        row = logits[0]
        if k <= TOPK_BY_ARGMAX and k < row.shape[0]:
            # k argmaxes: each takes the largest value left, ties to the lower id (argmax's first), which is the
            # stable sort's order; a NaN (argmax's first pick, the sort's last) or a -inf reaching the top k (where
            # an argmax may pick a taken id again): the sort decides
            left = row.copy()
            pick = left.argmax
            picks = []
            for _ in range(k - 1):
                i = pick()
                picks.append(i)
                left[i] = _NEG_INF
            picks.append(pick())
            top = row.take(picks)
            # a repeated id: the last pick met only -inf left (a taken id among them); else every pick is the
            # sort's, -inf ties included (argmax takes the lowest id left)
            if top[0] == top[0] and len(set(picks)) == k:
                out[0][0] = picks
                e = np.exp(top - top[:1])
                if k < SEQUENTIAL_SUM:
                    # the row's sum as f32 scalars: numpy sums fewer than 8 elements in order, a0 + a1 + ...
                    # (8 and more pairwise), the same bits without a reduction call
                    it = iter(e)
                    s = next(it)
                    for v in it:
                        s = s + v
                    np.divide(e, s, out=out[1][0])
                else:
                    np.divide(e, np.add.reduce(e, 0, None, None, True), out=out[1][0])
                return out
        order = np.argsort(-row, kind="stable")[:k]
        top = row[order]
        e = np.exp(top - top[:1])
        out[0][0] = order
        np.divide(e, e.sum(keepdims=True), out=out[1][0])
        return out

    def gather(self, x, rows, out=None):
        """See the reference; from a one-row x every row is row 0: a broadcast copy into `out`."""
        if out is None or type(x) is not np.ndarray or x.ndim != 2 or x.shape[0] != 1 or type(out) is not np.ndarray \
                or out.dtype != x.dtype:
            return super().gather(x, rows, out=out)
        out[...] = x
        return out

    def scatter_add(self, out, rows, y, scale):
        """See the reference; into a one-row `out` every row adds to row 0, summed in the given order."""
        if type(out) is not np.ndarray or out.shape[0] != 1 or type(y) is not np.ndarray or len(rows) == 0 \
                or type(scale) is not np.ndarray or y.dtype != _F32 or scale.dtype != _F32:
            return super().scatter_add(out, rows, y, scale)
        t = y * scale[:, None]
        n = len(t)
        if 2 <= n <= SEQUENTIAL_ROWS:
            # reduceat's sum of one segment of n <= 8 rows, spelled out: the first row plus the others summed in
            # order (a reduction over the outer axis adds its up to 7 rows in order; from -0.0, which leaves every
            # first term as it is, signed zeros included); three calls instead of reduceat's setup
            rest = np.add.reduce(t[1:], 0, None, None, False, _NEG_ZERO)
            np.add(t[0], rest, out=rest)
            out[0] += rest
            return
        out += np.add.reduceat(t, _ROW0, axis=0)


#: the primitives route_row and experts_row stand for (their bits), as HostKernels defines them
_ROW_PRIMITIVES = {name: getattr(HostKernels, name) for name in ("rmsnorm", "linear", "route_topk", "gather",
                                                                  "scatter_add")}
_OFFSETS: dict[int, np.ndarray] = {}
_ZERO_ROWS: dict[int, np.ndarray] = {}


def _offsets(k: int) -> np.ndarray:
    """0..k as int32: k groups of one row each (kept; read-only)."""
    a = _OFFSETS.get(k)
    if a is None:
        a = _OFFSETS[k] = np.arange(k + 1, dtype=np.int32)
        a.flags.writeable = False
    return a


def _zero_rows(k: int) -> np.ndarray:
    """k zeros as int32: every routed row of one token adds to row 0 (kept; read-only)."""
    a = _ZERO_ROWS.get(k)
    if a is None:
        a = _ZERO_ROWS[k] = np.zeros(k, dtype=np.int32)
        a.flags.writeable = False
    return a


class HostMemory:
    """DeviceMemory whose 'device' is host RAM: arrays are numpy arrays, copies are synchronous."""

    #: device arrays are host numpy arrays and nothing is asynchronous (layer ops may skip uploads and events)
    host_arrays = True

    def alloc(self, shape, dtype):
        """A numpy array, or None when the host has no room."""
        try:
            return np.empty(shape, dtype=dtype)
        except MemoryError:
            return None

    def free(self, arr):
        """Nothing to do: numpy frees on the last reference."""

    def upload(self, dst, src, stream=None):
        """Copy into dst."""
        if type(src) is np.ndarray and src.shape == dst.shape:
            np.copyto(dst, src)  # asarray and reshape would be no-ops; copyto's casting is "same_kind" by default
            return
        np.copyto(dst, np.asarray(src).reshape(dst.shape), casting="same_kind")

    def download(self, src, stream=None):
        """A host copy of src."""
        return np.array(src, copy=True)

    def to_device(self, src):
        """A copy of src."""
        return np.array(src, copy=True)

    def new_stream(self):
        """Streams are nominal on the host."""
        return None

    def new_event(self):
        """Events are nominal on the host."""
        return None

    def record(self, event, stream):
        """Nothing to record: work is synchronous."""

    def wait(self, stream, event):
        """Nothing to wait for: work is synchronous."""

    def synchronize(self, stream=None):
        """Nothing to wait for: work is synchronous."""

    def mem_info(self):
        """(available, total) host RAM."""
        h = probe_host()
        return h.ram_available_bytes, h.ram_total_bytes


class HostPinnedAllocator:
    """Host memory the budget accounts for; the cpu backend has nothing to page-lock for a copy engine."""

    kind = "numpy"

    def __init__(self, budget: PinnedBudget):
        self.budget = budget

    def alloc(self, nbytes, from_floor=False):
        """A budgeted numpy buffer, or None when the budget or the host says no."""
        if not self.budget.take(nbytes, from_floor=from_floor):
            return None
        try:
            return PinnedBuffer(array=np.empty(int(nbytes), dtype=np.uint8), nbytes=int(nbytes), kind="alloc",
                                from_floor=from_floor)
        except MemoryError:
            self.budget.give(nbytes)
            return None

    def register(self, array, from_floor=False):
        """Account for existing memory in the budget, or None when it does not fit."""
        nbytes = int(array.nbytes)
        if not self.budget.take(nbytes, from_floor=from_floor):
            return None
        return PinnedBuffer(array=array.reshape(-1).view(np.uint8), nbytes=nbytes, kind="register",
                            from_floor=from_floor)

    def free(self, buf):
        """Give the buffer's bytes back (idempotent)."""
        if not buf.freed:
            buf.freed = True
            self.budget.give(buf.nbytes)


BACKEND = Backend(name=NAME, vendor="none", probe=probe, version=__version__, api_version=API_VERSION,
                  install_hint="", description="numpy on the host (the reference)", describe=describe)


@hookimpl
def strata_backends():
    """The cpu backend."""
    return [BACKEND]
