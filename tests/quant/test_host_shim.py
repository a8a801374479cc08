"""host_build.block_shim's warp primitives themselves: the quant kernels' host tests trust its lane-ordered warp sum
and its xor exchange, and their shapes leave most lanes of a warp idle (a few 32-weight chunks a row), so a shim that
dropped or doubled a lane could pass them. Each lane here carries its own value: every lane of every warp must see
the exact sum, and every butterfly partner its partner's value."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
from host_build import FIBERS, block_shim, build_host_library

SOURCE = FIBERS + block_shim("hs") + r"""
// out[block, thread] = the warp sum of (lane + 1) * 2^(warp) (exact in float) and, per mask m, the xor partner's id
static void hs_kernel(float* sums, float* partners) {
    const unsigned t = threadIdx.x, lane = t % 32, warp = t / 32;
    const long long base = (long long)blockIdx.x * 256 + t;
    sums[base] = hs_host_warp_sum((float)((lane + 1) << warp));
    for (int b = 0; b < 5; ++b)
        partners[(long long)b * gridDim.x * 256 + base] = __shfl_xor_sync(0xffffffffu, (float)t, 1 << b);
}
extern "C" void hs_run(unsigned blocks, float* sums, float* partners) {
    hs_launch(blocks, 1, [&] { hs_kernel(sums, partners); });
}
"""


def test_the_shim_sums_every_lane_once_and_exchanges_with_the_xor_partner(tmp_path_factory):
    lib = build_host_library(tmp_path_factory, "host_shim_check", SOURCE, Path(__file__).parent)
    blocks = 2
    sums = np.full(blocks * 256, np.nan, dtype=np.float32)
    partners = np.full((5, blocks * 256), np.nan, dtype=np.float32)
    ptr = ctypes.POINTER(ctypes.c_float)
    lib.hs_run(ctypes.c_uint(blocks), sums.ctypes.data_as(ptr), partners.ctypes.data_as(ptr))
    t = np.arange(blocks * 256) % 256
    want = (528 << (t // 32)).astype(np.float32)  # 1 + 2 + ... + 32 = 528, times 2^warp
    assert np.array_equal(sums, want), f"warp sums {np.unique(sums)}, want {np.unique(want)}"
    for b in range(5):
        assert np.array_equal(partners[b], (t ^ (1 << b)).astype(np.float32)), f"xor {1 << b}"
