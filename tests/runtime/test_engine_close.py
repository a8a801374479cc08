"""Engine.close waits for the device before it unlocks page-locked memory or frees device arrays: a copy still queued
on a side stream (a decode admission's, a top-up's) reads those rows (on the H200 an unregistered source was an
illegal access that failed the next session). Run on the sim backend, whose device memory records the calls."""

from __future__ import annotations

import contextlib
import io

from strata_core.cli import main
from strata_core.runtime.engine import Engine


def test_close_synchronizes_the_device_before_releasing_anything(monkeypatch):
    events: list[str] = []
    original = Engine.close

    def close(self):
        sync, store_close, free = self.dm.synchronize, self.store.close, self.dm.free
        self.dm.synchronize = lambda stream=None: (events.append("synchronize"), sync(stream))[1]
        self.store.close = lambda: (events.append("store.close"), store_close())[1]
        self.dm.free = lambda a: (events.append("free"), free(a))[1]
        original(self)

    monkeypatch.setattr(Engine, "close", close)
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(["run", "--backend", "sim", "--prompt-tokens", "64", "--decode-tokens", "2", "--json"])
    assert rc == 0
    assert "store.close" in events and "free" in events, events
    assert events[0] == "synchronize", events
