"""Back-propagate many output directions to activations, then form per-weight moments block by block.

For a direction v in hidden space, d(v^T h)/dM for a matrix use y = x M^T is sum_r delta_r x_r^T,
with delta_r the gradient of v^T h at the call's output. Holding that for B directions and all P
weights costs B x P floats, so directions travel only to the recorded call outputs (one batched
backward per chunk), and each block folds them into its own moments right away:

- a *square group* {(v_j, w_j)} accumulates sum_j w_j (d(v_j^T h)/dtheta)^2 (a Fisher),
- a *linear group* v accumulates d(v^T h)/dtheta (a first moment such as kbar),
- an *embedding-row probe* (v, c) keeps only row c of the tied table's input-side gradient (the
  cross term needs (j_c - jbar)^T u_{(c,k)} for prefix tokens c). Where a square group's directions
  are an orthonormal basis, v = sum_j <v, v_j> v_j and the gradient is linear in the direction, so the
  probe's row is summed from the group's own per-direction rows instead of a backward of its own (a
  partial result's probe then holds the directions done, as its squares do).

Squares of a matrix are formed "direct" (each direction's [o, i] gradient, cost ~ B o i r) or
"ghost" (f_{o,i} = sum_{r,s} X_{r,i} X_{s,i} M_{o,r,s}, M = sum_j w_j delta_j delta_j^T, cost
~ B o r^2 + o i r^2, memory o r(r+1)/2), chosen per block by flops within a memory budget. Parameters
without a form (capture.generic) get their per-direction gradients from autograd itself.
Index conventions: b direction, r/s row, i in, o out, c token row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch

from backend.workspace import between_chunks_bytes, chunk_bytes
from workers.fisher import cpu_kernels
from workers.fisher.batched_backward import batched_grad
from workers.fisher.block_squares import (
    CarriedSquares,
    CarryingTotals,
    SquareAccumulator,
    SquareTotals,
    embedding_rows,
    ghost_moments,
    ghost_moments_compiled,
)
from workers.fisher.capture import (
    CapturedForward,
    EmbeddingBlock,
    EmbeddingUse,
    MatrixBlock,
    MatrixUse,
    UnsupportedArchitecture,
)
from workers.fisher.first_moments import Factored, FirstMoment, OuterRows, TableRows, Term, Whole
from workers.fisher.nested_ghost import KeptGhost
from workers.fisher.shards import check_agreement, current_shard, sum_over_processes

Progress = Callable[[float], None]
ChunkCallback = Callable[[Callable[[], "DirectionResults"], list[int]], None]
# square directions in the first chunk when partial results are wanted, as direction-tokens: a
# direction's backward costs in proportion to the context, so 16 directions at 5 tokens, 2 at 32.
# SmolLM2 at 5 tokens (three runs each, one process): 32 directions gave the first partial at
# 1.78-1.98 s with 80% of the trace, 16 at 1.45-1.71 s with 72%
FIRST_CHUNK_TOKENS = 80


def first_chunk_directions(context_length: int) -> int:
    """Square directions in the first chunk, when partial results are wanted (at least one)."""
    return max(1, FIRST_CHUNK_TOKENS // context_length)


@dataclass
class SquareGroup:
    name: str
    vectors: torch.Tensor  # [r, d]
    weights: torch.Tensor  # [r]
    # each tensor's total alone, a float64 scalar (``SquareTotals``): a response's first pass
    totals_only: bool = False
    # with ``totals_only``, also what these directions leave for a later pass of the context
    # (``CarryingTotals``, in ``DirectionResults.carried``): a response's refining round
    carry: bool = False
    # the group's leading directions, done by an earlier pass of this context: these are the rest
    carried: CarriedSquares | None = None
    # the squares as views of one recycled array of the model's size (``ParameterSums``), freed when
    # every tensor is: False for a reader that frees them tensor by tensor (the certificate)
    in_one_array: bool = True
    # a ghost block whose rows are the context's tokens leaves its pair moments unformed, in
    # ``DirectionResults.kept_ghost``: a study sums them over nested contexts (``nested_ghost``)
    keep_ghost: bool = False


@dataclass
class LinearGroup:
    name: str
    vector: torch.Tensor  # [d]


@dataclass
class EmbeddingRowProbe:
    name: str
    param: str  # the tied table
    token_id: int
    vector: torch.Tensor  # [d]
    group: int = 0  # the square group whose directions ``coordinates`` refer to
    coordinates: torch.Tensor | None = None  # [r] float64 <v, v_j>; None: a backward of its own
    # with coordinates: the row over the group's directions an earlier pass did (``CarriedSquares``)
    start: torch.Tensor | None = None


@dataclass
class DirectionResults:
    squares: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    linears: dict[str, FirstMoment] = field(default_factory=dict)  # in their small form
    probes: dict[str, torch.Tensor] = field(default_factory=dict)  # [d] per probe
    # a snapshot's tensors that are still the running pass's sums (read, never write): group -> names
    lent: dict[str, set[str]] = field(default_factory=dict)
    # group -> what its directions leave for a later pass of the context (``SquareGroup.carry``)
    carried: dict[str, CarriedSquares] = field(default_factory=dict)
    # group -> its blocks' pair moments left unformed (``SquareGroup.keep_ghost``), not in ``squares``
    kept_ghost: dict[str, list[KeptGhost]] = field(default_factory=dict)
    directions: int = 0  # back-propagated by this process (all of them but under torchrun)

    def owns(self, group: str, name: str) -> bool:
        """Whether a tensor of a group is the results' own (to write into), not the running pass's."""
        return name not in self.lent.get(group, ())


def _row_of(unique: torch.Tensor, token_id: int) -> int | None:
    """Where ``token_id`` is among an embedding's looked-up rows (None: the context does not read it)."""
    hit = (unique == token_id).nonzero()
    return int(hit[0, 0]) if hit.numel() else None


def _rows(uses: list, grads: tuple, count: int) -> torch.Tensor:
    """[b, r, o]: the uses' output gradients, rows concatenated (zeros where a use does not reach h)."""
    parts = []
    for use, grad in zip(uses, grads, strict=True):
        out = use.output.shape[-1]
        rows = use.output.numel() // out
        kept = context_rows(use)
        if grad is None:
            parts.append(use.output.new_zeros(count, kept, out))
        else:
            grad = grad.reshape(count, rows, out)
            parts.append(grad if kept == rows else grad[:, :kept].contiguous())
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


def context_rows(use: MatrixUse | EmbeddingUse) -> int:
    """The rows of a use's output that its record keeps: all, or the context's first ones where a
    longer forward is read at a position (``CapturedForward.at``; the rest get zero gradient)."""
    return int(use.feature.shape[0]) if isinstance(use, MatrixUse) else int(use.indices.numel())


def direction_targets(capture: CapturedForward) -> list[torch.Tensor]:
    """Where the directions travel to: every recorded matrix and embedding use's output, in the order
    ``fold`` reads them, then the parameters without a form themselves."""
    outputs = [use.output for block in capture.matrices for use in block.uses]
    outputs += [use.output for block in capture.embeddings for use in block.uses]
    return outputs + list(capture.generic.values())


def _chunk_size(capture: CapturedForward, memory_budget_bytes: int) -> int:
    """Directions per chunk: as many as the workspace's chunk share holds (``backend.workspace``)."""
    targets = sum(target.numel() for target in direction_targets(capture))
    per_direction = targets * capture.hidden.element_size() * 2  # the grads, and as much in temporaries
    return max(1, min(256, chunk_bytes(memory_budget_bytes) // max(per_direction, 1)))


@dataclass
class _ChunkRows:
    """A chunk's directions by kind (``_DirectionPass._square_slices``, ``_other_rows``)."""

    squares: list[tuple[SquareAccumulator | SquareTotals, slice, torch.Tensor, bool]]
    linear: list[tuple[int, int]]  # (position in the chunk, group)
    probes: list[tuple[int, int]]


@dataclass
class _Row:
    kind: str  # square | linear | probe
    group: int


class _DirectionPass:
    """One batched backward per chunk of directions, folded into the groups' moments block by block."""

    def __init__(self, capture, squares, linears, probes, memory_budget_bytes, held_bytes=0):
        self.capture = capture
        self.squares: list[SquareGroup] = squares
        self.linears: list[LinearGroup] = linears
        # probes back-propagated (rows of the pass) and probes summed from their square group's rows
        self.probes: list[EmbeddingRowProbe] = [probe for probe in probes if probe.coordinates is None]
        self.summed = [probe for probe in probes if probe.coordinates is not None]
        # name -> [d] float64, the directions so far (zeros before the first: a partial may come before
        # a group's first chunk, off the policy)
        self.summed_rows = {
            probe.name: torch.zeros(
                capture.shapes[probe.param][-1], dtype=torch.float64, device=probe.vector.device
            )
            if probe.start is None
            else probe.start.clone()
            for probe in self.summed
        }
        dtype = capture.hidden.dtype
        # first moments and probes lead, so that every partial result after the first chunk has them;
        # then each square group's directions in the order given (descending eigenvalue for exact)
        self.rows = [_Row("linear", g) for g in range(len(linears))]
        self.rows += [_Row("probe", g) for g in range(len(self.probes))]
        self.rows += [_Row("square", g) for g, s in enumerate(squares) for _ in range(s.vectors.shape[0])]
        vectors = [x.vector[None] for x in linears] + [p.vector[None] for p in self.probes]
        vectors += [s.vectors for s in squares]
        self.vectors = torch.cat([v.to(dtype) for v in vectors]) if vectors else None  # [B, d]
        self.square_weights = [s.weights.to(dtype) for s in squares]
        self.square_offsets = [len(linears) + len(self.probes)]
        for s in squares:
            self.square_offsets.append(self.square_offsets[-1] + s.vectors.shape[0])
        # the ghost moments between chunks: the workspace's other share, but what the caller holds there
        ghost_budget = max(0, between_chunks_bytes(memory_budget_bytes) - held_bytes)
        self.accumulators = [self._accumulator(s, ghost_budget // max(len(squares), 1)) for s in squares]
        # name -> the first moment's terms so far, per linear group (its small form, never parameter-sized)
        self.linear_terms: list[dict[str, Factored]] = [{} for _ in linears]
        self.results = DirectionResults()
        self.padding = {
            block.name: sorted({u.padding_idx for u in block.uses if u.padding_idx is not None})
            for block in capture.embeddings
        }
        self.indices = {block.name: block.indices for block in capture.embeddings}

    def _accumulator(self, group: SquareGroup, ghost_budget_bytes: int) -> SquareAccumulator | SquareTotals:
        directions = int(group.vectors.shape[0])
        if group.totals_only:
            if group.carry:
                return CarryingTotals(self.capture, directions)
            return SquareTotals(self.capture.grams)
        return SquareAccumulator(
            self.capture,
            directions,
            ghost_budget_bytes,
            group.carried,
            in_one_array=group.in_one_array,
            keep_ghost=group.keep_ghost,
        )

    def fold(self, start: int, count: int, grads: tuple) -> None:
        """Fold the gradients of directions start..start+count ([count, *target shape] per target)."""
        cursor = 0
        deltas = []
        for block in self.capture.matrices:
            deltas.append(_rows(block.uses, grads[cursor : cursor + len(block.uses)], count))
            cursor += len(block.uses)
        # the chunk's rows by kind, the same for every tensor: found once, not once per tensor (a
        # response's first pass folds a few directions per position into each of ~300 tensors)
        chunk = _ChunkRows(
            list(self._square_slices(start, count)),
            self._other_rows(start, count, "linear"),
            self._other_rows(start, count, "probe"),
        )
        moments = self._compiled_ghost_moments(deltas, chunk)
        for index, (block, delta) in enumerate(zip(self.capture.matrices, deltas, strict=True)):
            self._fold_matrix(index, block, delta, moments, chunk)
        for acc in self.accumulators:
            acc.flush()
        for block in self.capture.embeddings:
            delta = _rows(block.uses, grads[cursor : cursor + len(block.uses)], count)
            cursor += len(block.uses)
            unique, rows = embedding_rows(block, self.indices[block.name], delta, self.padding[block.name])
            self._fold_embedding(block, start, unique, rows, chunk)
        for name, grad in zip(self.capture.generic, grads[cursor:], strict=True):
            if grad is not None:
                self._fold_generic(name, start, grad, chunk)

    def _group_slices(self, g: int, start: int, count: int) -> tuple[slice, slice, bool] | None:
        """Square group g's directions in the chunk of ``count`` from ``start``: (their slice of the
        chunk, their slice of the group, whether the group ends in this chunk); None when it has none."""
        lo = max(self.square_offsets[g], start)
        hi = min(self.square_offsets[g + 1], start + count)
        if lo >= hi:
            return None
        first = self.square_offsets[g]
        return slice(lo - start, hi - start), slice(lo - first, hi - first), hi == self.square_offsets[g + 1]

    def _square_slices(self, start: int, count: int):
        """(accumulator, local slice of this chunk, weights, whether the group ends in this chunk) for
        each square group the chunk touches."""
        for g, acc in enumerate(self.accumulators):
            found = self._group_slices(g, start, count)
            if found is not None:
                local, own, last = found
                yield acc, local, self.square_weights[g][own], last

    def _other_rows(self, start: int, count: int, kind: str) -> list[tuple[int, int]]:
        """(position in the chunk, group) of the chunk's linear or probe rows."""
        return [(b, self.rows[start + b].group) for b in range(count) if self.rows[start + b].kind == kind]

    def _compiled_ghost_moments(
        self, deltas: list[torch.Tensor], chunk: _ChunkRows
    ) -> dict[tuple[int, SquareAccumulator | SquareTotals], torch.Tensor]:
        """(block, square group's accumulator) -> the block's ghost moments so far, this chunk's included,
        for the blocks whose moments are a compiled loop. Those loops run in threads, blocks shared
        among them: each runs on one core, and at short contexts they were 0.3 s of SmolLM2's 5-token
        direction pass, the other core idle."""
        items = [
            (index, acc, local, weights)
            for index, delta in enumerate(deltas)
            if ghost_moments_compiled(delta)
            for acc, local, weights, _ in chunk.squares
            if index in acc.ghost_blocks
        ]
        sizes = [deltas[index][local].numel() for index, _, local, _ in items]
        found = cpu_kernels.each_in_threads(
            # into the block's moments of earlier chunks: each (block, group) is one item, one thread
            lambda item: ghost_moments(deltas[item[0]][item[2]], item[3], item[1].ghost.get(item[0])),
            items,
            sizes,
        )
        return {(index, acc): m for (index, acc, _, _), m in zip(items, found, strict=True)}

    def _fold_matrix(
        self,
        index: int,
        block: MatrixBlock,
        delta: torch.Tensor,
        moments: dict[tuple[int, SquareAccumulator | SquareTotals], torch.Tensor],
        chunk: _ChunkRows,
    ) -> None:
        for acc, local, weights, last in chunk.squares:
            acc.add_matrix(index, block, delta[local], weights, last, moments.get((index, acc)))
        feature = block.feature  # the block's one array: positions' terms on it join (``_shared_side``)
        for b, group in chunk.linear:  # a copy of the row: the chunk's gradients are freed after the fold
            self._add_linear(
                group, block.name, OuterRows(delta[b].clone(), feature, block.transposed, block.slice)
            )

    def _fold_embedding(self, block: EmbeddingBlock, start: int, unique, rows, chunk: _ChunkRows) -> None:
        for acc, local, weights, _ in chunk.squares:
            acc.add_embedding(block, unique, rows[local], weights)
        for b, group in chunk.linear:
            self._add_linear(group, block.name, TableRows(unique, rows[b].clone()))
        for b, group in chunk.probes:
            probe = self.probes[group]
            if probe.param == block.name:
                at = _row_of(unique, probe.token_id)
                self.results.probes[probe.name] = rows.new_zeros(rows.shape[2]) if at is None else rows[b, at]
        for probe in self.summed:
            at = _row_of(unique, probe.token_id) if probe.param == block.name else None
            if at is not None:
                self._sum_probe(probe, start, rows[:, at])

    def _fold_generic(self, name: str, start: int, grad: torch.Tensor, chunk: _ChunkRows) -> None:
        for acc, local, weights, _ in chunk.squares:
            acc.add_generic(name, grad[local], weights)
        for b, group in chunk.linear:
            self._add_linear(group, name, Whole(grad[b].clone()))
        for b, group in chunk.probes:
            probe = self.probes[group]
            if probe.param == name:
                self.results.probes[probe.name] = grad[b][probe.token_id]
        for probe in self.summed:
            if probe.param == name:
                self._sum_probe(probe, start, grad[:, probe.token_id])

    def _add_linear(self, group: int, name: str, term: Term) -> None:
        terms = self.linear_terms[group]
        if name not in terms:
            like = self.capture.hidden
            terms[name] = Factored(tuple(self.capture.shapes[name]), like.dtype, like.device)
        terms[name] = terms[name].plus(term)

    def _sum_probe(self, probe: EmbeddingRowProbe, start: int, rows: torch.Tensor) -> None:
        """Add this chunk's directions of the probe's square group, each row [b, d] at its coordinate, to
        the probe's row (in float64: a sum of up to d rows)."""
        assert probe.coordinates is not None
        found = self._group_slices(probe.group, start, rows.shape[0])
        if found is not None:
            local, own, _ = found
            self.summed_rows[probe.name] += probe.coordinates[own] @ rows[local].to(torch.float64)

    def finish(self, keep: bool = False, directions: int = 0) -> DirectionResults:
        """The results; ``keep``: a snapshot of what the chunks so far give (``directions`` of them), the
        pass going on (it reads the running sums: it holds until the next chunk)."""
        results = DirectionResults(probes=dict(self.results.probes)) if keep else self.results
        results.directions = directions
        for name, row in self.summed_rows.items():  # a snapshot's copy: the pass adds on into the row
            results.probes[name] = row.clone() if keep else row
        for g, (square, acc) in enumerate(zip(self.squares, self.accumulators, strict=True)):
            sums = acc.finalize(self.capture, keep)
            results.squares[square.name] = sums.values
            results.lent[square.name] = sums.lent
            if isinstance(acc, SquareAccumulator) and acc.kept and not keep:
                results.kept_ghost[square.name] = [
                    KeptGhost(block.name, m, block.feature, block.transposed)
                    for block, m in ((self.capture.matrices[index], m) for index, m in acc.kept.items())
                ]
            if isinstance(acc, CarryingTotals) and not keep:
                rows = {p.name: self.summed_rows[p.name] for p in self.summed if p.group == g}
                results.carried[square.name] = acc.carried(rows)
        for linear, terms in zip(self.linears, self.linear_terms, strict=True):
            # a snapshot shares the terms: they are never changed, only replaced by sums with more
            results.linears[linear.name] = FirstMoment(terms)
        return results

    def done_per_group(self, stop: int) -> list[int]:
        """How many directions of each square group the rows before ``stop`` cover."""
        return [
            max(0, min(stop, self.square_offsets[g + 1]) - self.square_offsets[g])
            for g in range(len(self.squares))
        ]


def backprop_directions(
    capture: CapturedForward,
    position: int,
    squares: list[SquareGroup],
    linears: list[LinearGroup],
    probes: list[EmbeddingRowProbe],
    *,
    memory_budget_bytes: int,
    held_bytes: int = 0,
    progress: Progress | None = None,
    on_chunk: ChunkCallback | None = None,
) -> DirectionResults:
    """Run every direction from h[position] back to the recorded outputs and fold them per block.

    ``memory_budget_bytes``: the engine's workspace (``backend.workspace``), of whose share between
    chunks the caller holds ``held_bytes`` meanwhile (a response's kept plans for later positions).

    ``on_chunk(snapshot, done)`` is called after every chunk but the last: ``done`` counts the
    directions of each square group folded in so far, ``snapshot()`` returns the results they give
    (read them before ``on_chunk`` returns: the next chunk adds into the sums they read).
    With it, the first chunk is kept small so that a first partial result comes early.
    """
    work = _DirectionPass(capture, squares, linears, probes, memory_budget_bytes, held_bytes)
    return _backprop(work, position, memory_budget_bytes, progress, on_chunk)


def _backprop(
    work: _DirectionPass,
    position: int,
    memory_budget_bytes: int,
    progress: Progress | None = None,
    on_chunk: ChunkCallback | None = None,
) -> DirectionResults:
    """``backprop_directions`` of a pass already made."""
    capture = work.capture
    shard = current_shard()
    if work.vectors is None and shard is None:
        return DirectionResults()
    hidden = capture.hidden[position]
    targets = direction_targets(capture)
    chunk = _chunk_size(capture, memory_budget_bytes)
    total = len(work.rows)
    if progress is not None:
        progress(0.0)
    lead = work.square_offsets[0]
    if shard is None:
        first = first_chunk_directions(position + 1)
        bounds = chunk_bounds(total, lead, chunk, first if on_chunk is not None else None)
        chunks = list(zip(bounds, bounds[1:], strict=False))
    else:  # this process's share, no partial results (a partial would be one process's share only)
        check_agreement(total)
        chunks = [(a, min(a + chunk, hi)) for lo, hi in shard.rows(lead, total) for a in range(lo, hi, chunk)]
        on_chunk = None
    for start, stop in chunks:
        assert work.vectors is not None
        grads = batched_grad(hidden, targets, work.vectors[start:stop])
        if start == chunks[0][0]:
            check_causal(capture, targets, grads)
        work.fold(start, stop - start, grads)
        # freed before the next chunk's backward, which then reuses the pages: held until it returned,
        # they made it touch as much new memory (SmolLM2, 5 tokens: 1e5 page faults, 0.5 s in the kernel)
        del grads
        if progress is not None:
            progress(stop / total)
        if on_chunk is not None and lead < stop < total:  # a partial result holds some of the trace
            on_chunk(partial(work.finish, keep=True, directions=stop), work.done_per_group(stop))
    results = work.finish(directions=sum(stop - start for start, stop in chunks))
    if shard is not None:
        _sum_over_processes(results, work)
    return results


def backprop_positions(
    positions: Iterable[
        tuple[CapturedForward, list[SquareGroup], list[LinearGroup], list[EmbeddingRowProbe]]
    ],
    memory_budget_bytes: int,
) -> Iterator[DirectionResults]:
    """``backprop_directions`` of positions read from one forward (``CapturedForward.at``: capture,
    squares, linears, probes each), in their order: as many positions' directions as the budget's chunk
    holds go back in one batched backward, each from its own position's row of h.

    Why: a response's first pass gives a position a few directions (its first moments, the tied probes,
    a first chunk), and a backward of its own for each ran at 26 ms a direction on SmolLM2 at 26 rows,
    17 ms in batches of 80. ``positions`` is read lazily, a chunk's worth ahead of the results: the
    caller's work for a position (its plans) need not be made for all at once. A position with more
    directions than a chunk, or of another forward than the positions before it, starts a backward of
    its own."""
    batch: list[_DirectionPass] = []
    held = 0
    for capture, squares, linears, probes in positions:
        work = _DirectionPass(capture, squares, linears, probes, memory_budget_bytes)
        chunk = _chunk_size(capture, memory_budget_bytes)
        if batch and (held + len(work.rows) > chunk or capture.hidden is not batch[0].capture.hidden):
            yield from _shared_backward(batch)
            batch, held = [], 0
        if len(work.rows) > chunk:
            yield _backprop(work, capture.position, memory_budget_bytes)
            continue
        batch.append(work)
        held += len(work.rows)
    if batch:
        yield from _shared_backward(batch)


def _shared_backward(batch: list[_DirectionPass]) -> Iterator[DirectionResults]:
    """One backward for the positions' directions, then each position folded and finished in turn."""
    hidden = batch[0].capture.hidden
    assert all(work.capture.hidden is hidden for work in batch)  # views of one forward
    targets = direction_targets(batch[0].capture)
    counts = [len(work.rows) for work in batch]
    vectors = hidden.new_zeros(sum(counts), *hidden.shape)
    at = 0
    for work, count in zip(batch, counts, strict=True):
        if count:
            assert work.vectors is not None
            vectors[at : at + count, work.capture.position] = work.vectors
        at += count
    grads = batched_grad(hidden, targets, vectors)
    del vectors
    at = 0
    for work, count in zip(batch, counts, strict=True):
        own = tuple(None if grad is None else grad[at : at + count] for grad in grads)
        if count:
            check_causal(work.capture, targets, own)
            work.fold(0, count, own)
        at += count
        del own
        yield work.finish(directions=count)


def check_causal(capture: CapturedForward, targets: list[torch.Tensor], grads: tuple) -> None:
    """Refuse a forward read at an earlier position (``CapturedForward.at``) whose later rows its
    directions reach: every use of one row per token must get exact zeros after the position, or the
    rows after it would add to its moments what a forward of its context alone does not have."""
    position = capture.position
    if position == capture.length - 1:
        return
    uses = len(targets) - len(capture.generic)  # the outputs of uses; then parameters, which have no rows
    for target, grad in zip(targets[:uses], grads[:uses], strict=True):
        if grad is None or target.numel() // target.shape[-1] != capture.length:
            continue
        later = grad.reshape(grad.shape[0], capture.length, -1)[:, position + 1 :]
        if bool(later.any()):
            raise UnsupportedArchitecture(
                f"the model's output at row {position} depends on later rows: it is not causal, and "
                "one forward of a response cannot serve its positions"
            )


def _sum_over_processes(results: DirectionResults, work: _DirectionPass) -> None:
    """Every process's partial sums added up (``shards``): each group's parameter tensors, the probes'
    rows back-propagated (the model's dtype) and summed from coordinates (float64) apart."""
    shapes = work.capture.shapes
    grown = {probe.name: (shapes[probe.param][-1],) for probe in work.probes}
    summed = {probe.name: (shapes[probe.param][-1],) for probe in work.summed}
    own = {name: results.probes[name] for name in grown if name in results.probes}
    from_coordinates = {name: results.probes[name] for name in summed if name in results.probes}
    tables = [results.squares.setdefault(s.name, {}) for s in work.squares]
    # the first moments are rank 0's (it runs the lead), summed formed: a small form's terms differ in
    # number between processes, a parameter-shaped sum does not
    firsts = [results.linears[g.name].dense() if g.name in results.linears else {} for g in work.linears]
    sum_over_processes(
        tables + firsts + [own, from_coordinates], [shapes] * (len(tables) + len(firsts)) + [grown, summed]
    )
    for group, first in zip(work.linears, firsts, strict=True):
        results.linears[group.name] = FirstMoment(first)
    results.probes = {**own, **from_coordinates}


def chunk_bounds(total: int, lead: int, chunk: int, first: int | None) -> list[int]:
    """Where the chunks of ``total`` directions start and end, at most ``chunk`` each; the first ``lead``
    are the first moments and probes, then the square directions.

    ``first`` (partial results wanted): the first ``first`` square directions come in a small chunk,
    with the lead where the memory budget's chunk has room for both. Where it has not, the lead goes
    first and the square directions follow: at 32 tokens the lead of SmolLM2 (a probe per distinct
    token) filled the budget's 26 directions, and a first chunk of it alone gave a partial result with
    none of the trace. Never above ``chunk``: a larger first chunk touches memory for the first time.
    """
    if first is None:
        head = [0]
    elif lead < chunk:
        head = [0, lead + min(first, chunk - lead)]
    else:
        head = [*range(0, lead, chunk), lead, lead + min(first, chunk)]
    bounds = [*head, *range(head[-1] + chunk, total, chunk), total]
    return sorted({min(b, total) for b in bounds})
