"""The run's log: one-line notices, fallbacks (what was turned off and why) and trace lines, each said once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable


@dataclass(frozen=True)
class Fallback:
    """An optional path that stood down: what it was and why."""

    what: str
    why: str

    def to_json(self) -> dict:
        """The {"what", "why"} object of the run and simulation schemas."""
        return {"what": self.what, "why": self.why}


@dataclass
class RunLog:
    """Collects lines and fallbacks; `echo` (stderr in commands) sees each line as it is said."""

    echo: Callable[[str], None] | None = None
    trace_enabled: bool = False
    lines: list[str] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    _said: set = field(default_factory=set)

    def say(self, line: str, once: Hashable | None = None) -> bool:
        """Log one line; with `once`, only the first time that key is said. True when it was logged."""
        if once is not None:
            if once in self._said:
                return False
            self._said.add(once)
        self.lines.append(line)
        if self.echo:
            self.echo(line)
        return True

    def fallback(self, what: str, why: str, once: Hashable | None = None) -> bool:
        """Record an optional path turned off, and say so in one line (once per key, by default per `what`)."""
        key = ("fallback", what) if once is None else once
        if key in self._said:
            return False
        self.fallbacks.append(Fallback(what, why))
        return self.say(f"{what}: {why}", once=key)

    def trace(self, line: str) -> None:
        """A line that only `trace` runs log (loans as they happen)."""
        if self.trace_enabled:
            self.say(line)

    def lines_matching(self, text: str) -> list[str]:
        """The lines that contain `text` (tests and summaries count them)."""
        return [ln for ln in self.lines if text in ln]
