"""Slide 5, Part 1 section 5: what this needs is a centered score."""

from __future__ import annotations

from frontend import figures
from frontend.slides.common import Summary, num, pct

TITLE = "5. What this needs: a centered score"
CLAIM = (
    "None of this needs on-policy sampling. It needs the score centered under the distribution "
    "that drew the samples."
)
FORMULA = (
    r"$$c_i^{(t)}=\kappa_{i,y_t}-\bar\kappa^{\mu}_i(s_t),\qquad G_i=\operatorname{Cov}_{\mu}(A,c_i),"
    r"\qquad |G_i|\le\operatorname{std}_{\mu}(A)\sqrt{F^{\mu}_i}$$"
)


def figure(summary: Summary, centering: str):
    return figures.mean_shift_per_layer(summary)


def sampler_text(summary: Summary) -> str:
    sampler = summary["sampler"]
    parts = [f"kind {sampler['kind']}", f"temperature {sampler['temperature']:g}"]
    if sampler.get("top_k"):
        parts.append(f"top-k {sampler['top_k']}")
    if sampler.get("top_p", 1.0) < 1.0:
        parts.append(f"top-p {sampler['top_p']:g}")
    parts.append(f"engine {sampler['engine']}")
    return ", ".join(parts)


def reading(summary: Summary, centering: str) -> str:
    totals = summary["totals"]
    if totals["mean_shift_sq"] <= 1e-12 * max(totals["fisher"], 1e-30):
        return (
            f"With the sampler ({sampler_text(summary)}) μ = p, so the mean shift is zero and the plain "
            "softmax score is already centered; lower the temperature or pick the bf16 engine to see it."
        )
    return (
        f"With the sampler ({sampler_text(summary)}) the mean shift² adds {num(totals['mean_shift_sq'])} "
        f"to the centered Fisher {num(totals['fisher'])}: without centering the second moment is "
        f"{pct(totals['mean_shift_sq'] / totals['fisher'])} larger."
    )
