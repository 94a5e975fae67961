"""Slide 4, Part 1 section 4: along the response the Fisher adds up."""

from __future__ import annotations

from frontend import figures
from frontend.slides.common import Summary, num, pct, quoted

TITLE = "4. Along the response: the Fisher adds up"
CLAIM = "Across positions the cross terms average to zero, so the Fisher is a sum of token Fishers."
FORMULA = (
    r"$$\mathbb{E}\big[\mathrm{score}_i^{(u)}\,\mathrm{score}_i^{(t)}\big]=0\quad(u<t),\qquad "
    r"F_i=\mathbb{E}\Big[\sum_t f_i(s_t)\Big]$$"
)


def figure(summary: Summary, centering: str):
    return figures.response_fisher(summary, centering)


def reading(summary: Summary, centering: str) -> str:
    response = summary.get("response")
    if not response:
        return "This analysis has no continuation: type one (e.g. ' coffee and') and run to see the sum."
    label, per_position, running = figures.response_series(summary, centering)
    total = running[-1]
    if total <= 0:
        return (
            f"With the data sampler μ is one-hot on each y_t, so over {response['T']} response tokens the "
            "centered Fisher under μ is 0: all of the second moment is mean shift (slide 8). Pick the model "
            "sampler to see the Fisher add up."
        )
    peak = max(range(len(per_position)), key=per_position.__getitem__)
    token = summary["tokens"]["continuation"][peak]["text"]
    return (
        f"Shown: {label}. Over {response['T']} response tokens it sums to {num(total)}; the position "
        f"predicting {quoted(token)} contributes the most, {num(per_position[peak])} "
        f"({pct(per_position[peak] / total)} of the sum)."
    )
