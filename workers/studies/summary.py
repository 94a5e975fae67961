"""The summary of a finished study (all parts merged): what the JSON file holds, and the Fisher's top-q
sets the mask file is cut from.

Why averages: docs/design.md §7 defines F = (1 / NK) sum_{n,k} sum_t fisher(s_t); the running sums are kept
as sums (parts add), and divided by the number of responses here and in the saved arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from backend.study_summary import checked_study_summary
from workers.fisher.stats import square_total
from workers.fisher.study import UNCENTERED, StudyStat
from workers.studies.masks import LevelMap, level_map, mask_shares
from workers.studies.runner import StudyPart
from workers.studies.spec import CompareAt, StudySpec
from workers.studies.statistics import estimator_comparison, fisher_vs_policy_gradient, model_vs_uniform

KIND = "fisherscope.study"
VERSION = 1
NORMALIZATION = (
    "F, U and M are averages over the N K sampled responses of sums over each response's positions: "
    "F = (1/NK) sum_{n,k} sum_t Var_mu[kappa](s_t), U = (1/NK) sum sum_t E_mu[(kappa - kbar^p)^2], "
    "M = (1/NK) sum sum_t (kbar^mu - kbar^p); totals below are sums over all coordinates"
)


@dataclass
class FinishedStudy:
    summary: dict
    fisher_levels: LevelMap  # top-q sets of F at spec.level_fractions


def finish_study(part: StudyPart, spec: StudySpec, model: dict, cost: dict | None = None) -> FinishedStudy:
    """Masks, comparisons and the paper's statistics of a merged part. ``model``: id, digest, sizes."""
    sums = part.sums
    fractions = spec.level_fractions
    fisher_levels = level_map(sums, StudyStat.fisher, fractions)
    per_response = max(sums.responses, 1)
    summary = {
        "kind": KIND,
        "version": VERSION,
        "model": model,
        "spec": spec.to_dict(),
        "normalization": NORMALIZATION,
        "counts": {
            "prompts": len(part.prompts),
            "responses": sums.responses,
            "positions": sums.positions,
            "distinct_contexts": sums.contexts,
            "targets": sums.targets,
            "directions": sums.directions,
            "direction_tokens": sums.direction_tokens,
            "n_params": sums.n_params,
        },
        "totals": {
            "fisher": sums.total(StudyStat.fisher) / per_response,
            "uncentered": sums.total(UNCENTERED) / per_response,
            "mean_shift_norm_sq": sum(
                square_total([value]) for _, value in sums.iter_stat(StudyStat.mean_shift)
            )
            / per_response**2,
        },
        "prompts": [p.model_dump() for p in part.prompts],
        "responses": [r.model_dump() for r in part.responses],
        "estimators": estimator_comparison(sums, fisher_levels, fractions),
        "masks": {
            "statistic": "F, the exact sequence Fisher of the study",
            "q": list(spec.fractions),
            "by_q": {
                f"{q:g}": mask_shares(fisher_levels, q, sums, part.head_name, part.embedding_name)
                for q in spec.fractions
            },
        },
        "paper": {
            "fisher_vs_policy_gradient": (
                None if spec.reward is None else fisher_vs_policy_gradient(sums, fisher_levels, part.prompts)
            ),
            "model_vs_uniform": (
                None if spec.compare_at == CompareAt.none else model_vs_uniform(part.prompts, spec.compare_at)
            ),
        },
        "cost": cost,
        "timing": dict(part.seconds),
    }
    return FinishedStudy(checked_study_summary(json_safe(summary)), fisher_levels)


def json_safe(value: Any) -> Any:
    """JSON has no NaN or infinity: an undefined number (an error against a zero reference) is null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value
