"""The portable dequantization sources against the numpy oracle: kits/opencl/quants.cl run on Intel's CPU OpenCL
runtime, strata_cuda/quants.cuh compiled to PTX by NVRTC (no GPU needed) and, where there is a GPU, run on it.

Both must give the oracle's float32 bits exactly: every weight is at most two rounded products and one rounded
difference, and the sources keep the compiler from fusing them (FP_CONTRACT OFF, __fmul_rn/__fsub_rn).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from strata_core.reference import quants as Q

REPO = Path(__file__).resolve().parents[2]
CL_SOURCE = REPO / "strata_core" / "kits" / "opencl" / "quants.cl"
CUH_SOURCE = REPO / "backends" / "cuda" / "strata_cuda" / "quants.cuh"
#: Byte offsets of the f16 fields of each block: random bytes there are made finite, the rest stays random.
F16_FIELDS = {"q8_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def _random_rows(rng: np.random.Generator, fmt: str, rows: int, n: int) -> np.ndarray:
    raw = rng.integers(0, 256, (rows, Q.row_bytes(fmt, n)), dtype=np.uint8)
    blocks = raw.reshape(-1, Q.FORMATS[fmt].block_bytes)
    for off in F16_FIELDS.get(fmt, ()):
        h = np.ascontiguousarray(blocks[:, off:off + 2]).view("<u2")
        h = np.where((h & 0x7C00) == 0x7C00, h ^ 0x4000, h).astype("<u2")   # exponent 31 -> 15: finite
        blocks[:, off:off + 2] = h.view(np.uint8).reshape(-1, 2)
    return raw


def cases() -> list[tuple[str, str, np.ndarray, int]]:
    """(case id, format, raw rows [R, row_bytes] uint8, weights per row) for every format."""
    rng = np.random.default_rng(20240614)
    out = []
    for fmt, f in Q.FORMATS.items():
        # 300 weights: not a multiple of the work-group, so the kernel's index guard is exercised
        n = 4 * f.block_weights if f.block_weights > 1 else 300
        out.append((f"{fmt}-random", fmt, _random_rows(rng, fmt, 5, n), n))
        m = 2 * max(f.block_weights, 256)
        w = (rng.standard_normal((3, m)) * 0.05).astype(np.float32)
        w[1, : m // 2] *= 1e3
        out.append((f"{fmt}-quantized", fmt, Q.quantize(fmt, w), m))
    # every f16 and bf16 bit pattern (NaNs and subnormals included) in one row each
    every16 = np.arange(1 << 16, dtype="<u2").view(np.uint8).reshape(1, -1)
    out += [("f16-every-pattern", "f16", every16, 1 << 16), ("bf16-every-pattern", "bf16", every16, 1 << 16)]
    # mxfp4: every scale byte with every nibble in both halves of the block
    nib = np.arange(16, dtype=np.uint8)
    mx = np.concatenate([np.arange(256, dtype=np.uint8)[:, None], np.tile(nib | (nib[::-1] << 4), (256, 1))], axis=1)
    out.append(("mxfp4-every-scale", "mxfp4", mx.reshape(8, -1), 32 * 32))
    return out


CASES = cases()


def oracle(fmt: str, raw: np.ndarray, n: int) -> np.ndarray:
    with np.errstate(over="ignore"):  # mxfp4's e = 255 is infinite, as in ggml
        return Q.dequantize(fmt, raw, n)


def assert_bits_equal(got: np.ndarray, want: np.ndarray, case: str) -> None:
    assert got.shape == want.shape, case
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, (f"{case}: {bad.size} of {got.size} weights differ, first at {bad[0]}: "
                           f"{got.flat[bad[0]]!r} != {want.flat[bad[0]]!r}")


def _defines(text: str) -> dict[str, int]:
    return {m[0].lower(): int(m[1]) for m in re.findall(r"#define DQ_TYPE_(\w+) (\d+)", text)}


def test_both_sources_take_ggmls_type_ids():
    assert _defines(CL_SOURCE.read_text()) == Q.GGML_TYPES
    assert _defines(CUH_SOURCE.read_text()) == Q.GGML_TYPES


# ------------------------------------------------------------------------------------------------------ OpenCL


def find_intel_ocl() -> Path | None:
    """libintelocl.so as the intel-opencl-rt wheel installed it (or under this environment's lib), or None."""
    try:
        for f in md.files("intel-opencl-rt") or ():
            if f.name == "libintelocl.so" and Path(f.locate()).is_file():
                return Path(f.locate()).resolve()
    except md.PackageNotFoundError:
        pass
    p = Path(sys.prefix) / "lib" / "libintelocl.so"
    return p if p.is_file() else None


#: Run in a child process: the ICD loader reads its environment once, when pyopencl first loads it.
OCL_CHILD = r"""
import sys
import numpy as np
import pyopencl as cl

src_path, data_path, out_path = sys.argv[1:4]
devs = [d for p in cl.get_platforms() if "intel" in p.name.lower() for d in p.get_devices(cl.device_type.CPU)]
if not devs:
    print("no Intel OpenCL CPU device among", [p.name for p in cl.get_platforms()])
    sys.exit(77)
ctx = cl.Context(devs[:1])
queue = cl.CommandQueue(ctx)
data = np.load(data_path)
out = {}
for build, options in BUILDS.items():
    kernel = cl.Kernel(cl.Program(ctx, open(src_path).read()).build(options=options), "dequant_rows")
    for key in data.files:
        if not key.endswith(".raw"):
            continue
        case = key[:-4]
        raw = np.ascontiguousarray(data[key])
        n, fmt = (int(v) for v in data[case + ".meta"])
        rows = raw.shape[0]
        dst = np.empty((rows, n), np.float32)
        mf = cl.mem_flags
        src_buf = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=raw)
        dst_buf = cl.Buffer(ctx, mf.WRITE_ONLY, max(dst.nbytes, 4))
        kernel(queue, ((n + 63) // 64 * 64, rows), None, src_buf, dst_buf, np.int32(n), np.int32(raw.shape[1]),
               np.int32(fmt))
        cl.enqueue_copy(queue, dst, dst_buf)
        out[f"{case}@{build}"] = dst
queue.finish()
np.savez(out_path, **out)
"""
#: Build options the results must not depend on: the default, and flushed denormals with mad contraction allowed
#: (what a GPU driver may do by default).
BUILDS = {"default": [], "ftz-mad": ["-cl-denorms-are-zero", "-cl-mad-enable"]}


@pytest.fixture(scope="module")
def opencl_results(tmp_path_factory):
    """{case id: the OpenCL test kernel's output} from one child process on Intel's CPU OpenCL runtime."""
    if importlib.util.find_spec("pyopencl") is None:
        pytest.skip("pyopencl is not installed (the [opencl] extra)")
    lib = find_intel_ocl()
    if lib is None:
        pytest.skip("Intel's CPU OpenCL runtime (the intel-opencl-rt package) is not installed")
    d = tmp_path_factory.mktemp("quants_cl")
    arrays = {}
    for case, fmt, raw, n in CASES:
        arrays[f"{case}.raw"] = raw
        arrays[f"{case}.meta"] = np.array([n, Q.GGML_TYPES[fmt]])
    np.savez(d / "in.npz", **arrays)
    # pyopencl's bundled ICD loader reads OCL_ICD_VENDORS (a file is taken as the one driver), the system's
    # ocl-icd reads OCL_ICD_FILENAMES: set both, in the child only, so this process's environment is untouched
    env = dict(os.environ, OCL_ICD_VENDORS=str(lib), OCL_ICD_FILENAMES=str(lib), PYOPENCL_NO_CACHE="1")
    child = f"BUILDS = {BUILDS!r}\n{OCL_CHILD}"
    done = subprocess.run([sys.executable, "-c", child, str(CL_SOURCE), str(d / "in.npz"), str(d / "out.npz")],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode == 77:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, f"OpenCL child failed:\n{done.stdout}\n{done.stderr}"
    with np.load(d / "out.npz") as got:
        return {k: got[k] for k in got.files}


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("case,fmt,raw,n", CASES, ids=[c[0] for c in CASES])
def test_opencl_dequant_rows_is_bit_exact_with_the_oracle(opencl_results, case, fmt, raw, n, build):
    assert_bits_equal(opencl_results[f"{case}@{build}"], oracle(fmt, raw, n), f"{case}@{build}")


def test_the_opencl_source_needs_no_extension_and_no_half_type():
    code = re.sub(r"/\*.*?\*/", "", CL_SOURCE.read_text(), flags=re.S)
    for word in ("cl_khr_fp16", "#include", "vload_half", "half "):
        assert word not in code, word
    # the pragma must sit inside a function: at file scope it would change the includer's contraction state
    assert re.search(r"\{\s*#pragma OPENCL FP_CONTRACT OFF", code)
    assert not re.search(r"^\s*#pragma", code.split("inline float dq_k_affine", 1)[0], flags=re.M)


# -------------------------------------------------------------------------------------------------------- CUDA


def _nvrtc_or_skip():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as e:  # cupy or the NVRTC library is not installed here
        pytest.skip(f"NVRTC is not available here ({type(e).__name__}: {e}); it comes with 'strata-core[cuda]'")
    return nvrtc


def compile_cuh(arch: str, source: str | None = None, defines: tuple[str, ...] = ()) -> str:
    """quants.cuh (or `source`) compiled by NVRTC to PTX text; RuntimeError with NVRTC's log on failure."""
    nvrtc = _nvrtc_or_skip()
    prog = nvrtc.createProgram(CUH_SOURCE.read_text() if source is None else source, "quants.cuh", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, (f"-arch={arch}", "-std=c++17", *(f"-D{d}" for d in defines)))
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed on quants.cuh ({e}):\n{nvrtc.getProgramLog(prog)}") from None
        return nvrtc.getPTX(prog).decode()
    finally:
        nvrtc.destroyProgram(prog)


@pytest.mark.parametrize("arch", ["compute_75", "compute_90"])
def test_quants_cuh_compiles_to_ptx(arch):
    ptx = compile_cuh(arch)
    assert re.findall(r"\.entry\s+(\w+)", ptx) == ["strata_dequant_rows"]
    assert f".target sm_{arch.split('_')[1]}" in ptx
    # float ops without a rounding modifier may be fused by ptxas; an fma here would already be a contraction
    assert not re.search(r"\b(fma|mad)\.\S*f32|\b(mul|add|sub)\.f32", ptx)


def test_quants_cuh_can_be_included_twice_and_without_its_test_kernel():
    text = CUH_SOURCE.read_text()
    ptx = compile_cuh("compute_90", source=f"{text}\n{text}\n", defines=("STRATA_QUANTS_NO_TEST_KERNEL",))
    assert not re.findall(r"\.entry\s+(\w+)", ptx)


def test_a_cuh_compile_error_carries_nvrtcs_log():
    broken = CUH_SOURCE.read_text().replace("const int q = (int)(low | (high << 4)) - 32;", "const int q = ;")
    with pytest.raises(RuntimeError, match=r"NVRTC failed on quants.cuh(.|\n)*expected an expression"):
        compile_cuh("compute_90", source=broken)


def test_the_cuda_source_needs_no_headers_and_no_warp_intrinsics():
    # the rocm path will compile the same text through hiprtc, as it does moe.cu
    code = "\n".join(line.split("//", 1)[0] for line in CUH_SOURCE.read_text().splitlines())
    assert "#include" not in code
    for word in ("__shfl", "__ballot", "__activemask", "warpSize", "__half", "asm("):
        assert word not in code, word


def _cuda_or_skip():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("getDeviceCount() is 0")
    except Exception as e:  # no cupy, no driver or no device
        pytest.skip(f"no CUDA device ({type(e).__name__}: {e})")
    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("ftz", ["-ftz=false", "-ftz=true"])
def test_cuda_dequant_rows_is_bit_exact_with_the_oracle(ftz):
    cp = _cuda_or_skip()
    module = cp.RawModule(code=CUH_SOURCE.read_text(), options=("-std=c++17", "-fmad=true", ftz))
    kernel = module.get_function("strata_dequant_rows")
    failures = []
    for case, fmt, raw, n in CASES:
        rows = raw.shape[0]
        dst = cp.full((rows, n), np.nan, dtype=cp.float32)
        blocks = min(65535, (rows * n + 255) // 256)
        kernel((blocks,), (256,), (cp.asarray(raw), dst, np.int32(n), np.int32(raw.shape[1]),
                                   np.int32(Q.GGML_TYPES[fmt]), np.int32(rows)))
        try:
            assert_bits_equal(cp.asnumpy(dst), oracle(fmt, raw, n), case)
        except AssertionError as e:
            failures.append(str(e).splitlines()[0])
    assert not failures, "\n".join(failures)
