"""Figures as pure functions of the summary JSON: what they plot is the summary's own numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from frontend import figures

FIXTURES = Path(__file__).parent / "fixtures"
# Written by the engine on SmolLM2-135M for "She drank a cup of": temperature 0.7 with reward ' tea'=1
# (prefix only), on-policy with the continuation ' coffee with milk', and the data sampler on it.
FIXTURE = FIXTURES / "summary_smollm2.json"


@pytest.fixture(scope="module")
def summary() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def response_summary() -> dict:
    return json.loads((FIXTURES / "summary_smollm2_response.json").read_text())


@pytest.fixture(scope="module")
def data_summary() -> dict:
    return json.loads((FIXTURES / "summary_smollm2_data.json").read_text())


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


def test_response_figures_say_what_is_missing_without_a_continuation(response_summary):
    summary = response_summary
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
        # the engine accumulates in float32: the identity holds to float32 precision
        assert fisher + shift == pytest.approx(layer["totals"]["uncentered"], rel=1e-5)


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


def test_token_labels_are_unique_when_texts_collide():
    tokens = [{"id": 5, "text": "\ufffd"}, {"id": 9, "text": "\ufffd"}, {"id": 3, "text": " tea"}]
    assert figures.unique_token_labels(tokens) == ["'\ufffd' #5", "'\ufffd' #9", "' tea'"]
    repeated = [{"id": 3, "text": " tea"}, {"id": 3, "text": " tea"}]
    assert len(set(figures.unique_token_labels(repeated))) == 2


def test_every_token_axis_keeps_one_bar_per_token():
    """tiny-random's top tokens include several that decode to U+FFFD: no bar may merge with another."""
    summary = json.loads((FIXTURES / "summary_tiny_random.json").read_text())
    top = summary["positions"][0]["p"]["top"]
    assert len({token["text"] for token in top}) < len(top)  # the fixture does have collisions
    for figure in (
        figures.next_token(summary),
        figures.output_rows(summary),
        figures.engine_shift_rows(summary),
        figures.gradient_vs_bound(summary),
    ):
        for trace in figure.data:
            if trace.x is not None and trace.xaxis in (None, "x"):
                assert len(set(trace.x)) == len(trace.x), (figure.layout.title, trace.name)


def test_response_view_follows_the_toggle(response_summary):
    response = response_summary["response"]
    centered = figures.response_view(response_summary, "on")
    uncentered = figures.response_view(response_summary, "off")
    assert list(centered.data[0].y) == response["fisher_total"]
    assert list(centered.data[1].y) == response["fisher_running"]
    assert list(uncentered.data[0].y) == response["uncentered_total"]
    assert list(centered.data[2].y) == response["p_target"]
    assert list(centered.data[3].y) == response["chi2"]


def test_data_sampler_response_says_the_fisher_under_mu_is_zero(data_summary):
    figure = figures.response_fisher(data_summary, "on")
    assert figure.data == () and "one-hot" in figure.layout.annotations[0].text
    shifted = figures.response_fisher(data_summary, "off")
    assert list(shifted.data[0].y) == data_summary["response"]["uncentered_total"]
    assert "one-hot" in figures.spectrum(data_summary).layout.annotations[0].text


def test_spectrum_marks_numerical_rank_and_rank_bound(summary):
    spectrum = summary["positions"][0]["spectrum"]
    figure = figures.spectrum(summary)
    texts = " ".join(shape.text for shape in figure.layout.annotations)
    assert f"numerical rank {spectrum['numerical_rank']}" in texts
    assert f"{spectrum['rank_bound']:,}" in figure.layout.title.text
    truncated = json.loads(json.dumps(summary))
    truncated["positions"][0]["spectrum"]["rank_bound"] = 19  # as with top-k = 20
    texts = " ".join(shape.text for shape in figures.spectrum(truncated).layout.annotations)
    assert "rank bound n − 1 = 19" in texts


def test_layer_bars_open_that_layers_tensors(summary):
    figure = figures.layer_mass(summary, "on")
    assert [row[0] for row in figure.data[0].customdata] == [str(row["layer"]) for row in summary["layers"]]
    names = figures.tensors_of_layer(summary, "0", "fisher")
    assert names and all(".layers.0." in name for name in names)
    by_name = {tensor["name"]: tensor for tensor in summary["tensors"]}
    matrices = [name for name in names if len(by_name[name]["shape"]) == 2]
    assert names[: len(matrices)] == matrices  # matrices first, then the norm vectors
    fisher = [by_name[name]["totals"]["fisher"] for name in matrices]
    assert fisher == sorted(fisher, reverse=True)
