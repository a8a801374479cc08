"""`strata doctor`: the host, the backends, the settings' notices and what would be selected, in one report."""

from __future__ import annotations

import argparse
import json
import platform
import sys

from rich.console import Console

from strata_core import __version__
from strata_core.api import API_VERSION
from strata_core.registry import load_from_settings
from strata_core.config.settings import report_settings_from_args
from strata_core.commands._common import add_report_command, install_note, selection_json

SCHEMA = "strata.doctor/1"


def register(subparsers) -> None:
    """Add the `doctor` sub-command."""
    add_report_command(subparsers, "doctor", schema=SCHEMA, run=run,
                       help="check this machine: host, backends, settings, selection",
                       description="Report the host, every backend, settings notices and the selection.")


def doctor_report(loaded) -> dict:
    """The `strata.doctor/1` object."""
    plugins = load_from_settings(loaded.settings)
    statuses = plugins.statuses()
    selection = selection_json(plugins, loaded.settings)
    host = plugins.host_info()
    return {"schema": SCHEMA, "strata_version": __version__, "api_version": API_VERSION,
            "python": platform.python_version(), "platform": sys.platform, "host": host.to_json(),
            "backends": [s.to_json() for s in statuses], **selection,
            "settings_notices": list(loaded.notices), "plugin_notices": list(plugins.notices),
            "ok": selection["selected"] is not None}


def run(args: argparse.Namespace) -> int:
    """Print the report as JSON or as text."""
    report = doctor_report(report_settings_from_args(args))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    c = Console()
    h = report["host"]
    c.print(f"strata-core {report['strata_version']} (hook api {report['api_version']}), "
            f"Python {report['python']} on {report['platform']}", markup=False)
    c.print(f"host: {h['os']}, {h['ram_available_bytes'] / 2**30:.1f} of {h['ram_total_bytes'] / 2**30:.1f} GiB RAM "
            f"available, CPU {h['cpu']['name']} ({h['cpu']['cores']} cores, {' '.join(h['cpu']['flags']) or 'no flags'})",
            markup=False)
    for b in report["backends"]:
        mark = "ok " if b["available"] else "-- "
        c.print(f"  {mark}{b['name']:<8} {b['reason']}{install_note(b)}", markup=False)
    if report["selected"]:
        c.print(f"selected backend: {report['selected']}", markup=False)
    else:
        c.print(f"selected backend: none ({report['selection_error']})", markup=False)
    for n in report["settings_notices"] + report["plugin_notices"]:
        c.print(f"note: {n}", markup=False)
    return 0
