"""The SYCL device and its DeviceMemory, shared by the sycl test modules (which importorskip dpctl first)."""

from __future__ import annotations

import pytest
from strata_sycl import backend as sycl


@pytest.fixture(scope="module")
def device():
    """The first device the sycl probe reports; with dpctl installed, an unavailable probe is a failure, not a skip."""
    r = sycl.probe()
    assert r.available, r.reason
    return r.devices[0]


@pytest.fixture(scope="module")
def mem(device):
    """The sycl DeviceMemory of that device."""
    return sycl.strata_device_memory(device=device)
