"""Slide 8, Part 2 section 3: without centering, the mean shift accumulates."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from backend.summary import AnalysisSummary, SftIdentity, ShiftGrowth
from frontend.plots import (
    LAYOUT,
    LOG_TICKS,
    log_tickvals,
    message_figure,
    positive_or_none,
    response_labels,
)
from frontend.slides.common import no_response, num

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
CHANGES_WITH_CENTERING = False  # draws its own fixed quantities, whatever the toggle says
missing = no_response  # what the analysis must carry for this slide to teach

# A note in the plot's top-left corner, where no curve starts.
CORNER_NOTE = {"showarrow": False, "xref": "paper", "yref": "paper", "x": 0.02, "y": 0.98, "xanchor": "left"}


def figure(summary: AnalysisSummary, centering: str) -> go.Figure:
    """Squared accumulated mean shift against the sum of per-position terms along the response."""
    response = summary.response
    if response is None:
        return message_figure("Add a continuation (type or Sample one) to see the mean shift accumulate.")
    growth = response.shift_growth
    labels = response_labels(summary)
    fig = go.Figure()
    fig.add_trace(curve(labels, growth.accumulated_shift_sq, "‖Σ_t m(s_t)‖²: accumulated shift", "#d62728"))
    fig.add_trace(
        curve(labels, growth.sum_shift_sq, "Σ_t ‖m(s_t)‖²: the shifts one by one", "#ff7f0e", "dot")
    )
    if max(growth.sum_variances, default=0.0) > 0:
        fig.add_trace(curve(labels, growth.sum_variances, "Σ_t Fisher under μ (centered)", "#1f77b4"))
    else:
        fig.add_annotation(
            text="Σ_t Fisher under μ is 0 (μ one-hot): not drawn on the log axis", **CORNER_NOTE
        )
    drawn = [value for trace in fig.data for value in trace.y if value is not None]
    fig.update_layout(
        **LAYOUT,
        yaxis_type="log",
        yaxis_tickformat=LOG_TICKS["tickformat"],
        yaxis_tickmode="array",
        yaxis_tickvals=log_tickvals(drawn),
        yaxis_title="summed over all parameters (log)",
        xaxis_title="response position t: token y_t",
        legend={"orientation": "h", "y": -0.25},
    )
    return fig


def curve(
    labels: list[str], values: list[float], name: str, color: str, dash: str | None = None
) -> go.Scatter:
    """One running quantity along the response on the log axis (zeros left as gaps)."""
    line: dict[str, Any] = {"color": color} if dash is None else {"color": color, "dash": dash}
    return go.Scatter(x=labels, y=positive_or_none(values), name=name, mode="lines+markers", line=line)


def reading(summary: AnalysisSummary, centering: str) -> str:
    response = summary.response
    if response is None:
        return "This analysis has no continuation: type or Sample one to see the shift accumulate."
    growth = response.shift_growth
    shift, variances = growth.accumulated_shift_sq[-1], growth.sum_variances[-1]
    T = response.T
    if variances > 0:
        sentence = (
            f"After {T} tokens the squared accumulated shift is {num(shift)} against {num(variances)} "
            f"for the summed centered Fisher ({num(shift / variances)}×)."
        )
    else:
        sentence = (
            f"After {T} tokens the squared accumulated shift is {num(shift)}, all of it outside the "
            "Fisher under μ, which is 0 for a one-hot μ" + one_by_one_clause(growth, shift)
        )
    return sentence + sft_identity_sentence(response.sft_identity)


def one_by_one_clause(growth: ShiftGrowth, shift: float) -> str:
    """Whether the per-position shifts add up in step or partly cancel, ending the sentence."""
    one_by_one = (growth.sum_shift_sq or [0.0])[-1]
    if one_by_one <= 0:
        return "."
    how = "in step" if shift >= one_by_one else "partly cancelling"
    return (
        f"; the shifts taken one by one sum to {num(one_by_one)}, so they add up {how} "
        f"({num(shift / one_by_one)}×)."
    )


def sft_identity_sentence(identity: SftIdentity | None) -> str:
    """The engine's check that the accumulated shift is the SFT gradient (data sampler only)."""
    if identity is None:
        return ""
    return (
        " With the data sampler the accumulated shift is the SFT gradient: the engine checked it to "
        f"a max error of {identity.max_abs_error:.1e}, {identity.relative_error:.1e} of the largest entry."
    )
