"""A ghost block's squares summed over nested contexts: one product per longest context, not one per
context (a study's exact pass, docs/design.md §3 and §7).

The contexts a study computes for one response are prefixes of one another. A causal model's rows are
the same in each (the rows after r never reach row r), so at a context of n rows a ghost block's squares
sum_{r <= s < n} X_r X_s M_rs (``block_squares.ghost_squares``) read the first n rows of the longest
context's features. Summed over the contexts, with each context's count, they are one product: the
contexts' pair moments added into the longest context's pair layout (an addition the size of M), then
multiplied once against its features. Per context that saves a parameter-sized product of n (n + 1) / 2
pairs, its first touch and its addition into the study's sums.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from workers.fisher.block_squares import ghost_factors, pair_index

AddProduct = Callable[[str, torch.Tensor, torch.Tensor], None]  # name, left, right: += left @ right


@dataclass
class KeptGhost:
    """A ghost block's pair moments at one context, its squares not formed (``SquareGroup.keep_ghost``)."""

    name: str
    moments: torch.Tensor  # [pairs, o]: pairs r <= s of the context's rows, row-major
    feature: torch.Tensor  # [n, i]: the block's input at the context's rows
    transposed: bool  # the parameter is [i, o] (y = x M)

    @property
    def rows(self) -> int:
        return int(self.feature.shape[0])


@dataclass
class NestedGhostSums:
    """The pair moments of contexts that are prefixes of one context of ``rows`` rows, summed in its
    pair layout, and per block the features of the longest context that kept it (a context may take a
    block's direct form instead: fewer directions, or less workspace); ``add_into`` forms the sum."""

    rows: int
    dtype: torch.dtype
    held_bytes: int  # the most it holds (``nested_bytes``), of the workspace's share between chunks
    moments: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [pairs of rows, o]
    features: dict[str, tuple[torch.Tensor, bool]] = field(default_factory=dict)  # per block, see above

    def add(self, kept: Iterable[KeptGhost], weight: float) -> None:
        for block in kept:
            if block.rows > self.rows:
                raise ValueError(f"a context of {block.rows} rows is not a prefix of one of {self.rows}")
            index = pair_index(block.rows, self.rows, block.moments.device)
            target = self.moments.get(block.name)
            if target is None:
                pairs = self.rows * (self.rows + 1) // 2
                target = block.moments.new_zeros(pairs, block.moments.shape[1], dtype=self.dtype)
                self.moments[block.name] = target
            target.index_add_(0, index, block.moments.to(self.dtype), alpha=weight)
            seen = self.features.get(block.name)
            if seen is None or seen[0].shape[0] < block.rows:
                self.features[block.name] = (block.feature, block.transposed)

    def add_into(self, add_product: AddProduct) -> None:
        """Each block's summed squares, as one product ``add_product(name, left, right)``; then empty.
        A block's pairs beyond the rows of the longest context that kept it are zero: not multiplied."""
        for name, moments in self.moments.items():
            feature, transposed = self.features[name]
            rows = int(feature.shape[0])
            if rows < self.rows:
                moments = moments[pair_index(rows, self.rows, moments.device)]
            add_product(name, *ghost_factors(moments, feature.to(self.dtype), transposed))
        self.moments.clear()
        self.features.clear()


def nested_groups(contexts: dict[tuple[int, ...], int]) -> list[list[tuple[tuple[int, ...], int]]]:
    """``contexts`` (a response prefix -> its count) in groups of prefixes of one longest context, each
    group ordered by length (its longest last). A context that several longest ones extend joins the
    first of them in ids order, so the grouping does not depend on the order of the responses."""
    longest = [c for c in contexts if not any(len(o) > len(c) and o[: len(c)] == c for o in contexts)]
    longest.sort()
    groups: list[list[tuple[tuple[int, ...], int]]] = [[] for _ in longest]
    for context, count in sorted(contexts.items(), key=lambda item: (len(item[0]), item[0])):
        owner = next(k for k, whole in enumerate(longest) if whole[: len(context)] == context)
        groups[owner].append((context, count))
    return groups


def nested_bytes(rows: int, outputs: int, element_size: int) -> int:
    """What ``NestedGhostSums`` holds for blocks of ``outputs`` outputs in all at ``rows`` rows."""
    return rows * (rows + 1) // 2 * outputs * element_size
