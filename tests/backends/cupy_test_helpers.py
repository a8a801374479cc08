"""What the cuda and rocm backend tests share: a double of cupy's runtime (the same API on its CUDA and ROCm builds),
the no-cupy import check and the seed scenario files of one backend."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from strata_core.api.facts import load_profile

#: The project's own copies of the seed scenarios (the tests own their data).
SCENARIO_DIR = Path(__file__).resolve().parents[1] / "data" / "scenarios"


class FakeRuntime:
    """cupy.cuda.runtime's probing calls over a list of cards: dicts of "props", "free", "total" and (CUDA) "bus"."""

    def __init__(self, cards=(), fail: Exception | None = None):
        self.cards = list(cards)
        self.fail = fail
        self.current = 0
        self.mem_info_calls = 0

    def getDeviceCount(self):
        if self.fail:
            raise self.fail
        return len(self.cards)

    def getDeviceProperties(self, i):
        return self.cards[i]["props"]

    def deviceGetPCIBusId(self, i):
        return self.cards[i]["bus"]

    def getDevice(self):
        return self.current

    def setDevice(self, i):
        self.current = i

    def memGetInfo(self):
        self.mem_info_calls += 1
        c = self.cards[self.current]
        return c["free"], c["total"]


def assert_imports_without_cupy(*modules: str) -> None:
    """Import `modules` in a fresh interpreter and fail if that imported cupy (a backend must load without it)."""
    code = (f"import sys; import {', '.join(modules)}; "
            "assert 'cupy' not in sys.modules, sorted(m for m in sys.modules if m.startswith('cupy'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def scenario_paths(backend: str) -> list[Path]:
    """The seed scenario files whose profile is on `backend`."""
    if not SCENARIO_DIR.is_dir():
        return []
    return sorted(p for p in SCENARIO_DIR.glob("*.json") if load_profile(p).backend == backend)
