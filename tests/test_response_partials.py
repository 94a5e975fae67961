"""A response's partial results: every position in the first, refined position by position to exact.

The first partial is a pass over every position with its first moments whole and its Fisher cut to the
first chunk of directions (the largest eigenvalues of C_mu), or to none where the chunk would be a large
part of them; compared here, in float64, with a brute
force of that truncation: kappa from one backward per token, u = dh/dtheta recovered as pinv(W) kappa
(the head W has full column rank on these models), and sum_{j<k} lambda_j (v_j^T u)^2.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from backend.vocabulary import Method, MethodName, SamplerKind
from tests.tiny_models import BUDGET, tiny_llama, tiny_model
from workers.fisher import directions, response
from workers.fisher.reference import brute_force_logit_sensitivities, brute_force_moments
from workers.fisher.response import SequenceAnalysis, analyze_sequence
from workers.fisher.sampler import Sampler, warped_distribution
from workers.fisher.stats import square_total_of

pytestmark = pytest.mark.usefixtures("float64_reference")

# contexts of 6 to 9 tokens: the first chunk is 13 to 8 of the 16 directions of C_mu
PREFIX = torch.tensor([3, 5, 8, 7, 11, 4])
RESPONSE = torch.tensor([9, 4, 2, 6])


def _truncated_fisher(
    model, ids: torch.Tensor, mu: torch.Tensor, keep: int, rows: int | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The Fisher at the last position of ``ids`` cut to C_mu's ``keep`` largest eigen-directions off
    the head (whose closed form is whole; the untied head is linear, so j_a = w_a), and every exact
    moment there (``brute_force_moments``). ``rows``: of C_mu's part over mu's ``rows`` most probable
    tokens, centered at mu's whole mean."""
    logits, kappa = brute_force_logit_sensitivities(model, ids)
    head = model.get_output_embeddings().weight.detach()  # [V, d]
    covariance = head.T @ (torch.diag(mu) - torch.outer(mu, mu)) @ head
    if rows is not None:
        read = torch.topk(mu, rows).indices
        centered = head[read] - mu @ head
        covariance = centered.T @ (mu[read, None] * centered)
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
    lam, vectors = eigenvalues.flip(0)[:keep], eigenvectors.flip(1)[:, :keep]
    inverse = torch.linalg.pinv(head)  # [d, V]: u = dh/dtheta from kappa = W u
    moments = brute_force_moments(kappa, torch.softmax(logits, -1), mu, None)
    exact = moments["fisher"]
    out = {}
    for name, k in kappa.items():
        if k is kappa.get("lm_head.weight"):
            out[name] = exact[name]
            continue
        u = inverse @ k.reshape(k.shape[0], -1)  # [d, n]
        out[name] = (lam[:, None] * (vectors.T @ u).square()).sum(0).reshape(k.shape[1:])
    return out, moments


def _response_positions(model) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Each response position, its context and its mu at T 0.7."""
    full = torch.cat([PREFIX, RESPONSE])
    for t in range(RESPONSE.numel()):
        ids = full[: PREFIX.numel() + t]
        logits = model(input_ids=ids[None]).logits[0, -1].detach()
        yield t, ids, warped_distribution(logits, 0.7, None, 1.0)


def _partials(model, sampler: Sampler, rho: bool = False) -> tuple[SequenceAnalysis, list[dict]]:
    """The exact analysis and what each partial held (read before its callback returned)."""
    seen: list[dict] = []

    def on_partial(snapshot, kept_share: float) -> None:
        sequence = snapshot()
        seen.append(
            {
                "kept_share": kept_share,
                "positions": [r.moments_totals["fisher"] for r in sequence.positions],
                "kept": [r.kept_share for r in sequence.positions],
                "tensors": {t["name"]: t["totals"] for t in sequence.model_part["tensors"]},
                "model_totals": sequence.model_part["totals"],
                "mean_shift": {n: v.clone() for n, v in sequence.sums.iter_stat("mean_shift")},
                "spectra": [r.spectrum for r in sequence.positions],
                "accumulated": list(sequence.accumulated_shift_sq),
                "sft": sequence.sft_gradient,
            }
        )

    result = analyze_sequence(
        model,
        PREFIX,
        RESPONSE,
        sampler,
        Method(),
        memory_budget_bytes=BUDGET,
        on_partial=on_partial,
        fisher_under_p=rho,
    )
    return result, seen


@pytest.mark.parametrize("chunk_share", [response.FIRST_PASS_CHUNK_SHARE, 0.05])
def test_the_first_partial_is_every_positions_truncated_fisher_and_its_whole_first_moments(
    chunk_share, monkeypatch
):
    """At the default share the first pass takes each position's leading direction; at a share of 0.05,
    16 directions are too few for one: the first pass is the first moments and the head's closed form."""
    monkeypatch.setattr(response, "FIRST_PASS_CHUNK_SHARE", chunk_share)
    model = tiny_llama(tied=False)
    sampler = Sampler(temperature=0.7)
    result, seen = _partials(model, sampler)
    first = seen[0]
    assert len(first["positions"]) == RESPONSE.numel()
    full = torch.cat([PREFIX, RESPONSE])
    # per tensor: the truncated Fisher, the uncentered and raw Fisher on it (fisher + m^2, fisher +
    # kbar_mu^2), summed over positions; the summed mean shift and common component
    expected: dict[str, dict[str, float]] = {}
    shift: dict[str, torch.Tensor] = {}
    common: dict[str, torch.Tensor] = {}
    for t in range(RESPONSE.numel()):
        ids = full[: PREFIX.numel() + t]
        logits = model(input_ids=ids[None]).logits[0, -1].detach()
        keep = response.first_pass_directions(model.config.hidden_size)
        assert keep == (response.FIRST_PASS_SQUARE_DIRECTIONS if chunk_share > 0.05 else 0)
        assert keep < model.config.hidden_size  # a truncation, not the whole Fisher
        mu = warped_distribution(logits, 0.7, None, 1.0)
        position, moments = _truncated_fisher(model, ids, mu, keep)
        total = sum(float(v.sum()) for v in position.values())
        assert first["positions"][t] == pytest.approx(total, rel=1e-9)
        assert first["kept"][t] < 1.0
        for name, value in position.items():
            exact_fisher = moments["fisher"][name]
            found = {
                "fisher": value,
                "uncentered": value + moments["uncentered"][name] - exact_fisher,
                "raw": value + moments["raw"][name] - exact_fisher,
            }
            sums = expected.setdefault(name, dict.fromkeys(found, 0.0))
            for key, stat in found.items():
                sums[key] += float(stat.sum())
            shift[name] = shift.get(name, 0) + moments["mean_shift"][name]
            common[name] = common.get(name, 0) + moments["common"][name]
    for name, sums in expected.items():
        sums["mean_shift_sq"] = float(shift[name].square().sum())
        sums["common_sq"] = float(common[name].square().sum())
        found = first["tensors"][name]
        assert found["rho_mean"] is None  # a ratio per parameter: not in a first partial
        for key, value in sums.items():
            assert found[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (name, key)
    for key in ("fisher", "uncentered", "raw", "mean_shift_sq", "common_sq"):
        over_model = sum(sums[key] for sums in expected.values())
        assert first["model_totals"][key] == pytest.approx(over_model, rel=1e-9)
    # the first moments are whole at once: the mean shift and its accumulation are the exact result's
    for name, value in first["mean_shift"].items():
        torch.testing.assert_close(value, result.sums.stat("mean_shift", name), rtol=1e-12, atol=1e-14)
    assert first["accumulated"] == pytest.approx(result.accumulated_shift_sq, rel=1e-12)


@pytest.mark.parametrize("forward_directions", [response.FORWARD_DIRECTIONS, 0])
def test_the_refining_round_is_every_positions_fisher_to_ninety_percent_of_its_trace(
    forward_directions, monkeypatch
):
    """The second partial: each position's Fisher cut to the fewest leading eigen-directions of C_mu
    that carry 90% of its trace, against the float64 brute force of that truncation; from the
    response's forward, or (a forward costing nothing) each position from its own context's."""
    monkeypatch.setattr(response, "FORWARD_DIRECTIONS", forward_directions)
    model = tiny_llama(tied=False)
    _, seen = _partials(model, Sampler(temperature=0.7))
    refined = seen[1]
    head = model.get_output_embeddings().weight.detach()
    for t, ids, mu in _response_positions(model):
        eigenvalues = torch.linalg.eigvalsh(head.T @ (torch.diag(mu) - torch.outer(mu, mu)) @ head).flip(0)
        shares = torch.cumsum(eigenvalues, 0) / eigenvalues.sum()
        keep = int((shares >= response.REFINED_SHARE).nonzero()[0, 0]) + 1
        assert keep < eigenvalues.numel()
        position, _ = _truncated_fisher(model, ids, mu, keep)
        assert refined["positions"][t] == pytest.approx(
            sum(float(v.sum()) for v in position.values()), rel=1e-9
        )
        assert refined["kept"][t] == pytest.approx(float(shares[keep - 1]), rel=1e-9)


def test_refinement_is_monotone_and_ends_at_the_exact_result():
    model = tiny_llama(tied=False)
    sampler = Sampler(temperature=0.7)
    result, seen = _partials(model, sampler, rho=True)
    exact = [r.moments_totals["fisher"] for r in result.positions]
    # the first pass, its round to 90% of every position's trace, then one partial per position the
    # exact pass finishes but the last
    assert len(seen) == 2 + RESPONSE.numel() - 1
    assert min(seen[0]["kept"]) < response.REFINED_SHARE <= min(seen[1]["kept"])
    assert all(kept < 1.0 for kept in seen[1]["kept"])  # the leading directions that reach it, not all
    shares = [s["kept_share"] for s in seen]
    assert shares == sorted(shares) and shares[-1] < 1.0
    for step, partial in enumerate(seen):
        done = max(step - 1, 0)  # positions the exact pass has finished
        for t, total in enumerate(partial["positions"]):
            if t < done:
                assert total == exact[t]  # finished: the exact pass's own record
            else:
                assert total <= exact[t] * (1 + 1e-12)
        if step:
            before = seen[step - 1]["positions"]
            assert all(a <= b * (1 + 1e-12) for a, b in zip(before, partial["positions"], strict=True))
    alone = analyze_sequence(model, PREFIX, RESPONSE, sampler, Method(), memory_budget_bytes=BUDGET)
    assert result.sums.has_rho and alone.sums.has_rho
    assert result.directions == alone.directions  # the round's, taken over by the exact pass, count
    # every stat is the analysis's without partial results, rounded apart at most: the round's
    # directions went back through the response's one forward, the first moments through a batch of
    # other directions
    for stat in ("fisher", "mean_shift", "common", "uncentered", "raw", "rho"):
        for name, value in alone.sums.iter_stat(stat):
            torch.testing.assert_close(result.sums.stat(stat, name), value, rtol=1e-10, atol=1e-14)
    for finished, single in zip(result.positions, alone.positions, strict=True):
        assert finished.moments_totals == pytest.approx(single.moments_totals, rel=1e-10)
    assert result.accumulated_shift_sq == pytest.approx(alone.accumulated_shift_sq, rel=1e-10)


def test_a_tied_tables_first_partial_and_responses_without_a_first_pass():
    """Tied: the first partial's first moments are the exact result's. The data sampler's mu is one-hot,
    so there is no Fisher to wait for and no first pass: the exact pass is the first moments alone; nor
    for the truncated method."""
    model = tiny_llama(tied=True)
    result, seen = _partials(model, Sampler(temperature=0.7))
    for name, value in seen[0]["mean_shift"].items():
        torch.testing.assert_close(value, result.sums.stat("mean_shift", name), rtol=1e-10, atol=1e-14)
    result, seen = _partials(model, Sampler(kind=SamplerKind.data))
    assert seen == [] and result.sft_gradient is not None
    assert square_total_of(result.sums.sums["mean_shift"]) > 0
    # a truncated plan is a few directions per position: a first pass would half repeat it
    truncated: list = []
    analyze_sequence(
        model, PREFIX, RESPONSE, Sampler(temperature=0.7), Method(MethodName.truncated, fraction=0.5),
        memory_budget_bytes=BUDGET, on_partial=lambda snapshot, kept: truncated.append(kept),
    )  # fmt: skip
    assert truncated == []


def test_the_first_passs_model_part_holds_every_partial_and_no_second_moment_is_summed():
    """The first pass makes the model's part of the partial summaries from per-tensor totals, its
    refining round again with more of the Fisher: every later partial carries the round's, and no
    partial's sums hold a parameter-sized Fisher or square."""
    model = tiny_llama(tied=False)
    snapshots: list[tuple[dict | None, set[str]]] = []

    def on_partial(snapshot, kept_share: float) -> None:
        sequence = snapshot()
        snapshots.append((sequence.model_part, set(sequence.sums.sums)))

    result = analyze_sequence(
        model, PREFIX, RESPONSE, Sampler(temperature=0.7), Method(), memory_budget_bytes=BUDGET,
        on_partial=on_partial,
    )  # fmt: skip
    first_part, refined = snapshots[0][0], snapshots[1][0]
    assert first_part is not None and first_part["concentration"] is None
    assert refined is not None and all(part is refined for part, _ in snapshots[1:])
    for key in ("fisher", "uncentered", "raw"):
        assert refined["totals"][key] > first_part["totals"][key]
    for key in ("mean_shift_sq", "common_sq"):  # the first moments are the first pass's
        assert refined["totals"][key] == first_part["totals"][key]
    assert all(keys == {"mean_shift", "common"} for _, keys in snapshots)
    assert {"fisher", "mean_shift_sq", "kbar_mu_sq"} <= set(result.sums.sums)


def test_with_a_reward_the_first_pass_has_no_refining_round():
    """The bound std(r) sum sqrt(F) of a round would need each position's Fisher per parameter."""
    model = tiny_llama(tied=False)
    reward = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    reward[[4, 9]] = 1.0
    kept: list[float] = []
    analyze_sequence(
        model, PREFIX, RESPONSE, Sampler(temperature=0.7), Method(), reward, memory_budget_bytes=BUDGET,
        on_partial=lambda snapshot, share: kept.append(min(r.kept_share for r in snapshot().positions)),
    )  # fmt: skip
    assert len(kept) == RESPONSE.numel() and kept[0] < response.REFINED_SHARE


def test_the_first_pass_reads_the_forward_the_logits_came_from():
    """The model runs once for the response's logits and its first pass, then once per position (a
    reward: no refining round, whose positions may take forwards of their own)."""
    model = tiny_llama(tied=False)
    reward = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    reward[[4, 9]] = 1.0
    forwards: list[int] = []
    handle = model.register_forward_hook(
        lambda module, args, kwargs, out: forwards.append(1), with_kwargs=True
    )
    try:
        analyze_sequence(
            model, PREFIX, RESPONSE, Sampler(temperature=0.7), Method(), reward, memory_budget_bytes=BUDGET,
            on_partial=lambda snapshot, share: None,
        )  # fmt: skip
    finally:
        handle.remove()
    assert len(forwards) == 1 + RESPONSE.numel()


def test_a_partials_tied_cross_term_is_that_of_the_directions_kept():
    """A plan cut to its leading directions sums each probe's row from its coordinates on them: the same
    Fisher as back-propagating the probe projected onto those directions, under top-k (whose directions
    are not a basis of the hidden space) as on the policy."""
    from dataclasses import replace

    from workers.fisher.capture import capture_forward
    from workers.fisher.position import PositionInputs, fisher_plans, position_moments

    model = tiny_llama(tied=True)
    ids = torch.cat([PREFIX, RESPONSE[:2]])
    logits = model(input_ids=ids[None]).logits[0, -1].detach()
    for sampler in (Sampler(temperature=0.7, top_k=6), Sampler()):
        p = torch.softmax(logits, -1)
        mu = warped_distribution(logits, sampler.temperature, sampler.top_k, 1.0)
        inputs = PositionInputs(ids, p, mu, None, sampler.is_on_policy, fisher_under_p=False)
        capture = capture_forward(model, ids)
        planned = fisher_plans(model, inputs, capture, Method())
        kept = planned.leading(3)
        plan = kept.plans["fisher"]
        assert plan.probes_on_kept and plan.probes  # the context reads rows the sampler draws
        projected = {c: plan.vectors.T @ (plan.vectors @ v) for c, v in plan.probes.items()}
        by_backward = replace(
            kept,
            plans={"fisher": replace(plan, probes=projected, probes_on_kept=False, complete_basis=False)},
        )
        found = position_moments(model, inputs, Method(), capture, memory_budget_bytes=BUDGET, planned=kept)
        expected = position_moments(
            model, inputs, Method(), capture, memory_budget_bytes=BUDGET, planned=by_backward
        )
        assert found.directions < expected.directions  # no backward for the probes
        for name, value in expected.fisher.items():
            torch.testing.assert_close(found.fisher[name], value, rtol=1e-10, atol=1e-13)


def test_a_first_pass_that_reads_c_mu_over_its_most_probable_rows_gives_that_parts_lower_bound(monkeypatch):
    """Where mu draws more tokens than the first pass reads, each position's Fisher in the first partial
    comes from the leading direction of C_S, C_mu's part over mu's most probable rows (centered at mu's
    whole mean): the float64 brute force of that truncation, below the exact Fisher parameter by
    parameter, its kept share one of C_mu's whole trace and no spectrum until the refining round; the
    exact result is the analysis's without partial results (to rounding)."""
    monkeypatch.setattr(response, "FIRST_PASS_GRAM_ROWS", 6)
    model = tiny_llama(tied=False)
    sampler = Sampler(temperature=0.7)
    result, seen = _partials(model, sampler)
    first, refined = seen[0], seen[1]
    assert all(spectrum is None for spectrum in first["spectra"])
    assert all(spectrum is not None for spectrum in refined["spectra"])
    head = model.get_output_embeddings().weight.detach()
    for t, ids, mu in _response_positions(model):
        keep = response.first_pass_directions(model.config.hidden_size)
        assert keep == 1
        position, moments = _truncated_fisher(model, ids, mu, keep, rows=6)
        assert first["positions"][t] == pytest.approx(
            sum(float(v.sum()) for v in position.values()), rel=1e-9
        )
        for name, value in position.items():  # C_S's leading direction is below C_mu
            assert bool((value <= moments["fisher"][name] * (1 + 1e-9) + 1e-15).all()), name
        read = torch.topk(mu, 6).indices
        centered = head[read] - mu @ head
        part = torch.linalg.eigvalsh(centered.T @ (mu[read, None] * centered))
        trace = float(torch.trace(head.T @ (torch.diag(mu) - torch.outer(mu, mu)) @ head))
        assert first["kept"][t] == pytest.approx(float(part[-1]) / trace, rel=1e-9)
    alone = analyze_sequence(model, PREFIX, RESPONSE, sampler, Method(), memory_budget_bytes=BUDGET)
    for name, value in alone.sums.iter_stat("fisher"):  # the round's plans, not the first pass's
        torch.testing.assert_close(result.sums.stat("fisher", name), value, rtol=1e-12, atol=1e-15)
    for finished, single in zip(result.positions, alone.positions, strict=True):
        assert finished.moments_totals == pytest.approx(single.moments_totals, rel=1e-12)


@pytest.mark.parametrize(
    ("family", "tied", "sampler"),
    [
        ("llama", True, Sampler()),  # the tied probes summed over a complete basis: from the round's rows
        ("llama", True, Sampler(temperature=0.7, top_k=6)),  # probes with a backward of their own
        ("qwen2", False, Sampler(temperature=0.7)),  # off the policy with rho: both Fisher carried
        ("gpt2", True, Sampler()),  # the norms' and biases' squares (autograd's parameters) carried
        ("qwen3_moe", False, Sampler()),  # an expert's rows are the whole response's: nothing carried
    ],
)
def test_the_exact_pass_continues_from_what_the_rounds_directions_left(monkeypatch, family, tied, sampler):
    """Each position's exact pass takes its refining round's directions over (the ghost moments of every
    block, the tables' rows, the other parameters' squares, the tied probes' rows) and back-propagates
    only the rest: fewer directions, every stat the analysis's without partial results to rounding.
    Where an expert's rows differ between the response's forward and the context's own, it repeats
    them, bit for bit the analysis without partials."""
    model = tiny_model(family, tied=tied)
    rho = not sampler.is_on_policy
    result, seen, carried_rows = _backward_rows(monkeypatch, model, sampler, rho)
    assert len(seen) == 2 + RESPONSE.numel() - 1  # a first pass and its round ran
    monkeypatch.setattr(response, "carried_bytes", lambda capture: 2 * BUDGET)  # nothing kept
    _, _, repeated_rows = _backward_rows(monkeypatch, model, sampler, rho)
    alone = analyze_sequence(
        model, PREFIX, RESPONSE, sampler, Method(), memory_budget_bytes=BUDGET, fisher_under_p=rho
    )
    assert result.directions == alone.directions  # the round's, taken over by the exact pass, count
    stats = ["fisher", "uncentered", "raw", *(["rho"] if rho else [])]
    if family == "qwen3_moe":
        assert carried_rows == repeated_rows
        for name, value in alone.sums.iter_stat("fisher"):
            assert torch.equal(result.sums.stat("fisher", name), value)
        return
    assert carried_rows < repeated_rows  # the exact pass back-propagated only the other directions
    for stat in stats:
        for name, value in alone.sums.iter_stat(stat):
            torch.testing.assert_close(result.sums.stat(stat, name), value, rtol=1e-10, atol=1e-14)
    for finished, single in zip(result.positions, alone.positions, strict=True):
        assert finished.moments_totals == pytest.approx(single.moments_totals, rel=1e-10)


def _backward_rows(monkeypatch, model, sampler: Sampler, rho: bool) -> tuple[SequenceAnalysis, list, int]:
    """``_partials``, and the directions every backward of the analysis took in all."""
    rows = [0]
    batched = directions.batched_grad

    def counted(output, inputs, grad_outputs):
        rows[0] += grad_outputs.shape[0]
        return batched(output, inputs, grad_outputs)

    monkeypatch.setattr(directions, "batched_grad", counted)
    result, seen = _partials(model, sampler, rho=rho)
    monkeypatch.setattr(directions, "batched_grad", batched)
    return result, seen, rows[0]


def test_where_the_workspace_keeps_none_of_the_rounds_directions_the_exact_pass_repeats_them(monkeypatch):
    """Beyond the workspace's worth kept between passes the round leaves nothing: the exact pass runs
    every direction, and the result is the analysis's without partial results bit for bit."""
    monkeypatch.setattr(response, "carried_bytes", lambda capture: 2 * BUDGET)
    model = tiny_llama(tied=True)
    sampler = Sampler()
    result, seen = _partials(model, sampler)
    assert len(seen) == 2 + RESPONSE.numel() - 1
    alone = analyze_sequence(model, PREFIX, RESPONSE, sampler, Method(), memory_budget_bytes=BUDGET)
    assert result.directions == alone.directions
    for name, value in alone.sums.iter_stat("fisher"):
        assert torch.equal(result.sums.stat("fisher", name), value)
    assert [r.moments_totals for r in alone.positions] == [r.moments_totals for r in result.positions]
