"""`strata config show` (every setting with its value and where it came from) and `strata config table`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from strata_core.errors import BadInput, StrataError
from strata_core.registry import load_from_settings
from strata_core.config.settings import (LoadedSettings, add_settings_arguments, embed_table, legacy_table_rows, settings_from_args,
                        settings_table_markdown, settings_table_rows, with_backend_defaults)

SCHEMA = "strata.config/1"
TABLE_SCHEMA = "strata.config-table/1"


def register(subparsers) -> None:
    """Add the `config` sub-command with `show` and `table`."""
    p = subparsers.add_parser("config", help="show the settings and where each value came from",
                              description="Show the settings (`show`) or print the settings table (`table`).")
    sub = p.add_subparsers(dest="config_command", metavar="ACTION")
    show = sub.add_parser("show", help="every setting with its value (and, with --origin, its source)")
    show.add_argument("--json", action="store_true", help=f"print one {SCHEMA} object")
    show.add_argument("--origin", action="store_true", help="also print where each value came from")
    add_settings_arguments(show)
    show.set_defaults(func=run_show)
    table = sub.add_parser("table", help="print the settings table (Markdown) that the README embeds")
    table.add_argument("--json", action="store_true", help=f"print one {TABLE_SCHEMA} object")
    table.add_argument("--write", metavar="FILE", help="replace the table between the markers in FILE")
    table.add_argument("--check", metavar="FILE", help="exit 1 if FILE's embedded table is out of date")
    table.set_defaults(func=run_table)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def resolved_settings(loaded: LoadedSettings) -> tuple[LoadedSettings, str | None, list[str]]:
    """The settings with backend defaults filled in, the backend that gave them (or None) and notices."""
    host = load_from_settings(loaded.settings)
    try:
        target = host.resolve_target(loaded.settings)
    except StrataError as e:
        return loaded, None, [f"backend defaults not shown: {e}"]
    return with_backend_defaults(loaded, target.defaults, target.backend.name), target.backend.name, []


def config_report(loaded: LoadedSettings) -> dict:
    """The `strata.config/1` object."""
    filled, backend, notes = resolved_settings(loaded)
    return {"schema": SCHEMA, "backend": backend, "values": filled.values_json(),
            "notices": list(loaded.notices) + notes}


def run_show(args: argparse.Namespace) -> int:
    """Print every setting, as JSON or a table."""
    report = config_report(settings_from_args(args))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    table = Table(title="Strata settings" + (f" (backend defaults: {report['backend']})" if report["backend"] else ""))
    # The key column is never cut or wrapped (a cut key cannot be typed back); the others fold to the width left.
    table.add_column("key", no_wrap=True, min_width=max(len(k) for k in report["values"]))
    table.add_column("value", overflow="fold")
    if args.origin:
        table.add_column("source", overflow="fold")
        table.add_column("origin", overflow="fold")
    for key, v in report["values"].items():
        row = [key, json.dumps(v["value"])]
        if args.origin:
            row += [v["source"], v["origin"]]
        table.add_row(*(Text(str(c)) for c in row))
    console = Console()
    console.print(table)
    for n in report["notices"]:
        console.print(f"note: {n}", markup=False)
    return 0


def run_table(args: argparse.Namespace) -> int:
    """Print the generated settings table, or write it into / check it against a file's markers."""
    if args.json:
        print(json.dumps({"schema": TABLE_SCHEMA, "settings": settings_table_rows(), "legacy": legacy_table_rows()},
                         indent=2, default=str))
        return 0
    target = args.write or args.check
    if not target:
        print(settings_table_markdown(), end="")
        return 0
    path = Path(target)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise BadInput(f"{target}: cannot read ({e.strerror or e})") from None
    updated = embed_table(text)
    if args.check:
        if updated != text:
            raise StrataError(f"{target}: the settings table is out of date; run `strata config table --write {target}`")
        print(f"{target}: the settings table is up to date")
        return 0
    if updated != text:
        path.write_text(updated, encoding="utf-8")
    print(f"{target}: settings table written")
    return 0
