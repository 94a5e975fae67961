"""A short human reading of a study's summary, for the terminal: what the JSON holds, in a dozen lines."""

from __future__ import annotations

PAPER_NOTE = "same statistic, this model; not a reproduction"


def format_study(summary: dict, top_kinds: int = 6) -> str:
    counts, totals = summary["counts"], summary["totals"]
    lines = [
        f"{counts['prompts']} prompts x {summary['spec']['samples']} responses: "
        f"{counts['positions']} positions ({counts['distinct_contexts']} distinct contexts, "
        f"{counts['directions']} directions)",
        f"per response: F total {totals['fisher']:.4g}, U total {totals['uncentered']:.4g}, "
        f"||M||^2 {totals['mean_shift_norm_sq']:.4g}",
    ]
    for name, row in summary["estimators"].items():
        if not isinstance(row, dict) or not row.get("available", True) or "relative_l2_vs_fisher" not in row:
            continue
        top = row["top_q_vs_fisher"]
        overlaps = ", ".join(
            f"q={q:g}: {o:.3f} (chance {c:.3g})"
            for q, o, c in zip(top["q"], top["overlap"], top["chance_overlap"], strict=True)
        )
        lines.append(
            f"{name}: relative L2 error vs F {_num(row['relative_l2_vs_fisher'])}; top-q overlap {overlaps}"
        )
    for key, mask in summary["masks"]["by_q"].items():
        kinds = sorted(mask["kinds"], key=lambda g: -g["share_of_mask"])[:top_kinds]
        shares = ", ".join(f"{g['group']} {g['share_of_mask']:.1%}" for g in kinds if g["count"])
        lines.append(f"mask q={key}: {mask['count']} coordinates; by kind {shares}")
    paper = summary["paper"]
    gradient = paper.get("fisher_vs_policy_gradient")
    if gradient is not None:
        if gradient.get("overlap") is None:
            lines.append(f"top-1% F vs top-1% |policy gradient|: {gradient.get('reason')}")
        else:
            lines.append(
                f"top-1% F vs top-1% |policy gradient|: overlap {gradient['overlap']:.2%} "
                f"(chance {gradient['chance_overlap']:.0%}; {PAPER_NOTE})"
            )
    uniform = paper.get("model_vs_uniform")
    if uniform is not None:
        lines.append(
            f"Fisher under the model / under uniform at the {uniform['at']}: "
            f"{uniform['ratio_model_to_uniform']:.3f} "
            f"(the sampler's: {uniform['ratio_sampler_to_uniform']:.3f}; {PAPER_NOTE})"
        )
    return "\n".join(lines)


def _num(value) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) else str(value)
