"""What the dashboard reads along a response: p(y_t), chi^2_t, the per-position totals and how the
accumulated mean shift grows against the sum of variances (Part 2, section 3), and the SFT identity."""

from __future__ import annotations

import itertools
import math

import torch

from workers.fisher.position_summary import Decode, token_entry
from workers.fisher.response import SequenceAnalysis


def response_summary(analysis: SequenceAnalysis, decode: Decode) -> dict | None:
    records = analysis.positions
    if not records or records[0].target_id is None:
        return None
    p_target = [float(r.p[r.target_id]) for r in records]  # type: ignore[index]
    chi2 = [1 / p - 1 if p > 0 else math.inf for p in p_target]
    fisher = [r.moments_totals["fisher"] for r in records]
    shift_sq = [r.moments_totals["mean_shift_sq"] for r in records]
    return {
        "T": len(records),
        "targets": [token_entry(decode, r.target_id) for r in records],  # type: ignore[arg-type]
        "p_target": p_target,
        "chi2": chi2,
        "log_one_plus_chi2_cum": list(
            itertools.accumulate(math.log1p(c) if math.isfinite(c) else math.inf for c in chi2)
        ),
        "fisher_total": fisher,
        "fisher_running": list(itertools.accumulate(fisher)),
        "uncentered_total": [r.moments_totals["uncentered"] for r in records],
        "uncentered_running": list(itertools.accumulate(r.moments_totals["uncentered"] for r in records)),
        # the floor of slide 9: log (1 + c)^t with c the smallest chi^2_t of the response
        "log_one_plus_chi2_floor": [(t + 1) * math.log1p(min(chi2)) for t in range(len(chi2))],
        "mean_shift_sq_total": shift_sq,
        "shift_growth": {
            "accumulated_shift_sq": analysis.accumulated_shift_sq or [0.0] * len(records),
            "sum_shift_sq": list(itertools.accumulate(shift_sq)),
            "sum_variances": list(itertools.accumulate(fisher)),
        },
        "sft_identity": sft_identity(analysis),
    }


def sft_identity(analysis: SequenceAnalysis) -> dict | None:
    """With the data sampler, M = sum_t mean_shift equals d log pi(y|x)/dtheta: how closely it does."""
    if analysis.sft_gradient is None:
        return None
    worst, scale = 0.0, 0.0
    for name, grad in analysis.sft_gradient.items():
        shift = analysis.sums.stat("mean_shift", name)
        worst = max(worst, float((shift.to(torch.float64) - grad.to(torch.float64)).abs().max()))
        scale = max(scale, float(grad.abs().max()))
    return {
        "max_abs_error": worst,
        "max_abs_gradient": scale,
        "relative_error": worst / scale if scale > 0 else 0.0,
    }
