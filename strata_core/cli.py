"""The `strata` command: one sub-command per module in `strata_core.commands`, one error boundary for all of them.

The boundary: bad input (a value, a file, an encoding, a size, a backend the settings make unusable) is one line on
stderr and exit 2; a failure the engine reports is one line and exit 1; a reader that closes stdout early
(`strata plan --json | head`) ends the command quietly. With `--json`, an error is also one `strata.error/1` object
on stdout, so a script reading stdout always gets JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback

from strata_core.errors import BadInput, StrataError

#: Sub-command modules, in the order `strata --help` lists them. Each has `register(subparsers)`; the parser it adds
#: sets `func(args) -> int`.
COMMANDS = ("backends", "config", "plan", "run", "simulate", "bench", "doctor")

ERROR_SCHEMA = "strata.error/1"


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (the usage block stays behind --help), exit 2."""

    def error(self, message: str):
        """Print one line naming the command and the problem, then exit 2."""
        raise _ParseError(f"{self.prog}: error: {message} (see {self.prog} --help)")


class _ParseError(Exception):
    """argparse's one-line error, carried to the boundary so `--json` can print it as JSON too."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every sub-command registered."""
    parser = OneLineParser(prog="strata", description="Strata Core: plan and run MoE models larger than the GPU.")
    parser.add_argument("--traceback", action="store_true",
                        help="on an unexpected error, print the Python traceback (for bug reports)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f".commands.{name}", __package__)
        except ModuleNotFoundError as e:
            if e.name == f"{__package__}.commands.{name}":
                continue  # a command not built yet is simply not listed
            raise
        mod.register(sub)
    return parser


def input_error(e: BaseException) -> BadInput | None:
    """The BadInput an exception from reading the user's input stands for (a file, an encoding), or None."""
    if isinstance(e, BadInput):
        return e
    if isinstance(e, json.JSONDecodeError):
        return BadInput(f"input is not valid JSON: {e}")
    if isinstance(e, UnicodeDecodeError):
        return BadInput(f"input is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})")
    if isinstance(e, IsADirectoryError):
        return BadInput(f"{e.filename}: is a directory, not a file")
    if isinstance(e, (FileNotFoundError, NotADirectoryError)) and e.filename:
        return BadInput(f"{e.filename}: no such file")
    if isinstance(e, PermissionError) and e.filename:
        return BadInput(f"{e.filename}: permission denied")
    return None


def _one_line(text: str) -> str:
    """The message on one line (a multi-line message from a library is joined, never split over lines)."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip()) or "unknown error"


def _report(message: str, exit_code: int, as_json: bool) -> int:
    """Print the error (stderr, and stdout as strata.error/1 under --json); return the exit code."""
    line = _one_line(message).removeprefix("strata: error: ")
    print(line if line.startswith("strata") else f"strata: error: {line}", file=sys.stderr)
    if as_json:
        print(json.dumps({"schema": ERROR_SCHEMA, "error": line, "exit_code": exit_code}))
    return exit_code


def _quiet_stdout() -> None:
    """Point stdout at /dev/null after the reader closed it, so the interpreter's final flush cannot fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (a test's capture): nothing to flush
        pass


def _rich_pipe_closed(console) -> None:
    """rich's hook for a closed stdout, made to raise BrokenPipeError, so a table ends like JSON does (quietly, 0)."""
    console.quiet = True
    raise BrokenPipeError


def main(argv: list[str] | None = None) -> int:
    """Entry point: exit 0 on success, 2 on bad input, 1 on a failure the engine reports; never a traceback for those."""
    from rich.console import Console
    default_hook = Console.on_broken_pipe
    Console.on_broken_pipe = _rich_pipe_closed  # rich's own exits 1; one rule for every output here
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    finally:
        Console.on_broken_pipe = default_hook


def _main(argv: list[str]) -> int:
    """main, inside the boundary."""
    as_json = "--json" in argv
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help and --version exit 0 inside argparse
            return int(e.code or 0)
        except _ParseError as e:
            return _report(str(e), 2, as_json)
        as_json = bool(getattr(args, "json", False))
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        try:
            code = int(args.func(args) or 0)
            sys.stdout.flush()
            return code
        except BrokenPipeError:
            raise
        except StrataError as e:
            return _report(str(e), e.exit_code, as_json)
        except KeyboardInterrupt:
            print("strata: interrupted", file=sys.stderr)
            return 130
        except (OSError, ValueError, MemoryError) as e:
            bad = input_error(e)
            if bad is not None:
                return _report(str(bad), 2, as_json)
            return _unexpected(e, args, as_json)
        except Exception as e:  # a bug: one line, exit 1; the traceback only when asked for
            return _unexpected(e, args, as_json)
    except BrokenPipeError:
        _quiet_stdout()
        return 0


def _unexpected(e: BaseException, args: argparse.Namespace, as_json: bool) -> int:
    """An error no layer turned into a StrataError: one line and exit 1 (`strata --traceback` shows where)."""
    if getattr(args, "traceback", False):
        traceback.print_exc()
    return _report(f"strata: internal error: {type(e).__name__}: {e} (a bug; `strata --traceback ...` shows where)",
                   1, as_json)


if __name__ == "__main__":
    sys.exit(main())
