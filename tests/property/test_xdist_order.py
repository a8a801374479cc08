"""tests/xdist_order.py's collection order: a permutation, known-long tests first in every worker's share, balanced,
modules with module-scoped fixtures kept whole and in file order."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import assume, given, settings as hyp_settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from xdist_order import LONG_S, known_durations, order_for_workers, share_sizes  # noqa: E402


@dataclass(frozen=True)
class _Def:
    scope: str


@dataclass
class _Info:
    name2fixturedefs: dict = field(default_factory=dict)


@dataclass
class _Item:
    nodeid: str
    path: str
    _fixtureinfo: _Info


def _items(modules: list[tuple[int, bool]]) -> list[_Item]:
    """Fake collected items: per module (how many tests, whether they use a module-scoped fixture)."""
    out = []
    for m, (n, whole) in enumerate(modules):
        defs = {"lib": [_Def("module")]} if whole else {"tmp_path": [_Def("function")]}
        out += [_Item(f"tests/m{m}.py::t{i}", f"tests/m{m}.py", _Info(defs)) for i in range(n)]
    return out


@hyp_settings(max_examples=200, deadline=None)
@given(modules=st.lists(st.tuples(st.integers(1, 12), st.booleans()), min_size=1, max_size=12),
       workers=st.integers(2, 4), data=st.data())
def test_each_share_starts_with_its_long_tests_and_nothing_is_lost(modules, workers, data):
    items = _items(modules)
    ids = [it.nodeid for it in items]
    long_ids = data.draw(st.lists(st.sampled_from(ids), unique=True, max_size=len(ids)))
    durations = {i: data.draw(st.floats(LONG_S, 200.0)) for i in long_ids}
    whole = {f"tests/m{m}.py" for m, (_, w) in enumerate(modules) if w}
    moved_modules = {it.path for it in items if it.path in whole and it.nodeid in durations}

    def moved(it) -> bool:
        return it.path in moved_modules if it.path in whole else it.nodeid in durations

    sizes = share_sizes(len(items), workers)
    assume(sum(moved(it) for it in items) <= min(sizes))  # every long unit fits any share
    out = order_for_workers(items, durations, workers)
    assert sorted(it.nodeid for it in out) == sorted(ids) and len(out) == len(items)
    assert [it.nodeid for it in order_for_workers(list(items), dict(durations), workers)] == \
        [it.nodeid for it in out], "not deterministic"
    assert [it.nodeid for it in out if not moved(it)] == [it.nodeid for it in items if not moved(it)], \
        "the tests not moved left their file order"
    pos = 0
    for n in sizes:
        flags = [moved(it) for it in out[pos:pos + n]]
        pos += n
        assert flags == sorted(flags, reverse=True), f"a moved test after one not moved in a share: {flags}"
    for path in moved_modules:
        where = [k for k, it in enumerate(out) if it.path == path]
        assert where == list(range(where[0], where[0] + len(where))), f"{path} (a module fixture) was split"
        assert [out[k].nodeid for k in where] == [it.nodeid for it in items if it.path == path]


def test_without_xdist_or_durations_nothing_moves(tmp_path):
    items = _items([(3, False), (2, True)])
    assert order_for_workers(items, {}, 2) == items
    assert known_durations(tmp_path / "absent.txt") == {}
    f = tmp_path / "d.txt"
    f.write_text("# comment\n 3.50s setup    tests/m0.py::t1\n12.25s call     tests/m0.py::t1\n0.01s teardown x::y\n")
    assert known_durations(f) == {"tests/m0.py::t1": 15.75, "x::y": 0.01}


def test_the_long_tests_are_balanced_over_the_shares():
    items = _items([(40, False)])
    durations = {f"tests/m0.py::t{i}": s for i, s in enumerate([100, 60, 50, 30, 20, 10])}
    out = order_for_workers(items, durations, 2)
    a, b = out[:20], out[20:]
    # longest first to the less loaded share: 100 a, 60 b, 50 b, 30 a, 20 b, 10 a (a tie goes to the first)
    assert [it.nodeid for it in a[:3]] == ["tests/m0.py::t0", "tests/m0.py::t3", "tests/m0.py::t5"]
    assert [it.nodeid for it in b[:3]] == ["tests/m0.py::t1", "tests/m0.py::t2", "tests/m0.py::t4"]
    assert sum(durations.get(it.nodeid, 0) for it in a) == 140 and sum(durations.get(it.nodeid, 0) for it in b) == 130
