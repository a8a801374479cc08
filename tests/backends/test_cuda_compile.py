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
