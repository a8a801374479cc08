"""The `strata` command: one sub-command per module in `strata_core.commands`, one error path for all of them."""

from __future__ import annotations

import argparse
import importlib
import sys

from strata_core.errors import StrataError

#: Sub-command modules, in the order `strata --help` lists them. Each has `register(subparsers)`; the parser it adds
#: sets `func(args) -> int`.
COMMANDS = ("backends", "config", "plan", "run", "simulate", "bench", "doctor")


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (the usage block stays behind --help), exit 2."""

    def error(self, message: str):
        """Print one line naming the command and the problem, then exit 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every sub-command registered."""
    parser = OneLineParser(prog="strata", description="Strata Core: plan and run MoE models larger than the GPU.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f".commands.{name}", __package__)
        except ModuleNotFoundError as e:
            if e.name == f"{__package__}.commands.{name}":
                continue  # a command not built yet is simply not listed
            raise
        mod.register(sub)
    return parser




def main(argv: list[str] | None = None) -> int:
    """Entry point: exit 0 on success, 2 on bad input, 1 on a failure the engine reports; never a traceback for those."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on bad flags, 0 on --help
        return int(e.code or 0)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except StrataError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
