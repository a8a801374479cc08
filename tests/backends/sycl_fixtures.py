"""The SYCL device, its session and DeviceMemory, shared by the sycl test modules (which importorskip dpctl first)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from strata_sycl import backend as sycl

MIB = 1 << 20


def plan(limit_bytes: int = 64 * MIB, floor_bytes: int = 8 * MIB):
    """The part of a plan a session reads: its page-locked limit and floor."""
    return SimpleNamespace(pinned=SimpleNamespace(limit_bytes=limit_bytes, floor_bytes=floor_bytes))


@pytest.fixture(scope="module")
def device():
    """The first device the sycl probe reports; with dpctl installed, an unavailable probe is a failure, not a skip."""
    r = sycl.BACKEND.probe()
    assert r.available, r.reason
    return r.devices[0]


@pytest.fixture(scope="module")
def session(device):
    """A session of that device for a plan of 64 MiB page-locked (8 MiB floor)."""
    s = device.open(plan())
    yield s
    s.close()


@pytest.fixture(scope="module")
def mem(session):
    """The sycl DeviceMemory of that device."""
    return session.memory
