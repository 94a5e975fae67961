"""Figures as pure functions of the summary JSON: what they plot is the summary's own numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from frontend import figures

FIXTURE = Path(__file__).parent / "fixtures" / "summary_smollm2.json"


@pytest.fixture(scope="module")
def summary() -> dict:
    return json.loads(FIXTURE.read_text())


def points_by_tensor(figure) -> dict[str, float]:
    """tensor name -> plotted value, from the per-tensor scatter traces (customdata holds the names)."""
    values = {}
    for trace in figure.data:
        if trace.customdata is not None:
            values.update(dict(zip(trace.customdata, trace.y, strict=True)))
    return values


def test_centering_toggle_switches_the_per_tensor_statistic(summary):
    centered = points_by_tensor(figures.per_tensor_stat(summary, "on"))
    uncentered = points_by_tensor(figures.per_tensor_stat(summary, "off"))
    raw = points_by_tensor(figures.per_tensor_stat(summary, "raw"))
    assert set(centered) == {tensor["name"] for tensor in summary["tensors"]}
    for tensor in summary["tensors"]:
        name = tensor["name"]
        assert centered[name] == tensor["totals"]["fisher"]
        assert uncentered[name] == tensor["totals"]["uncentered"]
        assert raw[name] == tensor["totals"]["raw"]
        # uncentered = fisher + mean_shift^2 >= fisher (DESIGN.md section 2)
        assert uncentered[name] >= centered[name]


def test_concentration_curve_reads_the_chosen_statistic(summary):
    for centering, stat in figures.CENTERING_STAT.items():
        figure = figures.concentration_curve(summary, centering)
        assert list(figure.data[0].y) == summary["concentration"][stat]["share"]
        assert list(figure.data[2].y) == [row["totals"][stat] for row in summary["layers"]]


def test_unknown_centering_is_a_clear_error(summary):
    with pytest.raises(ValueError, match="centering must be one of"):
        figures.concentration_curve(summary, "sideways")


def test_output_rows_are_exact_coin_flip_variances(summary):
    position = summary["positions"][0]
    rows = figures.reward_rows(position)
    h_norm_sq = position["output_layer"]["h_norm_sq"]
    for row, token in zip(rows, position["p"]["top"], strict=True):
        assert row["fisher"] == pytest.approx(h_norm_sq * token["mu"] * (1 - token["mu"]))
        # Cauchy-Schwarz per row: |G_row| <= std(r) sqrt(F_row)
        assert row["grad"] <= row["bound"] + 1e-9


def test_output_share_figure_plots_the_summary_rows(summary):
    figure = figures.output_rows(summary)
    rows = summary["positions"][0]["output_layer"]["rows"]
    assert list(figure.data[0].y) == [row["share"] for row in rows]
    assert figure.data[0].x[0] == "'" + rows[0]["text"] + "'"


def test_spectrum_plots_centered_below_uncentered_top(summary):
    figure = figures.spectrum(summary)
    uncentered, centered = figure.data[0].y, figure.data[1].y
    assert centered[0] <= uncentered[0]
    assert len(centered) == summary["model"]["d_model"]


def test_response_figures_say_what_is_missing_without_a_continuation(summary):
    prefix_only = {**summary, "response": None}
    for build in (figures.response_fisher, figures.shift_growth, figures.chi2_growth):
        figure = build(prefix_only)
        assert figure.data == ()
        assert "continuation" in figure.layout.annotations[0].text
    figure = figures.response_fisher(summary)
    assert list(figure.data[1].y) == summary["response"]["fisher_running"]


def test_mean_shift_stack_adds_to_uncentered(summary):
    figure = figures.mean_shift_per_layer(summary)
    for fisher, shift, layer in zip(figure.data[0].y, figure.data[1].y, summary["layers"], strict=True):
        assert fisher + shift == pytest.approx(layer["totals"]["uncentered"], rel=1e-9)


def test_csv_has_one_line_per_tensor(summary):
    text = figures.tensor_totals_csv(summary)
    lines = text.strip().split("\n")
    assert len(lines) == len(summary["tensors"]) + 1
    header = lines[0].split(",")
    first = dict(zip(header, lines[1].split(","), strict=True))
    assert float(first["fisher"]) == summary["tensors"][0]["totals"]["fisher"]


def test_heatmap_uses_pooled_values():
    pooled = {
        "shape": [2, 3],
        "row_edges": [0, 2, 4],
        "col_edges": [0, 1, 2, 3],
        "values": [[1, 2, 3], [4, 5, 6]],
    }
    figure = figures.heatmap(pooled, "model.layers.0.mlp.down_proj.weight", "fisher")
    assert [list(row) for row in figure.data[0].z] == pooled["values"]
