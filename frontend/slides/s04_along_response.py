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
    return figures.response_fisher(summary)


def reading(summary: Summary, centering: str) -> str:
    response = summary.get("response")
    if not response:
        return "This analysis has no continuation: type one (e.g. ' coffee and') and run to see the sum."
    per_position = response["fisher_total"]
    total = response["fisher_running"][-1]
    peak = max(range(len(per_position)), key=per_position.__getitem__)
    token = summary["tokens"]["continuation"][peak]["text"]
    return (
        f"Over {response['T']} response tokens the Fisher sums to {num(total)}; the position predicting "
        f"{quoted(token)} contributes the most, {pct(per_position[peak] / total)}."
    )
