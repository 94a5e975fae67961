"""Summaries of an analysis: everything the dashboard draws, as plain JSON-able values.

Per position: p and mu, the C_mu spectrum, the output layer's closed form. Over the model: totals per
tensor / layer / module kind, concentration curves, top coordinates, the top-q overlap of Fisher and
policy gradient. Token texts come from a ``decode`` callable so this module stays free of tokenizers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from workers.fisher.concentration import (
    NAMED_FRACTIONS,
    Histogram,
    Threshold,
    collect_bins,
    concentration_curve,
    histogram,
    merge,
    plan_thresholds,
    thresholds,
)
from workers.fisher.response import PositionRecord, SequenceAnalysis
from workers.fisher.sampler import entropy
from workers.fisher.stats import SIGNED_STATS, MomentSums

Decode = Callable[[int], str]
TOP_TOKENS = 20
TOP_COORDINATES = 50
# first match wins: the names of Llama-likes, GPT-2 (c_attn, c_fc, c_proj), GPT-NeoX and Falcon
# (query_key_value, dense_*), OPT (fc1, fc2, out_proj), mixture-of-experts (gate_up_proj, the router)
KIND_PATTERNS = (
    ("norm", r"norm|(^|\.)ln_"),
    ("position", r"wpe|embed_positions|position_embeddings"),
    ("qkv", r"qkv|query_key_value|c_attn"),
    ("gate_up", r"gate_up_proj"),
    ("q", r"q_proj"),
    ("k", r"k_proj"),
    ("v", r"v_proj"),
    ("o", r"o_proj|out_proj|attn\.c_proj|attention\.dense\."),
    ("gate", r"gate_proj"),
    ("up", r"up_proj|c_fc|fc1|dense_h_to_4h"),
    ("down", r"down_proj|mlp\.c_proj|fc2|dense_4h_to_h"),
    ("router", r"mlp\.gate\.|router"),
)
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def module_kind(name: str, head_name: str, embedding_name: str) -> str:
    if name == head_name:
        return "head"
    if name == embedding_name:
        return "embedding"
    for kind, pattern in KIND_PATTERNS:
        if re.search(pattern, name):
            return kind
    return "other"


def layer_of(name: str, embedding_name: str) -> int | str:
    match = _LAYER.search(name)
    if match:
        return int(match.group(1))
    return "embed" if name == embedding_name or re.search(KIND_PATTERNS[1][1], name) else "final"


def _token(decode: Decode, token_id: int) -> dict:
    return {"id": int(token_id), "text": decode(int(token_id))}


def distribution_summary(q: torch.Tensor) -> dict:
    return {"entropy": entropy(q), "support": int((q > 0).sum()), "sum_sq": float(q.square().sum())}


def position_summary(record: PositionRecord, index: int, decode: Decode, reward: torch.Tensor | None) -> dict:
    p, mu = record.p, record.mu
    top = torch.topk(torch.maximum(p, mu), min(TOP_TOKENS, p.numel())).indices.tolist()
    h_sq = float(record.h.square().sum())
    row_fisher = h_sq * mu * (1 - mu)
    total = h_sq * (1 - float(mu.square().sum()))
    top_rows = torch.topk(row_fisher, min(TOP_TOKENS, p.numel())).indices.tolist()
    order = torch.argsort(mu, descending=True)
    bounds = []
    for m in (1, 2, 5, 10, 20):
        inside = order[:m]
        kept = float(row_fisher[inside].sum())
        outside_mass = float(mu.sum() - mu[inside].sum())
        denom = 1 - float(mu.square().sum())
        bounds.append(
            {
                "top_tokens": m,
                "share_outside": (1 - kept / (h_sq * denom)) if denom > 0 and h_sq > 0 else 0.0,
                "bound": outside_mass / denom if denom > 0 else 0.0,
            }
        )
    target = None
    chi2 = None
    if record.target_id is not None:
        py = float(p[record.target_id])
        target = {**_token(decode, record.target_id), "p": py, "mu": float(mu[record.target_id])}
        chi2 = 1 / py - 1 if py > 0 else math.inf
    lam = record.cov_eigenvalues.clamp_min(0)
    return {
        "index": index,
        "context_length": record.context_length,
        "target": target,
        "p": {
            "top": [
                {
                    **_token(decode, a),
                    "p": float(p[a]),
                    "mu": float(mu[a]),
                    "reward": float(reward[a]) if reward is not None else 0.0,
                }
                for a in top
            ],
            **distribution_summary(p),
        },
        "mu": distribution_summary(mu),
        "spectrum": {
            "eigenvalues": lam.tolist(),
            "trace": float(lam.sum()),
            "numerical_rank": record.numerical_rank,
            "effective_rank": record.effective_rank,
            "participation_ratio": record.participation_ratio,
            "rank_bound": max(record.support - 1, 0),
            "uncentered_eigenvalues": record.uncentered_eigenvalues.clamp_min(0).tolist(),
        },
        "output_layer": {
            "h_norm_sq": h_sq,
            "total": total,
            "rows": [
                {
                    **_token(decode, c),
                    "mu": float(mu[c]),
                    "fisher": float(row_fisher[c]),
                    "share": float(row_fisher[c]) / total if total > 0 else 0.0,
                }
                for c in top_rows
            ],
            "concentration_bound": bounds,
        },
        "totals": record.moments_totals,
        "reward": None
        if record.reward_mean is None
        else {"mean": record.reward_mean, "std": record.reward_std},
        "chi2": chi2,
        "directions": record.directions,
        "kept_share": record.kept_share,
    }


def tensor_totals(
    sums: MomentSums, name: str, computed: dict[str, torch.Tensor] | None = None
) -> dict[str, float]:
    """Sums of the non-negative stats, sums of squares of the signed ones, the mean of rho.

    ``computed`` holds stats of this tensor the caller already formed, so none is formed twice.
    """
    computed = computed or {}

    def value_of(stat: str) -> torch.Tensor:
        return computed[stat] if stat in computed else sums.stat(stat, name)

    fisher = float(value_of("fisher").sum())

    def total(stat: str, squared: bool = False) -> float:
        if sums.identically_zero(stat):
            return 0.0
        if sums.alias(stat) == "fisher":
            return fisher
        value = value_of(stat)
        return float(value.square().sum() if squared else value.sum())

    totals = {
        "fisher": fisher,
        "uncentered": total("uncentered"),
        "raw": total("raw"),
        "mean_shift_sq": total("mean_shift", squared=True),
        "common_sq": total("common", squared=True),
        "rho_mean": float(sums.stat("rho", name).mean()),
    }
    if sums.has_reward:
        totals["policy_grad_sq"] = total("policy_grad", squared=True)
        totals["bound"] = total("bound")
    return totals


def _add_totals(into: dict[str, float], totals: dict[str, float], numel: int) -> None:
    for key, value in totals.items():
        # rho is a mean: carry it weighted by size, normalized by the caller
        into[key] = into.get(key, 0.0) + (value * numel if key == "rho_mean" else value)


def _normalize_rho(totals: dict[str, float], numel: int) -> dict[str, float]:
    if "rho_mean" in totals and numel:
        totals["rho_mean"] /= numel
    return totals


def _magnitude(sums: MomentSums, stat: str) -> Callable[[], Iterator[torch.Tensor]]:
    def chunks() -> Iterator[torch.Tensor]:
        for _, value in sums.iter_stat(stat):
            yield value.abs() if stat == "policy_grad" else value

    return chunks


def _shares(hist: Histogram, named: list) -> dict[str, float]:
    return {
        f"{q:g}": (t.top_sum / hist.total if hist.total > 0 else 0.0)
        for q, t in zip(NAMED_FRACTIONS, named, strict=True)
    }


def _curve(hist: Histogram, named: list) -> dict:
    qs, curve = concentration_curve(hist)
    return {
        "q": qs,
        "share": curve,
        "at": _shares(hist, named),
        "thresholds": {f"{q:g}": t.value for q, t in zip(NAMED_FRACTIONS, named, strict=True)},
    }


def _distinct_stats(sums: MomentSums, stats: tuple[str, ...]) -> list[str]:
    """Stats that need their own computation: no alias of another, not zero by construction."""
    out: list[str] = []
    for stat in stats:
        if not sums.identically_zero(stat) and sums.alias(stat) not in out:
            out.append(sums.alias(stat))
    return out


def model_summary(
    sums: MomentSums, head_name: str, embedding_name: str, curve_stats: tuple[str, ...]
) -> dict:
    """Totals per tensor / layer / kind, concentration, top coordinates, top-q overlap.

    Pass 1 forms each stat of each tensor once (totals, histograms, top coordinates); pass 2 reads
    only the boundary bins for the exact named shares, per tensor (Fisher) and over the model.
    """
    curve = _distinct_stats(sums, curve_stats)
    top_stats = _distinct_stats(sums, TOP_STATS)
    tensors: list[dict[str, Any]] = []
    layers: dict[int | str, dict[str, Any]] = {}
    kinds: dict[str, dict[str, Any]] = {}
    model_totals: dict[str, float] = {}
    hists: dict[str, dict[str, Histogram]] = {stat: {} for stat in curve}
    candidates: dict[str, list[tuple[float, str, int, float]]] = {stat: [] for stat in top_stats}
    for name in sums.names:
        computed = {stat: sums.stat(stat, name) for stat in dict.fromkeys(curve + top_stats)}
        totals = tensor_totals(sums, name, computed)
        for stat in curve:
            hists[stat][name] = histogram([computed[stat]])
        for stat in top_stats:
            if stat not in curve:  # curve stats find their top coordinates from the histogram below
                candidates[stat].extend(_top_candidates(name, computed[stat], stat in SIGNED_STATS))
        del computed
        numel = math.prod(sums.shapes[name])
        kind = module_kind(name, head_name, embedding_name)
        layer = layer_of(name, embedding_name)
        tensors.append(
            {
                "name": name,
                "layer": layer,
                "kind": kind,
                "shape": list(sums.shapes[name]),
                "numel": numel,
                "totals": totals,
            }
        )
        for group in (
            layers.setdefault(layer, {"numel": 0, "totals": {}}),
            kinds.setdefault(kind, {"numel": 0, "totals": {}}),
        ):
            group["numel"] += numel
            _add_totals(group["totals"], totals, numel)
        _add_totals(model_totals, totals, numel)
    model_hists = {stat: merge(hists[stat].values()) for stat in curve}
    model_plans = {stat: plan_thresholds(model_hists[stat], NAMED_FRACTIONS) for stat in curve}
    model_members: dict[str, dict[int, list[torch.Tensor]]] = {stat: {} for stat in curve}
    # the bin holding the model's TOP_COORDINATES-th largest value: everything at or above it is a candidate
    top_bins = {stat: _top_bin(model_hists[stat]) for stat in curve}
    for entry in tensors:
        name = entry["name"]
        tensor_plan = plan_thresholds(hists["fisher"][name], NAMED_FRACTIONS)
        for stat in curve:
            wanted = model_plans[stat].bins | (tensor_plan.bins if stat == "fisher" else set())
            found: dict[int, list[torch.Tensor]] = {}
            value = sums.stat(stat, name)
            index = collect_bins(value, wanted, found)
            if stat in candidates:
                flat = value.reshape(-1)
                for i in torch.nonzero(index >= top_bins[stat]).flatten().tolist():
                    candidates[stat].append((float(flat[i]), name, i, float(flat[i])))
            for b in model_plans[stat].bins:
                model_members[stat].setdefault(b, []).extend(found.get(b, []))
            if stat == "fisher":
                mine = {b: found.get(b, []) for b in tensor_plan.bins}
                entry["concentration"] = {"fisher": _shares(hists["fisher"][name], tensor_plan.finish(mine))}
    named = {stat: model_plans[stat].finish(model_members[stat]) for stat in curve}
    concentration = {stat: _curve(model_hists[stat], named[stat]) for stat in curve}
    for stat in curve_stats:
        concentration.setdefault(stat, concentration[sums.alias(stat)])
    n_total = sum(t["numel"] for t in tensors)
    return {
        "totals": _normalize_rho(model_totals, n_total),
        "tensors": tensors,
        "layers": [
            {"layer": k, "numel": v["numel"], "totals": _normalize_rho(v["totals"], v["numel"])}
            for k, v in layers.items()
        ],
        "kinds": [
            {"kind": k, "numel": v["numel"], "totals": _normalize_rho(v["totals"], v["numel"])}
            for k, v in kinds.items()
        ],
        "concentration": concentration,
        "top_coordinates": _top_coordinates(sums, candidates),
        "overlap": overlap(sums, named["fisher"]) if sums.has_reward else None,
    }


TOP_STATS = ("fisher", "uncentered", "raw", "mean_shift", "policy_grad")


def _top_bin(hist: Histogram, k: int = TOP_COORDINATES) -> int:
    """The histogram bin of the k-th largest value (bin 1 when fewer than k values are non-zero)."""
    (row,) = plan_thresholds(hist, [k / max(hist.total_count, 1)]).rows
    return row[1] if row[1] is not None else 1


def _top_candidates(name: str, value: torch.Tensor, signed: bool, k: int = TOP_COORDINATES) -> list[tuple]:
    flat = value.reshape(-1)
    magnitude = flat.abs() if signed else flat
    top = torch.topk(magnitude, min(k, flat.numel()))
    return [
        (float(m), name, int(i), float(flat[i]))
        for m, i in zip(top.values.tolist(), top.indices.tolist(), strict=True)
    ]


def _top_coordinates(
    sums: MomentSums, candidates: dict[str, list[tuple]], k: int = TOP_COORDINATES
) -> dict[str, list[dict]]:
    """The k largest coordinates of each stat over the whole model (by magnitude for signed stats)."""
    out: dict[str, list[dict]] = {}
    for stat in TOP_STATS:
        if stat == "policy_grad" and not sums.has_reward:
            continue
        if sums.identically_zero(stat):
            out[stat] = []
            continue
        ranked = sorted(candidates[sums.alias(stat)], key=lambda c: -c[0])[:k]
        out[stat] = [
            {"tensor": name, "index": list(_unravel(idx, sums.shapes[name])), "value": value}
            for _, name, idx, value in ranked
        ]
    return out


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index //= size
    return tuple(reversed(out))


def overlap(sums: MomentSums, fisher_thresholds: list[Threshold]) -> dict:
    """|top-q by fisher ∩ top-q by |policy_grad|| / |top-q|, against the random baseline q.

    The Fisher's exact top-q thresholds come from the concentration pass; only the gradient's are new.
    """
    grad_chunks = _magnitude(sums, "policy_grad")
    grad_thresholds = thresholds(histogram(grad_chunks()), grad_chunks, NAMED_FRACTIONS)
    both = [0] * len(NAMED_FRACTIONS)
    for name in sums.names:
        f = sums.stat("fisher", name)
        g = sums.stat("policy_grad", name).abs()
        for i, (ft, gt) in enumerate(zip(fisher_thresholds, grad_thresholds, strict=True)):
            both[i] += int(((f >= ft.value) & (f > 0) & (g >= gt.value) & (g > 0)).sum())
    values = [count / ft.k for count, ft in zip(both, fisher_thresholds, strict=True)]
    return {"q": list(NAMED_FRACTIONS), "fisher_vs_policy_grad": values, "baseline": list(NAMED_FRACTIONS)}


def response_summary(analysis: SequenceAnalysis, decode: Decode) -> dict | None:
    records = analysis.positions
    if not records or records[0].target_id is None:
        return None
    p_target = [float(r.p[r.target_id]) for r in records]  # type: ignore[index]
    chi2 = [1 / p - 1 if p > 0 else math.inf for p in p_target]
    fisher = [r.moments_totals["fisher"] for r in records]
    shift_sq = [r.moments_totals["mean_shift_sq"] for r in records]
    cumulative_log = []
    running = 0.0
    for c in chi2:
        running += math.log1p(c) if math.isfinite(c) else math.inf
        cumulative_log.append(running)
    out = {
        "T": len(records),
        "targets": [_token(decode, r.target_id) for r in records],  # type: ignore[arg-type]
        "p_target": p_target,
        "chi2": chi2,
        "log_one_plus_chi2_cum": cumulative_log,
        "fisher_total": fisher,
        "fisher_running": _running(fisher),
        "uncentered_total": [r.moments_totals["uncentered"] for r in records],
        "mean_shift_sq_total": shift_sq,
        "shift_growth": {
            "accumulated_shift_sq": analysis.accumulated_shift_sq or [0.0] * len(records),
            "sum_shift_sq": _running(shift_sq),
            "sum_variances": _running(fisher),
        },
        "sft_identity": None,
    }
    if analysis.sft_gradient is not None:
        worst, scale = 0.0, 0.0
        for name, grad in analysis.sft_gradient.items():
            shift = analysis.sums.stat("mean_shift", name)
            worst = max(worst, float((shift.to(torch.float64) - grad.to(torch.float64)).abs().max()))
            scale = max(scale, float(grad.abs().max()))
        out["sft_identity"] = {
            "max_abs_error": worst,
            "max_abs_gradient": scale,
            "relative_error": worst / scale if scale > 0 else 0.0,
        }
    return out


def _running(values: list[float]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out
