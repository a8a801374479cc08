"""PlanDraft: the knobs a site plugin may tighten (never loosen) before the plan is computed and proven."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata_core.errors import StrataError


@dataclass(frozen=True)
class Decision:
    """One planning decision: what was decided, the value, why, and which source it came from."""

    what: str
    value: Any
    why: str
    source: str


#: knob -> the direction that is "tighter": 'down' (smaller is safer) or 'up' (larger is safer) or 'off'.
KNOBS = {
    "prompt.chunk_cap_tokens": "down",
    "expert_cache.slots_cap": "down",
    "prompt.lend_fraction": "down",
    "vram.reserve_bytes": "up",
    "host_memory.headroom_bytes": "up",
    "cpu_share.enabled": "off",
}


@dataclass
class PlanDraft:
    """Inputs of the planner that plugins may tighten, the first-pass plan to read, and the decisions they made."""

    knobs: dict[str, Any]
    plan: Any = None  # the first-pass Plan, read-only, for plugins that decide from its figures
    source: str = "plugin"
    decisions: list[Decision] = field(default_factory=list)

    def get(self, knob: str) -> Any:
        """The current value of a knob (None means 'no cap')."""
        return self.knobs.get(knob)

    def tighten(self, knob: str, value: Any, why: str) -> None:
        """Set a knob to a tighter value and record a Decision; loosening one is refused as a plugin bug."""
        if knob not in KNOBS:
            raise StrataError(f"plugin '{self.source}' tried to adjust unknown plan knob '{knob}' "
                              f"(known: {', '.join(sorted(KNOBS))})")
        old = self.knobs.get(knob)
        way = KNOBS[knob]
        ok = (old is None or value <= old) if way == "down" else (
            (old is None or value >= old) if way == "up" else value in (False, old))
        if not ok:
            raise StrataError(f"plugin '{self.source}' loosened the plan: {knob} {old!r} -> {value!r}; "
                              f"strata_adjust_plan may only tighten")
        self.knobs[knob] = value
        self.decisions.append(Decision(what=knob, value=value, why=why, source=f"plugin:{self.source}"))
