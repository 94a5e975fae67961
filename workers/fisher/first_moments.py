"""First moments in their small form, formed one parameter tensor at a time (docs/design.md §3b).

A first moment d(v^T z)/dtheta is linear in the direction, and on a matrix use y = x M^T it is
sum_r delta_r x_r^T: the gradient at the use's output ([r, o]) and the activations the forward recorded
([r, i]) say all of it in (o + i) r floats, against o i for the tensor. So a position's first moments
(kbar under mu and p, the policy gradient, the mean shift as their difference) are kept as such terms,
and a tensor is formed only when something reads it, into a fresh array that lives as long as its
reader holds it. Why: held as parameter-shaped arrays, the first moments of one off-policy position
were three float32 copies of the model (7.2 GB of Qwen3-0.6B's peak of 16); kept small, the Fisher is the
one parameter-sized sum an analysis holds.

``FirstMoment`` reads like a ``dict`` of tensors (``moment[name]`` forms one); a bounded cache keeps the
tensors formed last, since a summary reads a tensor's first moments once per stat it derives from them.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import overload

import torch

from backend.vocabulary import PIECE_VALUES
from workers.fisher.feature_grams import FeatureGrams, memory_key

Params = dict[str, torch.Tensor]
# formed tensors kept for their next reader: a summary reads a tensor's first moments once per stat it
# derives from them, in one thread, before it goes on to the next tensor, so a few tensors' worth is
# the reuse there is (SmolLM2's first answer took as long as with every first moment held)
FORMED_KEPT_BYTES = 256 << 20


@dataclass(frozen=True)
class OuterRows:
    """scale * sum_r delta[r, o] feature[r, i]: a matrix use's [o, i] (``transposed``: the tensor is
    [i, o]), written at ``index`` of a 3-D tensor (a routed expert's slice) when given."""

    delta: torch.Tensor  # [r, o]
    feature: torch.Tensor  # [r, i]
    transposed: bool = False
    index: int | None = None
    scale: float = 1.0

    @property
    def covers(self) -> bool:
        return self.index is None

    def add_into(self, target: torch.Tensor, first: bool) -> None:
        at = target if self.index is None else target[self.index]
        left, right = (self.feature.T, self.delta) if self.transposed else (self.delta.T, self.feature)
        if first:
            torch.mm(left, right, out=at)
            if self.scale != 1.0:
                at.mul_(self.scale)
        else:
            at.addmm_(left, right, alpha=self.scale)

    def in_rows(self, start: int, stop: int) -> OuterRows | None:
        if self.index is not None:  # a routed expert's slice: whole, or not in these rows at all
            return replace(self, index=self.index - start) if start <= self.index < stop else None
        if self.transposed:
            return replace(self, feature=self.feature[:, start:stop])
        return replace(self, delta=self.delta[:, start:stop])


@dataclass(frozen=True)
class TableRows:
    """scale * rows at the table's ``unique`` rows (an embedding lookup's gradient), zero elsewhere."""

    unique: torch.Tensor  # [c] long
    rows: torch.Tensor  # [c, o]
    scale: float = 1.0

    covers = False

    def add_into(self, target: torch.Tensor, first: bool) -> None:
        target.index_add_(0, self.unique, self.rows.to(target.dtype), alpha=self.scale)

    def in_rows(self, start: int, stop: int) -> TableRows | None:
        inside = (self.unique >= start) & (self.unique < stop)
        if not bool(inside.any()):
            return None
        return replace(self, unique=self.unique[inside] - start, rows=self.rows[inside])


@dataclass(frozen=True)
class HeadOuter:
    """scale * per_row_c features_k: the LM head's closed form (a bias: ``features`` None, per_row_c)."""

    per_row: torch.Tensor  # [V]
    features: torch.Tensor | None  # [d]
    scale: float = 1.0

    covers = True

    def add_into(self, target: torch.Tensor, first: bool) -> None:
        if self.features is None:
            if first:
                torch.mul(self.per_row, self.scale, out=target)
            else:
                target.add_(self.per_row, alpha=self.scale)
            return
        if first:
            torch.outer(self.per_row, self.features, out=target)
            if self.scale != 1.0:
                target.mul_(self.scale)
        else:
            target.addr_(self.per_row, self.features, alpha=self.scale)

    def in_rows(self, start: int, stop: int) -> HeadOuter:
        return replace(self, per_row=self.per_row[start:stop])


@dataclass(frozen=True)
class Whole:
    """A parameter-shaped array, as autograd gives a parameter without a form (a norm weight, a bias)."""

    value: torch.Tensor
    scale: float = 1.0

    covers = True

    def add_into(self, target: torch.Tensor, first: bool) -> None:
        if first:
            torch.mul(self.value, self.scale, out=target)
        else:
            target.add_(self.value, alpha=self.scale)

    def in_rows(self, start: int, stop: int) -> Whole:
        return replace(self, value=self.value[start:stop])


@dataclass(frozen=True)
class Root:
    """scale * sqrt(max(value, 0)): the bound std(r) sqrt(fisher) of one position, read off its Fisher
    (``value``, which must not change while this is held)."""

    value: torch.Tensor
    scale: float = 1.0

    covers = True

    def add_into(self, target: torch.Tensor, first: bool) -> None:
        if first:
            torch.clamp_min(self.value, 0, out=target).sqrt_().mul_(self.scale)
        else:
            target.add_(self.value.clamp_min(0).sqrt(), alpha=self.scale)

    def in_rows(self, start: int, stop: int) -> Root:
        return replace(self, value=self.value[start:stop])


Term = OuterRows | TableRows | HeadOuter | Whole | Root


@dataclass(frozen=True)
class Factored:
    """One tensor's first moment as the sum of its terms (none: zero)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    terms: tuple[Term, ...] = ()

    # (the constructor, not ``replace``: a response's first pass adds each position's terms to every
    # tensor's sums, tens of thousands of calls, and ``replace`` was a third of that time)
    def plus(self, *terms: Term) -> Factored:
        return Factored(self.shape, self.dtype, self.device, self.terms + terms)

    def summed(self) -> Factored:
        """The same tensor in as few terms as a sum over positions allows (``summed_terms``)."""
        return Factored(self.shape, self.dtype, self.device, summed_terms(self.terms))

    def scaled(self, factor: float) -> Factored:
        return replace(self, terms=tuple(replace(t, scale=t.scale * factor) for t in self.terms))

    def minus(self, other: Factored) -> Factored:
        return self.plus(*other.scaled(-1.0).terms)

    def add_into(self, target: torch.Tensor) -> None:
        for term in _merged(self.terms):
            term.add_into(target, first=False)

    def square_sum(self) -> float | None:
        """sum of squares of the tensor, in float64, from its terms without forming it (``square_sum``);
        None where a term is a whole array (a norm's or bias's gradient, a root), which is formed."""
        return square_sum(self.terms)

    def in_rows(self, start: int, stop: int) -> Factored:
        """Rows ``start:stop`` of the tensor (along its first dimension), still in the small form."""
        terms = (term.in_rows(start, stop) for term in self.terms)
        return replace(
            self, shape=(stop - start, *self.shape[1:]), terms=tuple(t for t in terms if t is not None)
        )

    def form(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor, in ``out`` (shaped like it) or a fresh array: the first term that covers it writes
        it, zeros only where none does."""
        terms = _merged(self.terms)
        covering = next((t for t in terms if t.covers), None)
        target = torch.empty(self.shape, dtype=self.dtype, device=self.device) if out is None else out
        if covering is None:
            target.zero_()
        else:
            covering.add_into(target, first=True)
        for term in terms:
            if term is not covering:
                term.add_into(target, first=False)
        return target


def _merged(terms: tuple[Term, ...]) -> list[Term]:
    """The terms with those that share a recorded array (``_shared_side``: kbar under mu and under p of
    one position, in a mean shift) made one, their own sides combined: one product of the tensor's size
    instead of one per term (a mean shift's were a third of a response's first pass), and no less exact
    (the difference is taken before the product). Square sums join them in float64 (``_all_sides``)."""
    merged: list[Term] = []
    at_key: dict[tuple, int] = {}
    for term in terms:
        shared = _shared_side(term)
        at = None if shared is None else at_key.get(shared[0])
        if at is None:
            if shared is not None:
                at_key[shared[0]] = len(merged)
            merged.append(term)
        else:
            merged[at] = _joined(merged[at], term)
    return merged


def _joined(first: Term, other: Term) -> Term:
    """Two terms that share a recorded array as one, their own sides added (scales taken in). Two uses'
    features may be the first rows of one array (positions of a response read from one forward): the
    longer is kept, and the other's delta has zeros in the rows it lacks."""
    if isinstance(first, OuterRows) and isinstance(other, OuterRows):
        longer = first if first.feature.shape[0] >= other.feature.shape[0] else other
        delta = _padded_sum(first.delta, other.delta, first.scale, other.scale)
        return OuterRows(delta, longer.feature, longer.transposed, longer.index)
    if isinstance(first, HeadOuter) and isinstance(other, HeadOuter):
        per_row = _times(first.per_row, first.scale) + _times(other.per_row, other.scale)
        return replace(first, per_row=per_row, scale=1.0)
    assert isinstance(first, TableRows) and isinstance(other, TableRows)
    return replace(first, rows=_times(first.rows, first.scale) + _times(other.rows, other.scale), scale=1.0)


def _times(values: torch.Tensor, scale: float) -> torch.Tensor:
    return values if scale == 1.0 else values * scale


def _padded_sum(a: torch.Tensor, b: torch.Tensor, a_scale: float = 1.0, b_scale: float = 1.0) -> torch.Tensor:
    """a_scale a + b_scale b over rows (dim 0), the shorter taken as zero in the rows it lacks. A scale of
    -1 (a mean shift's term under p) is taken in the addition itself (exact), any other by a product."""
    if a.shape[0] < b.shape[0]:
        a, b, a_scale, b_scale = b, a, b_scale, a_scale
    rows = b.shape[0]
    if b_scale not in (1.0, -1.0):
        b, b_scale = b * b_scale, 1.0
    if a_scale == 1.0 and rows == a.shape[0]:
        return torch.add(a, b, alpha=b_scale)
    out = a.clone() if a_scale == 1.0 else a * a_scale
    out[:rows].add_(b, alpha=b_scale)
    return out


def summed_terms(terms: tuple[Term, ...]) -> tuple[Term, ...]:
    """``terms`` as few as their sum allows, for a first moment summed over a response's positions:
    those on one recorded array joined (``_merged``: a use's positions read from one forward share its
    features), the other products on one slot stacked into one (the head's rank-one terms, a position
    each), a lookup's rows put on the union of the rows read, whole arrays added. Why: such a sum then
    holds a few terms of the response's length, not terms per position, its square sum is a few Gram
    products and forming it one product per use, where forming each position's into an array was most
    of a response's first pass."""
    products: dict[tuple, list[OuterRows]] = {}
    lookups: list[TableRows] = []
    wholes: list[Whole] = []
    rest: list[Term] = []
    for term in _merged(terms):
        if isinstance(term, HeadOuter) and term.features is not None:
            term = OuterRows(term.per_row[None] * term.scale, term.features[None])
        if isinstance(term, OuterRows):
            products.setdefault((term.transposed, term.index), []).append(term)
        elif isinstance(term, TableRows):
            lookups.append(term)
        elif isinstance(term, Whole):
            wholes.append(term)
        else:
            rest.append(term)
    for (transposed, index), group in products.items():
        if len(group) == 1:
            rest.append(group[0])
            continue
        delta = torch.cat([_times(t.delta, t.scale) for t in group])
        rest.append(OuterRows(delta, torch.cat([t.feature for t in group]), transposed, index))
    if len(lookups) > 1:
        unique, inverse = torch.unique(torch.cat([t.unique for t in lookups]), return_inverse=True)
        rows = torch.cat([_times(t.rows, t.scale) for t in lookups])
        summed = rows.new_zeros(unique.numel(), rows.shape[1]).index_add_(0, inverse, rows)
        rest.append(TableRows(unique, summed))
    else:
        rest += lookups
    if len(wholes) > 1:
        rest.append(Whole(torch.stack([_times(t.value, t.scale) for t in wholes]).sum(0)))
    else:
        rest += wholes
    return tuple(rest)


@dataclass(frozen=True)
class _Sides:
    """A term as L^T R (L [r, rows], R [r, columns], float64, its scale in L) on the 2-D slice ``at``
    (a routed expert's; None: the tensor); or, for an embedding lookup, its rows at ``unique``."""

    left: torch.Tensor | None  # None: a lookup's one-hot rows at ``unique``
    right: torch.Tensor
    at: int | None = None
    unique: torch.Tensor | None = None


def _sides(term: Term) -> _Sides | None:
    """The term's sides, its scale on the side that is its own (a use's delta, the head's row
    coefficients, a lookup's rows): the other may be shared with another term (``_shared_side``)."""
    if isinstance(term, OuterRows):
        delta = term.delta.double() * term.scale
        left, right = (term.feature.double(), delta) if term.transposed else (delta, term.feature.double())
        return _Sides(left, right, term.index)
    if isinstance(term, HeadOuter):
        features = torch.ones(1, dtype=torch.float64) if term.features is None else term.features.double()
        return _Sides(term.per_row.double()[None] * term.scale, features[None])
    if isinstance(term, TableRows):
        return _Sides(None, term.rows.double() * term.scale, unique=term.unique)
    return None  # Whole, Root: an array


def _shared_side(term: Term) -> tuple[tuple, str] | None:
    """What a term may share with another of the same tensor (the same recorded array: a use's
    features, the head's h, a lookup's rows), and which of its sides is then its own."""
    if isinstance(term, OuterRows):
        # by the memory the features are read from (``memory_key``), so that a context's first rows of a
        # longer forward's features (``CapturedForward.at``) share them: the same memory holds the same values
        key = ("use", *memory_key(term.feature), term.transposed, term.index)
        return key, "right" if term.transposed else "left"
    if isinstance(term, HeadOuter):
        return ("head", None if term.features is None else id(term.features)), "left"
    if isinstance(term, TableRows):
        return ("lookup", id(term.unique)), "right"
    return None


def _all_sides(terms: tuple[Term, ...]) -> list[_Sides] | None:
    """The terms' sides, those that share a side made one, their own sides added in float64 (exact for
    the difference of two float32 arrays: a mean shift's terms under mu and p): fewer products, the
    same sum of squares. None where a term is a whole array."""
    sides: list[_Sides] = []
    at_key: dict[tuple, int] = {}
    for term in terms:
        side, shared = _sides(term), _shared_side(term)
        if side is None or shared is None:
            return None
        key, own = shared
        at = at_key.get(key)
        if at is None:
            at_key[key] = len(sides)
            sides.append(side)
        elif own == "left":
            before = sides[at]
            assert before.left is not None and side.left is not None
            longer = before.right if before.right.shape[0] >= side.right.shape[0] else side.right
            sides[at] = replace(before, left=_padded_sum(before.left, side.left), right=longer)
        else:
            before = sides[at]
            left = before.left
            if left is not None and side.left is not None and side.left.shape[0] > left.shape[0]:
                left = side.left
            sides[at] = replace(before, left=left, right=_padded_sum(before.right, side.right))
    return sides


def _inner(a: _Sides, b: _Sides) -> float:
    """<L_a^T R_a, L_b^T R_b> = sum((L_a L_b^T) * (R_a R_b^T)): r_a x r_b products, never the tensor."""
    if a.at != b.at:  # two experts' slices do not overlap
        return 0.0
    if a.left is None and b.left is None:
        assert a.unique is not None and b.unique is not None
        lefts = (a.unique[:, None] == b.unique[None, :]).double()
    elif a.left is None:
        assert b.left is not None and a.unique is not None
        lefts = b.left[:, a.unique].T
    elif b.left is None:
        assert b.unique is not None
        lefts = a.left[:, b.unique]
    else:
        lefts = a.left @ b.left.T
    return float((lefts * (a.right @ b.right.T)).sum())


# whole arrays up to this size are summed in float64 where their square sum is asked (``square_sum``)
SMALL_WHOLE_VALUES = 1 << 16


def square_sum(terms: tuple[Term, ...]) -> float | None:
    """The float64 sum of squares of sum_k term_k as sum_{k,l} <term_k, term_l>, each from the terms'
    small sides (Gram matrices of r rows, r the context's tokens): a first moment's square total costs
    r^2 (out + in) per use instead of forming out x in values. None where a term is a whole array (but a
    small tensor's whole arrays alone, summed in float64).
    The float64 sum of products also keeps a mean shift's total exact where it is a small difference of
    two large first moments."""
    arrays = [t for t in terms if isinstance(t, Whole)]
    if arrays and len(arrays) == len(terms) and arrays[0].value.numel() <= SMALL_WHOLE_VALUES:
        # a norm's or bias's gradient: summed here, where a thread of its own cost more than the sum
        whole = torch.stack([t.value.double() * t.scale for t in arrays]).sum(0)
        return float(whole.square().sum())
    known = _all_sides(terms)
    if known is None:
        return None
    total = sum(_inner(a, a) for a in known)
    total += 2 * sum(_inner(a, b) for k, a in enumerate(known) for b in known[k + 1 :])
    return max(total, 0.0)  # rounding below an exact zero


def square_sums(
    entries: Mapping[str, Factored], feature_grams: FeatureGrams | None = None
) -> dict[str, float | None]:
    """``Factored.square_sum`` of many tensors at once: those whose terms are on one matrix use's
    features (every linear weight; a mean shift's two terms too) in one batched Gram product per shape,
    their own sides added in float64 in the batch; small tensors of one whole array (a norm's gradient)
    in one sum per shape. Why: per tensor the products are a few r x r matrices, and issuing them, or
    adding a mean shift's sides, a tensor at a time (272 tensors, three or four stats per position) was
    most of a response's first pass square totals.

    ``feature_grams``: the features' Gram matrices, shared by the calls on one forward's first moments
    (``CapturedForward.grams``: every position of a response, every statistic)."""
    grams = FeatureGrams() if feature_grams is None else feature_grams
    found: dict[str, float | None] = {}
    uses: dict[tuple, list[tuple[str, torch.Tensor, list[OuterRows]]]] = {}
    wholes: dict[tuple, list[tuple[str, torch.Tensor, float]]] = {}
    for name, entry in entries.items():
        terms = entry.terms
        use = _one_use(terms)
        if use is not None:
            feature, own = use
            sides = tuple((t.delta.shape, t.delta.dtype) for t in own)
            key = (feature.shape, feature.dtype, feature.device, sides)
            uses.setdefault(key, []).append((name, feature, own))
        elif len(terms) == 1 and isinstance(terms[0], Whole) and terms[0].value.numel() <= SMALL_WHOLE_VALUES:
            value, scale = terms[0].value, terms[0].scale
            wholes.setdefault((value.shape, value.dtype, value.device), []).append((name, value, scale))
        else:
            found[name] = entry.square_sum()
    grams.add(feature for group in uses.values() for _, feature, _ in group)
    for group in uses.values():
        features = torch.stack([grams.of(feature) for _, feature, _ in group])
        owns = _own_sides([own for *_, own in group])
        products = features * (owns @ owns.transpose(1, 2))
        for (name, *_), total in zip(group, products.sum((1, 2)).tolist(), strict=True):
            found[name] = max(total, 0.0)  # rounding below an exact zero
    for values in wholes.values():
        stacked = torch.stack([value for _, value, _ in values]).double().flatten(1)
        scales = torch.tensor([scale for *_, scale in values], dtype=torch.float64, device=stacked.device)
        totals = stacked.square().sum(1) * scales.square()
        for (name, *_), total in zip(values, totals.tolist(), strict=True):
            found[name] = total
    return found


def _own_sides(uses: list[list[OuterRows]]) -> torch.Tensor:
    """[n, r, o] float64: each use's terms' own sides (deltas) times their scales, added (exact for a
    mean shift's two float32 terms), the k-th terms of every use in one batched operation."""
    owns: torch.Tensor | None = None
    for k in range(len(uses[0])):
        deltas = torch.stack([terms[k].delta for terms in uses]).double()
        scales = torch.tensor([terms[k].scale for terms in uses], dtype=torch.float64, device=deltas.device)
        side = deltas.mul_(scales[:, None, None])
        owns = side if owns is None else owns.add_(side)
    assert owns is not None
    return owns


def _one_use(terms: tuple[Term, ...]) -> tuple[torch.Tensor, list[OuterRows]] | None:
    """(features [r, i], the terms) of terms that all read one use's recorded features on the whole
    tensor (``_shared_side``), with as many rows as its features; None otherwise (their squares are
    summed tensor by tensor, ``Factored.square_sum``)."""
    if not terms or not all(isinstance(t, OuterRows) and t.index is None for t in terms):
        return None
    uses = [t for t in terms if isinstance(t, OuterRows)]
    feature = uses[0].feature
    rows = feature.shape[0]
    if any(t.delta.shape[0] != rows or t.feature.shape[0] != rows for t in uses):
        return None
    if len(uses) > 1 and len({_shared_side(t) for t in uses}) > 1:
        return None
    return feature, uses


@dataclass(frozen=True)
class Piece:
    """A block of a parameter tensor's rows read as a tensor of its own (``row_pieces``), or all of it."""

    tensor: str
    shape: tuple[int, ...]  # the piece's own
    rows: tuple[int, int] | None = None  # start, stop along the first dimension; None: the whole tensor
    offset: int = 0  # the flat index of its first value in the tensor


def row_pieces(name: str, shape: tuple[int, ...], most: int | None = None) -> dict[str, Piece]:
    """A tensor of more than ``most`` values (``PIECE_VALUES``) as blocks of whole rows of at most ``most``
    values (at least one row each), named ``name[start:stop]``; any other as itself, whole."""
    most = PIECE_VALUES if most is None else most
    if math.prod(shape) <= most or len(shape) < 2:
        return {name: Piece(name, shape)}
    row = math.prod(shape[1:])
    step = max(1, most // row)
    bounds = [(start, min(start + step, shape[0])) for start in range(0, shape[0], step)]
    return {
        f"{name}[{start}:{stop}]": Piece(name, (stop - start, *shape[1:]), (start, stop), start * row)
        for start, stop in bounds
    }


def pieces_of(shapes: Mapping[str, tuple[int, ...]], most: int | None = None) -> dict[str, Piece]:
    """``row_pieces`` of every tensor, in order: each piece by its name."""
    return {
        key: piece for name, shape in shapes.items() for key, piece in row_pieces(name, shape, most).items()
    }


def largest_piece(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """Values in the largest of ``pieces_of(shapes)``: a buffer that holds any tensor's piece."""
    return max(math.prod(piece.shape) for piece in pieces_of(shapes).values())


def formed_in_pieces(
    name: str, entry: Factored | torch.Tensor, buffer: torch.Tensor
) -> Iterator[tuple[Piece, torch.Tensor]]:
    """Tensor ``name`` a piece at a time (``row_pieces``): a small form's each formed in the first
    values of ``buffer`` (flat, of its dtype, ``largest_piece`` long), valid until the next is formed;
    an array's as views of it. Why: a fresh array of more than 32 MB is mapped afresh and its first
    touch costs more than the arithmetic written into it, and a buffer of a piece is what the summary
    takes next from the pool."""
    for piece in row_pieces(name, tuple(entry.shape)).values():
        part = in_piece(entry, piece)
        if isinstance(part, torch.Tensor):
            yield piece, part
        else:
            yield piece, part.form(out=buffer[: math.prod(piece.shape)].view(piece.shape))


@overload
def in_piece(entry: torch.Tensor, piece: Piece) -> torch.Tensor: ...
@overload
def in_piece(entry: Factored, piece: Piece) -> Factored: ...
@overload
def in_piece(entry: Factored | torch.Tensor, piece: Piece) -> Factored | torch.Tensor: ...
def in_piece(entry: Factored | torch.Tensor, piece: Piece) -> Factored | torch.Tensor:
    """A tensor's entry (an array or its small form) restricted to one of its pieces."""
    if piece.rows is None:
        return entry
    start, stop = piece.rows
    return entry[start:stop] if isinstance(entry, torch.Tensor) else entry.in_rows(start, stop)


class FormedCache:
    """Tensors formed from small forms, kept for their next reader within a byte budget (the oldest let
    go first, the newest kept whatever its size: its reader holds it anyway). Keyed by the small form
    itself, which the cache holds, so that a key is never reused by another.

    Inside ``one_tensor_at_a_time()`` a thread forms into buffers of its own instead, one per table,
    which its next such block reuses: a summary visits each tensor in one thread and keeps nothing of
    it but numbers, and fresh arrays there (thousands of them, of every tensor's size) left the malloc
    arenas 3.5 GB larger than what was alive on Qwen3-0.6B.
    """

    def __init__(self, budget_bytes: int | None = None):
        self.budget_bytes = FORMED_KEPT_BYTES if budget_bytes is None else budget_bytes
        self._kept: OrderedDict[int, tuple[Factored, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self._thread = threading.local()  # .block: id -> (entry, tensor) formed in the block; .buffers

    @contextlib.contextmanager
    def one_tensor_at_a_time(self) -> Iterator[None]:
        """A block whose formed tensors its caller is done with when it ends (nested: the outer one)."""
        thread = self._thread
        if getattr(thread, "block", None) is not None:
            yield
            return
        thread.block, thread.labels = {}, set()
        try:
            yield
        finally:
            thread.block = None

    def formed(self, entry: Factored, label: str = "") -> torch.Tensor:
        block = getattr(self._thread, "block", None)
        if block is not None:
            return self._in_block(block, entry, label)
        key = id(entry)
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._kept[key][1]
        value = entry.form()  # outside the lock: tensors are formed in threads
        with self._lock:
            self._kept[key] = (entry, value)
            held = sum(v.numel() * v.element_size() for _, v in self._kept.values())
            while len(self._kept) > 1 and held > self.budget_bytes:
                _, (_, dropped) = self._kept.popitem(last=False)
                held -= dropped.numel() * dropped.element_size()
        return value

    def _in_block(self, block: dict, entry: Factored, label: str) -> torch.Tensor:
        found = block.get(id(entry))
        if found is not None:
            return found[1]
        thread = self._thread
        buffers: dict[str, torch.Tensor] = thread.__dict__.setdefault("buffers", {})
        size = math.prod(entry.shape)
        if label in thread.labels:  # the table's buffer holds another of its tensors in this block
            value = entry.form()
        else:
            thread.labels.add(label)
            buffer = buffers.get(label)
            if (
                buffer is None
                or buffer.numel() < size
                or (buffer.dtype, buffer.device) != (entry.dtype, entry.device)
            ):
                buffer = buffers[label] = torch.empty(size, dtype=entry.dtype, device=entry.device)
            value = entry.form(out=buffer[:size].view(entry.shape))
        block[id(entry)] = (entry, value)
        return value


class FirstMoment(Mapping[str, torch.Tensor]):
    """name -> the tensor, formed on reading from its small form (``Factored``) or stored whole.

    Read-only to its readers: a formed tensor may be the cache's, shared with the next reader.
    """

    def __init__(
        self,
        entries: Mapping[str, Factored | torch.Tensor],
        cache: FormedCache | None = None,
        label: str = "",
    ):
        self.entries: dict[str, Factored | torch.Tensor] = dict(entries)
        self.cache = cache
        self.label = label  # which of the cache's per-thread buffers its tensors are formed into

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        if isinstance(entry, torch.Tensor):
            return entry
        return entry.form() if self.cache is None else self.cache.formed(entry, self.label)

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def entry(self, name: str) -> Factored | torch.Tensor:
        return self.entries[name]

    def numel(self, name: str) -> int:
        entry = self.entries[name]
        return entry.numel() if isinstance(entry, torch.Tensor) else math.prod(entry.shape)

    def minus(self, other: FirstMoment) -> FirstMoment:
        """self - other, tensor by tensor, still small where both are."""
        out: dict[str, Factored | torch.Tensor] = {}
        for name, mine in self.entries.items():
            theirs = other.entries[name]
            if isinstance(mine, Factored) and isinstance(theirs, Factored):
                out[name] = mine.minus(theirs)
            else:
                out[name] = self[name] - other[name]
        return FirstMoment(out)

    def dense(self) -> Params:
        """Every tensor formed (parameter-sized in all): for sums over positions, which are dense."""
        return {name: e if isinstance(e, torch.Tensor) else e.form() for name, e in self.entries.items()}
