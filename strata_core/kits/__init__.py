"""Shared kernel kits: source and driver code that several backends build on (no vendor library is imported here)."""
