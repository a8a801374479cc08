"""What `strata backends` and `strata doctor` share: the report command's arguments, the selection, the install note."""

from __future__ import annotations

from typing import Callable

from strata_core.config.settings import add_settings_arguments


def add_report_command(subparsers, name: str, *, schema: str, help: str, description: str,
                       run: Callable) -> None:
    """Add a sub-command that prints one report: `--json` for the `schema` object, the settings arguments, `run`."""
    p = subparsers.add_parser(name, help=help, description=description)
    p.add_argument("--json", action="store_true", help=f"print one {schema} object")
    add_settings_arguments(p)
    p.set_defaults(func=run)


def selection_json(plugins, backend_name) -> dict:
    """{"selected", "selection_error"} for the settings' backend name (None for an empty error, as both reports say)."""
    selected, why_not = plugins.selection(backend_name)
    return {"selected": selected, "selection_error": why_not or None}


def install_note(backend: dict) -> str:
    """' (install: HINT)' for a backend's JSON that carries an install hint, '' otherwise."""
    return f" (install: {backend['install_hint']})" if backend["install_hint"] else ""
