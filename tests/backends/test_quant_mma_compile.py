"""quant_mma.cu builds through NVRTC on a machine without a GPU: the wgmma path for sm_90a (what the H200 runs), with
every kernel of every block shape, its wgmmas asynchronous and next to no spills, and the mma.sync path for sm_90 and
sm_80; no load or store in either loses its address space."""

from __future__ import annotations

import re

import pytest

from strata_cuda import quant_mma
from strata_cuda.kernels import nvrtc_compile


def _nvrtc_or_skip():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as e:  # cupy or the NVRTC library is not installed here
        pytest.skip(f"NVRTC is not available here ({type(e).__name__}: {e}); it comes with 'strata-core[cuda]'")


def _ptx(arch: str) -> str:
    return nvrtc_compile(quant_mma.kernel_source(), quant_mma.SOURCE_NAME, (f"-arch={arch}", "-std=c++17")).decode()


@pytest.mark.parametrize("arch,wgmma", [("compute_90a", True), ("compute_90", False), ("compute_80", False)])
def test_each_arch_gets_its_path_and_every_kernel(arch, wgmma):
    _nvrtc_or_skip()
    ptx = _ptx(arch)
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    shapes = quant_mma.SHAPES if wgmma else quant_mma.SHAPES[:1]  # the others: the sm_90a build only
    want = {n for a in quant_mma.TYPES for b in quant_mma.TYPES for m, w in shapes
            for n in quant_mma.kernel_names(a, b, (w, w), (m, m))}
    assert len(want) == 4 * len(shapes)
    assert entries == want
    assert ("wgmma.mma_async" in ptx) is wgmma
    assert ("mma.sync.aligned.m16n8k16" in ptx) is not wgmma


def test_the_h200_cubin_builds_with_its_wgmmas_asynchronous():
    _nvrtc_or_skip()
    log: list[str] = []
    assert len(quant_mma.compile_cubin(quant_mma.WGMMA_ARCH, ("--ptxas-options=-v",), log=log)) > 10_000
    text = "".join(log)
    assert "Compiling entry function 'strata_qm_gate_up_q4_k'" in text  # ptxas's notes are in the log
    # spills: none in any kernel with this tree's NVRTC; the bound leaves room for another ptxas's few bytes, not for
    # the 194-268 bytes a thread the 128-row q6_k kernels spilled at 9251d97
    spills, name = {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        name = m.group(1) if m else name
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            spills[name] = max(int(m.group(1)), int(m.group(2)))
    assert len(spills) == 4 * len(quant_mma.SHAPES) and max(spills.values()) <= 64, spills
    # ptxas serializes every wgmma (a wait after each) when one sits on a path it cannot prove warp-uniform (C7518) or
    # when registers run short (C7511); the next step's decode then no longer overlaps the tensor cores
    assert "C7518" not in text and "serialized" not in text, text


@pytest.mark.parametrize("arch", ["compute_90a", "compute_80"])
def test_every_load_and_store_names_its_state_space(arch):
    """A pointer that lost its address space (cast from an integer, or kept in a struct) compiles to a generic ld/st
    (LD.E / ST.E in SASS), slower than ld.global.nc / st.shared: the q6_k quant loads and the decoded tiles' stores
    were generic until 2026-12-04."""
    _nvrtc_or_skip()
    generic = re.findall(r"^\s*(?:@!?%p\d+\s+)?((?:ld|st)(?:\.(?:v2|v4|[usbf](?:8|16|32|64)))+)\s", _ptx(arch), re.M)
    assert not generic, sorted(set(generic))


def test_takes_only_whole_steps_tiles_and_known_types():
    assert quant_mma.takes("q4_k", "q6_k", 2048, 768)
    assert not quant_mma.takes("q4_k", "q6_k", 2048, 768, biased=True)
    assert not quant_mma.takes("q5_k", "q6_k", 2048, 768)
    assert not quant_mma.takes("q4_k", "q6_k", 2048, 640)  # 640 weights: not whole trips of four K steps
    assert quant_mma.takes("q4_k", "q6_k", 2048, 768, block_rows=(128, 128))
    assert not quant_mma.takes("q4_k", "q6_k", 2048, 768, block_rows=(64, 256))
    assert quant_mma.takes("q4_k", "q6_k", 2048, 768, block_rows=(128, 256), input_rows=(256, 128))
    assert not quant_mma.takes("q4_k", "q6_k", 2048, 768, input_rows=(256, 256))  # 256 x 256: no such block
