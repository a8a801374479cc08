"""strata-site-policy: fleet-wide limits applied to every Strata Core plan through `strata_adjust_plan`."""

__version__ = "0.1.0"
