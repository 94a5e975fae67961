"""The model's top coordinates and top-q sets: the largest coordinates of a stat (by magnitude for a
signed one), each coordinate's level among the named top-q sets, and the overlap of the Fisher's top-q
sets with the policy gradient's (docs/design.md §2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from backend.vocabulary import SIGNED_STATS
from workers.fisher import cpu_kernels
from workers.fisher.concentration import (
    NAMED_FRACTIONS,
    Histogram,
    Threshold,
    histogram,
    plan_thresholds,
    thresholds,
)
from workers.fisher.stats import MomentSums, each_tensor

TOP_COORDINATES = 50
TOP_STATS = ("fisher", "uncentered", "raw", "mean_shift", "policy_grad")
Candidate = tuple[float, str, int, float]  # (magnitude, tensor, flat index, value)


def fisher_levels_at(sums: MomentSums, named: list[Threshold]) -> Callable[[str], torch.Tensor]:
    values = [t.value for t in named]
    return lambda name: levels_at(sums.stat("fisher", name), values)


def top_bin(hist: Histogram, k: int = TOP_COORDINATES) -> int:
    """The histogram bin of the k-th largest value (bin 1 when fewer than k values are non-zero)."""
    (row,) = plan_thresholds(hist, [k / max(hist.total_count, 1)]).rows
    return row[1] if row[1] is not None else 1


def top_candidates(name: str, value: torch.Tensor, signed: bool, k: int = TOP_COORDINATES) -> list[Candidate]:
    """The k largest coordinates of a tensor, by magnitude for a signed stat."""
    flat = value.reshape(-1)
    k = min(k, flat.numel())
    if cpu_kernels.compiled_for(flat):
        index = cpu_kernels.largest_indices(flat, k, magnitude=signed)
    elif signed:
        index = _largest_magnitudes(flat, k)
    else:
        index = torch.topk(flat, k).indices
    values = flat[index].tolist()
    return [(abs(v) if signed else v, name, int(i), v) for i, v in zip(index.tolist(), values, strict=True)]


# values whose magnitudes are taken at a time: a tensor's whole |value| array was 1.2 GB of Qwen3-1.7B's
# peak (its embedding table); one topk per part costs what one over the whole does (two topk passes,
# largest and smallest, cost 1.7x one)
MAGNITUDE_PART = 1 << 22


def _largest_magnitudes(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest |values|, largest first: the best k of each part, then of those."""
    if flat.numel() <= MAGNITUDE_PART:
        return torch.topk(flat.abs(), k).indices
    buffer = torch.empty(MAGNITUDE_PART, dtype=flat.dtype, device=flat.device)
    picks = []
    for start in range(0, flat.numel(), MAGNITUDE_PART):
        part = flat[start : start + MAGNITUDE_PART]
        magnitudes = torch.abs(part, out=buffer[: part.numel()])
        picks.append(torch.topk(magnitudes, min(k, part.numel())).indices + start)
    index = torch.cat(picks)
    return index[torch.topk(flat[index].abs(), k).indices]


def top_coordinates(
    sums: MomentSums, candidates: dict[str, list[Candidate]], k: int = TOP_COORDINATES
) -> dict[str, list[dict]]:
    """The k largest coordinates of each stat over the whole model (by magnitude for signed stats)."""
    out: dict[str, list[dict]] = {}
    for stat in TOP_STATS:
        if stat == "policy_grad" and not sums.has_reward:
            continue
        if sums.identically_zero(stat):
            out[stat] = []
            continue
        out[stat] = _ranked(candidates[sums.alias(stat)], sums.shapes, k)
    return out


def top_coordinates_of(sums: MomentSums, stat: str, k: int = TOP_COORDINATES) -> list[dict]:
    """``top_coordinates`` of one stat on its own, in a pass of its own."""
    signed = stat in SIGNED_STATS

    def candidates(name: str) -> list[Candidate]:
        return top_candidates(name, sums.stat(stat, name), signed, k)

    return _ranked([c for found in each_tensor(sums, candidates, sums.names) for c in found], sums.shapes, k)


def _ranked(candidates: list[Candidate], shapes: dict[str, tuple[int, ...]], k: int) -> list[dict]:
    ranked = sorted(candidates, key=lambda c: -c[0])[:k]
    return [
        {"tensor": name, "index": list(_unravel(idx, shapes[name])), "value": value}
        for _, name, idx, value in ranked
    ]


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index //= size
    return tuple(reversed(out))


def _magnitude(sums: MomentSums, stat: str) -> Callable[[], Iterator[torch.Tensor]]:
    def chunks() -> Iterator[torch.Tensor]:
        for _, value in sums.iter_stat(stat):
            yield value.abs() if stat in SIGNED_STATS else value

    return chunks


def levels_at(values: torch.Tensor, named: list[float]) -> torch.Tensor:
    """uint8 shaped like ``values``: the 1-based level of the smallest named top-q set a coordinate is
    in (value >= that set's threshold ``named[l]``, and > 0), 0 outside all of them. The Fisher's side
    of ``overlap``, and what a reward change reads instead of the Fisher (``workers.fisher.reward_pass``).
    """
    ascending = torch.tensor(sorted(named), dtype=values.dtype, device=values.device)  # named: q ascending
    if cpu_kernels.compiled_for(values):
        return cpu_kernels.threshold_levels(values, ascending)
    reached = torch.searchsorted(ascending, values, right=True)  # how many thresholds value is at or above
    levels = (len(named) + 1 - reached).to(torch.uint8)
    levels[(reached == 0) | (values <= 0)] = 0
    return levels


def overlap(sums: MomentSums, fisher_levels_of: Callable[[str], torch.Tensor]) -> dict:
    """|top-q by fisher ∩ top-q by |policy_grad|| / |top-q|, against the random baseline q.

    ``fisher_levels_of(name)``: the tensor's ``levels_at`` the Fisher's exact top-q thresholds (from the
    concentration pass); only the gradient's thresholds are found here. A coordinate is in both sets of
    density q_l when the larger of its two levels is at most l.
    """
    grad_chunks = _magnitude(sums, "policy_grad")
    grad_thresholds = [t.value for t in thresholds(histogram(grad_chunks()), grad_chunks, NAMED_FRACTIONS)]

    def deepest_levels(name: str) -> torch.Tensor:
        fisher = fisher_levels_of(name)
        gradient = levels_at(sums.stat("policy_grad", name).abs(), grad_thresholds).to(fisher.device)
        both = torch.maximum(fisher, gradient)[(fisher > 0) & (gradient > 0)]
        return torch.bincount(both.long(), minlength=len(NAMED_FRACTIONS) + 1).cpu()

    deepest = sum(each_tensor(sums, deepest_levels, sums.names), torch.zeros(len(NAMED_FRACTIONS) + 1))
    total = sum(math.prod(shape) for shape in sums.shapes.values())
    counts = [int(c) for c in deepest[1:].cumsum(0).tolist()]
    values = [count / max(1, math.ceil(q * total)) for count, q in zip(counts, NAMED_FRACTIONS, strict=True)]
    return {"q": list(NAMED_FRACTIONS), "fisher_vs_policy_grad": values, "baseline": list(NAMED_FRACTIONS)}
