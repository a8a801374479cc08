"""The project's scenario files (tests/data/scenarios) are byte-identical copies of ../shared/scenarios, where it exists."""

from __future__ import annotations

from pathlib import Path

import pytest

COPIES = Path(__file__).resolve().parent / "scenarios"
SHARED = (Path(__file__).resolve().parents[2] / ".." / "shared" / "scenarios").resolve()


def test_the_copies_are_there():
    """A fresh clone carries its own scenarios: the tests that read them never skip for want of files."""
    names = sorted(p.name for p in COPIES.glob("*.json"))
    assert len(names) >= 5, names


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} is absent (a fresh clone): the copies are the project's own")
def test_the_copies_equal_the_shared_scenarios():
    """Same file names, same bytes: a changed seed scenario is copied in, not silently diverged from."""
    shared = {p.name: p.read_bytes() for p in SHARED.glob("*.json")}
    copies = {p.name: p.read_bytes() for p in COPIES.glob("*.json")}
    assert sorted(copies) == sorted(shared)
    for name, data in shared.items():
        assert copies[name] == data, f"tests/data/scenarios/{name} differs from {SHARED / name}"
