"""Slide 7, Part 2 section 2: in hidden layers the Fisher sees few directions, not few coordinates."""

from __future__ import annotations

import plotly.graph_objects as go

from backend.summary import AnalysisSummary
from frontend.explorer import SPECTRUM_PENDING, spectrum
from frontend.slides.common import first_position, num

TITLE = "7. Hidden layers: few directions, not few coordinates"
CLAIM = "In hidden layers the Fisher sees only the few directions that tell the likely candidates apart."
FORMULA = (
    r"$$f_i(s)=u_i^\top C_\mu\,u_i,\qquad C_\mu=\sum_a\mu(a)\,(w_a-\bar w_\mu)(w_a-\bar w_\mu)^\top,"
    r"\qquad \operatorname{rank}C_\mu\le n-1$$"
)
CHANGES_WITH_CENTERING = False  # draws its own fixed quantities, whatever the toggle says


def figure(summary: AnalysisSummary, centering: str) -> go.Figure:
    """The C_mu spectrum at the prefix's next-token position (the explorer shows any position)."""
    return spectrum(summary, 0)


def reading(summary: AnalysisSummary, centering: str) -> str:
    spec = first_position(summary).spectrum
    if spec is None:
        return SPECTRUM_PENDING
    d_model = summary.model.d_model
    top_centered, top_uncentered = spec.eigenvalues[0], spec.uncentered_eigenvalues[0]
    return (
        f"C_μ has numerical rank {spec.numerical_rank} of d = {d_model} (bound n − 1 = "
        f"{spec.rank_bound:,}), but an effective rank of only {spec.effective_rank:.1f} and a "
        f"participation ratio of {spec.participation_ratio:.1f}; centering lowers the top eigenvalue "
        f"from {num(top_uncentered)} to {num(top_centered)}."
    )
