"""The prefill's embedding on CUDA: CudaLayerOps.embed_rows gathers a chunk's rows from the page-locked table the
greedy loop reads, bit for bit the host's f16 rows widened to f32, and refuses ids outside the table (the executor
then uploads the rows itself). Skipped with "no CUDA device" where there is none."""

from __future__ import annotations

import numpy as np
import pytest

from .test_fast_paths import _cuda_device_count, cp  # noqa: F401 (cp is a fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_device_count() == 0, reason="no CUDA device")]


def ops_with_table(cp, vocab: int, hidden: int):
    """A cuda session's layer ops with a session pinned allocator and a greedy table of random f16 rows."""
    from strata_core.api.backend import PinnedBudget
    from strata_cuda.cupy_device import CupyDeviceMemory, CupyPinnedAllocator
    from strata_cuda.kernels import CupyKernels
    from strata_cuda.layer_ops import CudaLayerOps
    budget = PinnedBudget(1 << 30)
    op = CudaLayerOps(CupyDeviceMemory(0), CupyKernels(0), pinned=CupyPinnedAllocator(budget))
    embed = np.random.default_rng(vocab).standard_normal((vocab, hidden)).astype(np.float16)
    embed[3, :5] = [np.inf, -np.inf, 0.0, -0.0, 6.1e-5]  # specials and a subnormal widen exactly too
    table = op.greedy_table(embed)
    assert table is not None, "the table was not page-locked and mapped"
    return op, embed, table


@pytest.mark.parametrize("rows", [1, 7, 4096])
def test_embed_rows_equal_the_host_rows(cp, rows):
    op, embed, table = ops_with_table(cp, 5000, 256)
    ids = np.random.default_rng(rows).integers(0, embed.shape[0], rows).astype(np.int32)
    ids[0] = 3
    x = cp.full((rows, embed.shape[1]), np.nan, dtype=cp.float32)
    assert op.embed_rows(table, ids, x)
    got = x.get()
    want = embed[ids].astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), "not the host rows bit for bit"
    op.greedy_release()


def test_embed_rows_takes_no_device_memory_and_regrows_its_staging(cp):
    """The ids are read from mapped page-locked staging: no device byte outside the plan (a device copy of a
    4096-token chunk's ids once put the H200's measured peak 16,384 bytes over the plan); a longer chunk regrows it."""
    op, embed, table = ops_with_table(cp, 3000, 128)
    pool = cp.get_default_memory_pool()
    rng = np.random.default_rng(5)
    for rows in (16, 16, 4096, 9):
        ids = rng.integers(0, embed.shape[0], rows).astype(np.int32)
        x = cp.full((rows, embed.shape[1]), np.nan, dtype=cp.float32)
        cp.cuda.Device().synchronize()
        used, total = pool.used_bytes(), pool.total_bytes()
        assert op.embed_rows(table, ids, x)
        cp.cuda.Device().synchronize()
        assert (pool.used_bytes(), pool.total_bytes()) == (used, total), "embed_rows took device memory"
        assert np.array_equal(x.get(), embed[ids].astype(np.float32)), f"{rows} rows not the table's"
    op.greedy_release()


def test_embed_rows_refuses_ids_outside_the_table(cp):
    op, embed, table = ops_with_table(cp, 100, 64)
    x = cp.zeros((2, 64), dtype=cp.float32)
    assert not op.embed_rows(table, np.array([1, 100], dtype=np.int32), x)
    assert not op.embed_rows(table, np.array([-1, 0], dtype=np.int32), x)
    assert not bool(x.any()), "a refused gather queued nothing"
    op.greedy_release()
