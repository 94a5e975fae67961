"""The ten slides of docs/design.md §5, in order: one module per essay section."""

from __future__ import annotations

from importlib import import_module

from frontend.slides.common import SlideModule

SLIDE_MODULES = (
    "s01_small_not_sparse",
    "s02_gradient_covariance",
    "s03_one_position",
    "s04_along_response",
    "s05_centered_score",
    "s06_output_layer",
    "s07_hidden_directions",
    "s08_mean_shift",
    "s09_chi2",
    "s10_not_a_defect",
)  # named once, in slide order; each is imported as frontend.slides.<name>

SLIDES: list[SlideModule] = [import_module(f"{__name__}.{name}") for name in SLIDE_MODULES]
