"""The cpu backend's HostKernels give the reference kernels' bits exactly, on decode's one-row shapes and others."""

from __future__ import annotations

import numpy as np
import pytest

from strata_core.builtin.cpu import HostKernels
from strata_core.reference.kernels import ReferenceKernels

REF, HOST = ReferenceKernels(), HostKernels()


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("seed", range(40))
def test_rmsnorm_bits(seed):
    rng = np.random.default_rng(seed)
    T, H = int(rng.choice([1, 1, 3])), int(rng.choice([7, 128, 100, 2048]))
    x = (rng.standard_normal((T, H)) * rng.choice([1e-3, 1.0, 30.0])).astype(np.float32)
    w = rng.standard_normal(H).astype(np.float32)
    a, b = np.empty((T, H), np.float32), np.empty((T, H), np.float32)
    REF.rmsnorm(x, w, out=a)
    HOST.rmsnorm(x, w, out=b)
    assert np.array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("seed", range(40))
def test_route_topk_bits_ties_included(seed):
    rng = np.random.default_rng(seed)
    E, k = int(rng.choice([8, 64, 256])), int(rng.choice([1, 2, 4, 6, 8, 16]))
    logits = rng.standard_normal((1, E)).astype(np.float32)
    if seed % 3 == 0:  # ties: the lower id first, as the reference's stable sort
        logits = np.round(logits * 2) / 2
    want = (np.empty((1, k), np.int32), np.empty((1, k), np.float32))
    got = (np.empty((1, k), np.int32), np.empty((1, k), np.float32))
    REF.route_topk(logits, k, out=want)
    HOST.route_topk(logits, k, out=got)
    assert np.array_equal(want[0], got[0]) and np.array_equal(_bits(want[1]), _bits(got[1]))


@pytest.mark.parametrize("seed", range(40))
def test_scatter_add_into_one_row_bits(seed):
    rng = np.random.default_rng(seed)
    N, H = int(rng.choice([1, 4, 8, 9])), int(rng.choice([16, 128]))
    base = rng.standard_normal((1, H)).astype(np.float32)
    y = rng.standard_normal((N, H)).astype(np.float32)
    s = rng.random(N).astype(np.float32)
    rows = np.zeros(N, np.int32)
    a, b = base.copy(), base.copy()
    REF.scatter_add(a, rows, y, s)
    HOST.scatter_add(b, rows, y, s)
    assert np.array_equal(_bits(a), _bits(b))


def test_scatter_add_into_many_rows_is_the_reference():
    rng = np.random.default_rng(1)
    base = rng.standard_normal((5, 16)).astype(np.float32)
    rows = rng.integers(0, 5, 12).astype(np.int32)
    y, s = rng.standard_normal((12, 16)).astype(np.float32), rng.random(12).astype(np.float32)
    a, b = base.copy(), base.copy()
    REF.scatter_add(a, rows, y, s)
    HOST.scatter_add(b, rows, y, s)
    assert np.array_equal(_bits(a), _bits(b))


def test_linear_of_a_read_only_f16_weight_keeps_its_f32_form_same_bits():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((2048, 128)).astype(np.float16)
    w.flags.writeable = False
    x = rng.standard_normal((1, 128)).astype(np.float32)
    host = HostKernels()
    a, b, c = (np.empty((1, 2048), np.float32) for _ in range(3))
    REF.linear(x, w, out=a)
    host.linear(x, w, out=b)
    host.linear(x, w, out=c)
    assert np.array_equal(_bits(a), _bits(b)) and np.array_equal(_bits(a), _bits(c))
    assert host.f32_copy_bytes == w.size * 4  # one copy, made once


def test_linear_of_a_writeable_weight_converts_every_call():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 32)).astype(np.float16)
    x = rng.standard_normal((1, 32)).astype(np.float32)
    host = HostKernels()
    first = host.linear(x, w, out=np.empty((1, 64), np.float32)).copy()
    w[:] = 0  # a weight that can change is never kept
    assert not host.linear(x, w, out=np.empty((1, 64), np.float32)).any() and first.any()
    assert host.f32_copy_bytes == 0


@pytest.mark.parametrize("seed", range(10))
def test_gather_from_one_row_is_the_reference(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    rows = np.zeros(int(rng.integers(1, 9)), np.int32)
    a, b = np.empty((len(rows), 64), np.float32), np.empty((len(rows), 64), np.float32)
    REF.gather(x, rows, out=a)
    HOST.gather(x, rows, out=b)
    assert np.array_equal(_bits(a), _bits(b))


def test_linear_of_f32_weights_is_the_reference():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((256, 128)).astype(np.float32)
    x = rng.standard_normal((1, 128)).astype(np.float32)
    a, b = np.empty((1, 256), np.float32), np.empty((1, 256), np.float32)
    REF.linear(x, w, out=a)
    HOST.linear(x, w, out=b)
    assert np.array_equal(_bits(a), _bits(b))
