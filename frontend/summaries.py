"""What the figures draw, fetched on the dashboard's server for an analysis id and kept a while.

Why this exists: a whole summary held in the browser is posted back on every callback, and a response
of a few tokens outgrows any body limit (docs/design.md §6, the 413). So the browser holds ids and view state
only; the callbacks run here, in Python, and ask the API for the part a figure needs: the overview (the
summary with its first position whole), one position, one tensor's pooled view, a compare. A finished
analysis never changes, so each answer is kept by id in a small LRU and a slide step or a centering
toggle asks the API nothing. A running analysis's partial result is kept by (id, kept share): each
refinement is a new key.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypedDict, TypeVar

from backend.schemas import ComparePublic, TensorView
from backend.summary import AnalysisOverview, AnalysisSummary, PositionEntry, PositionSummary
from frontend.api_client import ApiClient, partial_result

VIEWS_KEPT = 96  # a few analyses' overviews, positions, pooled views and compares
T = TypeVar("T")


class View(TypedDict, total=False):
    """What the browser holds of an analysis to draw: its id, while it runs the partial's share, and the
    query of the controls that asked for it (None for an analysis a link opened by id)."""

    id: str
    kept_share: float | None
    query: str | None


class LruCache:
    """A thread-safe least-recently-used map (Dash answers callbacks on several threads).

    A new analysis sets off every figure's callback at once, all wanting the same overview: one of them
    asks the API, the others wait for its answer (a lock per key being fetched), and a slow answer for
    one key never holds up another.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict[Hashable, Any] = OrderedDict()
        self.lock = threading.Lock()
        self.fetching: dict[Hashable, threading.Lock] = {}

    def get(self, key: Hashable, fetch: Callable[[], T]) -> T:
        """The kept value for `key`, else `fetch()`'s, fetched once however many ask at the same time."""
        with self.lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                return self.entries[key]
            key_lock = self.fetching.setdefault(key, threading.Lock())
        with key_lock:
            with self.lock:
                if key in self.entries:  # fetched by another caller while this one waited
                    return self.entries[key]
            try:
                value = fetch()
                self.put(key, value)
            finally:
                with self.lock:
                    self.fetching.pop(key, None)
            return value

    def put(self, key: Hashable, value: Any) -> None:
        with self.lock:
            self.entries[key] = value
            self.entries.move_to_end(key)
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)


class Summaries:
    """The API's views of analyses, by id, for the figures: the only way a callback reads a result.

    Every view is kept as the typed object the API client checked (`frontend.api_client`), so a figure
    reads fields, never keys of an unchecked answer."""

    def __init__(self, api: ApiClient, size: int = VIEWS_KEPT) -> None:
        self.api = api
        self.cache = LruCache(size)

    def summary(self, view: View) -> AnalysisSummary:
        """What the slides draw: the overview of a finished analysis, or the partial result so far."""
        if view.get("kept_share") is None:
            return self.overview(view["id"])
        return self.cache.get(("partial", view["id"], view["kept_share"]), lambda: self._latest(view["id"]))

    def _latest(self, analysis_id: str) -> AnalysisSummary:
        """A partial this process has not seen (another dashboard process polled it): ask again; by now
        the analysis may be done, then its overview."""
        body = self.api.analysis(analysis_id)
        partial = partial_result(body)
        return partial.result if partial is not None else self.overview(body["id"])

    def remember_partial(self, analysis_id: str, kept_share: float, result: AnalysisSummary) -> None:
        """The partial result a poll just read, so drawing it asks the API nothing more."""
        self.cache.put(("partial", analysis_id, kept_share), result)

    def overview(self, analysis_id: str) -> AnalysisOverview:
        return self.cache.get(("overview", analysis_id), lambda: self.api.overview(analysis_id))

    def position(self, view: View, index: int) -> PositionSummary:
        """One position's whole summary; a partial result carries its positions itself."""
        summary = self.summary(view)
        if index == 0 or view.get("kept_share") is not None:
            return summary.positions[min(index, len(summary.positions) - 1)]
        return self.cache.get(("position", view["id"], index), lambda: self.api.position(view["id"], index))

    def pooled(self, analysis_id: str, tensor: str, stat: str, rows: int = 64, cols: int = 64) -> TensorView:
        key = ("pooled", analysis_id, tensor, stat, rows, cols)
        return self.cache.get(key, lambda: self.api.pooled(analysis_id, tensor, stat, rows, cols))

    def compare(self, a: str, b: str) -> ComparePublic:
        return self.cache.get(("compare", a, b), lambda: self.api.compare(a, b))


def position_entries(summary: AnalysisSummary) -> list[PositionEntry]:
    """Every analysed position in brief: the overview's index, or, for a partial result (which carries
    its positions whole), read off the positions themselves."""
    if isinstance(summary, AnalysisOverview):
        return summary.position_index
    return [
        PositionEntry(index=i, context_length=p.context_length, target=p.target)
        for i, p in enumerate(summary.positions)
    ]
