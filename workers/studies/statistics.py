"""What a study compares: the estimators people use against the exact F, and the paper's statistics.

Why beside chance everywhere: an overlap of top-q sets means something only next to what two unrelated
sets of the same density would share (q for the overlap, q / (2 - q) for Jaccard), so every overlap
comes with its chance value. The paper's numbers are labelled as this model's values, never as a
reproduction: same statistics, another model, other prompts and sampler.
"""

from __future__ import annotations

from collections.abc import Sequence

from backend.study_summary import PromptRecord
from workers.fisher.study import UNCENTERED, StudyStat, StudySums, relative_l2_error
from workers.studies.masks import LevelMap, compare_levels, level_map
from workers.studies.spec import PAPER_FRACTION

PAPER_LABEL = (
    "same statistic as Zhang, Mukherjee & Peng (2026), computed on this model with these prompts, "
    "responses and sampler; not a reproduction of the paper's values"
)
ESTIMATORS = {
    StudyStat.mc_fisher: "Monte Carlo Fisher: squared score d log pi(y|x)/dtheta of each sampled response, "
    "averaged over the responses",
    StudyStat.empirical_fisher: "empirical Fisher: squared score d log pi(target|x)/dtheta of each "
    "prompt's target, averaged over the prompts with a target",
}


def estimator_comparison(sums: StudySums, fisher_levels: LevelMap, fractions: Sequence[float]) -> dict:
    """Each estimator against the exact F (both as averages): relative L2 error, top-q overlap and Jaccard;
    and the two estimators' masks against each other."""
    out: dict[str, object] = {}
    maps: dict[str, LevelMap] = {}
    for stat, definition in ESTIMATORS.items():
        count = sums.responses if stat == StudyStat.mc_fisher else sums.targets
        if count == 0:
            out[stat.value] = {
                "definition": definition,
                "available": False,
                "reason": "no prompt has a target",
            }
            continue
        maps[stat] = level_map(sums, stat, fractions)
        out[stat.value] = {
            "definition": definition,
            "available": True,
            "count": count,
            "relative_l2_vs_fisher": relative_l2_error(sums, stat, count, StudyStat.fisher, sums.responses),
            # off the policy the score is not centered under mu: it estimates U rather than F
            "relative_l2_vs_uncentered": relative_l2_error(sums, stat, count, UNCENTERED, sums.responses),
            "top_q_vs_fisher": compare_levels(maps[stat], fisher_levels, fractions),
        }
    if len(maps) == 2:
        out["mc_vs_empirical"] = compare_levels(
            maps[StudyStat.mc_fisher], maps[StudyStat.empirical_fisher], fractions
        )
    return out


def fisher_vs_policy_gradient(
    sums: StudySums, fisher_levels: LevelMap, prompts: Sequence[PromptRecord]
) -> dict:
    """Top 1% by F against top 1% by |policy gradient| of the reward over the sampled responses."""
    varied = sum(1 for p in prompts if p.rewards is not None and len(set(p.rewards)) > 1)
    rewards = [r for p in prompts for r in (p.rewards or [])]
    base = {
        "q": PAPER_FRACTION,
        "label": PAPER_LABEL,
        "paper_value": "47.40% on Qwen3-1.7B-Base before RL training",
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "prompts_with_reward_variance": varied,
        "policy_gradient": "sum over prompts and responses of (r - mean r of the prompt's K responses) "
        "* d log pi(y|x)/dtheta",
    }
    if varied == 0:
        return {
            **base,
            "overlap": None,
            "reason": "no prompt's responses differ in reward: the gradient is 0",
        }
    gradient_levels = level_map(sums, StudyStat.policy_gradient, [PAPER_FRACTION], magnitude=True)
    compared = compare_levels(fisher_levels, gradient_levels, [PAPER_FRACTION])
    return {
        **base,
        "overlap": compared["overlap"][0],
        "chance_overlap": compared["chance_overlap"][0],
        "jaccard": compared["jaccard"][0],
        "chance_jaccard": compared["chance_jaccard"][0],
    }


def model_vs_uniform(prompts: Sequence[PromptRecord], where: str) -> dict | None:
    """Total Fisher under the model's p (and under the study's sampler) over the total under uniform,
    at the same prefixes."""
    totals = {key: sum(p.compared.get(key, 0.0) for p in prompts) for key in ("fisher", "model", "uniform")}
    if totals["uniform"] <= 0:
        return None
    return {
        "label": PAPER_LABEL,
        "paper_value": "0.16 on Qwen3-1.7B-Base at the start of RL",
        "at": where,
        "fisher_model": totals["model"],
        "fisher_sampler": totals["fisher"],
        "fisher_uniform": totals["uniform"],
        "ratio_model_to_uniform": totals["model"] / totals["uniform"],
        "ratio_sampler_to_uniform": totals["fisher"] / totals["uniform"],
    }
