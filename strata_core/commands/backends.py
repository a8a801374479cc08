"""`strata backends`: every discovered backend, whether it is available here, and why not."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table
from rich.text import Text

from strata_core.registry import load_from_settings
from strata_core.config.settings import report_settings_from_args
from strata_core.commands._common import add_report_command, install_note, selection_json

SCHEMA = "strata.backends/1"


def register(subparsers) -> None:
    """Add the `backends` sub-command."""
    add_report_command(subparsers, "backends", schema=SCHEMA, run=run,
                       help="list installed backends, whether they are available, and why not",
                       description="List every backend the plugins provide, with its probe result.")


def backends_report(settings) -> dict:
    """The `strata.backends/1` object for these settings (plugins loaded as the `plugins` group says)."""
    host = load_from_settings(settings)
    return {"schema": SCHEMA, **selection_json(host, settings),
            "backends": [s.to_json() for s in host.statuses()], "notices": list(host.notices)}


def run(args: argparse.Namespace) -> int:
    """Print the backends as JSON or as a table."""
    loaded = report_settings_from_args(args)
    report = backends_report(loaded.settings)
    report["notices"] = list(loaded.notices) + report["notices"]
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    console = Console()
    # Below 100 columns vendor and version (in --json) give their width to the reason, which folds; names never do.
    wide = console.width >= 100
    table = Table(title="Strata backends")
    cols = ["name", "vendor", "version", "available", "score", "devices", "reason"] if wide else \
        ["name", "available", "score", "devices", "reason"]
    for col in cols:
        table.add_column(col, overflow="fold", no_wrap=col == "name", ratio=1 if col == "reason" else None,
                         max_width=14 if col == "devices" else None)
    for b in report["backends"]:
        cells = {"name": b["name"], "vendor": b["vendor"], "version": b["version"] or "-",
                 "available": "yes" if b["available"] else "no", "score": b["score"],
                 "devices": ", ".join(d["name"] for d in b["devices"]) or "-", "reason": b["reason"] + install_note(b)}
        # Text cells, because install hints carry brackets ('strata-core[cuda]') that rich would read as markup.
        table.add_row(*(Text(str(cells[c])) for c in cols))
    console.print(table)
    if report["selected"]:
        console.print(f"selected: [bold]{report['selected']}[/bold]")
    else:
        console.print(f"selected: none ({report['selection_error']})", markup=False)
    for n in report["notices"]:
        console.print(f"note: {n}", markup=False)
    return 0
