"""Command-line arguments: the settings flags every command shares, and argparse types that bound numbers and paths.

A flag's value is checked as argparse reads it, so a bad one is argparse's one-line error and exit 2, naming the
flag and the bound (`--requests: expected a whole number from 0 to 1000000, got '1e9'`).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from strata_core.config.sources import FlagValue, LoadedSettings, load_settings
from strata_core.errors import BadInput

#: The largest seed a command takes: numpy's generators take any non-negative integer; 2**63 - 1 keeps it a C long.
MAX_SEED = (1 << 63) - 1


def _bounded(pattern: str, convert: Callable[[str], Any], lo: Any, hi: Any, desc: str) -> Callable[[str], Any]:
    """An argparse type: text matching `pattern`, converted, from `lo` to `hi`; `desc` names it in the error."""

    def parse(text: str) -> Any:
        s = text.strip()
        if not re.fullmatch(pattern, s) or not lo <= convert(s) <= hi:
            raise argparse.ArgumentTypeError(f"expected {desc}, got {text!r}")
        return convert(s)

    parse.__name__ = desc  # argparse names the type in its own messages
    return parse


def bounded_int(lo: int, hi: int, unit: str = "") -> Callable[[str], int]:
    """An argparse type: a whole number in ASCII digits from `lo` to `hi` (`unit` names what it counts)."""
    return _bounded(r"[+-]?[0-9]+", int, lo, hi, f"a whole number{' of ' + unit if unit else ''} from {lo} to {hi}")


def bounded_float(lo: float, hi: float, what: str) -> Callable[[str], float]:
    """An argparse type: a finite decimal number from `lo` to `hi` (`what` names what it is)."""
    return _bounded(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", float, lo, hi,
                    f"{what} from {lo:g} to {hi:g}")


#: `--seed N`: a non-negative integer.
seed_arg = bounded_int(0, MAX_SEED)


def output_path(suffixes: tuple[str, ...]) -> Callable[[str], str]:
    """An argparse type: a file to write whose name ends in one of `suffixes` and that is not a directory."""
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError("expected a file name, got ''")
        p = Path(text)
        if p.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"expected a file ending in {', '.join(suffixes)}, got {text!r}")
        if p.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
        return text

    parse.__name__ = "output file"
    return parse


def _parse_set(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise BadInput(f"flag --set {item}: expected KEY=VALUE, e.g. --set prefill.chunk=4096")
    key, value = item.split("=", 1)
    if not key.strip():
        raise BadInput(f"flag --set {item}: expected KEY=VALUE with a key, e.g. --set prefill.chunk=4096")
    return key.strip(), value


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --config FILE, --backend NAME and --set KEY=VALUE (repeatable) to a command's parser."""
    g = parser.add_argument_group("settings")
    g.add_argument("--config", metavar="FILE", default=None,
                   help="TOML settings file (default: ./strata.toml, else [tool.strata] in ./pyproject.toml)")
    g.add_argument("--backend", metavar="NAME", default=None, help="backend to use: auto or a name (backend.name)")
    g.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="set_values",
                   help="set any setting by its dotted key, e.g. --set prefill.chunk=4096 (repeatable)")


def flags_from_args(args: argparse.Namespace, overrides: Mapping[str, Any] | None = None) -> dict[str, FlagValue]:
    """{dotted key: FlagValue} from a command's --set/--backend flags and `overrides` (dotted key -> value)."""
    flags: dict[str, FlagValue] = {}
    for item in getattr(args, "set_values", None) or []:
        key, value = _parse_set(item)
        flags[key] = FlagValue(value, f"--set {key}")
    if getattr(args, "backend", None) is not None:  # '' is a value to refuse, not an absent flag
        flags["backend.name"] = FlagValue(args.backend, "--backend")
    for key, v in (overrides or {}).items():
        if v is not None:
            flags[key] = v if isinstance(v, FlagValue) else FlagValue(v, f"flag for {key}")
    return flags


def settings_from_args(args: argparse.Namespace, overrides: Mapping[str, Any] | None = None,
                       skip_bad_file: bool = False) -> LoadedSettings:
    """Load settings for a command: its --set/--backend flags and `overrides` (dotted key -> value) over the rest."""
    return load_settings(flags=flags_from_args(args, overrides), config_file=getattr(args, "config", None),
                         skip_bad_file=skip_bad_file)


def report_settings_from_args(args: argparse.Namespace) -> LoadedSettings:
    """Settings for a report command (doctor, backends): a bad settings file is a notice, not the end of the report."""
    return settings_from_args(args, skip_bad_file=True)
