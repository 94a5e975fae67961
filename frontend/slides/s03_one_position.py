"""Slide 3, Part 1 section 3: at one position the Fisher is a spread of sensitivities."""

from __future__ import annotations

from frontend import figures
from frontend.slides.common import Summary, num

TITLE = "3. One position: the Fisher is a spread of sensitivities"
CLAIM = (
    "At one prefix, a parameter's token Fisher is the variance of how strongly it moves each "
    "candidate's logit."
)
FORMULA = (
    r"$$\frac{\partial\log p(a\mid s)}{\partial\theta_i}=\kappa_{i,a}-\bar\kappa^{p}_i,\qquad "
    r"f_i(s)=\operatorname{Var}_{a\sim p}\big[\kappa_{i,a}\big]"
    r"=\tfrac12\sum_{a,b}p(a)\,p(b)\,\big(\kappa_{i,a}-\kappa_{i,b}\big)^2$$"
)


def figure(summary: Summary, centering: str):
    return figures.per_tensor_stat(summary, centering)


def reading(summary: Summary, centering: str) -> str:
    totals = summary["totals"]
    stat = figures.stat_for_centering(centering)
    kinds = summary["kinds"]
    most_common = max(kinds, key=lambda k: k["totals"]["rho_mean"])
    return (
        f"Shown: {figures.STAT_LABEL[stat]}. Over the whole model the centered Fisher is "
        f"{num(totals['fisher'])}, the uncentered second moment {num(totals['uncentered'])} and the raw "
        f"{num(totals['raw'])} ({num(totals['raw'] / totals['fisher'])}× the Fisher); centering removes "
        f"the most in the {most_common['kind']} matrices, mean ρ = {most_common['totals']['rho_mean']:.2f}."
    )
