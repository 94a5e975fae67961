"""Fisher masks: the global top-q coordinates of a statistic, as per-tensor 0/1 arrays and as shares.

Why from level maps: ``workers.fisher.masks.top_q_levels`` gives every density's set in one byte per
coordinate (nested sets, exactly ceil(q P) coordinates each, ties by index), which is also what
``backend.compare.set_comparison`` counts; a mask for training is that map cut at one q. Coordinates
are numbered in the order of ``sums.names``, each tensor flattened.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backend.compare import set_comparison
from workers.fisher.concentration import Threshold
from workers.fisher.grouping import layer_of, module_kind
from workers.fisher.masks import top_q_levels
from workers.fisher.study import StudySums

POLARITY = (
    "1 = in the mask: the coordinate is among the global top q of all parameters by the study's exact "
    "sequence Fisher F (train it); 0 = outside the mask (freeze it)"
)


@dataclass
class LevelMap:
    """Nested top-q sets of one statistic: ``levels`` uint8 [P], level l for the q_l set."""

    fractions: tuple[float, ...]
    levels: torch.Tensor
    thresholds: list[Threshold]

    def level(self, q: float) -> int:
        return self.fractions.index(q) + 1

    def members(self, q: float) -> torch.Tensor:
        """bool [P]: the coordinates in the top-q set."""
        level = self.level(q)
        return (self.levels > 0) & (self.levels <= level)


def level_map(sums: StudySums, stat: str, fractions: Sequence[float], magnitude: bool = False) -> LevelMap:
    """The top-q sets of ``stat`` (of |stat| when ``magnitude``: a signed gradient)."""

    def values():
        for _, value in sums.iter_stat(stat):
            yield value.abs() if magnitude else value

    levels, thresholds = top_q_levels(values, sums.n_params, fractions)
    return LevelMap(tuple(fractions), levels, thresholds)


def mask_tensors(levels: LevelMap, q: float, sums: StudySums) -> dict[str, torch.Tensor]:
    """uint8 arrays shaped like each parameter, 1 inside the top-q set."""
    inside = levels.members(q).to(torch.uint8)
    out, offset = {}, 0
    for name in sums.names:
        size = math.prod(sums.shapes[name])
        # a copy per tensor: safetensors refuses tensors that share storage
        out[name] = inside[offset : offset + size].reshape(sums.shapes[name]).clone()
        offset += size
    return out


def mask_counts(levels: LevelMap, q: float, sums: StudySums) -> dict[str, int]:
    """Coordinates in the mask per tensor."""
    inside = levels.members(q)
    counts, offset = {}, 0
    for name in sums.names:
        size = math.prod(sums.shapes[name])
        counts[name] = int(inside[offset : offset + size].sum())
        offset += size
    return counts


def mask_shares(
    levels: LevelMap, q: float, sums: StudySums, head_name: str, embedding_name: str
) -> dict[str, object]:
    """Where the top-q mask lies: per tensor, layer and module kind, its share of the mask (count / mask
    size) beside the group's density (count / group size; q where the mask ignores groups)."""
    counts = mask_counts(levels, q, sums)
    size = sum(counts.values())
    groups: dict[str, dict[str, list[int]]] = {"layers": {}, "kinds": {}}
    tensors = []
    for name in sums.names:
        numel = math.prod(sums.shapes[name])
        count = counts[name]
        tensors.append({"name": name, "count": count, "size": numel, **_shares(count, numel, size)})
        for key, group in (
            ("layers", str(layer_of(name, embedding_name))),
            ("kinds", module_kind(name, head_name, embedding_name)),
        ):
            slot = groups[key].setdefault(group, [0, 0])
            slot[0] += count
            slot[1] += numel
    return {
        "q": q,
        "count": size,
        "threshold": levels.thresholds[levels.level(q) - 1].value,
        "tensors": tensors,
        **{
            key: [
                {"group": group, "count": c, "size": n, **_shares(c, n, size)}
                for group, (c, n) in table.items()
            ]
            for key, table in groups.items()
        },
    }


def compare_levels(a: LevelMap, b: LevelMap, fractions: Sequence[float]) -> dict:
    """Overlap and Jaccard of the top-q sets of two statistics, each beside chance (``set_comparison``);
    the two maps may hold different densities, as long as both hold ``fractions``."""
    rows = [
        set_comparison(a.members(q).to(torch.uint8).numpy(), b.members(q).to(torch.uint8).numpy(), [q])
        for q in fractions
    ]
    return {key: [row[key][0] for row in rows] for key in rows[0]} if rows else {}


def _shares(count: int, group_size: int, mask_size: int) -> dict[str, float]:
    return {
        "share_of_mask": count / mask_size if mask_size else 0.0,
        "density": count / group_size if group_size else 0.0,
    }
