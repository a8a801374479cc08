"""Strata Core: the vendor-neutral platform layer of a Mixture-of-Experts inference engine."""

__version__ = "0.1.0"

#: The hook contract's version. A backend whose major version differs is refused.
API_VERSION = "1.0"
