"""The two kinds of failure a command reports: bad input (exit 2) and an engine failure (exit 1)."""


class StrataError(Exception):
    """A failure the engine reports in one line; the command exits 1."""

    exit_code = 1


class BadInput(StrataError):
    """Input that cannot be used (a setting, a file, a flag); the command exits 2 with one line."""

    exit_code = 2


class PlanRefused(BadInput):
    """No plan exists for this machine; the message carries the shortfall and the setting that would fix it."""


class InvariantBroken(AssertionError):
    """A plan broke one of its invariants: a bug in the planner, never returned to a caller."""
