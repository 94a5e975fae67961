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
    T = response["T"]
    if variances > 0:
        sentence = (
            f"After {T} tokens the squared accumulated shift is {num(shift)} against {num(variances)} "
            f"for the summed centered Fisher ({num(shift / variances)}×)."
        )
    else:
        sentence = (
            f"After {T} tokens the squared accumulated shift is {num(shift)}, all of it outside the "
            "Fisher under μ, which is 0 for a one-hot μ"
        )
        one_by_one = (growth.get("sum_shift_sq") or [0.0])[-1]
        if one_by_one > 0:
            how = "in step" if shift >= one_by_one else "partly cancelling"
            sentence += (
                f"; the shifts taken one by one sum to {num(one_by_one)}, so they add up {how} "
                f"({num(shift / one_by_one)}×)."
            )
        else:
            sentence += "."
    identity = response.get("sft_identity")
    if identity and identity.get("max_abs_error") is not None:
        relative = identity.get("relative_error")
        scale = f", {relative:.1e} of the largest entry" if relative is not None else ""
        sentence += (
            " With the data sampler the accumulated shift is the SFT gradient: the engine checked it to "
            f"a max error of {identity['max_abs_error']:.1e}{scale}."
        )
    return sentence
