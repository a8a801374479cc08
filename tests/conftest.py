"""Fixtures shared by every test folder (kept small: each folder adds its own in its own conftest.py).

`@pytest.mark.requires_cuda` skips a test, saying "no CUDA device" and why, on a machine without one (a CI runner,
a laptop); the GPU tests use it so a fresh clone's skips name the real reason, not a driver error.
"""

from __future__ import annotations

import functools
import os

import pytest


@functools.lru_cache(maxsize=1)
def cuda_device_reason() -> str | None:
    """None when a CUDA device is usable here, else why not (starting with "no CUDA device")."""
    try:
        import cupy
    except Exception as e:  # not installed, or a broken install: either way no device for the tests
        return f"no CUDA device (cupy not importable: {type(e).__name__})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # cudaErrorNoDevice, cudaErrorInsufficientDriver (no driver at all), ...
        return f"no CUDA device ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None if count > 0 else "no CUDA device (the runtime reports 0 devices)"


#: Marks a test that needs a CUDA device: skipped with the reason where there is none.
requires_cuda = pytest.mark.requires_cuda


def pytest_configure(config):
    """Register the requires_cuda marker."""
    config.addinivalue_line("markers", "requires_cuda: needs a CUDA device (skipped, saying 'no CUDA device', without)")


@pytest.hookimpl(trylast=True)  # after -k/-m and any conftest's deselection: the shares are of what runs
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, start each worker with its share of the known-long tests (tests/xdist_order.py)."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers and workers > 1:
        from xdist_order import known_durations, order_for_workers
        items[:] = order_for_workers(items, known_durations(), int(workers))


def pytest_runtest_setup(item):
    """Skip a requires_cuda test where there is no CUDA device, saying so."""
    if item.get_closest_marker("requires_cuda") is not None:
        why = cuda_device_reason()
        if why is not None:
            pytest.skip(why)


@pytest.fixture
def clean_strata_env(monkeypatch, tmp_path):
    """No STRATA_* variable set and an empty working directory, so only what a test sets reaches the settings."""
    for name in list(os.environ):
        if name.upper().startswith("STRATA_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path
