"""What the dashboard reads of the whole model: totals per tensor, layer and kind, concentration
curves, top coordinates and the top-q overlap of Fisher and policy gradient.

Two passes over the tensors (a large one in blocks of rows, ``MomentSums.in_pieces``): pass 1
(``model_totals``) takes totals, histograms (``concentration``) and the top candidates of stats
without a curve; pass 2 (``model_boundary``) keeps only the values in the boundary bins, for the exact
named shares per tensor (Fisher) and over the model, and the top coordinates of the curve stats. A
light summary (a partial result's) takes the totals only: the same sums, so a partial's totals are the
final ones'.
"""

from __future__ import annotations

import torch

from workers.fisher.concentration import NAMED_FRACTIONS, Histogram, Threshold, concentration_curve
from workers.fisher.model_boundary import BoundaryPass, named_shares
from workers.fisher.model_totals import TotalsPass
from workers.fisher.stats import MomentSums
from workers.fisher.top_sets import fisher_levels_at, overlap, top_coordinates


def _curve(hist: Histogram, named: list[Threshold]) -> dict:
    qs, curve = concentration_curve(hist)
    return {
        "q": qs,
        "share": curve,
        "at": named_shares(hist, named),
        "thresholds": {f"{q:g}": t.value for q, t in zip(NAMED_FRACTIONS, named, strict=True)},
    }


def _zero_curve() -> dict:
    qs, shares = concentration_curve(Histogram(torch.zeros(1), torch.zeros(1), 0))
    zeros = {f"{q:g}": 0.0 for q in NAMED_FRACTIONS}
    return {"q": qs, "share": shares, "at": zeros, "thresholds": dict(zeros)}


def model_summary(
    sums: MomentSums, head_name: str, embedding_name: str, curve_stats: tuple[str, ...], light: bool = False
) -> dict:
    """Totals per tensor / layer / kind, concentration, top coordinates, top-q overlap.

    ``light``: totals only (one pass; no histogram kept): concentration, top coordinates and overlap are
    null. What a partial result can afford after each chunk of directions.
    """
    work = TotalsPass(sums, head_name, embedding_name, curve_stats, light)
    try:
        return _summarize(work, sums, curve_stats, light)
    finally:
        work.release()


def _summarize(work: TotalsPass, sums: MomentSums, curve_stats: tuple[str, ...], light: bool) -> dict:
    pieces = list(work.pieces)
    for name, first in zip(pieces, work.each_tensor(work.first, pieces), strict=True):
        work.record_first(name, first)
    if light:
        return {**work.groups(), "concentration": None, "top_coordinates": None, "overlap": None}
    boundary = BoundaryPass(work)
    named = boundary.named()
    concentration = {stat: _curve(boundary.model_hists[stat], named[stat]) for stat in work.curve}
    for stat in curve_stats:
        alias = sums.alias(stat)
        concentration.setdefault(stat, concentration[alias] if alias in concentration else _zero_curve())
    return {
        **work.groups(),
        "concentration": concentration,
        "top_coordinates": top_coordinates(sums, work.candidates),
        "overlap": overlap(work.sums, fisher_levels_at(work.sums, named["fisher"]))  # piece by piece
        if sums.has_reward and "fisher" in named
        else None,
    }
