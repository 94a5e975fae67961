"""Shares and bounds as a reader sees them: significant figures that never contradict the value.

Fixed decimals print a small positive share as "0%" (it is not zero) and a share just under 1 as
"100%" (it is not all); rounding a bound and its value to the nearest digit independently can print
the bound below the value it bounds. These helpers round with the direction that keeps each printed
number honest, so every figure, table and reading writes shares one way.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, ROUND_HALF_EVEN, Decimal

SHARE_DIGITS = 2  # significant figures of a share: 0.42%, 3.1%, 42%
SMALLEST_PERCENT = 1e-4  # below this a positive share prints as "<0.0001%", never as a 0
DECIMAL_ROUNDING = {"nearest": ROUND_HALF_EVEN, "up": ROUND_CEILING, "down": ROUND_FLOOR}
ROUNDING = tuple(DECIMAL_ROUNDING)


def rounded(value: float, digits: int = SHARE_DIGITS, direction: str = "nearest") -> float:
    """`value` rounded to `digits` significant figures: to the nearest, or up / down (towards +-inf)."""
    if direction not in ROUNDING:
        raise ValueError(f"direction must be one of {ROUNDING}, got {direction!r}")
    if value == 0 or not math.isfinite(value):
        return value
    # 12 significant digits first: float noise (0.29 * 100 = 28.999999999999996) must not step a
    # whole digit down, nor 50.00000000001 a digit up
    exact = Decimal(f"{value:.12e}")
    grid = Decimal(1).scaleb(exact.adjusted() - (digits - 1))
    return float(exact.quantize(grid, rounding=DECIMAL_ROUNDING[direction]))


def plain(value: float, digits: int = SHARE_DIGITS) -> str:
    """A rounded number without exponent or trailing zeros: 0.00042, 3.1, 4200."""
    if value == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}".rstrip("0").rstrip(".") if decimals else f"{value:.0f}"


def percent(share: float, digits: int = SHARE_DIGITS, direction: str = "nearest") -> str:
    """A share in [0, 1] as a percentage with `digits` significant figures.

    Zero prints "0%", one "100%"; a positive share never "0%" (a tiny one is "<0.0001%") and a share
    below one never "100%" (more digits, then ">99.99%").
    """
    if not math.isfinite(share):
        return "–"
    value = 100.0 * share
    if value == 0:
        return "0%"
    if 0 < value < SMALLEST_PERCENT:
        return f"<{plain(SMALLEST_PERCENT, 1)}%"
    text = rounded(value, digits, direction)
    if 99 < value < 100:
        for more in range(digits, digits + 4):  # 99.96% -> "99.96%", never "100%"
            text = rounded(value, more, direction)
            if text < 100:
                return f"{plain(text, more)}%"
        return ">99.99%"
    return f"{plain(text, digits)}%"


def value_and_bound(
    value: float, bound: float, digits: int = SHARE_DIGITS, as_percent: bool = True
) -> tuple[str, str]:
    """A value and an upper bound on it, printed so the bound never reads below the value: the value
    rounded down, the bound rounded up (each to `digits` significant figures)."""
    if as_percent:
        value_text = percent(value, digits, "down") if value > 0 else percent(value, digits)
        return value_text, percent(bound, digits, "up")
    return plain(rounded(value, digits, "down"), digits), plain(rounded(bound, digits, "up"), digits)
