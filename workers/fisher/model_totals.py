"""The first pass of ``model_summary``: each tensor's totals, the histograms of the curve stats and the
top candidates of the stats without a curve; the totals summed per layer, kind and model.

A large tensor is read as blocks of its rows (``MomentSums.in_pieces``), each a tensor of its own to
the passes; what they find is recorded per tensor.

On the CPU the totals (the Fisher, the uncentered and raw Fisher, a sum of squares, rho) come from one
pass over a tensor's stored arrays and its histograms from another, each reading the arrays once for
every stat that is a sum of them; a stat that has to be formed is formed once per pass, into a scratch
buffer of this summary's.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from backend.vocabulary import SIGNED_STATS
from workers.fisher import cpu_kernels
from workers.fisher.concentration import (
    Histogram,
    Stat,
    histogram,
    histograms_in_one_pass,
    totals_in_one_pass,
)
from workers.fisher.first_moments import Piece
from workers.fisher.grouping import layer_of, module_kind
from workers.fisher.scratch_pool import summary_scratch
from workers.fisher.stats import MomentSums, each_tensor, square_total
from workers.fisher.top_sets import TOP_STATS, Candidate, top_candidates

# the totals a stat contributes: (key in "totals", summed as a square)
_TOTALS = {
    "fisher": ("fisher", False),
    "uncentered": ("uncentered", False),
    "raw": ("raw", False),
    "mean_shift": ("mean_shift_sq", True),
    "common": ("common_sq", True),
}
_REWARD_TOTALS = {"policy_grad": ("policy_grad_sq", True), "bound": ("bound", False)}


@dataclass
class _First:
    """What the first pass finds in one tensor."""

    totals: dict[str, float | None]
    hists: dict[str, Histogram]  # per curve stat
    candidates: dict[str, list[Candidate]]  # per top stat without a curve


@dataclass
class _Joint:
    """What the passes over a tensor's stored arrays find (``TotalsPass._joint``)."""

    hists: dict[str, Histogram]  # per curve stat that is a sum of stored arrays (a full summary's)
    totals: dict[str, float]  # per binned stat that is a sum of stored arrays: the values it bins, summed
    squares: dict[str, float]  # a stat whose totals are its float64 sum of squares
    rho_mean: float | None  # None: not taken


_Result = TypeVar("_Result")


def in_tensor(candidates: list[Candidate], piece: Piece) -> list[Candidate]:
    """A piece's candidates, indexed in its tensor."""
    return [
        (magnitude, piece.tensor, index + piece.offset, value) for magnitude, _, index, value in candidates
    ]


@dataclass
class _Group:
    """Totals of a set of tensors (a layer, a kind, the model); rho is carried as a size-weighted sum."""

    numel: int = 0
    totals: dict[str, float | None] = field(default_factory=dict)

    def add(self, totals: dict[str, float | None], numel: int) -> None:
        self.numel += numel
        for key, value in totals.items():
            before = self.totals.get(key, 0.0)
            if value is None or before is None:  # rho where it was not computed
                self.totals[key] = None
                continue
            self.totals[key] = before + (value * numel if key == "rho_mean" else value)

    def finished(self) -> dict[str, float | None]:
        totals = dict(self.totals)
        rho_sum = totals.get("rho_mean")
        if rho_sum is not None and self.numel:
            totals["rho_mean"] = rho_sum / self.numel
        return totals


class TotalsGroups:
    """Each tensor's totals, and their sums per layer, module kind and the model: the totals part of a
    summary (``groups``). A tensor may come in blocks of rows, in order (``add``'s ``blocks``)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], head_name: str, embedding_name: str):
        self.shapes, self.head_name, self.embedding_name = shapes, head_name, embedding_name
        self.tensors: list[dict[str, Any]] = []
        self.layers: dict[int | str, _Group] = {}
        self.kinds: dict[str, _Group] = {}
        self.model = _Group()
        self.in_blocks: dict[str, _Group] = {}  # a tensor read in blocks: its totals so far

    def add(self, tensor: str, totals: dict[str, float | None], numel: int, blocks: bool = False) -> None:
        """``totals`` of ``numel`` values of ``tensor``: the whole tensor, or (``blocks``) its next block."""
        kind = module_kind(tensor, self.head_name, self.embedding_name)
        layer = layer_of(tensor, self.embedding_name)
        if not blocks or tensor not in self.in_blocks:
            self.tensors.append(
                {
                    "name": tensor,
                    "layer": layer,
                    "kind": kind,
                    "shape": list(self.shapes[tensor]),
                    "numel": math.prod(self.shapes[tensor]),
                    "totals": totals,
                    "concentration": None,  # the Fisher's named shares in it: a full summary's second pass
                }
            )
        if blocks:
            so_far = self.in_blocks.setdefault(tensor, _Group())
            so_far.add(totals, numel)
            self.tensors[-1]["totals"] = so_far.finished()
        for group in (
            self.layers.setdefault(layer, _Group()),
            self.kinds.setdefault(kind, _Group()),
            self.model,
        ):
            group.add(totals, numel)

    def groups(self) -> dict:
        return {
            "totals": self.model.finished(),
            "tensors": self.tensors,
            "layers": [
                {"layer": k, "numel": g.numel, "totals": g.finished()} for k, g in self.layers.items()
            ],
            "kinds": [{"kind": k, "numel": g.numel, "totals": g.finished()} for k, g in self.kinds.items()],
        }


def _distinct_stats(sums: MomentSums, stats: tuple[str, ...]) -> list[str]:
    """Stats that need their own computation: no alias of another, not zero by construction."""
    out: list[str] = []
    for stat in stats:
        if not sums.identically_zero(stat) and sums.alias(stat) not in out:
            out.append(sums.alias(stat))
    return out


class TotalsPass:
    """The first pass of ``model_summary``, and the state its second pass (``BoundaryPass``) reads.

    ``sums`` is read piece by piece (``sums.in_pieces``): its histograms and boundary choices are the
    pieces', its totals, tensor entries and candidates the tensors'.
    """

    def __init__(
        self,
        sums: MomentSums,
        head_name: str,
        embedding_name: str,
        curve_stats: tuple[str, ...],
        light: bool = False,
    ):
        self.tensor_shapes = sums.shapes
        sums, self.pieces = sums.in_pieces()
        self.sums = sums
        self.head_name, self.embedding_name = head_name, embedding_name
        # the curve stats' totals are the float64 sums of the values they bin, light or not (a partial's
        # totals are the final ones'); only a full summary bins them, for curves and a second pass
        self.binned = _distinct_stats(sums, curve_stats)
        self.curve = [] if light else self.binned
        self.top_stats = [] if light else _distinct_stats(sums, TOP_STATS)
        self.grouped = TotalsGroups(self.tensor_shapes, head_name, embedding_name)
        self.hists: dict[str, dict[str, Histogram]] = {stat: {} for stat in self.curve}
        self.candidates: dict[str, list[Candidate]] = {stat: [] for stat in self.top_stats}
        self.totals_of = dict(_TOTALS, **(_REWARD_TOTALS if sums.has_reward else {}))
        # every stat that is formed: the curves', the top coordinates' and the totals'; a stat equal to
        # another by construction is formed once, for all of them, and one zero by construction not at all
        self.formed = _distinct_stats(sums, (*self.binned, *self.top_stats, *self.totals_of))
        self.aliases = {stat: [s for s in self.totals_of if sums.alias(s) == stat] for stat in self.formed}
        self.total_keys = [key for key, _ in _TOTALS.values()] + ["rho_mean"]
        self.total_keys += [key for key, _ in _REWARD_TOTALS.values()] if sums.has_reward else []
        self.local = threading.local()  # each thread's scratch buffer
        self.taken: list[torch.Tensor] = []
        self.taken_lock = threading.Lock()

    def scratch(self, name: str) -> torch.Tensor:
        """This thread's buffer for formed stats (tensors are summarized in threads), at least as large
        as tensor ``name``: it grows to the largest tensor this thread summarizes, not the model's
        (one thread takes the embedding table; a buffer of its size in the other was 1.2 GB of
        Qwen3-1.7B's peak spent on nothing)."""
        need = math.prod(self.sums.shapes[name])
        buffer = getattr(self.local, "scratch", None)
        if buffer is None or buffer.numel() < need:
            sums = self.sums
            grown = self.local.scratch = summary_scratch.take(need, sums.dtype, sums.device)
            with self.taken_lock:
                if buffer is not None:  # outgrown: back to the pool now
                    self.taken = [b for b in self.taken if b is not buffer]
                    summary_scratch.give(buffer)
                self.taken.append(grown)
            buffer = grown
        return buffer

    def release(self) -> None:
        for buffer in self.taken:
            summary_scratch.give(buffer)
        self.taken.clear()

    def each_tensor(self, work: Callable[[str], _Result], names: list[str]) -> list[_Result]:
        return each_tensor(self.sums, work, names)

    def first(self, name: str) -> _First:
        """Totals, histograms and (for stats without a curve) top candidates of one tensor.

        On the CPU the curve stats' totals and histograms, one squared total and rho's mean come from
        the arrays they share, each read once for the totals and once for the histograms (``_joint``).
        Any other stat is formed once, into this thread's scratch buffer, and everything it feeds is
        taken from it before the next one is formed. Reads only: ``record_first`` keeps the result.
        """
        with self.sums.one_tensor_at_a_time():
            return self._first(name)

    def _first(self, name: str) -> _First:
        sums = self.sums
        # a stat whose totals are its sum of squares, held in its small form (a first moment at one
        # position): the sum from its terms, in float64 (formed only where its top coordinates are read,
        # so a light summary's totals are a full one's)
        small = {
            stat: square
            for stat in self.formed
            if self._totals_are_squares(stat) and (square := sums.small_square_sum(stat, name)) is not None
        }
        joint = (
            self._joint(name, small) if cpu_kernels.compiled_for(sums.device) else _Joint({}, {}, {}, None)
        )
        joint.squares.update(small)
        found: dict[str, float | None] = {}
        hists: dict[str, Histogram] = dict(joint.hists)
        candidates: dict[str, list[Candidate]] = {}
        for stat in self.formed:
            if stat in self.binned:
                # its totals: the float64 sum of the values it bins, the same with a histogram or without
                # (a light summary's); its top coordinates are found in the second pass
                total = joint.totals.get(stat)
                if total is None:  # formed: raw at one position off the policy, or off the CPU
                    value = self.terms_or_formed(stat, name)
                    if cpu_kernels.compiled_for(sums.device):
                        (total,), _, _ = totals_in_one_pass([value])
                    if stat in self.curve or total is None:
                        hists[stat] = histogram([value])
                        total = hists[stat].total if total is None else total
                for alias in self.aliases[stat]:
                    found[self.totals_of[alias][0]] = total
                continue
            if stat in joint.squares:
                for alias in self.aliases[stat]:
                    found[self.totals_of[alias][0]] = joint.squares[stat]
                if stat not in self.top_stats:
                    continue
            value = sums.stat(stat, name, out=self.scratch(name))
            for alias in self.aliases[stat]:
                key, squared = self.totals_of[alias]
                if stat not in joint.squares:
                    found[key] = self._total(value, squared)
            if stat in self.top_stats:
                candidates[stat] = top_candidates(name, value, stat in SIGNED_STATS)
        if sums.has_rho:
            found["rho_mean"] = self._rho_mean(name) if joint.rho_mean is None else joint.rho_mean
        else:
            found["rho_mean"] = None
        # the order of the contract's totals; a stat zero by construction was never formed: 0
        totals = {key: found.get(key, 0.0) for key in self.total_keys}
        return _First(totals, {stat: hists[stat] for stat in self.curve}, candidates)

    def _totals_are_squares(self, stat: str) -> bool:
        """Whether a stat's totals are its sum of squares alone (no histogram)."""
        return (
            stat not in self.binned
            and bool(self.aliases[stat])
            and all(self.totals_of[alias][1] for alias in self.aliases[stat])
        )

    def _joint(self, name: str, small: dict[str, float]) -> _Joint:
        """The passes of ``first`` on the CPU: the totals of the binned stats that are sums of stored
        arrays, of the first stat whose totals are only a sum of squares of a stored array (not one of
        ``small``, summed from its terms), and rho's mean; then the histograms of the curve stats among
        them (a full summary's)."""
        sums = self.sums
        binned = {stat: terms for stat in self.binned if (terms := sums.terms(stat, name)) is not None}
        squared = next(
            (
                stat
                for stat in self.formed
                if self._totals_are_squares(stat)
                and stat not in self.top_stats
                and stat not in small
                and (terms := sums.terms(stat, name)) is not None
                and terms.extra is None
            ),
            None,
        )
        rho = sums.rho_terms(name) if sums.has_rho else None
        totals, square_sum, share_sum = totals_in_one_pass(
            list(binned.values()), None if squared is None else sums.stat(squared, name), rho
        )
        curve = [stat for stat in binned if stat in self.curve]
        size = math.prod(sums.shapes[name])
        return _Joint(
            dict(zip(curve, histograms_in_one_pass([binned[stat] for stat in curve]), strict=True)),
            dict(zip(binned, totals, strict=True)),
            {} if squared is None else {squared: square_sum},
            None if rho is None else share_sum / size if size else 0.0,
        )

    def record_first(self, name: str, first: _First) -> None:
        """Keep one piece's first-pass results (pieces in order: sums are summed in that order)."""
        piece = self.pieces[name]
        for stat, hist in first.hists.items():
            self.hists[stat][name] = hist
        for stat, found in first.candidates.items():
            self.candidates[stat].extend(in_tensor(found, piece))
        self.grouped.add(
            piece.tensor, first.totals, math.prod(self.sums.shapes[name]), blocks=piece.rows is not None
        )

    def terms_or_formed(self, stat: str, name: str) -> Stat:
        """The stat's terms where it is a sum of stored arrays, else the stat formed in the scratch."""
        terms = self.sums.terms(stat, name)
        return terms if terms is not None else self.sums.stat(stat, name, out=self.scratch(name))

    def _rho_mean(self, name: str) -> float:
        """Off the CPU (on it, ``_joint`` takes rho's mean in its pass)."""
        return float(self.sums.stat("rho", name, out=self.scratch(name)).mean())

    @staticmethod
    def _total(value: torch.Tensor, squared: bool) -> float:
        return square_total([value]) if squared else float(value.sum())

    def groups(self) -> dict:
        return self.grouped.groups()
