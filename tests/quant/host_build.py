"""Host builds (g++) of the CUDA sources' test shims, built once per test session for every xdist worker.

A build is keyed by the sha256 of its whole source text and g++ command, so a changed kernel, shim or flag builds
anew. The shared folder is the session's base temp folder (under xdist: the parent of each worker's own), and a
lock file makes a second worker wait for the first's build instead of compiling the same text at the same time.

FIBERS is the C++ both shims launch blocks with: a block's GPU threads run as fibers (ucontext) of one OS thread,
each until it waits at a barrier or ends, then the next. 256 OS threads a block meeting at hundreds of barriers on
two shared cores cost 10-20 s a test; fibers keep the same barrier semantics (no thread passes a barrier before
all its threads reached it), at a context switch each.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

try:
    import fcntl
except ImportError:  # not POSIX: no lock, two workers may build the same text (each into its own file first)
    fcntl = None

FIBERS = r"""
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <ucontext.h>
#include <vector>
// A block's threads as fibers: qh_run_block resumes each in turn; a fiber gives the OS thread back only when it
// waits at a barrier (qh_barrier) or ends. Sweeps alternate between ascending and descending thread order, so a
// thread that reads what another writes without a barrier between sees the wrong value in one of the two orders.
// A sweep in which no fiber arrived at a barrier or ended means every live thread waits at a barrier no other will
// reach (a divergent __syncthreads): the block is abandoned and qh_failures() counts it, the caller fails.
static const size_t QH_STACK_BYTES = 256 * 1024;
static std::vector<ucontext_t> qh_ctx;
static std::vector<char*> qh_stacks;
static std::vector<unsigned char> qh_done;
static ucontext_t qh_main;
static unsigned qh_cur = 0;
static unsigned long long qh_progress = 0;
static int qh_failed_blocks = 0;
extern "C" int qh_failures() { return qh_failed_blocks; }
static const std::function<void()>* qh_body = nullptr;
static inline void qh_yield() { swapcontext(&qh_ctx[qh_cur], &qh_main); }
struct qh_barrier {
    unsigned n, arrived = 0, gen = 0;
    explicit qh_barrier(unsigned count) : n(count) {}
    void arrive_and_wait() {
        const unsigned g = gen;
        ++qh_progress;
        if (++arrived == n) { arrived = 0; ++gen; return; }
        while (gen == g) qh_yield();
    }
};
static void qh_entry() { (*qh_body)(); qh_done[qh_cur] = 1; ++qh_progress; }
static void qh_run_block(unsigned block, const std::function<void()>& body, void (*set_thread)(unsigned)) {
    while (qh_stacks.size() < block) qh_stacks.push_back(static_cast<char*>(std::malloc(QH_STACK_BYTES)));
    qh_ctx.assign(block, ucontext_t{});
    qh_done.assign(block, 0);
    qh_body = &body;
    for (unsigned t = 0; t < block; ++t) {
        getcontext(&qh_ctx[t]);
        qh_ctx[t].uc_stack.ss_sp = qh_stacks[t];
        qh_ctx[t].uc_stack.ss_size = QH_STACK_BYTES;
        qh_ctx[t].uc_link = &qh_main;
        makecontext(&qh_ctx[t], qh_entry, 0);
    }
    for (unsigned left = block, sweep = 0; left > 0; ++sweep) {
        const unsigned long long before = qh_progress;
        for (unsigned i = 0; i < block; ++i) {
            const unsigned t = sweep % 2 ? block - 1 - i : i;
            if (qh_done[t]) continue;
            qh_cur = t;
            set_thread(t);
            swapcontext(&qh_main, &qh_ctx[t]);
            if (qh_done[t]) --left;
        }
        if (left > 0 && qh_progress == before) {
            std::fprintf(stderr, "host shim: %u threads wait at a barrier the others never reach\n", left);
            ++qh_failed_blocks;
            return;
        }
    }
}
"""



def block_shim(p: str) -> str:
    """C++ standing in for CUDA around a kernel source built for the host, its names prefixed `p`: dim3 indices,
    the vector types, the bit-cast and rounding intrinsics, __syncthreads / __syncwarp / __shfl_xor_sync over the
    fibers' barriers (8 warps of 32), `<p>_host_warp_sum` (every lane's value through memory once, summed in lane
    order by each lane), CUDA's qualifiers as nothing, and `<p>_launch(gx, gy, body)`: 256-thread blocks of a gx by
    gy grid, one block at a time. Goes after FIBERS and the source's own host defines."""
    return r"""
#include <algorithm>
#include <cmath>
#include <cstring>
using std::min;
struct qt_dim3 { unsigned int x = 1, y = 1, z = 1; };
struct uint4 { unsigned int x, y, z, w; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
static inline float2 make_float2(float a, float b) { return float2{a, b}; }
static qt_dim3 threadIdx, blockIdx, blockDim, gridDim;
static qh_barrier* P_warp_bar[8];
static qh_barrier* P_block_bar;
static float P_xchg[256];
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
static inline void __syncwarp() { P_warp_bar[threadIdx.x / 32]->arrive_and_wait(); }
static inline void __syncthreads() { P_block_bar->arrive_and_wait(); }
static inline float __shfl_xor_sync(unsigned, float v, int m) {
    const unsigned t = threadIdx.x;
    P_xchg[t] = v;
    P_warp_bar[t / 32]->arrive_and_wait();
    const float r = P_xchg[(t & ~31u) | ((t & 31u) ^ (unsigned)m)];
    P_warp_bar[t / 32]->arrive_and_wait();
    return r;
}
static inline float P_host_warp_sum(float v) {
    const unsigned t = threadIdx.x, w0 = t & ~31u;
    P_xchg[t] = v;
    P_warp_bar[t / 32]->arrive_and_wait();
    float s = 0.0f;
    for (unsigned l = 0; l < 32; ++l) s += P_xchg[w0 + l];
    P_warp_bar[t / 32]->arrive_and_wait();
    return s;
}
#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__
#define __launch_bounds__(...)
static void P_set_thread(unsigned t) { threadIdx.x = t; }
static void P_launch(unsigned gx, unsigned gy, const std::function<void()>& body) {
    blockDim.x = 256; gridDim.x = gx; gridDim.y = gy;
    for (unsigned by = 0; by < gy; ++by)
        for (unsigned bx = 0; bx < gx; ++bx) {
            std::vector<qh_barrier> bars(8, qh_barrier(32));
            for (int w = 0; w < 8; ++w) P_warp_bar[w] = &bars[w];
            qh_barrier block_bar(256);
            P_block_bar = &block_bar;
            blockIdx.x = bx;
            blockIdx.y = by;
            qh_run_block(256, body, P_set_thread);
        }
}
""".replace("P_", f"{p}_")


GXX_FLAGS = ("-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w")


def session_build_dir(tmp_path_factory) -> Path:
    """The folder every worker of this test session shares (the base temp folder, or under xdist its parent)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if base.name.startswith("popen-gw") else base
    d = root / "host_builds"
    d.mkdir(parents=True, exist_ok=True)
    return d


def build_host_library(tmp_path_factory, stem: str, source: str, include_dir: Path,
                       includes: list[Path] = ()) -> ctypes.CDLL:
    """`source` built by g++ into a shared library, once per session for all workers; a build error fails.

    The key hashes the command, the source and the text of `includes` (the headers it includes). Skipped only
    where there is no g++.
    """
    if shutil.which("g++") is None:
        pytest.skip(f"no g++ on this machine: the host build of {stem} needs a C++20 compiler")
    cmd = ["g++", *GXX_FLAGS, f"-I{include_dir}"]
    text = "\0".join([*cmd, source, *(Path(h).read_text() for h in includes)])
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    d = session_build_dir(tmp_path_factory)
    lib = d / f"{stem}-{key}.so"
    with open(d / f"{stem}-{key}.lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():
            src = d / f"{stem}-{key}.{os.getpid()}.cpp"
            part = d / f"{stem}-{key}.{os.getpid()}.so"
            src.write_text(source)
            done = subprocess.run([*cmd, str(src), "-o", str(part)], capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
            os.replace(part, lib)  # whole or absent: a worker never loads a half-written library
    return CheckedLibrary(ctypes.CDLL(str(lib)))


class CheckedLibrary:
    """A host build whose every call fails (AssertionError) when a block it launched deadlocked at a barrier."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib

    def __getattr__(self, name: str):
        fn = getattr(self._lib, name)
        failures = self._lib.qh_failures

        def call(*args):
            before = failures()
            out = fn(*args)
            assert failures() == before, f"{name}: a block's threads waited at a barrier the others never reached"
            return out

        return call


def pointer(a: np.ndarray) -> ctypes.c_void_p:
    """A numpy array's data as the void pointer a host build's wrappers take."""
    return a.ctypes.data_as(ctypes.c_void_p)


def nvrtc_or_skip() -> None:
    """Skip the calling test where cupy's NVRTC is not installed (its PTX checks need it; the host builds do not)."""
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as e:  # cupy or NVRTC not installed here
        pytest.skip(f"NVRTC is not available here ({type(e).__name__}: {e})")
