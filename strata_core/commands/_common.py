"""What `strata backends` and `strata doctor` share: the report command's arguments, the selection, the install note."""

from __future__ import annotations

from typing import Callable

from strata_core.config.settings import add_settings_arguments
from strata_core.errors import StrataError


def add_report_command(subparsers, name: str, *, schema: str, help: str, description: str,
                       run: Callable) -> None:
    """Add a sub-command that prints one report: `--json` for the `schema` object, the settings arguments, `run`."""
    p = subparsers.add_parser(name, help=help, description=description)
    p.add_argument("--json", action="store_true", help=f"print one {schema} object")
    add_settings_arguments(p)
    p.set_defaults(func=run)


def selection_json(plugins, settings) -> dict:
    """{"selected", "selection_error", "device"} of the Target these settings resolve to (never raises)."""
    try:
        target = plugins.resolve_target(settings)
    except StrataError as e:
        return {"selected": None, "selection_error": str(e), "selected_device": None}
    return {"selected": target.backend.name, "selection_error": None, "selected_device": target.device.info.to_json()}


def install_note(backend: dict) -> str:
    """' (install: HINT)' for a backend's JSON that carries an install hint, '' otherwise."""
    return f" (install: {backend['install_hint']})" if backend["install_hint"] else ""
