"""A download's query (`stats`, `tensors`, `dtype`) read into an `ExportChoice`, or a 422 saying what to fix.

Why its own module: the route, the service and the dashboard's URL all speak this query, and the rules
(known statistics, selectors that select something, what a float16 file can hold) are stated once.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from backend.normalize import RequestError
from backend.schemas import DEFAULT_EXPORT_STATS, ExportChoice, ExportDtype
from backend.vocabulary import STATS

FLOAT16_MAX = 65504.0  # the largest finite float16; larger magnitudes would round to inf
BYTES_PER_VALUE = {ExportDtype.float16: 2, ExportDtype.float32: 4}
MAX_SELECTORS = 64
EXPORT_FIELD_PREFIX = "export:"  # an analysis's record keeps one field per download choice


def _items(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_export_choice(stats: str | None, tensors: str | None, dtype: str | None) -> ExportChoice:
    """The choice a query names; missing parts take the defaults (fisher and mean_shift in float16)."""
    chosen = _items(stats) if stats is not None else list(DEFAULT_EXPORT_STATS)
    unknown = [stat for stat in chosen if stat not in STATS]
    if unknown or not chosen:
        raise RequestError(f"stats must be a comma list of {', '.join(STATS)}; got {stats!r}", field="stats")
    try:
        precision = ExportDtype(dtype or ExportDtype.float16.value)
    except ValueError:
        raise RequestError(
            f"dtype must be {' or '.join(d.value for d in ExportDtype)}; got {dtype!r}", field="dtype"
        ) from None
    selectors = None
    if tensors is not None:
        selectors = tuple(sorted(set(_items(tensors))))
        if not selectors or len(selectors) > MAX_SELECTORS:
            raise RequestError(
                f"tensors must be 1 to {MAX_SELECTORS} comma-separated names, dotted prefixes or globs "
                "(e.g. model.layers.0,*.mlp.*); leave it out for every parameter",
                field="tensors",
            )
    ordered = tuple(stat for stat in STATS if stat in chosen)
    return ExportChoice(stats=ordered, tensors=selectors, dtype=precision)


def check_selects_something(choice: ExportChoice, names: Iterable[str]) -> list[str]:
    """The parameter names the choice keeps; a selector that keeps none is a 422 naming it."""
    names = list(names)
    if choice.tensors is None:
        return names
    for selector in choice.tensors:
        if not any(choice.model_copy(update={"tensors": (selector,)}).selects(name) for name in names):
            example = ", ".join(names[:3])
            raise RequestError(
                f"tensors: {selector!r} selects no parameter of this analysis (names look like "
                f"{example}; GET .../tensors lists them)",
                field="tensors",
            )
    return [name for name in names if choice.selects(name)]


def overflow_detail(stat: str, peak: float) -> str:
    """Why a float16 file of ``stat`` is refused (the worker writes it, the API answers it as a 422)."""
    return (
        f"{stat} reaches {peak:.3g} in magnitude, beyond float16's largest value {FLOAT16_MAX:g} (it would "
        "be written as inf); ask for dtype=float32"
    )


def export_key(choice: ExportChoice) -> str:
    """The field of an analysis's record that tracks one choice's file: queued, running, done, failed."""
    return EXPORT_FIELD_PREFIX + choice.slug()


def export_record(
    choice: ExportChoice, status: str, error: str | None = None, overflow: bool = False
) -> dict:
    """What that field holds: the API writes it queued, the worker running, then done or failed.
    ``overflow``: failed because float16 cannot hold the values, which asking again does not change."""
    record = {
        "status": status,
        "started": time.time(),
        "choice": choice.model_dump(mode="json"),
        "error": error,
    }
    return {**record, "overflow": True} if overflow else record
