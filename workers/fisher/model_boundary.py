"""The second pass of ``model_summary``: only the values in the boundary bins of the first pass's
histograms are kept, for the exact named shares per tensor (Fisher) and over the model, and the top
coordinates of the curve stats."""

from __future__ import annotations

import torch

from workers.fisher.concentration import (
    NAMED_FRACTIONS,
    BinChoice,
    Histogram,
    Selection,
    Threshold,
    merge,
    plan_thresholds,
    plans_of,
    select_in_one_pass,
)
from workers.fisher.model_totals import TotalsPass, in_tensor
from workers.fisher.top_sets import Candidate, top_bin


def named_shares(hist: Histogram, named: list[Threshold]) -> dict[str, float]:
    """The share of the total above each named fraction's threshold."""
    total = hist.total
    return {
        f"{q:g}": (t.top_sum / total if total > 0 else 0.0)
        for q, t in zip(NAMED_FRACTIONS, named, strict=True)
    }


class BoundaryPass:
    """The bins each tensor's pass reads, planned from the first pass's histograms before the threads."""

    def __init__(self, totals: TotalsPass) -> None:
        self.totals = totals
        curve, hists = totals.curve, totals.hists
        self.model_hists = {stat: merge(hists[stat].values()) for stat in curve}
        self.model_plans = {stat: plan_thresholds(self.model_hists[stat], NAMED_FRACTIONS) for stat in curve}
        # the bin of the model's TOP_COORDINATES-th largest value: everything at or above it is a candidate
        self.top_bin = {stat: top_bin(self.model_hists[stat]) for stat in curve}
        self.names = names = list(totals.pieces)  # what each pass reads: a tensor, or a block of its rows
        self.pieces_of: dict[str, list[str]] = {}
        for name, piece in totals.pieces.items():
            self.pieces_of.setdefault(piece.tensor, []).append(name)
        # planned for all tensors at once, before the threads (numpy's per-call cost, not the bins, was
        # most of a plan's time): the Fisher's per tensor plans (none when it is identically zero: shares
        # 0), and the bins each piece's pass reads
        tensors = list(self.pieces_of)
        self.fisher_hists = {
            tensor: merge(hists["fisher"][p] for p in pieces)
            if len(pieces) > 1
            else hists["fisher"][pieces[0]]
            for tensor, pieces in self.pieces_of.items()
            if "fisher" in hists
        }
        fisher = [self.fisher_hists[tensor] for tensor in tensors] if "fisher" in hists else []
        self.tensor_plans = dict(zip(tensors, plans_of(fisher, NAMED_FRACTIONS), strict=bool(fisher)))
        self.choices = {
            stat: dict(
                zip(
                    names,
                    BinChoice.each(
                        [hists[stat][name] for name in names],
                        [self._wanted(stat, name) for name in names],
                        self.top_bin[stat],  # everything at or above it: the candidates
                    ),
                    strict=True,
                )
            )
            for stat in curve
        }
        sums = totals.sums
        self._nothing = torch.empty(0, dtype=sums.dtype, device=sums.device)  # a stat not read

    def named(self) -> dict[str, list[Threshold]]:
        """Exact named shares (model and, for the Fisher, per tensor, into the first pass's tensor entries)
        and the curve stats' top candidates (added to the first pass's candidates)."""
        totals = self.totals
        members: dict[str, dict[int, list[torch.Tensor]]] = {stat: {} for stat in totals.curve}
        fisher_members: dict[str, dict[int, list[torch.Tensor]]] = {}  # per tensor: its plan's bins
        found = totals.each_tensor(self._of_tensor, self.names)
        for name, (selected, candidates, mine) in zip(self.names, found, strict=True):
            piece = totals.pieces[name]
            for stat in totals.curve:
                for b, values in selected[stat].items():
                    members[stat].setdefault(b, []).append(values)
            for stat, more in candidates.items():
                totals.candidates[stat].extend(in_tensor(more, piece))
            for b, values in mine.items():
                fisher_members.setdefault(piece.tensor, {}).setdefault(b, []).append(values)
        for entry in totals.grouped.tensors:
            plan = self.tensor_plans.get(entry["name"])
            shares = (
                named_shares(
                    self.fisher_hists[entry["name"]], plan.finish(fisher_members.get(entry["name"], {}))
                )
                if plan is not None
                else {f"{q:g}": 0.0 for q in NAMED_FRACTIONS}
            )
            entry["concentration"] = {"fisher": shares}
        return {stat: self.model_plans[stat].finish(members[stat]) for stat in totals.curve}

    def _wanted(self, stat: str, name: str) -> set[int]:
        """The boundary bins a piece's pass reads of a curve stat: the model's, and its tensor's own
        Fisher's."""
        plan = self.tensor_plans.get(self.totals.pieces[name].tensor) if stat == "fisher" else None
        return self.model_plans[stat].bins | (plan.bins if plan else set())

    def _of_tensor(
        self, name: str
    ) -> tuple[dict[str, dict[int, torch.Tensor]], dict, dict[int, torch.Tensor]]:
        """One piece's boundary-bin values per curve stat, its top candidates and its values in the bins
        of its tensor's Fisher plan. Reads only: ``named`` combines the pieces' results in order."""
        with self.totals.sums.one_tensor_at_a_time():
            return self._tensor_pass(name)

    def _tensor_pass(
        self, name: str
    ) -> tuple[dict[str, dict[int, torch.Tensor]], dict, dict[int, torch.Tensor]]:
        tensor_plan = self.tensor_plans.get(self.totals.pieces[name].tensor)
        mine: dict[int, torch.Tensor] = {}
        selected: dict[str, dict[int, torch.Tensor]] = {}
        candidates: dict[str, list[Candidate]] = {}
        choices = {stat: self.choices[stat][name] for stat in self.totals.curve}
        for stat, selection in self._selections(name, choices).items():
            boundary = {b: selection.of(b) for b in self.model_plans[stat].bins}
            selected[stat] = {b: values for b, values in boundary.items() if values.numel()}
            if stat in self.totals.candidates:
                index, values = selection.at_or_above(self.top_bin[stat])
                candidates[stat] = [
                    (v, name, i, v) for i, v in zip(index.tolist(), values.tolist(), strict=True)
                ]
            if stat == "fisher" and tensor_plan is not None:
                mine = {b: selection.of(b) for b in tensor_plan.bins}
        return selected, candidates, mine

    def _selections(self, name: str, choices: dict[str, BinChoice]) -> dict[str, Selection]:
        """Each curve stat's chosen values of one tensor: the stats that are sums of stored arrays in one
        pass, any other formed in the scratch in turn (a tensor with none chosen is not formed)."""
        totals = self.totals
        stored = {stat: terms for stat in choices if (terms := totals.sums.terms(stat, name)) is not None}
        found = dict(
            zip(stored, select_in_one_pass(list(stored.values()), [choices[s] for s in stored]), strict=True)
        )
        for stat, choice in choices.items():
            if stat not in found:
                chosen = totals.terms_or_formed(stat, name) if choice.size else self._nothing
                found[stat] = choice.select(chosen)
        return {stat: found[stat] for stat in choices}
