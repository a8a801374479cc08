"""Scenarios (`strata.scenario/1`): a machine, a model, settings, a list of requests and what must hold."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from strata_core.errors import BadInput
from strata_core.api.facts import Profile, load_json_file
from strata_core.models.spec import ModelSpec
from strata_core.config.settings import StrataSettings, settings_from_partial

SCHEMA = "strata.scenario/1"

#: The longest prompt a scenario may list: far beyond any context (a request longer than kv.max_context is the
#: plan's to refuse, by name), but a number the planner's arithmetic can carry.
MAX_REQUEST_TOKENS = 1 << 40


@dataclass(frozen=True)
class Scenario:
    """One scenario file, parsed: every part validated, bad input named by file and field."""

    profile: Profile
    model: ModelSpec
    settings: StrataSettings
    requests: tuple[int, ...]           # prompt tokens of each request, in order
    expect: dict = field(default_factory=dict)
    source: str = ""                    # what the scenario replays (a seed report, a counterpart)
    path: str = ""
    settings_keys: tuple[str, ...] = ()  # the dotted keys the scenario's settings block sets

    @property
    def name(self) -> str:
        """The file's stem."""
        return Path(self.path).stem if self.path else "scenario"


def settings_keys(block: Mapping[str, Any] | None, prefix: str = "") -> tuple[str, ...]:
    """The dotted leaf keys a nested settings block sets."""
    out: list[str] = []
    for k, v in (block or {}).items():
        if isinstance(v, Mapping):
            out.extend(settings_keys(v, f"{prefix}{k}."))
        else:
            out.append(f"{prefix}{k}")
    return tuple(out)


def _requests(raw: Any, where: str) -> tuple[int, ...]:
    """Prompt lengths from `requests`: a list of ints or of {"prompt_tokens": N} objects."""
    if not isinstance(raw, list):
        raise BadInput(f"{where}: expected a list of requests")
    out = []
    for i, r in enumerate(raw):
        v = r.get("prompt_tokens") if isinstance(r, dict) else r
        if isinstance(r, dict) and "prompt_tokens" not in r:
            raise BadInput(f"{where}[{i}]: missing field 'prompt_tokens'")
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_REQUEST_TOKENS:
            raise BadInput(f"{where}[{i}].prompt_tokens: expected a whole number from 1 to {MAX_REQUEST_TOKENS:,}, "
                           f"got {v!r}")
        out.append(v)
    return tuple(out)


def scenario_from_json(d: dict, where: str = "scenario") -> Scenario:
    """Build a Scenario from its JSON object; BadInput names `where` and the field on any problem."""
    schema = d.get("schema")
    if schema != SCHEMA:
        raise BadInput(f"{where}: field 'schema' is {schema!r}, expected '{SCHEMA}'")
    for k in ("profile", "model"):
        if k not in d:
            raise BadInput(f"{where}: missing field '{k}'")
    block = d.get("settings") or {}
    expect = d.get("expect") or {}
    if not isinstance(expect, dict):
        raise BadInput(f"{where}: field 'expect' must be an object")
    return Scenario(
        profile=Profile.from_json(d["profile"], where=f"{where}: profile"),
        model=ModelSpec.from_json(d["model"], where=f"{where}: model"),
        settings=settings_from_partial(block, where=f"{where}: settings"),
        requests=_requests(d.get("requests", []), f"{where}: requests"),
        expect=dict(expect), source=str(d.get("source", "")), path=where,
        settings_keys=settings_keys(block) if isinstance(block, Mapping) else (),
    )


def load_scenario(path: str | Path) -> Scenario:
    """Load a `strata.scenario/1` file; BadInput names the file and the field on bad input."""
    p = Path(path)
    return scenario_from_json(load_json_file(p), where=str(p))
