"""The per-parameter stats of docs/design.md §2, derived from base moments.

Base moments (fisher, fisher_p, kbar_mu, kbar_p, policy_grad) are what the direction pass computes;
every reported stat is a cheap elementwise function of them, formed one tensor at a time so that no
more than the base moments are ever held for the whole model.

Along a response the sums over positions are kept (F = sum_t fisher, M = sum_t mean_shift, and the
sums of squares the uncentered and raw moments need), and rho is the ratio of sums.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from backend.vocabulary import RHO_NOT_ASKED, STATS
from workers.fisher import cpu_kernels
from workers.fisher.feature_grams import FeatureGrams
from workers.fisher.first_moments import (
    Factored,
    FirstMoment,
    FormedCache,
    Piece,
    Root,
    Whole,
    formed_in_pieces,
    in_piece,
    largest_piece,
    pieces_of,
    square_sums,
)
from workers.fisher.parameter_arrays import SumsStorage
from workers.fisher.position import PositionMoments
from workers.fisher.scratch_pool import summary_scratch
from workers.fisher.terms import StatTerms

Params = dict[str, torch.Tensor]
_Result = TypeVar("_Result")


class RhoNotComputed(ValueError):
    """rho asked of sums that lack the second moment under p."""


def square_total(values: Sequence[torch.Tensor]) -> float:
    """The sum of squares of every tensor, each square and the sum in float64. On the CPU one compiled
    pass per tensor, tensors shared among threads, forms no array (``value.square()`` is a fresh P-sized
    array; a float32 dot is 5e-4 off at 1e7 values)."""
    if values and cpu_kernels.compiled_for(values[0]):
        return sum(cpu_kernels.each_in_threads(cpu_kernels.square_sum, values, [v.numel() for v in values]))
    return sum(float(v.double().square().sum()) for v in values)


def square_total_of(tensors: Mapping[str, torch.Tensor], feature_grams: FeatureGrams | None = None) -> float:
    """``square_total`` of a mapping's tensors (``square_sums_of``, added up)."""
    return sum(square_sums_of(tensors, feature_grams).values())


def square_sums_of(
    tensors: Mapping[str, torch.Tensor], feature_grams: FeatureGrams | None = None
) -> dict[str, float]:
    """Each tensor's float64 sum of squares. A first moment in its small form is summed from its terms
    (``Factored.square_sum``: never formed); any other tensor is read one at a time, a large one a block
    of rows at a time (a ``FirstMoment`` forms each as it is read: all at once would be
    parameter-sized)."""
    whole = tensors.entries if isinstance(tensors, FirstMoment) else dict(tensors)
    small = square_sums(
        {name: entry for name, entry in whole.items() if isinstance(entry, Factored)}, feature_grams
    )
    sums: dict[str, float] = {}
    rest: dict[str, Factored | torch.Tensor] = {}
    for name, entry in whole.items():
        found = small.get(name)
        if found is None:
            rest[name] = entry
        else:
            sums[name] = found
    pieces = pieces_of({name: tuple(entry.shape) for name, entry in rest.items()})
    entries = {key: in_piece(rest[piece.tensor], piece) for key, piece in pieces.items()}
    cache = FormedCache(0)
    moment = FirstMoment(entries, cache, "square")  # each thread forms into one buffer of its own
    names = list(moment)
    compiled = bool(names) and cpu_kernels.compiled_for(moment.entry(names[0]).device)

    def square_sum(name: str) -> float:
        with cache.one_tensor_at_a_time():
            value = moment[name]
            return cpu_kernels.square_sum(value) if compiled else square_total([value])

    found_sums = (
        cpu_kernels.each_in_threads(square_sum, names, [moment.numel(n) for n in names])
        if compiled
        else [square_sum(name) for name in names]
    )
    for key, value in zip(names, found_sums, strict=True):
        tensor = pieces[key].tensor
        sums[tensor] = sums.get(tensor, 0.0) + value
    return sums


@dataclass
class MomentSums:
    """Sums over positions of every base quantity (one position: the position's own values).

    Absent entries are zero by construction (mean shifts on-policy, policy gradients without a
    reward). Sums of squares are only materialized from the second position on: for one position
    they are the squares of the first moments, and not storing them keeps two P-sized arrays free.
    One position's first moments (common, mean shift, policy gradient) stay in their small form
    (``first_moments``), formed one tensor at a time where read (the tensors formed last kept for
    their next reader); from the second position on, they are summed as arrays.
    """

    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    sums: dict[str, FirstMoment] = field(default_factory=dict)
    positions: int = 0
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    # where the sums over positions are kept as arrays (``SumsStorage``: in memory, or mapped files beyond
    # its budget); None: each a fresh array of its own
    storage: SumsStorage | None = None

    def __post_init__(self) -> None:
        self.cache = FormedCache()
        self.sums = {key: FirstMoment(table.entries, self.cache, key) for key, table in self.sums.items()}
        self._stored: dict[str, dict[str, torch.Tensor] | None] = {}  # the storage's tables, by statistic

    SQUARED = {"mean_shift_sq": "mean_shift", "common_sq": "common"}

    def add(self, m: PositionMoments) -> None:
        """Fold one position in (the caller may drop ``m`` afterwards)."""
        on_policy = m.kbar_mu is m.kbar_p
        self.dtype = m.hidden.dtype
        self.device = m.hidden.device
        if self.positions == 1:
            self._materialize_squares()
        shifts = None if on_policy else m.kbar_mu.minus(m.kbar_p)  # small where both are
        # the squares of its first moments from the second position on (the first's are formed later)
        squared = self._squared_moments(m, shifts) if self.positions >= 1 else []
        self._fold(m, on_policy, shifts, squared, first_moments=True)
        self.positions += 1

    SECOND_MOMENTS = ("fisher", "fisher_p", "bound")

    def add_first_moments(self, m: PositionMoments) -> None:
        """Fold in one position's first moments only (common, mean shift, policy gradient): a response's
        first pass, whose partial result reads the Fisher and the squares as per-tensor totals alone
        (``response.tensor_totals``); ``second_moments_over`` then hands these sums to the exact pass.

        The sums stay in their small form (``summed_terms``): positions read from one forward of the
        response share each use's features, so a sum over them is one term per use, formed once by
        ``second_moments_over``, and its square sums are Gram products."""
        self.dtype = m.hidden.dtype
        self.device = m.hidden.device
        shifts = None if m.kbar_mu is m.kbar_p else m.kbar_mu.minus(m.kbar_p)
        for name in self.names:
            if shifts is not None:
                self._add_small("mean_shift", name, shifts.entry(name))
            self._add_small("common", name, m.kbar_p.entry(name))
            if m.policy_grad is not None:
                self._add_small("policy_grad", name, m.policy_grad.entry(name))
        self.positions += 1

    def _add_small(self, key: str, name: str, value: torch.Tensor | Factored) -> None:
        """A first moment added to its sum in their small forms (an array taken as a whole term)."""
        entries = self._table(key).entries
        if isinstance(value, torch.Tensor):
            value = Factored(self.shapes[name], value.dtype, value.device, (Whole(value),))
        current = entries.get(name)
        assert current is None or isinstance(current, Factored)  # a first pass's sums stay small
        entries[name] = value if current is None else current.plus(*value.terms).summed()

    def second_moments_over(self, storage: SumsStorage | None = None) -> MomentSums:
        """Sums for a second pass over the same positions, kept in ``storage``: these sums' first moments
        (small in a response's first pass, ``add_first_moments``), no second moment and no square yet;
        ``add_second_moments`` adds each position's. Neither sums writes to the first moments again."""
        tables = {key: table for key, table in self.sums.items() if key in self.FIRST_MOMENTS}
        sums = MomentSums(self.names, self.shapes, tables, self.positions, self.dtype, self.device, storage)
        sums._form_first_position()  # a single position's small forms: later ones read them as arrays
        return sums

    FIRST_MOMENTS = ("mean_shift", "common", "policy_grad")

    def add_second_moments(self, m: PositionMoments) -> None:
        """Fold in one position's second moments (its Fisher, under p off the policy, and the bound) and
        the squares of its first moments: sums whose first moments came from an earlier pass
        (``second_moments_over``)."""
        on_policy = m.kbar_mu is m.kbar_p
        shifts = None if on_policy else m.kbar_mu.minus(m.kbar_p)
        self._fold(m, on_policy, shifts, self._squared_moments(m, shifts), first_moments=False)

    def _fold(
        self,
        m: PositionMoments,
        on_policy: bool,
        shifts: FirstMoment | None,
        squared: list[tuple[str, FirstMoment]],
        first_moments: bool,
    ) -> None:
        """Each tensor's second moments of position ``m``, its first moments where asked, and the squares
        of ``squared``, each formed into one kept buffer, a large tensor a block of rows at a time
        (``row_pieces``). Why: a fresh array the size of the head costs as much in first-touch page faults
        as the rest of its square (150 ms a form on SmolLM2's tied table, twice per position off the
        policy), and a buffer of a block is the one the summary takes next from the same pool; formed
        whole, the mean shift and kbar_mu of a tied table were two fresh arrays of its size at once."""
        largest = largest_piece(self.shapes)
        scratch = summary_scratch.take(largest, self.dtype, self.device) if squared else None
        try:
            for name in self.names:
                self._add_second_moments(m, name, on_policy)
                if first_moments:
                    if shifts is not None:
                        self._add("mean_shift", name, shifts.entry(name))
                    self._add("common", name, m.kbar_p.entry(name))
                    if m.policy_grad is not None:
                        self._add("policy_grad", name, m.policy_grad.entry(name))
                for key, moment in squared:
                    if self._keeps(key):  # after the second moments: rho's is kept once fisher_p is
                        assert scratch is not None  # (for the type checker: taken where squared)
                        self._add_square_formed(key, name, moment, scratch)
        finally:
            if scratch is not None:
                summary_scratch.give(scratch)

    def _add_square_formed(self, key: str, name: str, moment: FirstMoment, scratch: torch.Tensor) -> None:
        """``_add_square`` of a first moment's tensor, formed in ``scratch`` a piece at a time."""
        entry = moment.entry(name)
        entries = self._table(key).entries
        current = entries.get(name)
        fresh = current is None
        total = current if not fresh else self._kept_array(key, name, entry.dtype)
        if total is None:
            total = torch.empty(entry.shape, dtype=entry.dtype, device=entry.device)
        assert isinstance(total, torch.Tensor)  # sums of squares are arrays
        for piece, formed in formed_in_pieces(name, entry, scratch):
            into = in_piece(total, piece)
            if fresh:
                torch.mul(formed, formed, out=into)
            else:
                into.addcmul_(formed, formed)
        entries[name] = total

    @staticmethod
    def _squared_moments(m: PositionMoments, shifts: FirstMoment | None) -> list[tuple[str, FirstMoment]]:
        """The first moments of a position whose squares the sums keep: the mean shift's and kbar_mu's off
        the policy, and kbar_p's (the common component) where it is kept."""
        off_policy = [] if shifts is None else [("mean_shift_sq", shifts), ("kbar_mu_sq", m.kbar_mu)]
        return [*off_policy, ("common_sq", m.kbar_p)]

    def _add_second_moments(self, m: PositionMoments, name: str, on_policy: bool) -> None:
        """One tensor's second moments of a position: its Fisher, under p off the policy (on it the
        Fisher is that), and with a reward the bound."""
        f = m.fisher[name]
        if not m.fisher_zero:  # a one-hot mu adds nothing: keep no P-sized zeros
            self._add("fisher", name, f)
        if not on_policy and m.fisher_p is not None:
            self._add("fisher_p", name, m.fisher_p[name])
        if m.policy_grad is not None and not m.fisher_zero:
            assert m.reward_std is not None
            # read off the Fisher where it is read: no second P-sized array
            bound = Root(f, m.reward_std)
            self._add("bound", name, Factored(self.shapes[name], f.dtype, f.device, (bound,)))

    def _materialize_squares(self) -> None:
        """Before the second position: the first's small forms become arrays (the bound's reads the
        Fisher, which the second position adds into), and the sums of squares start."""
        self._form_first_position()
        for name in self.names:
            for key, base in self.SQUARED.items():
                value = self._get(base, name)
                if value is not None and self._keeps(key):
                    self._add_square(key, name, value)
            shift = self._get("mean_shift", name)
            if shift is not None:
                self._add_square("kbar_mu_sq", name, self.sums["common"][name] + shift)

    def _form_first_position(self) -> None:
        """The first position's small forms become arrays, which later positions add into (its arrays
        move into the storage where there is one)."""
        for key, table in self.sums.items():
            for name, entry in table.entries.items():
                table.entries[name] = self._kept(key, name, entry)

    def _kept(self, key: str, name: str, value: torch.Tensor | Factored) -> torch.Tensor:
        """``value`` as the array sum ``key`` keeps: formed (a small form), in the storage's array where
        there is one (else the array itself, or a fresh one)."""
        kept = self._kept_array(key, name, value.dtype)
        if isinstance(value, Factored):
            return value.form(out=kept)
        return value if kept is None or kept is value else kept.copy_(value)

    def _kept_array(self, key: str, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        """The storage's array for sum ``key`` of tensor ``name`` (its table made at the first ask, of the
        ``dtype`` of the value that asks), or None without a storage or where it keeps ``key`` in
        memory."""
        if self.storage is None:
            return None
        if key not in self._stored:
            self._stored[key] = self.storage.table(key, self.names, self.shapes, dtype, self.device)
        table = self._stored[key]
        return None if table is None else table[name]

    def _keeps(self, key: str) -> bool:
        """Whether a sum of squares is kept along a response: the common component's is read only by the
        raw Fisher on the policy and by rho, so off the policy without the second moment under p it is a
        parameter-sized array nothing reads."""
        return key != "common_sq" or self.has_rho

    def _table(self, key: str) -> FirstMoment:
        if key not in self.sums:
            self.sums[key] = FirstMoment({}, self.cache, key)
        return self.sums[key]

    def _add(self, key: str, name: str, value: torch.Tensor | Factored) -> None:
        """The first position's tensors (or small forms) are taken as they are (callers hand over fresh
        moments); from the second position on the sums are arrays, which later positions add into. Why
        not a new sum each time: a P-sized array per stat and position (most of them fresh memory) took
        0.3-1.0 s of each position's 2.6 s on SmolLM2 at 5 + 16 tokens, mc:16."""
        entries = self._table(key).entries
        current = entries.get(name)
        if self.positions == 0 and self.storage is None:
            entries[name] = value
            return
        if current is None:  # formed now: a bound's small form reads a Fisher that later positions add into
            entries[name] = self._kept(key, name, value)
            return
        assert isinstance(current, torch.Tensor)  # the first position's small forms were formed
        if isinstance(value, Factored):
            value.add_into(current)
        else:
            current.add_(value)

    def _add_square(self, key: str, name: str, value: torch.Tensor) -> None:
        """``_add`` of value^2, without forming it where a sum is there to add into."""
        entries = self._table(key).entries
        if name in entries:
            current = entries[name]
            assert isinstance(current, torch.Tensor)  # sums of squares are arrays
            current.addcmul_(value, value)
        else:
            kept = self._kept_array(key, name, value.dtype)
            entries[name] = value.square() if kept is None else torch.mul(value, value, out=kept)

    def _get(self, key: str, name: str) -> torch.Tensor | None:
        """A stored sum (none for the squares of a single position: those are formed where used)."""
        table = self.sums.get(key)
        return None if table is None else table.get(name)

    @property
    def has_reward(self) -> bool:
        return "policy_grad" in self.sums

    @property
    def has_mean_shift(self) -> bool:
        return "mean_shift" in self.sums

    @property
    def has_rho(self) -> bool:
        """rho needs E_p[kappa^2]: free on the policy (no mean shift), the second moment under p off it."""
        return not self.has_mean_shift or "fisher_p" in self.sums

    def identically_zero(self, stat: str) -> bool:
        """True when a stat is zero by construction (no computation needed to know it)."""
        if stat == "mean_shift":
            return not self.has_mean_shift
        if stat == "policy_grad":
            return not self.has_reward
        if stat in ("fisher", "bound"):  # no position had a Fisher: every one had a one-hot mu
            return stat not in self.sums
        return False

    def alias(self, stat: str) -> str:
        """The stat this one equals exactly (uncentered is fisher on-policy)."""
        return "fisher" if stat == "uncentered" and not self.has_mean_shift else stat

    def stat(self, stat: str, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """One stat for one parameter tensor.

        ``out``: a buffer (at least the tensor's size, the sums' dtype) that a formed stat is written into
        instead of a new tensor, so that a pass over every stat of every tensor allocates nothing large
        (on some machines a fresh P-sized array costs more in page faults than the arithmetic). A stored
        stat (fisher, mean_shift, common, policy_grad, bound) is returned as it is: never modify it.
        An unknown stat is refused (``terms``).
        """
        if stat == "rho":
            return self._rho(name, self._buffer(name, out))
        terms = self.terms(stat, name)  # zeros for a stat zero by construction
        if terms is None:  # raw at one position off-policy: kbar_mu = common + shift, squared in place
            target = self._buffer(name, out)
            common, shift = self.sums["common"].entry(name), self.sums["mean_shift"].entry(name)
            if isinstance(common, Factored) and isinstance(shift, Factored):  # formed once, in the target
                common.plus(*shift.terms).form(out=target)
            else:
                torch.add(self.sums["common"][name], self.sums["mean_shift"][name], out=target)
            return target.square_().add_(self._fisher(name))
        return terms.formed(None if terms.extra is None else self._buffer(name, out))

    def small_square_sum(self, stat: str, name: str) -> float | None:
        """The float64 sum of squares of a stored stat held in its small form (a first moment at one
        position), from its terms (``Factored.square_sum``); None for any other."""
        table = self.sums.get(stat)
        entry = None if table is None else table.entries.get(name)
        return entry.square_sum() if isinstance(entry, Factored) else None

    def terms(self, stat: str, name: str) -> StatTerms | None:
        """The stat as a sum of stored arrays (see ``StatTerms``); None for rho, and for raw at one
        position off-policy (the square of common + shift), which have to be formed."""
        if stat not in STATS:
            raise KeyError(f"unknown stat {stat!r}; choose from {', '.join(STATS)}")
        if stat == "rho":
            return None
        if self.identically_zero(stat):
            return StatTerms(self._zeros(name))
        fisher = self._fisher(name)
        if stat == "fisher" or (stat == "uncentered" and not self.has_mean_shift):
            return StatTerms(fisher)  # on-policy the uncentered Fisher is the Fisher
        if stat == "uncentered":
            return self._plus_square(fisher, "mean_shift_sq", name)
        if stat == "raw":
            if "kbar_mu_sq" in self.sums:
                return StatTerms(fisher, self.sums["kbar_mu_sq"][name])
            if self.has_mean_shift:
                return None
            return self._plus_square(fisher, "common_sq", name)
        return StatTerms(self.sums[stat][name])  # mean_shift, common, policy_grad, bound

    def _fisher(self, name: str) -> torch.Tensor:
        return self.sums["fisher"][name] if "fisher" in self.sums else self._zeros(name)

    def rho_terms(self, name: str) -> StatTerms:
        """fisher_p + common_sq: rho is its common term's share (``StatTerms.extra_share``), 0 where 0/0.
        Refused (``RhoNotComputed``) where the second moment under p was not asked for."""
        if not self.has_rho:
            raise RhoNotComputed(RHO_NOT_ASKED)
        fisher_p = self._get("fisher_p", name)
        return self._plus_square(self._fisher(name) if fisher_p is None else fisher_p, "common_sq", name)

    def _rho(self, name: str, out: torch.Tensor) -> torch.Tensor:
        return self.rho_terms(name).extra_share(out)

    def _buffer(self, name: str, out: torch.Tensor | None) -> torch.Tensor:
        shape = self.shapes[name]
        if out is None:
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        return out.reshape(-1)[: math.prod(shape)].view(shape)

    def _plus_square(self, base: torch.Tensor, key: str, name: str) -> StatTerms:
        """base + the sum of squares ``key`` (mean_shift_sq, common_sq): stored from the second position
        on, the square of the first moment at one position."""
        stored = self._get(key, name)
        if stored is not None:
            return StatTerms(base, stored)
        first = self._get(self.SQUARED[key], name)
        if first is None:  # every position adds the common component (and a mean shift when it has one)
            raise ValueError("no position has been added")
        return StatTerms(base, first, squared=True)

    def _zeros(self, name: str) -> torch.Tensor:
        return torch.zeros(self.shapes[name], dtype=self.dtype, device=self.device)

    def in_pieces(self, most: int | None = None) -> tuple[MomentSums, dict[str, Piece]]:
        """These sums with each tensor of more than ``most`` values (``PIECE_VALUES``) read as blocks of
        its rows (``row_pieces``): a pass over them forms a block's arrays at a time, never a large
        tensor's. Each piece's name, and the tensor it is a piece of."""
        pieces = pieces_of({name: self.shapes[name] for name in self.names}, most)
        if all(piece.rows is None for piece in pieces.values()):
            return self, pieces
        shapes = {key: piece.shape for key, piece in pieces.items()}
        tables = {
            table_key: FirstMoment(
                {
                    key: in_piece(table.entries[piece.tensor], piece)
                    for key, piece in pieces.items()
                    if piece.tensor in table.entries
                }
            )
            for table_key, table in self.sums.items()
        }
        return MomentSums(list(pieces), shapes, tables, self.positions, self.dtype, self.device), pieces

    def one_tensor_at_a_time(self) -> contextlib.AbstractContextManager[None]:
        """A block that reads one tensor's stats and keeps only numbers of them: its first moments are
        formed into this thread's buffers (``FormedCache.one_tensor_at_a_time``)."""
        return self.cache.one_tensor_at_a_time()

    def iter_stat(self, stat: str) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names:
            yield name, self.stat(stat, name)


def each_tensor(sums: MomentSums, work: Callable[[str], _Result], names: list[str]) -> list[_Result]:
    """``work`` for every tensor of ``sums``, in threads on the CPU, where its compiled passes release
    the GIL (results in ``names``' order)."""
    if not cpu_kernels.compiled_for(sums.device):
        return [work(name) for name in names]
    sizes = [math.prod(sums.shapes[name]) for name in names]
    return cpu_kernels.each_in_threads(work, names, sizes)
