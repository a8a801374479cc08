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


@pytest.mark.parametrize("floor", [8, 32, 64])
def test_a_class_floor_only_lifts_the_small_groups_and_the_stack_bound_holds(floor):
    import numpy as np
    from types import SimpleNamespace
    from strata_cuda.fast import FastMoE, StackLayout, class_rows
    c = np.arange(1, 5000)
    r = class_rows(c, floor)
    assert np.all(r >= np.maximum(c, floor)) and np.array_equal(r[c > floor], class_rows(c[c > floor]))

    def device_cap(v: int) -> int:  # moe_fast.cu's stack_cap with `classes` = the floor, written out
        p = 1
        while p < v:
            p <<= 1
        mid = 3 * p // 4
        out = mid if (mid >= v and mid % 8 == 0) else p
        return max(out, 8, floor)
    assert [device_cap(int(v)) for v in c[:700]] == r[:700].tolist()
    # any routing of a chunk fits the bound the plan lends the stack (the worst case: many groups just past a class)
    moe = SimpleNamespace(top_k=8, experts=128, gemm_mode="classes", class_floor=floor)
    rng = np.random.default_rng(floor)
    for tokens in (1, 7, 64, 4096):
        routed = tokens * moe.top_k
        bound = FastMoE.stack_rows_bound(moe, tokens)
        for _ in range(50):
            counts = np.bincount(rng.choice(moe.experts, routed, p=rng.dirichlet(np.full(moe.experts, 0.3))),
                                 minlength=moe.experts)
            assert StackLayout.of(counts, "classes", floor).rows <= bound, (tokens, floor)
        worst = np.full(moe.experts, routed // moe.experts)  # every group one row past a class
        worst[: routed % moe.experts] += 1
        assert StackLayout.of(worst, "classes", floor).rows <= bound, (tokens, floor)


# each third-form decode kernel's weight loads a lane issues before its first sum (moe_fast.cu: 2 x STRATA_GU3_GROUP
# for gate/up, BATCH for the down kernels)
THIRD_FORM_LOADS = {"strata_fast_decode_gate_up3": 16, "strata_fast_decode_down3_s1": 12,
                    "strata_fast_decode_down3_s2": 12, "strata_fast_decode_down3_s4": 6}


def test_the_third_decode_forms_issue_every_load_of_a_trip_before_the_fence():
    """In the PTX of each third-form kernel, the lane's weight loads (16-byte ld.v4.u32) all sit between the kernel's
    first griddepcontrol.launch_dependents and the issue fence (the second), with no half conversion among them and no
    weight load after it: the order moe_fast.cu's STRATA_ISSUE_FENCE keeps (without it ptxas interleaved loads and
    sums, several trips to memory a warp). Every kernel of fast.DECODE_THIRD is one of them."""
    _nvrtc_or_skip()
    from strata_cuda import fast
    assert {v[0] for v in fast.DECODE_THIRD.values()} | {"strata_fast_decode_gate_up3"} == set(THIRD_FORM_LOADS)
    ptx = fast.compile_to_ptx(arch="compute_90").decode()
    for name, loads in THIRD_FORM_LOADS.items():
        body = _entry_body(ptx, name)
        fences = [m.start() for m in re.finditer(r"griddepcontrol\.launch_dependents", body)]
        assert len(fences) == 2, f"{name}: {len(fences)} launch_dependents (the start's and the issue fence)"
        before, after = body[fences[0]:fences[1]], body[fences[1]:]
        assert len(re.findall(r"ld\.[\w.]*v4\.u32", before)) == loads, name
        assert "cvt.f32.f16" not in before, f"{name}: a sum before the fence"
        assert not re.search(r"ld\.[\w.]*v4\.u32", after), f"{name}: a weight load after the fence"


def _entry_body(ptx: str, name: str) -> str:
    """The PTX of kernel `name`, from its .entry line to its closing brace."""
    body = ptx[ptx.index(f".entry {name}("):]
    return body[:body.index("\n}\n")]


def _q8_pair_bodies(variant: str) -> dict[str, str]:
    """The PTX bodies of the Q8_0 decode kernels, moe_fast.cu compiled as FastMoE compiles it for `variant`."""
    from strata_cuda import fast
    ptx = fast.compile_to_ptx("compute_90", fast.module_options(fast.DECODE_ROWS_PER_WARP, variant)).decode()
    return {name: _entry_body(ptx, name) for name in ("strata_fast_decode_gate_up3_q8", "strata_fast_decode_down3_q8",
                                                      "strata_fast_decode_gate_up4_q8", "strata_fast_decode_down4_q8")}


@pytest.mark.parametrize("variant", ["cast", "prmt", "cast_reg", "prmt_reg"])
def test_each_q8_decode_variant_compiles_the_widening_it_names(variant):
    """fast.Q8_DECODE_VARIANTS: the "prmt" variants widen quants by byte permutes (no int8 conversion left in the
    Q8_0 decode kernels), the "cast" variants by conversions (no byte permute); both pairs are in every build."""
    _nvrtc_or_skip()
    from strata_cuda import fast
    prmt = fast.Q8_DECODE_VARIANTS[variant][0]
    for name, body in _q8_pair_bodies(variant).items():
        casts, perms = len(re.findall(r"cvt\.rn\.f32\.s(8|16|32)", body)), body.count("prmt.b32")
        if prmt:
            assert casts == 0 and perms >= 64, (variant, name, casts, perms)
        else:
            assert perms == 0 and casts >= 64, (variant, name, casts, perms)
