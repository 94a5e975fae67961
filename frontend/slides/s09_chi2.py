"""Slide 9, Part 2 section 3 (continued): the same cost, booked as a chi^2 signal."""

from __future__ import annotations

import math

from frontend import figures
from frontend.slides.common import Summary, num

TITLE = "9. The same cost, booked as a χ² signal"
CLAIM = (
    "The bound still holds, but its signal scale grows at least exponentially with distance from the model."
)
FORMULA = (
    r"$$|G^{\text{SFT}}_i|\le\sqrt{\chi^2(D\,\|\,\pi_\theta)+(1-b)^2}\,\sqrt{F_i},\qquad "
    r"1+\chi^2(D\,\|\,\pi_\theta)\ \ge\ (1+c)^T$$"
)


def figure(summary: Summary, centering: str):
    return figures.chi2_growth(summary)


def reading(summary: Summary, centering: str) -> str:
    response = summary.get("response")
    if not response:
        return "This analysis has no continuation: add one to see χ² per position and its product."
    chi2 = response["chi2"]
    log_total = response["log_one_plus_chi2_cum"][-1]
    return (
        f"Per position χ² runs from {num(min(chi2))} to {num(max(chi2))}; over {response['T']} tokens "
        f"Σ log(1+χ²) = {log_total:.2f}, so 1 + χ² ≥ {num(math.exp(log_total))} for this response "
        f"(the (1+c)^T floor with c = {num(min(chi2))} is {num((1 + min(chi2)) ** response['T'])})."
    )
