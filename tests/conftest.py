"""Fixtures shared by every test folder (kept small: each folder adds its own in its own conftest.py)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def clean_strata_env(monkeypatch, tmp_path):
    """No STRATA_* variable set and an empty working directory, so only what a test sets reaches the settings."""
    for name in list(os.environ):
        if name.upper().startswith("STRATA_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path
