"""The squares of one matrix block, from the gradients at its output: the two forms and the ghost form's
pair moments (docs/design.md §3).

For y = x M^T over rows r, d(v_b^T h)/dM = sum_r delta_{b,r} x_r^T. "Direct": each direction's [o, i]
gradient, squared and weighted (cost ~ b o i r). "Ghost": f_{o,i} = sum_{r,s} X_{r,i} X_{s,i} M_{o,r,s}
with M = sum_b w_b delta_b delta_b^T (cost ~ b o r^2 + o i r^2, memory o r (r + 1) / 2); M by rows (a
compiled kernel), by products or by batched Grams, all the same sums. Which form a block takes:
``backend.square_forms``, shared with the cost estimate. ``SquareAccumulator`` folds one square group's
chunks into parameter-shaped sums (``ParameterSums``), block by block.
Index conventions: b direction, r/s row, i in, o out, c token row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from backend.square_forms import GHOST_ROWWISE_MAX_ROWS, direct_cost, ghost_cost, ghost_entries
from workers.fisher import cpu_kernels, recycled
from workers.fisher.capture import CapturedForward, EmbeddingBlock, MatrixBlock
from workers.fisher.feature_grams import FeatureGrams

# Direct squares: tiles of about this many bytes of per-direction gradient (which form a block takes:
# backend.square_forms, shared with the cost estimate)
DIRECT_TILE_BYTES = 2 << 20
DIRECT_TILE_MIN_ROWS = 8


def block_gradients(block: MatrixBlock, delta: torch.Tensor) -> torch.Tensor:
    """d(v_b^T h)/dM for each direction, shaped like M: [b, o, i] (or [b, i, o] when y = x M)."""
    grad = torch.einsum("bro,ri->boi", delta, block.feature)
    return grad.transpose(1, 2) if block.transposed else grad


def embedding_rows(block: EmbeddingBlock, indices: torch.Tensor, delta: torch.Tensor, padding: list):
    """Rows of the table that received gradient: ([c] ids, [b, c, o] rows); padding rows get none."""
    keep = torch.ones_like(indices, dtype=torch.bool)
    for pad in padding:
        keep &= indices != pad
    unique, inverse = torch.unique(indices[keep], return_inverse=True)
    rows = delta.new_zeros(delta.shape[0], unique.numel(), delta.shape[2])
    rows.index_add_(1, inverse, delta[:, keep])
    return unique, rows


def direct_squares(
    x: torch.Tensor, delta: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """[o, i]: sum_b w_b (sum_r delta[b, r, o] x[r, i])^2, w_b >= 0, written into ``out`` where given.

    Why tiles of output rows: at short contexts the per-direction gradients cost few flops per element
    (2r), so writing all of them ([b, o, i]) and reading them back to square and sum is what takes the
    time; a tile of rows is squared and summed while it is still in cache.
    """
    count, _, width = delta.shape
    scaled = (delta * weights.clamp_min(0).sqrt().to(delta.dtype)[:, None, None]).transpose(1, 2)
    scaled = scaled.contiguous()  # [b, o, r]
    value = x.new_empty(width, x.shape[1]) if out is None else out
    step = max(DIRECT_TILE_MIN_ROWS, DIRECT_TILE_BYTES // max(1, count * x.shape[1] * x.element_size()))
    for lo in range(0, width, step):
        grad = torch.matmul(scaled[:, lo : lo + step], x)  # [b, rows of the tile, i]
        grad.mul_(grad)
        torch.sum(grad, dim=0, out=value[lo : lo + step])
    return value


def ghost_squares(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """f_{o,i} = sum_{r,s} X_{r,i} X_{s,i} M_{o,r,s}, over M's pairs r <= s (M is symmetric); ``m`` is M
    as ``ghost_moments`` keeps it: its pairs [pairs, o], or the whole [o, r, r]."""
    left, right = ghost_factors(m, x)
    return left @ right  # [o, i]


def ghost_factors(
    m: torch.Tensor, x: torch.Tensor, transposed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ghost_squares`` as the product left @ right of M's pairs and the features' pair products, [o, i]
    (``transposed``: [i, o]), for a caller that writes or adds it into an array of its own
    (``ParameterSums.add_product``)."""
    first, second, twice = _pairs(x.shape[0], x.device, x.dtype)
    m_pairs = as_pairs(m)
    features = x[first] * x[second] * twice[:, None]  # [pairs, i]
    return (features.T, m_pairs) if transposed else (m_pairs.T, features)


def _pairs(
    rows: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """M's pairs r <= s in row-major order (``ghost_moments``' layout), and each pair's count in the
    symmetric sum: an off-diagonal pair stands for (r, s) and (s, r)."""
    first, second = torch.triu_indices(rows, rows, device=device)
    return first, second, torch.where(first == second, 1.0, 2.0).to(dtype)


def as_pairs(m: torch.Tensor) -> torch.Tensor:
    """M as its pairs r <= s [pairs, o], either layout ``ghost_moments`` keeps (kept whole: [o, r, r])."""
    if m.dim() == 2:
        return m
    first, second, _ = _pairs(m.shape[1], m.device, m.dtype)
    return m[:, first, second].T


def pair_index(rows: int, within: int, device: torch.device) -> torch.Tensor:
    """Where the pairs r <= s of the first ``rows`` rows sit among the pairs of ``within`` rows, both in
    ``_pairs``' row-major order (row r's pairs start after r rows of within, within - 1, ... pairs)."""
    first, second = torch.triu_indices(rows, rows, device=device)
    return first * within - first * (first - 1) // 2 + (second - first)


def ghost_moments(
    delta: torch.Tensor, weights: torch.Tensor, into: torch.Tensor | None = None
) -> torch.Tensor:
    """M[o, r, s] = sum_b w_b delta[b, r, o] delta[b, s, o] (w >= 0): with few rows its pairs r <= s only
    ([pairs, o]), with many the whole [o, r, r] (picking the pairs out of each chunk's Grams costs more
    than the Grams; they are picked once, in ``ghost_squares``). Chunks add up in either layout: with
    ``into`` (the earlier chunks' M), this chunk's is added into it and it is returned.

    Why two ways: with few rows, each row's products with the rows after it are summed while they are
    in cache (a compiled loop on the CPU, a matrix-vector product per row on the GPU); a broadcast over
    all pairs at once writes b r^2 o floats, and reading them back was most of a short prefix's
    direction pass. With many rows, one small Gram per output (a batched matmul) costs less.
    """
    if ghost_moments_compiled(delta):  # the loop adds into the earlier chunks' M itself
        return cpu_kernels.pair_moments(delta, weights.clamp_min(0), into)
    rows = delta.shape[1]
    m = (
        pair_moments_by_grams(delta, weights)
        if rows > GHOST_ROWWISE_MAX_ROWS
        else pair_moments_by_rows(delta, weights)
    )
    return m if into is None else into.add_(m)


def ghost_moments_compiled(delta: torch.Tensor) -> bool:
    """Whether ``ghost_moments`` runs a compiled loop (one core) rather than torch's ops."""
    return cpu_kernels.compiled_for(delta) and delta.shape[1] <= GHOST_ROWWISE_MAX_ROWS


def pair_moments_by_rows(delta: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    if ghost_moments_compiled(delta):
        return cpu_kernels.pair_moments(delta, weights.clamp_min(0))
    return pair_moments_by_products(delta, weights)


def pair_moments_by_products(delta: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The GPU's way (and the reference of the CPU's loop): all of a row's products at once."""
    count, rows, out = delta.shape
    weights = weights.clamp_min(0).to(delta.dtype)
    parts = [
        (weights @ (delta[:, r : r + 1] * delta[:, r:]).reshape(count, -1)).reshape(rows - r, out)
        for r in range(rows)
    ]
    return torch.cat(parts)


def pair_moments_by_grams(delta: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    count, rows, out = delta.shape
    scaled = delta * weights.clamp_min(0).sqrt().to(delta.dtype)[:, None, None]
    # [o, b, r] by one 2-D transpose of [b r, o]: the 3-D permute to [o, r, b] cost more than the Grams
    # (nearly twice the time for an MLP block's outputs); the same sums
    scaled = scaled.reshape(count * rows, out).T.contiguous().view(out, count, rows)
    return torch.bmm(scaled.transpose(1, 2), scaled)


class ParameterSums:
    """name -> a parameter-shaped running sum; expert slices land in their slot of the 3-D tensor.

    ``in_one_array``: the tensors are views of one array of all of them, made at the first value and
    recycled (``recycled``) once every view is gone. Why: a response's or a study's every position forms
    a Fisher of the model's size, and formed into fresh arrays each was first touched again: 2.25M page
    faults (9 GB) and 23 s of system time in a 16-token top-k 50 response on SmolLM2, 62 s in all."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        values: dict[str, torch.Tensor] | None = None,
        in_one_array: bool = False,
    ):
        self.shapes = shapes
        self.values: dict[str, torch.Tensor] = dict(values or {})
        self.lent = set(
            self.values
        )  # another ParameterSums' tensors: copied before the first addition into one
        self.in_one_array = in_one_array
        self._views: dict[str, torch.Tensor] | None = None

    def borrowed(self) -> ParameterSums:
        """Sums that start as these, reading the same tensors: what is added to them goes into copies.
        Why not copies of all: a snapshot of SmolLM2's squares copied 540 MB (0.1-0.3 s of a partial)."""
        return ParameterSums(self.shapes, self.values)

    def add(self, name: str, value: torch.Tensor, index: int | None = None) -> None:
        if index is None and name not in self.values and not self.in_one_array:
            self.values[name] = value
            return
        target, fresh = self.slot(name, value, index)
        if fresh:
            target.copy_(value)
        else:
            target += value

    def add_product(
        self, name: str, left: torch.Tensor, right: torch.Tensor, index: int | None = None
    ) -> None:
        """left @ right added to tensor ``name`` (its slice ``index``) in the product itself."""
        target, fresh = self.slot(name, left, index)
        if fresh:
            torch.mm(left, right, out=target)
        else:
            target.addmm_(left, right)

    def slot(self, name: str, like: torch.Tensor, index: int | None = None) -> tuple[torch.Tensor, bool]:
        """Where a value of tensor ``name`` (its slice ``index``, of ``like``'s dtype) is summed, and
        whether nothing is there yet: the caller then writes it whole rather than adds."""
        if name not in self.values:
            self.values[name] = self._fresh(name, like)
            if index is None:
                return self.values[name], True
            self.values[name].zero_()
        elif name in self.lent:
            self.values[name] = recycled.copy(self.values[name])
            self.lent.discard(name)
        return (self.values[name] if index is None else self.values[name][index]), False

    def _fresh(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """An uninitialized array for tensor ``name``: its view of the one array (``in_one_array``)."""
        if not self.in_one_array:
            return recycled.empty(self.shapes[name], like)
        if self._views is None:
            sizes = [math.prod(shape) for shape in self.shapes.values()]
            flat = recycled.empty((sum(sizes),), like)
            self._views = {
                key: part.view(shape)
                for (key, shape), part in zip(self.shapes.items(), flat.split(sizes), strict=True)
            }
        view = self._views[name]
        return view if view.dtype == like.dtype else like.new_empty(view.shape)


@dataclass
class CarriedSquares:
    """A square group's leading directions as an earlier pass of the same position left them, in the form
    a later pass continues (``SquareAccumulator``'s ``carried``): per matrix block its ghost moments M
    over the context's rows, per lookup table the rows' weighted squares, per generic parameter its
    weighted squares, and the tied probes' rows summed over these directions.

    Why: a response's refining round takes each position's leading directions to 90% of its trace, and
    the exact pass used to spend them again (about a sixth of its directions on SmolLM2 on the policy);
    M is what they leave that the exact pass can add to, o r (r + 1) / 2 values per block, against the
    o i of their squares."""

    directions: int  # the group's leading directions these hold
    ghost: dict[int, torch.Tensor]  # block index -> M as ``ghost_moments`` keeps it
    table_rows: dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> ([c] ids, [c, o])
    generic: dict[str, torch.Tensor]
    # what the moments were formed on: each block's (name, slice, rows), each table's ids looked up
    blocks: list[tuple[str, int | None, int]]
    lookups: dict[str, torch.Tensor]
    probes: dict[str, torch.Tensor] = field(default_factory=dict)  # probe name -> [d] float64

    def fits(self, capture: CapturedForward) -> bool:
        """Whether ``capture`` is a forward of the same rows (a later pass's own forward of the context):
        the same blocks with as many rows, the same ids looked up."""
        lookups = _lookups_of(capture)
        return _blocks_of(capture) == self.blocks and all(
            torch.equal(lookups[name], ids) for name, ids in self.lookups.items()
        )

    def nbytes(self) -> int:
        arrays = [*self.ghost.values(), *self.generic.values(), *self.probes.values()]
        arrays += [rows for _, rows in self.table_rows.values()]
        return sum(a.numel() * a.element_size() for a in arrays)


def carried_bytes(capture: CapturedForward) -> int:
    """What ``CarriedSquares`` of ``capture``'s context holds, at most: its blocks' ghost moments, a
    row per lookup of each table, the generic parameters' squares, and a float64 probe row per lookup."""
    size = capture.hidden.element_size()
    moments = sum(
        block.uses[0].output.shape[-1] * ghost_entries(block.feature.shape[0]) * block.feature.element_size()
        for block in capture.matrices
    )
    lookups = sum(
        int(block.indices.numel()) * capture.shapes[block.name][-1] * (size + 8)
        for block in capture.embeddings
    )
    generic = sum(param.numel() * size for param in capture.generic.values())
    return moments + lookups + generic


def rows_are_the_tokens(capture: CapturedForward, index: int) -> bool:
    """Whether matrix block ``index``'s rows are the context's tokens, its tensor's one use: the first n
    rows of a longer context's are then this context's (``nested_ghost``). Not an expert's (the tokens
    routed to it), a weight used twice, or a tensor of several blocks."""
    block = capture.matrices[index]
    return (
        block.slice is None
        and len(block.uses) == 1
        and block.feature.shape[0] == capture.length
        and sum(other.name == block.name for other in capture.matrices) == 1
    )


def carries_to_a_forward_of_its_own(capture: CapturedForward) -> bool:
    """Whether a later pass's own forward of the context has the same rows as ``capture`` (read at a
    position of a longer forward, ``CapturedForward.at``): not where an expert's rows are the tokens
    routed to it, which a longer forward keeps whole."""
    return all(block.slice is None for block in capture.matrices)


def _blocks_of(capture: CapturedForward) -> list[tuple[str, int | None, int]]:
    return [(block.name, block.slice, int(block.feature.shape[0])) for block in capture.matrices]


def _lookups_of(capture: CapturedForward) -> dict[str, torch.Tensor]:
    return {block.name: block.indices for block in capture.embeddings}


def add_table_rows(
    table_rows: dict[str, tuple[torch.Tensor, torch.Tensor]],
    block: EmbeddingBlock,
    unique: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
) -> None:
    """A lookup's weighted squares, [c, o] for the ids it read (``unique``), added to its table's."""
    value = torch.einsum("b,bco->co", weights, rows.square())
    if block.name in table_rows:
        table_rows[block.name][1].add_(value)
    else:
        table_rows[block.name] = (unique, value)


class SquareAccumulator:
    """sum_j w_j (d(v_j^T h)/dtheta)^2 for one square group, over every block and generic parameter;
    ``carried``: its leading directions done by an earlier pass of this context, which this one adds to
    (every block's M folds into its squares at the end, a ghost block's taking this pass's moments first);
    ``in_one_array``: the sums' (``ParameterSums``); ``keep_ghost``: a ghost block whose rows are the
    context's tokens keeps its pair moments (``kept``) instead of folding them into its squares, for a
    caller that sums them over nested contexts (``nested_ghost``)."""

    def __init__(
        self,
        capture: CapturedForward,
        directions: int,
        ghost_budget_bytes: int,
        carried: CarriedSquares | None = None,
        in_one_array: bool = True,
        keep_ghost: bool = False,
    ):
        self.sums = ParameterSums(capture.shapes, in_one_array=in_one_array)
        self.ghost_blocks: set[int] = set()  # blocks whose squares take the ghost form
        # M [o, r, s] of ghost blocks between chunks; a group's last chunk folds M into the sums at once,
        # so a pass of one chunk (a study's few directions) never holds every block's M together
        self.ghost: dict[int, torch.Tensor] = {}
        self.table_rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> ([c] ids, [c, o])
        # the ghost form where it saves work, within the budget for M: the blocks that save the most per
        # byte of M first (at long contexts not every block's M fits, and which ones do decides the time)
        candidates = []
        for index, block in enumerate(capture.matrices):
            rows, inp = block.feature.shape
            out = block.uses[0].output.shape[-1]
            saving = direct_cost(directions, rows, out, inp) - ghost_cost(directions, rows, out, inp)
            ghost_bytes = out * ghost_entries(rows) * block.feature.element_size()
            if saving > 0:
                candidates.append((saving / ghost_bytes, ghost_bytes, index))
        budget = ghost_budget_bytes
        for _, ghost_bytes, index in sorted(candidates, reverse=True):
            if ghost_bytes <= budget:
                budget -= ghost_bytes
                self.ghost_blocks.add(index)
        # block -> its pair moments [pairs, o], the squares left unformed (``keep_ghost``)
        self.kept: dict[int, torch.Tensor] = {}
        self.keeps = (
            {index for index in self.ghost_blocks if rows_are_the_tokens(capture, index)}
            if keep_ghost and carried is None
            else set()
        )
        if carried is not None:
            self.ghost.update(carried.ghost)
            self.table_rows.update(carried.table_rows)
            for name, value in carried.generic.items():
                self.sums.add(name, value)

    def add_matrix(
        self,
        index: int,
        block: MatrixBlock,
        delta: torch.Tensor,
        weights: torch.Tensor,
        last: bool,
        moments: torch.Tensor | None = None,
    ) -> None:
        """Fold one chunk's directions of one block; ``last``: no more directions of this group follow;
        ``moments``: this block's ghost moments so far, this chunk's included, when they were formed
        already (``_compiled_ghost_moments``)."""
        if index in self.ghost_blocks:
            m = moments if moments is not None else ghost_moments(delta, weights, self.ghost.get(index))
            if not last:
                self.ghost[index] = m
                return
            self.ghost.pop(index, None)
            if index in self.keeps:
                self.kept[index] = as_pairs(m)
                return
            self.sums.add_product(block.name, *ghost_factors(m, block.feature, block.transposed), block.slice)
            return
        target, fresh = self.sums.slot(block.name, delta, block.slice)
        target = target.T if block.transposed else target  # [o, i]
        if fresh:
            direct_squares(block.feature, delta, weights, out=target)
        else:
            target += direct_squares(block.feature, delta, weights)

    def flush(self) -> None:
        """Nothing waits for the end of a chunk: its blocks were folded as they came."""

    def add_embedding(self, block: EmbeddingBlock, unique: torch.Tensor, rows: torch.Tensor, weights) -> None:
        """Only the looked-up rows carry anything: summed as [c, o] rows, made dense in ``finalize``."""
        add_table_rows(self.table_rows, block, unique, rows, weights)

    def add_generic(self, name: str, grad: torch.Tensor, weights: torch.Tensor) -> None:
        self.sums.add(name, torch.einsum("b,b...->...", weights, grad.square()))

    def finalize(self, capture: CapturedForward, keep: bool = False) -> ParameterSums:
        """Every parameter's sum; ``keep``: a snapshot that leaves the accumulator running. It reads the
        running sums (copying only those it adds into), so it holds until the next chunk is folded."""
        sums = self.sums.borrowed() if keep else self.sums
        for index, m in self.ghost.items():
            block = capture.matrices[index]
            sums.add_product(block.name, *ghost_factors(m, block.feature, block.transposed), block.slice)
        for name, (unique, rows) in self.table_rows.items():
            target, fresh = sums.slot(name, rows)
            if fresh:
                target.zero_()
            target.index_add_(0, unique, rows)
        if not keep:
            self.ghost.clear()
            self.table_rows.clear()
        return sums


class SquareTotals:
    """``SquareAccumulator``'s sums as each tensor's total alone, never formed: per matrix block
    sum_o delta_o^T (X X^T) delta_o over the directions, weighted (float64), per lookup and generic
    parameter the weighted squares added up in float64.

    Why: a response's first pass keeps of each position's Fisher only its tensors' totals
    (``response.tensor_totals``), and forming a first chunk's squares, parameter-sized at every position,
    was a third of its time on the policy. A Gram of r rows costs r^2 (b o + i) per block, not o i.
    A chunk's blocks are taken together when it is folded (``flush``): those of one shape in one batched
    product, each recorded array's Gram made once (q, k and v read one). One block at a time, their
    small products' calls were most of a 16-token first pass's 0.8 s of totals (210 blocks x 16
    positions on SmolLM2)."""

    def __init__(self, grams: FeatureGrams) -> None:
        self.totals: dict[str, float] = {}
        self.ghost_blocks: frozenset[int] = frozenset()  # no block keeps moments between chunks
        self.ghost: dict[int, torch.Tensor] = {}
        self.pending: list[tuple[MatrixBlock, torch.Tensor, torch.Tensor]] = []  # this chunk's blocks
        # the forward's Grams (``CapturedForward.grams``): shared by the response's positions read from it
        self.grams = grams

    def _add(self, name: str, value: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + value

    def add_matrix(
        self,
        index: int,
        block: MatrixBlock,
        delta: torch.Tensor,
        weights: torch.Tensor,
        last: bool,
        moments: torch.Tensor | None = None,
    ) -> None:
        self.pending.append((block, delta, weights))

    def flush(self) -> None:
        """The chunk's blocks' totals (``add_matrix``), before its gradients are freed."""
        pending, self.pending = self.pending, []
        self.grams.add(block.feature for block, _, _ in pending)
        by_shape: dict[tuple, list[tuple[MatrixBlock, torch.Tensor, torch.Tensor]]] = {}
        for item in pending:
            by_shape.setdefault((item[1].shape, item[1].dtype, item[0].feature.shape), []).append(item)
        for group in by_shape.values():
            deltas = torch.stack([delta for _, delta, _ in group]).double()  # [n, b, r, o]
            features = torch.stack([self.grams.of(block.feature) for block, _, _ in group])  # [n, r, r]
            per_direction = (deltas * torch.matmul(features[:, None], deltas)).sum((2, 3))  # [n, b]
            weights = torch.stack([w for _, _, w in group]).double().clamp_min(0)
            for (block, _, _), total in zip(group, (per_direction * weights).sum(1).tolist(), strict=True):
                self._add(block.name, total)

    def add_embedding(self, block: EmbeddingBlock, unique: torch.Tensor, rows: torch.Tensor, weights) -> None:
        self._add(block.name, float(torch.einsum("b,bco->", weights.double(), rows.double().square())))

    def add_generic(self, name: str, grad: torch.Tensor, weights: torch.Tensor) -> None:
        self._add(name, float(torch.einsum("b,b...->", weights.double(), grad.double().square())))

    def finalize(self, capture: CapturedForward, keep: bool = False) -> ParameterSums:
        """Each tensor's total as a float64 scalar (a tensor the directions did not reach: absent)."""
        values = {name: torch.tensor(total, dtype=torch.float64) for name, total in self.totals.items()}
        return ParameterSums({}, values)


class CarryingTotals(SquareTotals):
    """``SquareTotals`` that keeps what its directions leave for a later pass of the same context
    (``CarriedSquares``): every block's ghost moments M, from which its total is read
    (sum_{r,s} (X X^T)_{rs} sum_o M_{o,r,s}), the tables' rows and the generic parameters' squares.

    Why M and not the directions' Gram: a Gram of r rows summed over the outputs is all a total needs,
    but a later pass adds its own directions per output; forming M costs the same b o r^2."""

    def __init__(self, capture: CapturedForward, directions: int) -> None:
        super().__init__(capture.grams)
        self.directions = directions
        self.ghost_blocks = frozenset(range(len(capture.matrices)))
        self.blocks = _blocks_of(capture)
        self.lookups = _lookups_of(capture)
        self.table_rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.generic: dict[str, torch.Tensor] = {}

    def add_matrix(
        self,
        index: int,
        block: MatrixBlock,
        delta: torch.Tensor,
        weights: torch.Tensor,
        last: bool,
        moments: torch.Tensor | None = None,
    ) -> None:
        m = moments if moments is not None else ghost_moments(delta, weights, self.ghost.get(index))
        self.ghost[index] = m

    def add_embedding(self, block: EmbeddingBlock, unique: torch.Tensor, rows: torch.Tensor, weights) -> None:
        add_table_rows(self.table_rows, block, unique, rows, weights)

    def add_generic(self, name: str, grad: torch.Tensor, weights: torch.Tensor) -> None:
        value = torch.einsum("b,b...->...", weights, grad.square())
        self.generic[name] = value if name not in self.generic else self.generic[name].add_(value)

    def finalize(self, capture: CapturedForward, keep: bool = False) -> ParameterSums:
        self.totals = {}
        self.grams.add(capture.matrices[index].feature for index in self.ghost)
        for index, m in self.ghost.items():
            block = capture.matrices[index]
            self._add(block.name, ghost_total(m, self.grams.of(block.feature)))
        for name, (_, rows) in self.table_rows.items():
            self._add(name, float(rows.double().sum()))
        for name, value in self.generic.items():
            self._add(name, float(value.double().sum()))
        return super().finalize(capture, keep)

    def carried(self, probes: dict[str, torch.Tensor]) -> CarriedSquares:
        """What a later pass of this context continues from, the tied probes' rows given."""
        return CarriedSquares(
            self.directions, self.ghost, self.table_rows, self.generic, self.blocks, self.lookups, probes
        )


def ghost_total(m: torch.Tensor, gram: torch.Tensor) -> float:
    """sum_{o,i} of ``ghost_squares(m, x)`` without forming it: M summed over its outputs, against the
    features' Gram X X^T (float64, ``FeatureGrams``)."""
    if m.dim() == 3:  # [o, r, r]
        return float((m.sum(0, dtype=torch.float64) * gram).sum())
    first, second, twice = _pairs(gram.shape[0], gram.device, torch.float64)
    return float((m.sum(1, dtype=torch.float64) * gram[first, second] * twice).sum())
