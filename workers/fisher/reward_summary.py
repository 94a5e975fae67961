"""An analysis's summary and pooled views under another reward, from the reward-free parts it kept.

What a reward changes in the summary (docs/contract.md): the reward's tokens; per position its mean and
std under mu, the candidates' reward and row gradient and bound, and the totals policy_grad_sq and bound;
per tensor, layer, kind and the model the same two totals; the top coordinates of the policy gradient;
the top-q overlap with the Fisher; the pooled views of policy_grad and bound. Everything else is the
analysis's own. Each is formed by the function the full analysis uses, so the two agree to rounding
(tests/test_reward_reuse.py).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from workers.fisher.first_moments import FirstMoment
from workers.fisher.pooling import pooled_view, zero_view
from workers.fisher.position_summary import HeadRows
from workers.fisher.reward_pass import FisherRoots, RewardPass
from workers.fisher.stats import MomentSums, square_total
from workers.fisher.top_sets import overlap, top_coordinates_of

REWARD_TOTALS = ("policy_grad_sq", "bound")
REWARD_ROW_KEYS = ("row_policy_grad", "row_bound")
Levels = Callable[[str], torch.Tensor]


@dataclass
class RewardParts:
    """A reward and what was computed of it (``None`` for no reward)."""

    entries: list[dict]  # the summary's "reward": [{"id", "text", "value"}]
    vector: torch.Tensor | None  # [V] float64
    computed: RewardPass | None


def summary_with_reward(
    summary: dict,
    pooled: dict[str, dict[str, dict]],
    roots: FisherRoots,
    fisher_levels_of: Levels,
    shapes: dict[str, tuple[int, ...]],
    reward: RewardParts,
) -> tuple[dict, dict[str, dict[str, dict]]]:
    """``summary``/``pooled`` (of any reward, or none) with ``reward``'s parts in place of theirs."""
    out = copy.deepcopy(summary)
    # the directions the whole analysis would count: the policy gradient's, one per position, with a reward
    # (a first moment: rank 0's share)
    had, has = bool(out["reward"]), bool(reward.entries)
    out["directions_per_process"][0] += len(out["positions"]) * (int(has) - int(had))
    out["reward"] = reward.entries
    _positions(out["positions"], reward, roots)
    top = out.get("top_coordinates")
    if top is not None:
        top.pop("policy_grad", None)
    computed = reward.computed
    if computed is None:
        _group_totals(out, {})
        out["overlap"] = None
        zeros = {name: zero_view(shape, *_grid(pooled["fisher"][name])) for name, shape in shapes.items()}
        return out, {**pooled, "policy_grad": zeros, "bound": zeros}
    gradient = MomentSums(list(shapes), shapes, {"policy_grad": FirstMoment(computed.policy_grad)})
    stds = [p.reward_std for p in computed.positions]
    _group_totals(
        out,
        {
            name: {
                "policy_grad_sq": square_total([computed.policy_grad[name]]),
                "bound": roots.bound_totals(stds, name) if roots.any_fisher else 0.0,
            }
            for name in shapes
        },
    )
    if top is not None:
        top["policy_grad"] = top_coordinates_of(gradient, "policy_grad")
    out["overlap"] = overlap(gradient, fisher_levels_of) if roots.any_fisher else None
    views: dict[str, dict] = {}
    bounds: dict[str, dict] = {}
    for name in shapes:
        grid = pooled["fisher"][name]
        views[name] = pooled_view(computed.policy_grad[name], *_grid(grid))
        bound = roots.bound_view(stds, name) if roots.any_fisher else np.zeros(grid["shape"], np.float32)
        bounds[name] = {**{k: grid[k] for k in ("shape", "row_edges", "col_edges")}, "values": bound}
    return out, {**pooled, "policy_grad": views, "bound": bounds}


def _grid(view: dict) -> tuple[int, int]:
    """The (rows, cols) a pooled view was asked for, read from its edges."""
    return len(view["row_edges"]) - 1, len(view["col_edges"]) - 1


def _positions(positions: list[dict], reward: RewardParts, roots: FisherRoots) -> None:
    computed = reward.computed
    for t, position in enumerate(positions):
        totals = {k: v for k, v in position["totals"].items() if k not in REWARD_TOTALS}
        rows = None
        if computed is not None and reward.vector is not None:
            at = computed.positions[t]
            rows = HeadRows(at.h, at.head_scale, at.p, at.mu, reward.vector, at.reward_mean, at.reward_std)
            totals["policy_grad_sq"] = at.policy_grad_sq
            totals["bound"] = at.reward_std * sum(roots.totals[t].values())
            position["reward"] = {"mean": at.reward_mean, "std": at.reward_std}
        else:
            position["reward"] = None
        position["totals"] = totals
        for entry in position["p"]["top"]:
            token = entry["id"]
            entry["reward"] = float(reward.vector[token]) if reward.vector is not None else 0.0
            entry.update(dict.fromkeys(REWARD_ROW_KEYS) if rows is None else rows.reward_entry(token))


def _group_totals(summary: dict, tensor_totals: dict[str, dict[str, float]]) -> None:
    """Per tensor the reward's totals (or none); layers, kinds and the model sum their tensors'."""
    sums: dict[tuple[str, object], dict[str, float]] = {}
    for tensor in summary["tensors"]:
        kept = {k: v for k, v in tensor["totals"].items() if k not in REWARD_TOTALS}
        added = tensor_totals.get(tensor["name"], {})
        tensor["totals"] = {**kept, **added}
        for group in (("layer", tensor["layer"]), ("kind", tensor["kind"]), ("model", None)):
            into = sums.setdefault(group, dict.fromkeys(added, 0.0))
            for key, value in added.items():
                into[key] += value

    def replace(totals: dict, group: tuple[str, object]) -> dict:
        return {**{k: v for k, v in totals.items() if k not in REWARD_TOTALS}, **sums.get(group, {})}

    summary["totals"] = replace(summary["totals"], ("model", None))
    for layer in summary["layers"]:
        layer["totals"] = replace(layer["totals"], ("layer", layer["layer"]))
    for kind in summary["kinds"]:
        kind["totals"] = replace(kind["totals"], ("kind", kind["kind"]))


def reward_vector(reward: dict[int, float], vocab_size: int, device: torch.device | str = "cpu"):
    """[V] float64, 0 for every token without a reward; None for no reward at all."""
    if not reward:
        return None
    vector = torch.zeros(vocab_size, dtype=torch.float64, device=device)
    for token, value in reward.items():
        vector[int(token)] = float(value)
    return vector


def reward_entries(reward: dict[int, float], decode: Callable[[int], str]) -> list[dict]:
    """The summary's "reward": each rewarded token with its text."""
    return [{"id": int(t), "text": decode(int(t)), "value": v} for t, v in reward.items()]


def flat_levels(levels: np.ndarray, shapes: dict[str, tuple[int, ...]]) -> Levels:
    """``fisher_levels_of`` over one array of every tensor's levels, flattened in ``shapes``' order."""
    offsets, start = {}, 0
    for name, shape in shapes.items():
        offsets[name] = (start, shape)
        start += math.prod(shape)

    def of(name: str) -> torch.Tensor:
        begin, shape = offsets[name]
        return torch.from_numpy(levels[begin : begin + math.prod(shape)]).view(shape)

    return of
