"""Slide 1, Part 1 section 1: small is not sparse."""

from __future__ import annotations

from frontend import figures
from frontend.slides.common import Summary, layer_share, pct

TITLE = "1. Small is not sparse"
CLAIM = (
    "Reweighting what the model already samples explains why the update is small, "
    "not why it lands on a few coordinates."
)
FORMULA = (
    r"$$\mathrm{share}(q)=\frac{\sum_{i\,\in\,\text{top }q}F_i}{\sum_i F_i},"
    r"\qquad \mathrm{share}(q)=q \text{ if the Fisher were spread evenly}$$"
)


def figure(summary: Summary, centering: str):
    return figures.concentration_curve(summary, centering)


def reading(summary: Summary, centering: str) -> str:
    stat = figures.stat_for_centering(centering)
    at = summary["concentration"][stat]["at"]
    layer, share = layer_share(summary, stat)
    return (
        f"The top 1% of the model's {summary['model']['n_params']:,} coordinates hold {pct(at['0.01'])} "
        f"of the {figures.STAT_LABEL[stat]} (0.1% hold {pct(at['0.001'])}), against 1% if it were "
        f"spread evenly; layer {figures.layer_label(layer)} holds the most, {pct(share)} of the total."
    )
