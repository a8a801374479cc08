"""moe.cu compiles to PTX through NVRTC on a machine without a GPU (NVRTC needs no driver)."""

from __future__ import annotations

import re

import pytest

from strata_cuda.kernels import KERNEL_NAMES, compile_to_ptx, kernel_source


def _nvrtc_or_skip():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as e:  # cupy or the NVRTC library is not installed here
        pytest.skip(f"NVRTC is not available here ({type(e).__name__}: {e}); it comes with 'strata-core[cuda]'")


@pytest.mark.parametrize("arch", ["compute_75", "compute_90"])
def test_moe_cu_compiles_to_ptx_with_every_kernel(arch):
    _nvrtc_or_skip()
    ptx = compile_to_ptx(arch=arch)
    entries = set(re.findall(rb"\.entry\s+(\w+)", ptx))
    assert entries == {n.encode() for n in KERNEL_NAMES}
    assert f".target sm_{arch.split('_')[1]}".encode() in ptx


def test_a_compile_error_carries_nvrtcs_log():
    _nvrtc_or_skip()
    broken = kernel_source().replace("const float v = row[e];", "const float v = row[e] +;")
    with pytest.raises(RuntimeError, match=r"NVRTC failed on moe.cu(.|\n)*expected an expression"):
        compile_to_ptx(source=broken)


def test_the_source_needs_no_headers_and_no_warp_intrinsics():
    # the rocm path compiles the same text through hiprtc: nothing vendor-specific may creep in
    src = kernel_source()
    code = "\n".join(line.split("//", 1)[0] for line in src.splitlines())
    assert "#include" not in code
    for intrinsic in ("__shfl", "__ballot", "__activemask", "warpSize", "__half", "asm("):
        assert intrinsic not in code, intrinsic


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_moe_fast_cu_compiles_to_ptx_with_every_kernel_and_no_atomics(arch):
    _nvrtc_or_skip()
    from strata_cuda import fast
    ptx = fast.compile_to_ptx(arch=arch)
    entries = set(re.findall(rb"\.entry\s+(\w+)", ptx))
    assert entries == {n.encode() for n in fast.KERNEL_NAMES}
    # no atomic anywhere: routing positions, combine and the decode sums are owned by one thread each
    assert not re.search(rb"\b(atom|red)\.", ptx)
    code = "\n".join(line.split("//", 1)[0] for line in fast.kernel_source().splitlines())
    assert "atomic" not in code


def test_moe_cu_has_no_atomics_either():
    _nvrtc_or_skip()
    ptx = compile_to_ptx(arch="compute_90")
    assert not re.search(rb"\b(atom|red)\.", ptx)


def test_the_size_classes_bound_the_padding():
    import numpy as np
    from strata_cuda.fast import ROW_ALIGN, StackLayout, class_rows
    c = np.arange(1, 20000)
    r = class_rows(c)
    assert np.all(r >= c) and np.all(r % ROW_ALIGN == 0)
    assert np.all(r[c > 16] <= 1.5 * c[c > 16]) and np.all(r[c <= 16] <= 16)
    assert len(np.unique(class_rows(np.arange(17, 4097)))) == 2 * 8  # two classes an octave: 24, 32, ..., 4096
    # the device's stack_cap (moe_fast.cu), written out: the same classes
    def device_cap(v: int) -> int:
        p = 1
        while p < v:
            p <<= 1
        mid = 3 * p // 4
        out = mid if (mid >= v and mid % 8 == 0) else p
        return max(out, 8)
    assert [device_cap(int(v)) for v in c[:5000]] == r[:5000].tolist()
    # the compact layout: groups back to back, each starting aligned, no group padded to the largest
    counts = np.array([3900, 1, 7, 250, 2])
    lay = StackLayout.of(counts, "grouped")
    assert list(lay.row0) == [0, 3904, 3912, 3920, 4176] and lay.rows == 4184
    lay = StackLayout.of(counts, "classes")
    assert list(lay.cap) == [4096, 8, 8, 256, 8] and lay.rows == int(lay.cap.sum())
