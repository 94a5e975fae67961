"""The engine glue on the shipped tiny-random model: summaries, progress, pooled views, files."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from backend.schemas import AnalysisJob
from backend.settings import Settings
from backend.store import Store
from backend.vocabulary import STATS, EngineKind, Sampler, SamplerKind
from workers.fisher.directions import first_chunk_directions
from workers.jobs import analyze_job


def run_analysis(loaded, job: AnalysisJob, progress=None):
    """The worker's own path from a job to an analysis, at the configured settings."""
    return analyze_job(loaded, job, Settings(), progress)


def _job(loaded, prefix="She drank a cup of", continuation="", **kwargs) -> AnalysisJob:
    ids = loaded.tokenizer.encode(prefix).ids
    cont = loaded.tokenizer.encode(continuation, add_special_tokens=False).ids if continuation else []
    return AnalysisJob(
        model=loaded.id, weights_digest=loaded.info.digest, input_ids=ids, continuation_ids=cont, **kwargs
    )


def _token(loaded, text: str) -> int:
    (token,) = loaded.tokenizer.encode(text, add_special_tokens=False).ids
    return token


def test_progress_is_monotone_and_complete(tiny_random):
    seen: list[tuple[str, float]] = []
    run_analysis(tiny_random, _job(tiny_random), lambda stage, fraction: seen.append((stage, fraction)))
    fractions = [f for _, f in seen]
    assert fractions == sorted(fractions)
    assert fractions[-1] == 1.0
    assert [s for s, _ in seen][0] == "forward" and {"directions", "summary"} <= {s for s, _ in seen}


def test_summary_numbers_agree_with_the_arrays(tiny_random):
    reward = {str(_token(tiny_random, " tea")): 1.0, str(_token(tiny_random, " coffee")): -1.0}
    analysis = run_analysis(tiny_random, _job(tiny_random, sampler=Sampler(temperature=0.7), reward=reward))
    summary = analysis.summary
    for stat in ("fisher", "uncentered", "raw"):
        arrays = analysis.per_parameter(stat)
        assert summary["totals"][stat] == pytest.approx(
            sum(float(v.double().sum()) for v in arrays.values()), rel=1e-5
        )
        for entry in summary["tensors"]:
            assert entry["totals"][stat] == pytest.approx(
                float(arrays[entry["name"]].double().sum()), rel=1e-5, abs=1e-9
            )
    assert sum(k["numel"] for k in summary["kinds"]) == tiny_random.info.n_params
    assert {t["name"] for t in summary["tensors"]} == {n for n, _ in tiny_random.model.named_parameters()}
    # the top coordinate really is the largest Fisher value
    top = summary["top_coordinates"]["fisher"][0]
    fisher = analysis.per_parameter("fisher")
    assert top["value"] == pytest.approx(max(float(v.max()) for v in fisher.values()))
    assert float(fisher[top["tensor"]][tuple(top["index"])]) == pytest.approx(top["value"])
    # a signed stat's top coordinates are the largest by magnitude, with their sign
    shift = analysis.per_parameter("mean_shift")
    magnitudes = sorted((abs(float(x)) for v in shift.values() for x in v.reshape(-1)), reverse=True)
    tops = summary["top_coordinates"]["mean_shift"]
    assert [abs(t["value"]) for t in tops] == pytest.approx(magnitudes[: len(tops)])
    assert all(float(shift[t["tensor"]][tuple(t["index"])]) == pytest.approx(t["value"]) for t in tops)
    # concentration: the named shares are exact top-k sums
    flat = torch.cat([v.reshape(-1).double() for v in fisher.values()])
    k = math.ceil(0.01 * flat.numel())
    assert summary["concentration"]["fisher"]["at"]["0.01"] == pytest.approx(
        float(torch.topk(flat, k).values.sum() / flat.sum()), rel=1e-5
    )
    # overlap: the top-q sets by Fisher and by |policy gradient|, counted directly
    gradient = torch.cat(
        [v.reshape(-1).double().abs() for v in analysis.per_parameter("policy_grad").values()]
    )
    overlap = summary["overlap"]
    assert overlap["baseline"] == overlap["q"]
    for q, share in zip(overlap["q"], overlap["fisher_vs_policy_grad"], strict=True):
        k = math.ceil(q * flat.numel())
        by_fisher = set(torch.topk(flat, k).indices.tolist())
        by_gradient = set(torch.topk(gradient, k).indices.tolist())
        assert share == len(by_fisher & by_gradient) / k
    position = summary["positions"][0]
    assert position["reward"]["std"] > 0
    # V = 512 rows in general position: the rank is d_model, below the bound n - 1 = 511
    assert position["spectrum"]["numerical_rank"] == tiny_random.info.d_model
    assert position["spectrum"]["rank_bound"] == tiny_random.info.vocab_size - 1
    shift = analysis.per_parameter("mean_shift")
    assert summary["totals"]["mean_shift_sq"] == pytest.approx(
        sum(float(v.double().square().sum()) for v in shift.values()), rel=1e-5
    )


def test_output_layer_rows_and_their_bound_follow_from_h_and_mu(tiny_random):
    """Part 2, section 1, recomputed from the model's own forward: rows h^2 mu (1 - mu), exact shares."""
    job = _job(tiny_random, sampler=Sampler(temperature=0.7))
    output = run_analysis(tiny_random, job).summary["positions"][0]["output_layer"]
    with torch.no_grad():
        out = tiny_random.model(torch.tensor([job.input_ids]), output_hidden_states=True)
    h = out.hidden_states[-1][0, -1].double()
    mu = torch.softmax(out.logits[0, -1].double() / 0.7, -1)
    h_sq = float(h.square().sum())
    assert output["h_norm_sq"] == pytest.approx(h_sq, rel=1e-6)
    assert output["total"] == pytest.approx(h_sq * (1 - float(mu.square().sum())), rel=1e-6)
    assert output["logit_map"] is False
    order = torch.argsort(mu, descending=True)
    for entry in output["concentration_bound"]:
        inside = order[: entry["top_tokens"]]
        kept = float((mu[inside] * (1 - mu[inside])).sum()) / (1 - float(mu.square().sum()))
        assert entry["share_outside"] == pytest.approx(1 - kept, rel=1e-6, abs=1e-9)
        assert entry["bound"] == pytest.approx(
            float(1 - mu[inside].sum()) / (1 - float(mu.square().sum())), rel=1e-6
        )
        assert entry["share_outside"] <= entry["bound"]


def test_pooled_views_add_up_to_tensor_totals(tiny_random):
    analysis = run_analysis(tiny_random, _job(tiny_random))
    pooled = analysis.pooled(max_rows=16, max_cols=8)
    totals = {t["name"]: t["totals"] for t in analysis.summary["tensors"]}
    for name, view in pooled["fisher"].items():
        assert view["shape"][0] <= 16 and view["shape"][1] <= 8
        assert float(view["values"].sum()) == pytest.approx(totals[name]["fisher"], rel=1e-5, abs=1e-9)
    assert pooled["uncentered"] is pooled["fisher"]  # on-policy: equal by construction, shared
    assert all(float(v["values"].sum()) == 0 for v in pooled["mean_shift"].values())
    # the size the worker picks its grid by, before pooling, is what the store is sent
    assert analysis.pooled_bytes(16, 8) == Store.encoded_size(pooled)


@pytest.mark.parametrize(
    "sampler",
    [
        Sampler(engine=EngineKind.bf16),
        Sampler(kind=SamplerKind.uniform),
        Sampler(kind=SamplerKind.data),
        Sampler(top_p=0.5),
    ],
    ids=["bf16", "uniform", "data", "top_p"],
)
def test_every_sampler_along_a_response(tiny_random, sampler, tmp_path):
    job = _job(tiny_random, prefix="She drank", continuation=" a cup of tea", sampler=sampler, rho=True)
    analysis = run_analysis(tiny_random, job)
    response = analysis.summary["response"]
    assert response["T"] == len(job.continuation_ids) == len(analysis.summary["positions"])
    assert response["fisher_running"][-1] == pytest.approx(sum(response["fisher_total"]))
    for chi2, p in zip(response["chi2"], response["p_target"], strict=True):
        assert chi2 == pytest.approx(1 / p - 1)
    if sampler.kind == "data":
        assert response["sft_identity"]["relative_error"] < 1e-4
        assert analysis.summary["totals"]["fisher"] == 0.0  # one-hot mu: nothing varies
    path = tmp_path / "arrays.safetensors"
    analysis.save(path)
    arrays = load_file(str(path))
    names = dict(tiny_random.model.named_parameters())
    for stat in STATS:
        for name, param in names.items():
            assert arrays[f"{stat}/{name}"].shape == param.shape
            assert arrays[f"{stat}/{name}"].dtype == torch.float32
    assert arrays["input_ids"].tolist() == job.input_ids
    assert arrays["continuation_ids"].tolist() == job.continuation_ids


def test_bf16_engine_shifts_the_mean(tiny_random):
    analysis = run_analysis(tiny_random, _job(tiny_random, sampler=Sampler(engine=EngineKind.bf16)))
    position = analysis.summary["positions"][0]
    gaps = [abs(t["p"] - t["mu"]) for t in position["p"]["top"]]
    assert max(gaps) > 0  # bf16 logits differ from float32 ones
    assert analysis.summary["totals"]["mean_shift_sq"] > 0
    assert analysis.summary["totals"]["uncentered"] == pytest.approx(
        analysis.summary["totals"]["fisher"] + analysis.summary["totals"]["mean_shift_sq"], rel=1e-6
    )


def test_truncated_and_monte_carlo_report_their_method(tiny_random):
    summary = run_analysis(tiny_random, _job(tiny_random, method="truncated:0.5")).summary
    truncated = summary["method"]
    eigenvalues = summary["positions"][0]["spectrum"]["eigenvalues"]
    kept = sum(eigenvalues[: truncated["directions"]]) / sum(eigenvalues)
    assert truncated["name"] == "truncated" and truncated["kept_share"] == pytest.approx(kept, rel=1e-9)
    # the fewest directions whose eigenvalues reach half the trace
    assert sum(eigenvalues[: truncated["directions"] - 1]) / sum(eigenvalues) < 0.5 <= truncated["kept_share"]
    assert truncated["missing_estimate"] == pytest.approx((1 - kept) / kept, rel=1e-9)
    mc = run_analysis(tiny_random, _job(tiny_random, method="mc:32")).summary["method"]
    assert mc["name"] == "mc" and mc["samples"] == 32 and mc["directions"] == 32


def test_partial_results_come_after_the_first_chunk_and_bound_the_exact_ones(tiny_random):
    """Directions run in descending eigenvalue order: the first partial is the truncated result."""
    partials: list[tuple[dict, float]] = []
    job = _job(tiny_random, sampler=Sampler(temperature=0.7))
    final = analyze_job(tiny_random, job, Settings(), on_partial=lambda s, k: partials.append((s, k))).summary
    assert len(partials) == 1
    summary, kept = partials[0]
    eigenvalues = final["positions"][0]["spectrum"]["eigenvalues"]
    first = first_chunk_directions(len(job.input_ids))  # the first chunk's square directions
    assert kept == pytest.approx(sum(eigenvalues[:first]) / sum(eigenvalues), rel=1e-6)
    assert summary["concentration"] is None and summary["top_coordinates"] is None
    assert summary["positions"][0]["p"] == final["positions"][0]["p"]  # p, mu and the rows: exact at once
    layout_head = {t["name"] for t in final["tensors"] if t["kind"] in ("head", "embedding")}
    partial_totals = {t["name"]: t["totals"] for t in summary["tensors"]}
    for tensor in final["tensors"]:
        got = partial_totals[tensor["name"]]
        # first moments are complete after the first chunk; the Fisher is a lower bound off the tied table
        assert got["mean_shift_sq"] == pytest.approx(tensor["totals"]["mean_shift_sq"], rel=1e-5, abs=1e-12)
        if tensor["name"] not in layout_head:
            assert got["fisher"] <= tensor["totals"]["fisher"] * (1 + 1e-6) + 1e-12


@pytest.mark.parametrize("sampler", [Sampler(), Sampler(temperature=0.7)])
def test_a_light_summary_has_the_full_summarys_totals(tiny_random, sampler):
    """A partial result's totals are the final ones' definition: the same numbers from the same sums
    (on- and off-policy, where the uncentered and raw Fisher have their own terms)."""
    from workers.engine import CURVE_STATS
    from workers.fisher.model_summary import model_summary
    from workers.fisher.position import HeadLayout

    sums = run_analysis(tiny_random, _job(tiny_random, sampler=sampler)).sequence.sums
    layout = HeadLayout.of(tiny_random.model)
    full, light = (
        model_summary(sums, layout.head_name, layout.embedding_name, CURVE_STATS, light=light)
        for light in (False, True)
    )
    assert light["concentration"] is None and light["top_coordinates"] is None
    assert light["totals"] == full["totals"]
    assert all(t["concentration"] is None for t in light["tensors"])  # a full summary's second pass

    def without_concentration(tensors: list[dict]) -> list[dict]:
        return [{k: v for k, v in t.items() if k != "concentration"} for t in tensors]

    assert without_concentration(light["tensors"]) == without_concentration(full["tensors"])
    assert light["layers"] == full["layers"] and light["kinds"] == full["kinds"]


def test_a_one_token_response_has_no_partial_results_and_a_one_hot_mu_stores_no_fisher(tiny_random):
    partials: list = []
    job = _job(tiny_random, continuation=" tea", sampler=Sampler(kind=SamplerKind.data))
    analysis = analyze_job(tiny_random, job, Settings(), on_partial=lambda s, k: partials.append(k))
    assert partials == []
    assert "fisher" not in analysis.sequence.sums.sums and "bound" not in analysis.sequence.sums.sums
    assert analysis.summary["totals"]["fisher"] == 0.0
    named = analysis.summary["concentration"]["fisher"]["at"]
    assert named == {"0.001": 0.0, "0.01": 0.0, "0.05": 0.0, "0.1": 0.0}


def test_a_responses_first_partial_summary_has_every_position(tiny_random):
    """The summaries a running response gives: every position from the first, each position's kept
    share, exact positions as the exact pass finishes them (``tests/test_response_partials.py`` checks
    the numbers)."""
    partials: list[tuple[dict, float]] = []
    job = _job(tiny_random, continuation=" and a slice of cake", sampler=Sampler(temperature=0.7, top_k=50))
    analysis = analyze_job(tiny_random, job, Settings(), on_partial=lambda s, k: partials.append((s, k)))
    final = analysis.summary
    positions = len(job.continuation_ids)
    assert positions > 1 and partials
    first, kept = partials[0]
    assert len(first["positions"]) == positions and first["response"]["T"] == positions
    # the first pass takes the leading one of each position's 49 directions (top-k 50): a lower bound
    assert 0 < kept < 1 and 0 < first["method"]["kept_share"] < 1
    assert first["concentration"] is None and first["top_coordinates"] is None
    # chi^2 and the mean shift along the response need no Fisher direction: complete in the first
    assert first["response"]["chi2"] == final["response"]["chi2"]
    shift = first["response"]["shift_growth"]["accumulated_shift_sq"]
    assert shift == pytest.approx(final["response"]["shift_growth"]["accumulated_shift_sq"], rel=1e-6)
    assert [k for _, k in partials] == sorted(k for _, k in partials)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_is_summarized_by_the_compiled_loops(dtype):
    """numpy has no bfloat16: the loops read half-precision sums widened to float32 (exactly)."""
    from backend.vocabulary import Method, Sampler
    from tests.tiny_models import BUDGET, tiny_llama
    from workers.engine import CURVE_STATS
    from workers.fisher.model_summary import model_summary
    from workers.fisher.position import HeadLayout
    from workers.fisher.response import analyze_sequence
    from workers.fisher.terms import StatTerms

    model = tiny_llama(dtype=dtype)
    empty = torch.tensor([], dtype=torch.long)
    sequence = analyze_sequence(
        model,
        torch.tensor([3, 5, 7, 2]),
        empty,
        Sampler(temperature=0.8),
        Method(),
        None,
        memory_budget_bytes=BUDGET,
    )
    layout = HeadLayout.of(model)
    summary = model_summary(sequence.sums, layout.head_name, layout.embedding_name, CURVE_STATS)
    sums = sequence.sums
    fisher = sum(float(sums.stat("fisher", name).double().sum()) for name in sums.names)
    assert summary["totals"]["fisher"] == pytest.approx(fisher, rel=1e-9)
    # rho's mean from the same sums widened (float16 would flush the squares of small first moments)
    widened = [sums.rho_terms(name) for name in sums.names]
    rho = [
        float(StatTerms(t.base.float(), t.extra.float(), t.squared).extra_share().double().mean())
        for t in widened
    ]
    assert [t["totals"]["rho_mean"] for t in summary["tensors"]] == pytest.approx(rho, rel=1e-6, abs=1e-9)


def test_the_summary_in_threads_is_the_summary_in_one_thread(tiny_random):
    """Tensors are summarized in threads and combined in order: the same numbers, to the last bit."""
    from workers.engine import CURVE_STATS
    from workers.fisher.model_summary import model_summary
    from workers.fisher.position import HeadLayout

    reward = {str(_token(tiny_random, " tea")): 1.0}
    analysis = run_analysis(
        tiny_random,
        _job(tiny_random, continuation=" coffee and", sampler=Sampler(temperature=0.7), reward=reward),
    )
    layout = HeadLayout.of(tiny_random.model)

    def summary() -> dict:
        sums = analysis.sequence.sums
        return model_summary(sums, layout.head_name, layout.embedding_name, CURVE_STATS)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = summary()
        torch.set_num_threads(3)
        together = summary()
    finally:
        torch.set_num_threads(threads)
    assert together == alone
    assert alone["top_coordinates"]["fisher"] and alone["overlap"] is not None


def test_a_response_with_its_sums_in_mapped_files_has_the_same_summary(tiny_random, tmp_path):
    """``FISHERSCOPE_SUMS_MEMORY_BYTES`` 0: every sum over positions a memory-mapped file in the sums
    folder; the worker's summary (concentration, top coordinates, rho) is the one kept in memory, and
    the folder is left empty."""
    job = _job(tiny_random, continuation=" tea with milk", sampler=Sampler(temperature=0.7), rho=True)
    in_memory = analyze_job(tiny_random, job, Settings()).summary
    mapped_settings = Settings(sums_memory_bytes=0, sums_dir=tmp_path / "sums")
    mapped = analyze_job(tiny_random, job, mapped_settings).summary
    assert len(mapped["positions"]) == len(job.continuation_ids) > 1
    for key in ("totals", "tensors", "concentration", "top_coordinates", "positions"):
        assert mapped[key] == in_memory[key], key
    assert list((tmp_path / "sums").iterdir()) == []


def test_each_partials_positions_are_its_records_summaries(tiny_random, monkeypatch):
    """Position summaries are kept between partial results and made again for a replaced record: as the
    exact pass finishes positions, a partial shows their exact entries, the others their earlier ones."""
    from workers import engine

    monkeypatch.setattr(engine._Partials, "MIN_INTERVAL_S", 0.0)
    monkeypatch.setattr(engine._Partials, "COST_MULTIPLE", 0.0)
    made: list[int] = []
    summarise = engine.position_summary

    def counted(record, index, decode, reward):
        made.append(index)
        return summarise(record, index, decode, reward)

    monkeypatch.setattr(engine, "position_summary", counted)
    partials: list[dict] = []
    job = _job(tiny_random, continuation=" and a slice of cake")  # on the policy: a refining round
    analysis = analyze_job(tiny_random, job, Settings(), on_partial=lambda s, k: partials.append(s))
    final = analysis.summary["positions"]
    exact_counts = []
    for partial in partials:
        entries = partial["positions"]
        exact = [i for i, entry in enumerate(entries) if entry == final[i]]
        assert exact == list(range(len(exact)))  # positions turn exact in order, shown with their entry
        assert all(entry["kept_share"] < 1 for entry in entries[len(exact) :])
        exact_counts.append(len(exact))
    # the first pass's, the refining round's, then one after each exact position (none past 99% of the
    # trace)
    assert exact_counts == [0, 0, *range(1, len(partials) - 1)] and len(partials) > 3
    # each record summarised once for the partials (the first pass's, the round's, the exact pass's),
    # and every position once more for the result
    assert len(made) <= 4 * len(final)
