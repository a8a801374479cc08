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
    host.fresh_selection = True  # this command probes every backend: it measures again what 'auto' remembers
    selection = selection_json(host, settings)
    measured = (host.auto_selection or {}).get("figures", {})
    backends = [{**s.to_json(), "measured_us_per_layer": measured.get(s.name, {}).get("us_per_layer")}
                for s in host.statuses()]
    return {"schema": SCHEMA, **selection, "selected_by": _selected_by(host, selection, settings),
            "auto_selection": host.auto_selection, "backends": backends, "notices": list(host.notices)}


def _selected_by(host, selection: dict, settings) -> str | None:
    """Why the selected backend was selected: named, measured fastest on the host CPU, or the highest probe score."""
    if not selection.get("selected"):
        return None
    if host.auto_selection and host.auto_selection.get("selected") == selection["selected"]:
        return host.auto_selection["why"]
    requested = getattr(getattr(settings, "backend", None), "name", "auto") or "auto"
    return f"named in the settings (backend.name = {requested})" if requested != "auto" else "the highest probe score"


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
    cols = ["name", "vendor", "version", "available", "score", "measured", "devices", "reason"] if wide else \
        ["name", "available", "score", "measured", "devices", "reason"]
    for col in cols:
        table.add_column(col, overflow="fold", no_wrap=col == "name", ratio=1 if col == "reason" else None,
                         max_width=14 if col == "devices" else None)
    for b in report["backends"]:
        cells = {"name": b["name"], "vendor": b["vendor"], "version": b["version"] or "-",
                 "available": "yes" if b["available"] else "no", "score": b["score"],
                 "measured": "-" if b["measured_us_per_layer"] is None else f"{b['measured_us_per_layer']:.0f} us",
                 "devices": ", ".join(d["name"] for d in b["devices"]) or "-", "reason": b["reason"] + install_note(b)}
        # Text cells, because install hints carry brackets ('strata-core[cuda]') that rich would read as markup.
        table.add_row(*(Text(str(cells[c])) for c in cols))
    console.print(table)
    if report["selected"]:
        console.print(f"selected: [bold]{report['selected']}[/bold]")
        console.print(f"  because: {report['selected_by']}", markup=False)
        if report["auto_selection"]:
            console.print(f"  measured: a decode layer of the tiny model per backend, cached in "
                          f"{report['auto_selection']['cache']}", markup=False)
    else:
        console.print(f"selected: none ({report['selection_error']})", markup=False)
    for n in report["notices"]:
        console.print(f"note: {n}", markup=False)
    return 0
