"""Reads of a finished analysis: the overview and one position of its summary, the tokens of the
vocabulary rows it names, the comparison of two analyses, a tensor's pooled view and the top coordinates.
"""

from __future__ import annotations

import numpy as np

from backend.analysis_records import AnalysisRecords
from backend.compare import set_comparison, tensor_pairs
from backend.disk import mark_used
from backend.fastjson import loads
from backend.normalize import RequestError
from backend.schemas import (
    ComparePublic,
    PooledView,
    SetComparison,
    TensorPair,
    TensorView,
    TopCoordinate,
    TopCoordinates,
)
from backend.service_error import ServiceError
from backend.store import decode_view
from backend.summary import PositionEntry
from backend.vocabulary import RHO_NOT_ASKED, STATS, TOP_FRACTIONS


class AnalysisViews(AnalysisRecords):
    """What the dashboard reads of a done analysis, from its kept summary and the stored pooled views."""

    def overview(self, analysis_id: str) -> dict:
        """The summary with only its first position whole, and every position in brief: what the
        slides draw, the same size for a 64-token response as for a prefix."""
        _, summary = self.summary(analysis_id)
        positions = summary["positions"]
        index = [
            PositionEntry(index=p["index"], context_length=p["context_length"], target=p.get("target"))
            for p in positions
        ]
        return {
            **summary,
            "positions": positions[:1],
            "position_index": [e.model_dump() for e in index],
            "vocabulary": self._row_tokens(summary),
        }

    def _row_tokens(self, summary: dict) -> dict[str, str]:
        """The token of every vocabulary row among the top coordinates (embedding, output layer), by
        id, so a reader sees ' Paris' where the row index is 7042. Empty when the model's tokenizer is
        no longer here: the ids still stand."""
        model = summary.get("model") or {}
        shapes = {t["name"]: t.get("shape") or [] for t in summary.get("tensors") or []}
        rows = {
            int(c["index"][0])
            for coordinates in (summary.get("top_coordinates") or {}).values()
            for c in coordinates
            if c.get("index") and (shapes.get(c.get("tensor")) or [None])[0] == model.get("vocab_size")
        }
        texts = self._token_texts(model, sorted(rows)) if rows else None
        return (
            {} if texts is None else {str(row): text for row, text in zip(sorted(rows), texts, strict=True)}
        )

    def _token_texts(self, model: dict, ids: list[int]) -> list[str] | None:
        """The tokens of ``ids`` in the analysed model's tokenizer; None when that model is no longer
        here (removed, or no longer allowed): the dashboard then names rows by id."""
        try:
            _, codec = self.resolve_model(str(model.get("id")))
        except Exception:
            return None
        return [codec.token_text(int(i)) for i in ids]

    def position(self, analysis_id: str, index: int) -> dict:
        _, summary = self.summary(analysis_id)
        positions = summary["positions"]
        if not 0 <= index < len(positions):
            raise ServiceError(
                404, f"analysis {analysis_id} has positions 0 to {len(positions) - 1}, not {index}"
            )
        return positions[index]

    def compare(self, a: str, b: str) -> ComparePublic:
        """Top-q set overlap and Jaccard (against chance) and per-tensor totals of two analyses."""
        a, summary_a = self.summary(a)
        b, summary_b = self.summary(b)
        try:
            tensors = [TensorPair(**pair) for pair in tensor_pairs(summary_a, summary_b)]
        except ValueError as error:
            raise RequestError(str(error), field="b") from None
        levels = []
        for analysis_id in (a, b):
            path = self.settings.levels_path(analysis_id)
            if not path.is_file():
                raise ServiceError(
                    409,
                    f"the top-q sets of {analysis_id} are not on disk yet (written right after the "
                    "analysis, and removed when the exports folder is over its budget); retry, or POST it "
                    "again",
                )
            mark_used(path)
            levels.append(np.fromfile(path, dtype=np.uint8))
        sets = SetComparison(**set_comparison(levels[0], levels[1], TOP_FRACTIONS))
        return ComparePublic(a=a, b=b, sets=sets, tensors=tensors)

    def tensor_view(self, analysis_id: str, tensor: str, stat: str, rows: int, cols: int) -> TensorView:
        analysis_id, stored = self._done(analysis_id)
        _check_stat(stat)
        header = self.store.get_pooled_header(analysis_id) or {}
        entry = header.get(stat, {}).get(tensor)
        blob = self.store.get_pooled_blob(analysis_id, stat, tensor) if entry else None
        if entry is None and stat == "rho" and stat not in header and header:
            raise ServiceError(409, f"{RHO_NOT_ASKED}: POST /api/v1/analyses/{analysis_id}/rho")
        if entry is None or blob is None:
            raise ServiceError(404, f"no tensor {tensor!r} with stat {stat!r} in analysis {analysis_id}")
        view = coarsen(decode_view(entry, blob), rows, cols)
        model = (loads(stored.summary_json) if stored.summary_json else {}).get("model") or {}
        vocabulary_rows = view.row_edges[-1] == model.get("vocab_size")  # the embedding, the LM head
        row_tokens = self._token_texts(model, view.row_edges[:-1]) if vocabulary_rows else None
        return TensorView(tensor=tensor, stat=stat, view=view, row_tokens=row_tokens)

    def tensor_names(self, analysis_id: str) -> list[str]:
        analysis_id, _ = self._done(analysis_id)
        header = self.store.get_pooled_header(analysis_id) or {}
        return list(header.get("fisher", {}))

    def top(self, analysis_id: str, stat: str, limit: int) -> TopCoordinates:
        summary_json = self._done(analysis_id)[1].summary_json
        tops = (loads(summary_json) if summary_json else {}).get("top_coordinates") or {}
        if stat not in tops:
            raise ServiceError(404, f"no top coordinates for stat {stat!r}; available: {sorted(tops)}")
        return TopCoordinates(stat=stat, coordinates=[TopCoordinate(**c) for c in tops[stat][:limit]])


def _check_stat(stat: str) -> None:
    if stat not in STATS:
        raise RequestError(f"stat must be one of {list(STATS)}; got {stat!r}", field="stat")


def _group_bounds(n_blocks: int, n_groups: int) -> np.ndarray:
    n_groups = max(1, min(n_groups, n_blocks))
    return np.unique(np.linspace(0, n_blocks, n_groups + 1).round().astype(int))


def coarsen(view: dict, rows: int, cols: int) -> PooledView:
    """Merge neighbouring blocks of a stored pooled view (block sums stay exact block sums)."""
    values = np.asarray(view["values"], dtype=np.float64)
    row_bounds = _group_bounds(values.shape[0], rows)
    col_bounds = _group_bounds(values.shape[1], cols)
    merged = np.add.reduceat(np.add.reduceat(values, row_bounds[:-1], axis=0), col_bounds[:-1], axis=1)
    row_edges = [int(view["row_edges"][i]) for i in row_bounds]
    col_edges = [int(view["col_edges"][i]) for i in col_bounds]
    return PooledView(
        shape=[int(n) for n in merged.shape],
        row_edges=row_edges,
        col_edges=col_edges,
        values=merged.tolist(),
    )
