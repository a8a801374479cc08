"""A plugin's own settings group: a name, a pydantic model, and what to do with the validated values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pydantic import BaseModel


@dataclass(frozen=True)
class SettingsGroup:
    """One settings group a plugin declares through `strata_settings_group` (versionadded 2.0).

    `name` is the group's key everywhere settings are read: the TOML table `[name]`, `STRATA_NAME__KEY` and
    `--set name.key=VALUE`. `model` validates the group (a pydantic model whose fields all have defaults, so the
    group may be left out). `apply` receives the validated values once per command, after loading and before any
    probe; a `BadInput` it raises is the user's (exit 2). None means the plugin reads nothing at apply time.
    """

    name: str
    model: type[BaseModel]
    apply: Callable[[BaseModel], None] | None = None
