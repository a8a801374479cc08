"""pytest plugin: plant a leak named by LEAK (test-local hook or sim backend), and HEAP=tracemalloc forces the old measure."""
import os
import numpy as np
import pytest

_LEAK = []
KIND = os.environ.get("LEAK", "")


def _plant(kind):
    import test_soak as ts
    import heap_growth as H
    if os.environ.get("HEAP") == "tracemalloc":
        H._MALLINFO2 = None
    if kind.startswith("req-"):
        orig = ts._bookkeeping_request
        make = {"req-float": lambda i: float(i) + 0.5, "req-bytes40": lambda i: bytes(40),
                "req-np4": lambda i: np.zeros(4), "req-np200": lambda i: np.zeros(200)}[kind]
        def leaky(engine, rng, n):
            _LEAK.append(make(len(_LEAK)))
            return orig(engine, rng, n)
        ts._bookkeeping_request = leaky
        from strata_core.runtime.engine import Engine
        serve = Engine.serve
        def leaky_serve(self, *a, **k):
            _LEAK.append(make(len(_LEAK)))
            return serve(self, *a, **k)
        Engine.serve = leaky_serve
    elif kind == "sim-free":
        from strata_core.builtin.sim.memory import SimDeviceMemory
        orig_free = SimDeviceMemory.free
        def free(self, arr):
            orig_free(self, arr)
            _LEAK.append(arr)   # the sim device keeps every array it got back
        SimDeviceMemory.free = free
    elif kind == "sim-events":
        from strata_core.builtin.sim.memory import SimDeviceMemory
        orig_ev = SimDeviceMemory.new_event
        def new_event(self):
            ev = orig_ev(self)
            _LEAK.append(ev)   # the sim device keeps every event it made
            return ev
        SimDeviceMemory.new_event = new_event
    elif kind == "sim-upload":
        from strata_core.builtin.sim.memory import SimDeviceMemory
        orig_up = SimDeviceMemory.upload
        def upload(self, dst, src, stream=None):
            _LEAK.append(int(dst.nbytes) + 10**6)   # a per-copy record that is never dropped
            return orig_up(self, dst, src, stream)
        SimDeviceMemory.upload = upload
    elif kind == "sim-pinned":
        from strata_core.builtin.sim.memory import SimPinnedAllocator
        orig = SimPinnedAllocator.alloc
        def alloc(self, *a, **k):
            buf = orig(self, *a, **k)
            _LEAK.append((a, buf))
            return buf
        SimPinnedAllocator.alloc = alloc


def pytest_collection_finish(session):
    if KIND or os.environ.get("HEAP"):
        _plant(KIND)


def pytest_sessionfinish(session):
    print(f"\nplanted {KIND!r}: {len(_LEAK)} objects kept")
