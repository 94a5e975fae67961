"""Figures as pure functions of the summary JSON: what they plot is the summary's own numbers.

Each slide module owns its figure (`frontend.slides.sNN_*.figure`), the explorer's figures live in
`frontend.explorer`, the shared helpers in `frontend.plots`: every number drawn is one the engine reported.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend.schemas import ComparePublic, PooledView, SetComparison, TensorView
from backend.summary import AnalysisOverview, AnalysisSummary, PositionSummary, TokenText
from backend.vocabulary import MODULE_KINDS
from frontend import compare_figures, explorer, exports, handles, numbers, plots, shown
from frontend.callbacks import explorer as explorer_callbacks
from frontend.slides import (
    s01_small_not_sparse,
    s02_gradient_covariance,
    s03_one_position,
    s04_along_response,
    s05_centered_score,
    s06_output_layer,
    s07_hidden_directions,
    s08_mean_shift,
    s09_chi2,
    s10_not_a_defect,
)
from frontend.state import CENTERING_STAT, DashboardState, parse_query

FIXTURES = Path(__file__).parent / "fixtures"
# Written by the engine on SmolLM2-135M for "She drank a cup of": temperature 0.7 with reward ' tea'=1
# (prefix only), on-policy with the continuation ' coffee with milk', and the data sampler on it.
FIXTURE = FIXTURES / "summary_smollm2.json"


@pytest.fixture(scope="module")
def summary() -> dict:
    return json.loads(FIXTURE.read_text())


def typed(summary: dict) -> AnalysisSummary:
    """The summary as the dashboard holds it: checked against the wire model where it enters."""
    return AnalysisSummary.model_validate(summary)


def tensor_view(pooled: dict, tensor: str, stat: str = "fisher") -> TensorView:
    """GET .../tensors/{name}'s answer: the pooled view, with its `row_tokens` when given."""
    view = {key: value for key, value in pooled.items() if key != "row_tokens"}
    return TensorView(tensor=tensor, stat=stat, view=PooledView(**view), row_tokens=pooled.get("row_tokens"))


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
    centered = points_by_tensor(s03_one_position.figure(typed(summary), "on"))
    uncentered = points_by_tensor(s03_one_position.figure(typed(summary), "off"))
    raw = points_by_tensor(s03_one_position.figure(typed(summary), "raw"))
    assert set(centered) == {tensor["name"] for tensor in summary["tensors"]}
    for tensor in summary["tensors"]:
        name = tensor["name"]
        assert centered[name] == tensor["totals"]["fisher"]
        assert uncentered[name] == tensor["totals"]["uncentered"]
        assert raw[name] == tensor["totals"]["raw"]
        # uncentered = fisher + mean_shift^2 (docs/design.md §2), to the engine's float32 accumulation
        assert uncentered[name] == pytest.approx(centered[name] + tensor["totals"]["mean_shift_sq"], rel=1e-5)


def test_per_tensor_traces_follow_the_vocabularys_module_kinds(summary):
    figure = s03_one_position.figure(typed(summary), "on")
    kinds = [trace.name for trace in figure.data if trace.customdata is not None]
    present = {tensor["kind"] for tensor in summary["tensors"]}
    assert kinds == [kind for kind in MODULE_KINDS if kind in present]
    for trace in figure.data:
        if trace.customdata is not None:
            assert trace.marker.color == plots.KIND_COLOR[trace.name]


def test_kind_colours_are_keyed_by_the_vocabularys_module_kinds():
    assert tuple(plots.KIND_COLOR) == MODULE_KINDS
    assert len(set(plots.KIND_COLOR.values())) == len(MODULE_KINDS)  # no two kinds share a colour


def test_concentration_curve_reads_the_chosen_statistic(summary):
    for centering, stat in CENTERING_STAT.items():
        figure = s01_small_not_sparse.figure(typed(summary), centering)
        assert list(figure.data[0].y) == summary["concentration"][stat]["share"]
        assert list(figure.data[2].y) == [row["totals"][stat] for row in summary["layers"]]


def test_unknown_centering_is_a_clear_error(summary):
    with pytest.raises(ValueError, match="centering must be one of"):
        s01_small_not_sparse.figure(typed(summary), "sideways")


def test_output_rows_are_exact_coin_flip_variances(summary):
    """The engine's row fields are the LM head's closed forms (SmolLM2's head is linear: g' = 1)."""
    position = summary["positions"][0]
    assert position["output_layer"]["logit_map"] is False
    h_norm_sq = position["output_layer"]["h_norm_sq"]
    reward = position["reward"]
    for token in position["p"]["top"]:
        mu, p = token["mu"], token["p"]
        assert token["row_fisher"] == pytest.approx(h_norm_sq * mu * (1 - mu), rel=1e-12)
        assert token["row_fisher_p"] == pytest.approx(h_norm_sq * p * (1 - p), rel=1e-12)
        assert token["row_shift_sq"] == pytest.approx(h_norm_sq * (mu - p) ** 2, rel=1e-12)
        centered_reward = token["reward"] - reward["mean"]
        gradient = abs(mu * centered_reward) * math.sqrt(h_norm_sq)
        assert token["row_policy_grad"] == pytest.approx(gradient, rel=1e-12)
        assert token["row_bound"] == pytest.approx(reward["std"] * math.sqrt(token["row_fisher"]), rel=1e-12)
        # Cauchy-Schwarz per row: |G_row| <= std(r) sqrt(F_row)
        assert token["row_policy_grad"] <= token["row_bound"] + 1e-9


def test_gradient_slide_draws_the_engines_row_gradient_and_bound(summary):
    figure = s02_gradient_covariance.figure(typed(summary), "on")
    top = summary["positions"][0]["p"]["top"][:12]
    bound, gradient = figure.data[0], figure.data[1]
    assert (
        list(bound.x) == list(gradient.x) == plots.unique_token_labels(typed(summary).positions[0].p.top[:12])
    )
    assert list(bound.y) == [token["row_bound"] for token in top]
    assert list(gradient.y) == [token["row_policy_grad"] for token in top]
    overlap = summary["overlap"]
    assert list(figure.data[2].y) == overlap["fisher_vs_policy_grad"]
    assert list(figure.data[3].y) == overlap["baseline"]


def test_gradient_slide_without_reward_draws_zero_rows(response_summary):
    """No reward: the engine reports no row gradient nor bound, both are 0, and the overlap asks for one."""
    top = response_summary["positions"][0]["p"]["top"]
    assert all(token["row_policy_grad"] is None and token["row_bound"] is None for token in top)
    figure = s02_gradient_covariance.figure(typed(response_summary), "on")
    assert list(figure.data[0].y) == list(figure.data[1].y) == [0.0] * 12
    assert "set a reward" in figure.layout.annotations[-1].text


def test_mismatch_slide_draws_update_and_sqrt_fisher_ordered_by_p(summary, data_summary):
    """Slide 10's x is p (log, rarest first); the update when drawn is sqrt((1 - p) / p) times the row's
    sqrt(on-policy Fisher), which the summary gives as row_fisher_p."""
    for source in (summary, data_summary):
        figure = s10_not_a_defect.figure(typed(source), "on")
        top = sorted((t for t in source["positions"][0]["p"]["top"] if t["p"] > 0), key=lambda t: t["p"])
        update, fisher = figure.data[0], figure.data[1]
        assert list(update.x) == list(fisher.x) == [t["p"] for t in top]
        assert figure.layout.xaxis.type == "log" and figure.layout.yaxis.type == "log"
        for token, u, f in zip(top, update.y, fisher.y, strict=True):
            assert math.isclose(f, math.sqrt(token["row_fisher_p"]), rel_tol=1e-12)
            assert math.isclose(u, f * math.sqrt((1 - token["p"]) / token["p"]), rel_tol=1e-12)


def test_output_share_figure_plots_the_summary_rows(summary):
    figure = s06_output_layer.figure(typed(summary), "on")
    rows = summary["positions"][0]["output_layer"]["rows"]
    assert list(figure.data[0].y) == [row["share"] for row in rows]
    assert figure.data[0].x[0] == "'" + rows[0]["text"] + "'"
    assert list(figure.data[1].y) == [row["mu"] for row in rows]


def test_spectrum_plots_centered_below_uncentered_top(summary):
    spectrum = summary["positions"][0]["spectrum"]
    figure = explorer.spectrum(typed(summary))
    uncentered, centered = figure.data[0].y, figure.data[1].y
    assert list(centered) == spectrum["eigenvalues"]  # all positive here: none held at the log floor
    assert list(uncentered) == spectrum["uncentered_eigenvalues"]
    assert centered[0] < uncentered[0]  # centering lowers the top eigenvalue
    assert len(centered) == summary["model"]["d_model"]


def test_slide_7_draws_the_explorers_spectrum_at_the_first_position(summary):
    slide = s07_hidden_directions.figure(typed(summary), "on")
    assert slide.to_plotly_json() == explorer.spectrum(typed(summary), 0).to_plotly_json()


def test_a_first_partials_pending_spectrum_is_said_not_drawn(response_summary):
    """A response's first partial reads C_mu over mu's most probable tokens: no spectrum yet, which the
    explorer's figure and slide 7 say."""
    positions = [{**position, "spectrum": None} for position in response_summary["positions"]]
    pending = typed({**response_summary, "positions": positions})
    for figure in (explorer.spectrum(pending, 1), s07_hidden_directions.figure(pending, "on")):
        assert figure.data == () and "next partial result" in figure.layout.annotations[0].text
    assert s07_hidden_directions.reading(pending, "on") == explorer.SPECTRUM_PENDING


def test_response_figures_say_what_is_missing_without_a_continuation(response_summary):
    summary = response_summary
    prefix_only = typed({**summary, "response": None})
    for slide in (s04_along_response, s08_mean_shift, s09_chi2):
        figure = slide.figure(prefix_only, "on")
        assert figure.data == ()
        assert "continuation" in figure.layout.annotations[0].text
    figure = s04_along_response.figure(typed(summary), "on")
    assert list(figure.data[1].y) == summary["response"]["fisher_running"]


def test_mean_shift_stack_adds_to_uncentered(summary):
    figure = s05_centered_score.figure(typed(summary), "on")
    for fisher, shift, layer in zip(figure.data[0].y, figure.data[1].y, summary["layers"], strict=True):
        # the engine accumulates in float32: the identity holds to float32 precision
        assert fisher + shift == pytest.approx(layer["totals"]["uncentered"], rel=1e-5)


def test_csv_has_one_line_per_tensor(summary):
    text = exports.tensor_totals_csv(typed(summary))
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
    figure = explorer.heatmap(tensor_view(pooled, "model.layers.0.mlp.down_proj.weight"))
    assert [list(row) for row in figure.data[0].z] == pooled["values"]


def test_token_labels_are_unique_when_texts_collide():
    tokens = [TokenText(id=5, text="\ufffd"), TokenText(id=9, text="\ufffd"), TokenText(id=3, text=" tea")]
    assert plots.unique_token_labels(tokens) == ["'\ufffd' #5", "'\ufffd' #9", "' tea'"]
    repeated = [TokenText(id=3, text=" tea"), TokenText(id=3, text=" tea")]
    assert len(set(plots.unique_token_labels(repeated))) == 2


def with_colliding_texts(summary: dict, count: int = 4) -> dict:
    """The summary with its first `count` top tokens decoding to U+FFFD (byte pieces), everywhere listed."""
    changed = json.loads(json.dumps(summary))
    ids = {token["id"] for token in changed["positions"][0]["p"]["top"][:count]}
    position = changed["positions"][0]
    for token in position["p"]["top"] + position["output_layer"]["rows"]:
        if token["id"] in ids:
            token["text"] = "\ufffd"
    return changed


def test_every_token_axis_keeps_one_bar_per_token():
    """Tokens that decode to the same text (byte pieces shown as U+FFFD): no bar may merge with another.

    The tiny-random tokenizer now decodes its byte tokens as distinct escapes, so the collisions are
    made here, on the engine's own summary.
    """
    engine_summary = json.loads((FIXTURES / "summary_tiny_random.json").read_text())
    summary = with_colliding_texts(engine_summary)
    top = summary["positions"][0]["p"]["top"]
    assert len({token["text"] for token in top}) < len(top)  # the summary does have collisions
    for source in (engine_summary, summary):
        for figure in (
            explorer.next_token(typed(source)),
            s06_output_layer.figure(typed(source), "on"),
            s10_not_a_defect.figure(typed(source), "on"),
            s02_gradient_covariance.figure(typed(source), "on"),
        ):
            for trace in figure.data:
                if trace.x is not None and trace.xaxis in (None, "x"):
                    assert len(set(trace.x)) == len(trace.x), (figure.layout.title, trace.name)


def test_response_view_follows_the_toggle(response_summary):
    response = response_summary["response"]
    centered = explorer.response_view(typed(response_summary), "on")
    uncentered = explorer.response_view(typed(response_summary), "off")
    assert list(centered.data[0].y) == response["fisher_total"]
    assert list(centered.data[1].y) == response["fisher_running"]
    assert list(uncentered.data[0].y) == response["uncentered_total"]
    assert list(centered.data[2].y) == response["p_target"]
    assert list(centered.data[3].y) == response["chi2"]


def with_chi2(summary: dict, chi2: list[float]) -> dict:
    """The summary with its response's chi^2 replaced (and its running log(1 + chi^2) recomputed)."""
    changed = json.loads(json.dumps(summary))
    changed["tokens"]["continuation"] = [{"id": t, "text": f" w{t}"} for t in range(len(chi2))]
    changed["response"].update(
        chi2=chi2,
        T=len(chi2),
        log_one_plus_chi2_cum=list(itertools.accumulate(math.log1p(value) for value in chi2)),
    )
    return changed


def check_chi2_axes(figure, chi2: list[float]) -> None:
    """Each axis spans whole decades, is labelled at whole decades and holds every point drawn on it."""
    left, right = figure.layout.yaxis, figure.layout.yaxis2
    assert left.type == "log" and left.tickmode == right.tickmode == "array"  # never Plotly's 'sync'
    for axis, exponents in ((left, [math.log10(value) for value in left.tickvals]), (right, right.tickvals)):
        low, high = axis.range
        assert float(low).is_integer() and float(high).is_integer()
        assert all(k == pytest.approx(round(k)) and low <= k <= high for k in exponents)
        assert 2 <= len(exponents) <= 11
        assert all("e+" not in label for label in axis.ticktext)
    low, high = left.range
    assert all(low < math.log10(value) < high for value in chi2 if value > 0)
    low, high = right.range
    for trace in figure.data[1:]:
        assert all(low <= y < high for y in trace.y), trace.name


def test_chi2_growth_plots_the_response_in_whole_decades(response_summary):
    response = response_summary["response"]
    figure = s09_chi2.figure(typed(response_summary), "on")
    assert list(figure.data[0].y) == response["chi2"]
    # the running sum of log(1 + chi^2_t), in decades of 1 + chi^2(D || pi)
    assert [y * math.log(10) for y in figure.data[1].y] == pytest.approx(response["log_one_plus_chi2_cum"])
    assert figure.data[1].y[-1] == pytest.approx(math.log10(1 + response["chi2"][-1]) + figure.data[1].y[-2])
    check_chi2_axes(figure, response["chi2"])
    # chi^2_t up to 1.3e4 and 1 + chi^2 up to 2.1e5: one shared range, so the decades line up
    assert list(figure.layout.yaxis.range) == list(figure.layout.yaxis2.range) == [0, 6]
    assert list(figure.layout.yaxis.ticktext[:3]) == ["1", "10", "10<sup>2</sup>"]


@pytest.mark.parametrize(
    "chi2",
    [
        [0.25, 0.004, 3.0],  # p(y_t) > 1/2: chi^2_t below 1 opens decades under 1
        [0.0, 1.0, 10.0],  # p(y_t) = 1 (no bar on a log axis) and values on whole decades
        [1.2e4] * 300,  # a long response: about 1,200 decades on the right, labelled every 200
    ],
)
def test_chi2_growth_axes_hold_every_point(response_summary, chi2):
    figure = s09_chi2.figure(typed(with_chi2(response_summary, chi2)), "on")
    check_chi2_axes(figure, chi2)
    if len(chi2) == 300:  # a shared range would flatten the bars: each axis keeps its own
        top = math.floor(300 * math.log10(1 + 1.2e4)) + 1  # 1 + chi^2 = 12001^300: 1,224 decades
        assert list(figure.layout.yaxis.range) == [0, 5] and list(figure.layout.yaxis2.range) == [0, top]


def test_data_sampler_response_says_the_fisher_under_mu_is_zero(data_summary):
    figure = s04_along_response.figure(typed(data_summary), "on")
    assert figure.data == () and "one-hot" in figure.layout.annotations[0].text
    shifted = s04_along_response.figure(typed(data_summary), "off")
    assert list(shifted.data[0].y) == data_summary["response"]["uncentered_total"]
    assert "one-hot" in explorer.spectrum(typed(data_summary)).layout.annotations[0].text


def test_spectrum_marks_numerical_rank_and_rank_bound(summary):
    spectrum = summary["positions"][0]["spectrum"]
    figure = explorer.spectrum(typed(summary))
    texts = " ".join(shape.text for shape in figure.layout.annotations)
    assert f"numerical rank {spectrum['numerical_rank']}" in texts
    assert f"{spectrum['rank_bound']:,}" in figure.layout.title.text
    truncated = json.loads(json.dumps(summary))
    truncated["positions"][0]["spectrum"]["rank_bound"] = 19  # as with top-k = 20
    texts = " ".join(shape.text for shape in explorer.spectrum(typed(truncated)).layout.annotations)
    assert "rank bound n − 1 = 19" in texts


def test_layer_bars_open_that_layers_tensors(summary):
    figure = explorer.layer_mass(typed(summary), "on")
    assert [row[0] for row in figure.data[0].customdata] == [str(row["layer"]) for row in summary["layers"]]
    names = explorer.tensors_of_layer(typed(summary), "0", "fisher")
    assert names and all(".layers.0." in name for name in names)
    by_name = {tensor["name"]: tensor for tensor in summary["tensors"]}
    matrices = [name for name in names if len(by_name[name]["shape"]) == 2]
    assert names[: len(matrices)] == matrices  # matrices first, then the norm vectors
    fisher = [by_name[name]["totals"]["fisher"] for name in matrices]
    assert fisher == sorted(fisher, reverse=True)


# --- the compare panel: two analyses of the same parameters side by side ---------------------------


@pytest.fixture(scope="module")
def compared(summary, response_summary) -> dict:
    """GET /compare's answer for A = the T = 0.7 prefix, B = the on-policy response, as the API forms
    its per-tensor part (backend.compare.tensor_pairs); the sets are a plausible set comparison."""
    from backend.compare import tensor_pairs

    qs = [0.001, 0.01, 0.05, 0.1]
    return {
        "a": "a" * 64,
        "b": "b" * 64,
        "sets": {
            "q": qs,
            "overlap": [0.62, 0.71, 0.8, 0.85],
            "jaccard": [0.45, 0.55, 0.67, 0.74],
            "chance_overlap": qs,
            "chance_jaccard": [q / (2 - q) for q in qs],
        },
        "tensors": tensor_pairs(summary, response_summary),
    }


def test_compare_labels_name_what_differs(summary, response_summary):
    label_a, label_b = compare_figures.side_labels(typed(summary), typed(response_summary))
    assert label_a == "A: temperature 0.7" and label_b == "B: temperature 1"
    assert compare_figures.side_labels(typed(summary), typed(summary)) == ("A", "B (the same analysis as A)")


@pytest.mark.parametrize("centering", ["on", "off", "raw"])
def test_compare_scatter_plots_both_totals_of_every_tensor(compared, centering):
    stat = CENTERING_STAT[centering]
    figure = compare_figures.tensor_scatter(ComparePublic.model_validate(compared), stat, ("A", "B"))
    plotted = {}
    for trace in figure.data:
        if trace.customdata is not None:
            plotted.update(
                {name: (x, y) for name, x, y in zip(trace.customdata, trace.x, trace.y, strict=True)}
            )
    expected = {t["name"]: (t["a"][stat], t["b"][stat]) for t in compared["tensors"] if t["a"][stat] > 0}
    assert plotted == expected
    line = next(trace for trace in figure.data if trace.name == "y = x")
    assert list(line.x) == list(line.y) and line.x[0] == min(min(v) for v in expected.values())
    assert figure.layout.xaxis.type == "log" and figure.layout.yaxis.type == "log"


def test_compare_scatter_counts_the_tensors_a_log_axis_cannot_hold(compared):
    with_zero = json.loads(json.dumps(compared))
    with_zero["tensors"][0]["b"]["fisher"] = 0.0
    figure = compare_figures.tensor_scatter(ComparePublic.model_validate(with_zero), "fisher", ("A", "B"))
    assert "(1 tensors with a 0 left out)" in figure.layout.title.text.replace("<br>", " ")
    assert with_zero["tensors"][0]["name"] not in {
        n for t in figure.data if t.customdata is not None for n in t.customdata
    }


def test_compare_sets_are_drawn_beside_chance(compared):
    sets = compared["sets"]
    figure = compare_figures.sets_figure(SetComparison.model_validate(sets))
    by_name = {trace.name: list(trace.y) for trace in figure.data}
    assert by_name["overlap |A∩B| / |A|"] == sets["overlap"]
    assert by_name["Jaccard |A∩B| / |A∪B|"] == sets["jaccard"]
    assert by_name["chance overlap = q"] == sets["q"]
    assert by_name["chance Jaccard = q/(2−q)"] == sets["chance_jaccard"]
    low, high = figure.layout.yaxis.range
    assert 10**low < min(sets["chance_jaccard"]) and 10**high > 1  # every bar and chance mark inside


def test_compare_next_tokens_side_by_side(summary, response_summary):
    figure = compare_figures.next_tokens(
        typed(summary).positions[0],
        typed(response_summary).positions[0],
        ("A: temperature 0.7", "B: temperature 1"),
    )
    mu = {trace.name: list(trace.y) for trace in figure.data if trace.name.startswith("μ")}
    top_a = summary["positions"][0]["p"]["top"][: compare_figures.TOP_TOKENS]
    top_b = response_summary["positions"][0]["p"]["top"][: compare_figures.TOP_TOKENS]
    assert mu == {"μ (sampler) of A": [t["mu"] for t in top_a], "μ (sampler) of B": [t["mu"] for t in top_b]}
    assert [a.text for a in figure.layout.annotations] == ["A: temperature 0.7", "B: temperature 1"]


def test_compare_difference_heatmap_is_b_minus_a():
    pooled_a = {"shape": [2, 2], "row_edges": [0, 3, 6], "col_edges": [0, 4, 8], "values": [[1, 2], [3, 4]]}
    pooled_b = {**pooled_a, "values": [[2, 2], [1, 8]]}
    figure = compare_figures.difference_heatmap(tensor_view(pooled_a, "w"), tensor_view(pooled_b, "w"))
    assert [list(row) for row in figure.data[0].z] == [[1, 0], [-2, 4]]
    assert figure.data[0].zmid == 0
    other_grid = {**pooled_b, "row_edges": [0, 2, 6]}
    assert (
        "different block grids"
        in compare_figures.difference_heatmap(tensor_view(pooled_a, "w"), tensor_view(other_grid, "w"))
        .layout.annotations[0]
        .text
    )
    same = compare_figures.difference_heatmap(tensor_view(pooled_a, "w"), tensor_view(pooled_a, "w"))
    assert "the same in A and B" in same.layout.annotations[0].text


def test_compare_opens_the_matrix_that_changed_most(compared):
    changes = {t["name"]: abs(t["b"]["fisher"] - t["a"]["fisher"]) for t in compared["tensors"]}
    matrices = [name for name in changes if "proj" in name]
    assert compare_figures.largest_change(ComparePublic.model_validate(compared), matrices, "fisher") == max(
        matrices, key=changes.get
    )


def test_compare_reading_quotes_the_top_1_percent_sets(compared):
    sentence = compare_figures.reading(
        ComparePublic.model_validate(compared), ("A: temperature 0.7", "B: temperature 1")
    )
    assert sentence.startswith("A: temperature 0.7 against B: temperature 1.")
    assert "overlap by 71% (chance 1%), Jaccard 55% (chance 0.5%)" in sentence


def test_compare_csv_holds_the_tensor_and_set_tables(compared):
    text = exports.compare_csv(
        ComparePublic.model_validate(compared), ("A: temperature 0.7", "B: temperature 1")
    )
    tensor_part, set_part = text.split("\n\n")
    tensor_rows = list(csv.DictReader(line for line in tensor_part.splitlines() if not line.startswith("#")))
    assert [row["name"] for row in tensor_rows] == [t["name"] for t in compared["tensors"]]
    first = compared["tensors"][0]
    assert float(tensor_rows[0]["a_fisher"]) == first["a"]["fisher"]
    assert float(tensor_rows[0]["b_raw"]) == first["b"]["raw"]
    set_rows = list(csv.DictReader(line for line in set_part.splitlines() if not line.startswith("#")))
    assert [float(row["q"]) for row in set_rows] == compared["sets"]["q"]
    assert [float(row["overlap"]) for row in set_rows] == compared["sets"]["overlap"]
    assert [float(row["chance_jaccard"]) for row in set_rows] == compared["sets"]["chance_jaccard"]
    assert compared["a"] in text.splitlines()[0] and compared["b"] in text.splitlines()[0]


def test_long_messages_are_wrapped_at_spaces():
    message = "the top-q sets of this analysis are not on disk yet (written right after the analysis); retry"
    text = plots.message_figure(message).layout.annotations[0].text
    assert text.replace("<br>", " ") == message and all(len(line) <= 64 for line in text.split("<br>"))


def test_response_positions_are_labelled_by_position_and_token(response_summary):
    """The position makes a label unique: a repeated token reads as itself, a byte piece keeps its id."""
    summary = json.loads(json.dumps(response_summary))
    tokens = [
        {"id": 30, "text": "."},
        {"id": 2306, "text": " She"},
        {"id": 30, "text": "."},
        {"id": 7, "text": "\ufffd"},
    ]
    summary["tokens"]["continuation"] = tokens
    assert plots.response_labels(typed(summary)) == ["1: '.'", "2: ' She'", "3: '.'", "4: '\ufffd' #7"]


def test_short_log_axes_are_labelled_at_1_2_5_and_long_ones_at_decades():
    assert plots.log_tickvals([1.1e3, 4.6e3, 3.7e4]) == [m * 10.0**k for k in (3, 4, 5) for m in (1, 2, 5)]
    assert plots.log_tickvals([1e-8, 1e3]) == [10.0**k for k in range(-8, 3, 2)]  # 11 decades: every 2nd
    assert plots.log_tickvals([0.0, math.inf]) == []  # nothing a log axis can hold


def test_mean_shift_axis_labels_every_drawn_decade(response_summary):
    figure = s08_mean_shift.figure(typed(response_summary), "on")
    drawn = [value for trace in figure.data for value in trace.y if value is not None]
    ticks = figure.layout.yaxis.tickvals
    assert min(ticks) <= min(drawn) and max(ticks) >= max(drawn)


def test_mismatch_slide_marks_every_shifted_row_by_its_shift(summary):
    """The x markers sit at |mu - p| ||h|| (sqrt of row_shift_sq), only on rows the sampler shifts."""
    figure = s10_not_a_defect.figure(typed(summary), "on")
    shifted = sorted(
        (t for t in summary["positions"][0]["p"]["top"] if t["p"] > 0 and t["row_shift_sq"] > 0),
        key=lambda t: t["p"],
    )
    assert list(figure.data[2].x) == [t["p"] for t in shifted]
    for token, y in zip(shifted, figure.data[2].y, strict=True):
        assert math.isclose(y, math.sqrt(token["row_shift_sq"]), rel_tol=1e-12)


def test_spectrum_marks_keep_their_labels_inside_the_plot(summary):
    """A rank far left of d is labelled to the right of its mark, one near d to the left."""
    spec = summary["positions"][0]["spectrum"]
    d = len(spec["eigenvalues"])
    for rank, side in ((3, "right"), (d - 2, "left")):
        position = {**summary["positions"][0], "spectrum": {**spec, "numerical_rank": rank}}
        figure = explorer.position_spectrum(PositionSummary.model_validate(position), 0)
        label = next(a for a in figure.layout.annotations if a.text.startswith("numerical rank"))
        assert label.xanchor == ("left" if side == "right" else "right")


# --- shares and bounds as printed; what is shown against what the controls say ----------------------


@given(st.floats(min_value=0, max_value=1, allow_nan=False))
def test_a_positive_share_never_prints_as_zero_nor_a_partial_one_as_whole(share):
    text = numbers.percent(share)
    assert (text == "0%") == (share == 0)
    assert (text == "100%") == (share == 1)


@given(
    st.floats(min_value=0, max_value=1e6, allow_nan=False),
    st.floats(min_value=0, max_value=1e6, allow_nan=False),
    st.booleans(),
)
def test_a_bound_never_prints_below_the_value_it_bounds(a, b, as_percent):
    value, bound = min(a, b), max(a, b)
    if as_percent:
        value, bound = value / 1e6, bound / 1e6
    value_text, bound_text = numbers.value_and_bound(value, bound, as_percent=as_percent)

    def read(text: str) -> float:
        return float(text.strip("<>%"))

    assert read(value_text) <= read(bound_text), (value, bound, value_text, bound_text)


def test_shares_print_with_two_significant_figures():
    assert [numbers.percent(s) for s in (0.00042, 0.031, 0.42, 0.999, 1e-9)] == [
        "0.042%",
        "3.1%",
        "42%",
        "99.9%",
        "<0.0001%",
    ]
    assert numbers.value_and_bound(0.1235, 0.1236) == ("12%", "13%")


def test_the_banner_names_what_differs_between_the_drawing_and_the_controls():
    drawn = DashboardState(model="smollm2-135m", prefix="She drank a cup of")
    edited = replace(drawn, model="tiny-random", centering="off", slide=4)
    assert shown.differing(drawn, drawn) == []
    assert shown.differing(drawn, edited) == ["model"]  # slide and centering are the view, not the analysis
    assert "smollm2-135m" in shown.describe(drawn) and "'She drank a cup of'" in shown.describe(drawn)
    link = parse_query(shown.link_query(shown.analysis_query(drawn), 3, "raw"))[0]
    assert (link.model, link.prefix, link.slide, link.centering) == ("smollm2-135m", drawn.prefix, 3, "raw")


def test_a_drawing_is_stale_while_a_newer_analysis_computes_or_after_a_failure():
    view = handles.view_of({"id": "a", "status": "done", "query": "?model=x"})
    assert view == {"id": "a", "kept_share": None, "query": "?model=x"}
    assert not handles.is_stale({"id": "a", "status": "done"}, view)
    assert handles.is_stale({"id": "b", "status": "running"}, view)
    assert handles.is_stale(handles.refused("no such model"), view)
    assert not handles.is_stale({"id": "a", "status": "running", "kept_share": 0.5}, view)  # a partial
    assert not handles.is_stale({"id": "b", "status": "queued"}, None)  # nothing drawn to grey


def test_vocabulary_rows_are_named_by_their_tokens(summary):
    known = plots.vocabulary(typed(summary))
    prefix = summary["tokens"]["prefix"]
    assert all(known[token["id"]] == token["text"] for token in prefix)
    embedding = next(t for t in summary["tensors"] if plots.is_vocabulary_sized(t["shape"], typed(summary)))
    row = prefix[0]["id"]
    assert explorer_callbacks.coordinate([row, 7], embedding["shape"], typed(summary), known) == (
        f"{plots.token_label(prefix[0]['text'])}, col 7"
    )
    assert explorer_callbacks.coordinate([3, 7], [64, 64], typed(summary), known) == "[3, 7]"
    pooled = {
        "shape": [3, 1],
        "row_edges": [0, row, row + 1, embedding["shape"][0]],
        "col_edges": [0, embedding["shape"][1]],
        "values": [[1.0], [2.0], [0.5]],
    }
    figure = explorer.heatmap(tensor_view(pooled, embedding["name"]), known)
    assert plots.token_label(prefix[0]["text"]) in figure.data[0].customdata[1][0]
    assert plots.token_label(prefix[0]["text"]) in figure.layout.yaxis.ticktext
    # a block holding no token the summary knows is named by its first row's token (the API's row_tokens)
    only = {row: known[row]}
    assert (
        explorer.heatmap(tensor_view(pooled, embedding["name"]), only).data[0].customdata[2][0]
        == "none known"
    )
    with_first = {**pooled, "row_tokens": ["!", " Paris", " tent"]}
    named = explorer.heatmap(tensor_view(with_first, embedding["name"]), only)
    assert named.data[0].customdata[2][0] == f"from {plots.token_label(' tent')}"
    assert list(named.layout.yaxis.ticktext) == [plots.token_label(known[row])]  # ticks: known tokens only


def test_every_layer_is_labelled(summary):
    figure = explorer.layer_mass(typed(summary), "on")
    assert (figure.layout.xaxis.tickmode, figure.layout.xaxis.dtick) == ("linear", 1)


def test_the_vocabulary_takes_the_rows_the_api_names(summary):
    named = {
        "tokens": {"prefix": [{"id": 1, "text": "She"}], "continuation": []},
        "vocabulary": {"7042": " Paris", "1": "x"},
    }
    summary = AnalysisOverview.model_validate({**summary, **named, "positions": [], "position_index": []})
    assert plots.vocabulary(summary) == {1: "She", 7042: " Paris"}  # the summary's own text first
