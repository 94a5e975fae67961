"""One forward of a response read at each of its positions (``CapturedForward.at``), their directions in
shared backward passes (``positions_moments``), the Fisher as totals alone (``SquareTotals``) and the
first moments summed in their small form (``summed_terms``): each equal, in float64, to what a forward
of each position's own context gives, on every family.
"""

from __future__ import annotations

import pytest
import torch

from backend.vocabulary import Method, SamplerKind
from tests.tiny_models import BUDGET, FAMILIES, tiny_llama, tiny_model
from workers.fisher.capture import UnsupportedArchitecture, capture_forward
from workers.fisher.covariance import (
    ROWS_PER_BLOCK,
    head_row_norms,
    leading_rows_covariance,
    mean_logit_row,
    mean_logit_rows,
)
from workers.fisher.directions import first_chunk_directions
from workers.fisher.first_moments import Factored, HeadOuter, OuterRows, TableRows, Whole
from workers.fisher.logit_map import LogitJacobian
from workers.fisher.position import (
    PositionInputs,
    PositionWork,
    fisher_plans,
    position_moments,
    positions_moments,
)
from workers.fisher.sampler import Sampler, model_distribution, sampler_distribution

pytestmark = pytest.mark.usefixtures("float64_reference")

PREFIX = torch.tensor([3, 5, 3, 9])
RESPONSE = torch.tensor([8, 3, 1, 6, 5])
# small enough that the positions' first chunks take several shared backward passes
SMALL_BUDGET = 1 << 19


def _positions(model, sampler: Sampler, reward: torch.Tensor | None = None):
    """Each position's inputs and plans cut to a first chunk (from its own context's forward), with
    the forward of the whole response."""
    full = torch.cat([PREFIX, RESPONSE])
    context = full[:-1]
    logits = model(input_ids=context[None]).logits[0].detach()
    whole = capture_forward(model, context)
    items = []
    for t in range(RESPONSE.numel()):
        index = PREFIX.numel() - 1 + t
        ids = full[: index + 1]
        p = model_distribution(logits[index])
        mu = sampler_distribution(sampler, logits[index], None, int(RESPONSE[t]))
        inputs = PositionInputs(ids, p, mu, reward, sampler.is_on_policy, fisher_under_p=False)
        own = capture_forward(model, ids)
        planned = fisher_plans(model, inputs, own, Method())
        items.append((inputs, own, planned.leading(first_chunk_directions(ids.numel())), whole.at(index)))
    return items


def _assert_first_moments_equal(found, expected, names) -> None:
    for name in names:
        torch.testing.assert_close(found[name], expected[name], rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_responses_forward_read_at_each_position_gives_each_contexts_moments(family):
    """Per position: the Fisher's totals (``fisher_totals``) and the Fisher per parameter, kbar under mu
    and p, from the response's one forward in shared backward passes, against a forward of the context."""
    model = tiny_model(family, tied=FAMILIES[family].tied_options[-1])
    sampler = Sampler(temperature=0.7, top_k=5)
    items = _positions(model, sampler)
    names = [name for name, _ in model.named_parameters()]
    for fisher_totals in (True, False):
        works = (
            PositionWork.of(model, inputs, Method(), view, planned, fisher_totals)
            for inputs, _, planned, view in items
        )
        found = list(positions_moments(works, SMALL_BUDGET))
        assert len(found) == len(items)
        for (inputs, own, planned, _), (_, moments) in zip(items, found, strict=True):
            expected = position_moments(
                model, inputs, Method(), own, memory_budget_bytes=BUDGET, planned=planned
            )
            assert moments.directions == expected.directions
            for name in names:
                value = expected.fisher[name]
                if fisher_totals:
                    assert moments.fisher[name].dim() == 0
                    assert float(moments.fisher[name]) == pytest.approx(
                        float(value.sum()), rel=1e-10, abs=1e-14
                    )
                else:
                    torch.testing.assert_close(moments.fisher[name], value, rtol=1e-10, atol=1e-13)
            _assert_first_moments_equal(moments.kbar_mu, expected.kbar_mu, names)
            _assert_first_moments_equal(moments.kbar_p, expected.kbar_p, names)


@pytest.mark.parametrize("budget", [1 << 17, BUDGET])
def test_positions_share_a_backward_as_the_budget_allows_or_run_alone(budget):
    """A budget below one position's directions runs each alone, a large one all in one backward."""
    model = tiny_llama(tied=True)
    items = _positions(model, Sampler(temperature=0.7))
    works = (PositionWork.of(model, inputs, Method(), view, planned) for inputs, _, planned, view in items)
    names = [name for name, _ in model.named_parameters()]
    for (inputs, own, planned, _), (_, moments) in zip(items, positions_moments(works, budget), strict=True):
        expected = position_moments(model, inputs, Method(), own, memory_budget_bytes=BUDGET, planned=planned)
        for name in names:
            torch.testing.assert_close(moments.fisher[name], expected.fisher[name], rtol=1e-10, atol=1e-13)
        _assert_first_moments_equal(moments.kbar_p, expected.kbar_p, names)


def test_on_the_policy_with_a_reward_the_fisher_is_per_parameter():
    """The bound std(r) sum sqrt(F) needs F per parameter: totals alone are refused with a reward."""
    model = tiny_llama(tied=True)
    reward = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    reward[[8, 9]] = 1.0
    items = _positions(model, Sampler(), reward)
    inputs, own, planned, view = items[2]
    with pytest.raises(ValueError, match="per parameter"):
        PositionWork.of(model, inputs, Method(), view, planned, fisher_totals=True)
    work = PositionWork.of(model, inputs, Method(), view, planned)
    ((_, moments),) = positions_moments([work], BUDGET)
    expected = position_moments(model, inputs, Method(), own, memory_budget_bytes=BUDGET, planned=planned)
    assert moments.policy_grad is not None and expected.policy_grad is not None
    names = [name for name, _ in model.named_parameters()]
    _assert_first_moments_equal(moments.policy_grad, expected.policy_grad, names)
    for name in names:
        torch.testing.assert_close(moments.fisher[name], expected.fisher[name], rtol=1e-10, atol=1e-13)


def test_a_model_whose_positions_see_later_tokens_is_refused():
    """Bidirectional attention: rows after the position reach it, so the response's forward is not each
    context's. The refusal names why; a forward of the context alone stays what it always was."""
    model = tiny_llama(tied=True)
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    sampler = Sampler(temperature=0.7)
    inputs, _, planned, view = _positions(model, sampler)[1]
    work = PositionWork.of(model, inputs, Method(), view, planned)
    with pytest.raises(UnsupportedArchitecture, match="not causal"):
        list(positions_moments([work], BUDGET))


def test_a_sum_over_positions_keeps_few_terms_and_is_their_sum():
    """``Factored.summed``: a use's terms on the first rows of one array join (zeros in the rows a
    shorter one lacks), the head's rank-one terms stack, lookups meet on the union of their rows, whole
    arrays add; forming and square sums equal the terms' own."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    features = randn(6, 5)
    use = Factored((4, 5), torch.float64, torch.device("cpu"))
    head = Factored((7, 3), torch.float64, torch.device("cpu"))
    table = Factored((7, 3), torch.float64, torch.device("cpu"))
    bias = Factored((7,), torch.float64, torch.device("cpu"))
    norm = Factored((3,), torch.float64, torch.device("cpu"))
    running = {"use": use, "head": head, "bias": bias, "table": table, "norm": norm}
    added: dict[str, list[Factored]] = {key: [] for key in running}
    for rows in (3, 4, 6):
        one = {
            "use": use.plus(OuterRows(randn(rows, 4), features[:rows], scale=0.5)),
            "head": head.plus(HeadOuter(randn(7), randn(3), scale=2.0)),
            "bias": bias.plus(HeadOuter(randn(7), None), HeadOuter(randn(7), None, scale=-1.0)),
            "table": table.plus(TableRows(torch.tensor([1, rows]), randn(2, 3))),
            "norm": norm.plus(Whole(randn(3))),
        }
        for key, value in one.items():
            added[key].append(value)
            running[key] = running[key].plus(*value.terms).summed()
    for key, summed in running.items():
        expected = sum(value.form() for value in added[key])
        assert len(summed.terms) <= 2  # not a term per position
        torch.testing.assert_close(summed.form(), expected, rtol=1e-12, atol=1e-12)
        square = summed.square_sum()
        if square is not None:
            assert square == pytest.approx(float(expected.square().sum()), rel=1e-12)


def test_the_data_sampler_reads_one_forward_too():
    """A data sampler's mu is one-hot: no Fisher, the first moments alone, from the response's forward."""
    model = tiny_llama(tied=False)
    items = _positions(model, Sampler(kind=SamplerKind.data))
    works = (
        PositionWork.of(model, inputs, Method(), view, planned, True) for inputs, _, planned, view in items
    )
    names = [name for name, _ in model.named_parameters()]
    for (inputs, own, planned, _), (_, moments) in zip(items, positions_moments(works, BUDGET), strict=True):
        expected = position_moments(model, inputs, Method(), own, memory_budget_bytes=BUDGET, planned=planned)
        _assert_first_moments_equal(moments.kbar_mu, expected.kbar_mu, names)
        assert moments.fisher_zero and all(float(v) == 0 for v in moments.fisher.values())


def test_several_positions_mean_logit_rows_read_at_once_are_each_positions_own():
    """``mean_logit_rows``: jbar_q of several positions from one read of the head (blocks of rows made
    float64 once), with and without a logit map, equal each position's ``mean_logit_row``."""
    generator = torch.Generator().manual_seed(0)
    vocab = 2 * ROWS_PER_BLOCK + 5  # a last block shorter than the others
    weight = torch.randn(vocab, 8, generator=generator)
    scale = torch.rand(vocab, generator=generator, dtype=torch.float64)
    jacobians = [LogitJacobian(weight, None), LogitJacobian(weight, scale), LogitJacobian(weight, None)]
    qs = [torch.softmax(torch.randn(vocab, generator=generator, dtype=torch.float64), 0) for _ in jacobians]
    qs[2][: vocab // 2] = 0.0  # a distribution that leaves rows out
    rows = mean_logit_rows(jacobians, qs)
    for jacobian, q, row in zip(jacobians, qs, rows, strict=True):
        torch.testing.assert_close(row, mean_logit_row(jacobian, q), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("rows", [3, 40])
def test_c_mu_over_its_most_probable_rows_is_below_c_mu_with_c_mus_trace(rows):
    """``leading_rows_covariance``: C_S over q's most probable rows, centered at q's whole mean, with and
    without a logit map: its matrix, C_q - C_S positive semi-definite, and trace(C_q) from the rest's sums;
    fewer rows than the width (3 of 6) decomposed in their own space, an orthonormal basis all the same."""
    generator = torch.Generator().manual_seed(1)
    vocab, width = 300, 6
    weight = torch.randn(vocab, width, generator=generator)
    q = torch.softmax(3 * torch.randn(vocab, generator=generator, dtype=torch.float64), 0)
    norms = head_row_norms(weight)
    for scale in (None, torch.rand(vocab, generator=generator, dtype=torch.float64) + 0.5):
        jacobian = LogitJacobian(weight, scale)
        j = jacobian.rows(torch.arange(vocab))
        mean = q @ j
        whole = (j - mean).T @ (q[:, None] * (j - mean))
        read = torch.topk(q, rows).indices
        part = (j[read] - mean).T @ (q[read, None] * (j[read] - mean))
        found = leading_rows_covariance(jacobian, q, rows, mean, norms)
        assert not found.whole and found.rows_read == rows
        rebuilt = (found.eigenvectors * found.eigenvalues) @ found.eigenvectors.T
        torch.testing.assert_close(rebuilt, part, rtol=1e-10, atol=1e-13)
        identity = torch.eye(width, dtype=torch.float64)
        torch.testing.assert_close(found.eigenvectors.T @ found.eigenvectors, identity, rtol=0, atol=1e-12)
        assert bool((found.eigenvalues[:-1] >= found.eigenvalues[1:]).all())
        assert float(torch.linalg.eigvalsh(whole - part)[0]) >= -1e-12
        assert found.trace == pytest.approx(float(torch.trace(whole)), rel=1e-10)
