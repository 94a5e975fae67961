"""What a test needs from the machine (Redis, Chromium, the compose binary), and what happens without it.

Why: on a developer's laptop a missing tool skips its tests with the reason; under CI (``CI=true``,
which `.ci/run` sets) every tool is installed, so a missing one fails the run instead of letting the
suite pass without testing what it claims to.
"""

from __future__ import annotations

import os

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(available: bool, what: str) -> None:
    """Skip (locally) or fail (under CI) unless ``available``; ``what`` names the missing tool."""
    if available:
        return
    if under_ci():
        pytest.fail(f"CI must have {what}")
    pytest.skip(f"{what} is missing here")
