"""Slide 8, Part 2 section 3: without centering, the mean shift accumulates."""

from __future__ import annotations

from frontend import figures
from frontend.slides.common import Summary, num

TITLE = "8. Without centering: the mean shift"
CLAIM = (
    "Without centering, a mean shift adds up along the sequence and pushes gradient into directions "
    "the Fisher cannot see."
)
FORMULA = (
    r"$$\mathbb{E}_{a\sim\mu}\big[(\kappa_{i,a}-\bar\kappa^{p}_i)^2\big]=\operatorname{Var}_{a\sim\mu}"
    r"\big[\kappa_{i,a}\big]+m_i^2,\qquad \frac{\partial}{\partial\theta_i}\mathbb{E}_{\text{data}}"
    r"\big[\log\pi_\theta(y\mid x)\big]=\mathbb{E}_{\text{data}}\Big[\sum_t m_i(s_t)\Big]$$"
)


def figure(summary: Summary, centering: str):
    return figures.shift_growth(summary)


def reading(summary: Summary, centering: str) -> str:
    response = summary.get("response")
    if not response:
        return "This analysis has no continuation: add one to see the shift accumulate over positions."
    growth = response["shift_growth"]
    shift, variances = growth["accumulated_shift_sq"][-1], growth["sum_variances"][-1]
    sentence = (
        f"After {response['T']} tokens the squared accumulated shift is {num(shift)} against "
        f"{num(variances)} for the summed centered Fisher ({num(shift / variances if variances else 0)}×)."
    )
    identity = response.get("sft_identity")
    if identity and identity.get("checked"):
        sentence += (
            f" With the data sampler the accumulated shift equals the SFT gradient "
            f"(max error {identity['max_abs_error']:.1e})."
        )
    return sentence
