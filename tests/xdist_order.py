"""The collection order under pytest-xdist that starts every known-long test first, spread over the workers.

`--dist worksteal` hands each of W workers one contiguous share of the collection (len // W items, in order) and
then lets an idle worker take the back half of a busy one's queue. In file order the soaks and host builds sat
together at one worker's front or end, so one 100 s test could start last and end the run alone. This order
gives each share its longest tests first, balanced by known duration (longest first to the least loaded share),
and fills the rest of each share with the other tests in their file order.

Known durations are `tests/durations.txt`: lines of pytest's `--durations` report ("12.34s call     nodeid"),
phases of one test summed. A test that uses a module- or class-scoped fixture moves with its whole module, in
file order, so that fixture is still set up once per worker.
"""

from __future__ import annotations

import re
from pathlib import Path

DURATIONS_FILE = Path(__file__).resolve().parent / "durations.txt"
#: a unit (a test, or a module that must stay whole) of this many known seconds or more is placed first
LONG_S = 2.0
_LINE = re.compile(r"^\s*([0-9.]+)s\s+(?:setup|call|teardown)\s+(\S+)")


def known_durations(path: Path = DURATIONS_FILE) -> dict[str, float]:
    """nodeid -> seconds (phases summed) from a `--durations` report; {} when the file is absent."""
    out: dict[str, float] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        m = _LINE.match(line)
        if m:
            out[m.group(2)] = out.get(m.group(2), 0.0) + float(m.group(1))
    return out


def _keeps_module_whole(item) -> bool:
    """Whether the item uses a fixture that lives for its module or class (moving it alone would set it up again)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(str(getattr(d, "scope", "function")) in ("module", "class", "package")
               for defs in info.name2fixturedefs.values() for d in defs)


def share_sizes(n: int, workers: int) -> list[int]:
    """How many items worksteal's first schedule sends each of `workers` idle workers out of n, in order."""
    sizes, left = [], n
    for i in range(workers):
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    return sizes


def order_for_workers(items: list, durations: dict[str, float], workers: int) -> list:
    """`items` reordered so each worker's share starts with its part of the known-long tests (see the module doc).

    Deterministic (no set or hash order), as every worker must collect the same order.
    """
    units: list[list] = []
    by_module: dict[str, list] = {}
    for item in items:
        if _keeps_module_whole(item):
            key = str(getattr(item, "path", item.nodeid.split("::")[0]))
            if key not in by_module:
                by_module[key] = []
                units.append(by_module[key])
            by_module[key].append(item)
        else:
            units.append([item])
    seconds = [sum(durations.get(it.nodeid, 0.0) for it in unit) for unit in units]
    long_units = sorted((i for i, s in enumerate(seconds) if s >= LONG_S), key=lambda i: (-seconds[i], i))
    sizes = share_sizes(len(items), workers)
    heads: list[list] = [[] for _ in range(workers)]
    load, count = [0.0] * workers, [0] * workers
    for i in long_units:
        fits = [w for w in range(workers) if count[w] + len(units[i]) <= sizes[w]]
        w = min(fits or range(workers), key=lambda w: (load[w], w))
        heads[w].extend(units[i])
        load[w] += seconds[i]
        count[w] += len(units[i])
    placed = {id(it) for i in long_units for it in units[i]}
    rest = [it for it in items if id(it) not in placed]
    out: list = []
    for w in range(workers):
        take = max(0, sizes[w] - count[w]) if w < workers - 1 else len(rest)
        out.extend(heads[w])
        out.extend(rest[:take])
        rest = rest[take:]
    return out
