"""The essays' identities, checked on the engine's own outputs (tiny float64 Llamas)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from backend.vocabulary import Method, MethodName
from tests.tiny_models import BUDGET, tiny_llama
from workers.fisher import covariance
from workers.fisher.covariance import output_covariance
from workers.fisher.cpu_kernels import levels as cpu_levels
from workers.fisher.cpu_kernels import threads as cpu_threads
from workers.fisher.logit_map import LogitJacobian
from workers.fisher.position import PositionInputs, position_moments
from workers.fisher.reference import brute_force_logit_sensitivities
from workers.fisher.sampler import Sampler, warped_distribution
from workers.fisher.stats import MomentSums

IDS = torch.tensor([3, 5, 8, 3, 11])

pytestmark = pytest.mark.usefixtures("float64_reference")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(tied=False, seed=3, vocab_size=41)


def _moments(model, mu, on_policy, reward=None):
    logits = model(input_ids=IDS[None]).logits[0, -1].detach()
    p = torch.softmax(logits, -1)
    moments = position_moments(
        model,
        PositionInputs(IDS, p, mu(logits) if callable(mu) else mu, reward, on_policy),
        Method(),
        memory_budget_bytes=BUDGET,
    )
    sums = MomentSums(
        [n for n, _ in model.named_parameters()], {n: tuple(t.shape) for n, t in model.named_parameters()}
    )
    sums.add(moments)
    return logits, p, moments, sums


def test_centered_score_has_zero_mean_under_the_sampler(model):
    logits, kappa = brute_force_logit_sensitivities(model, IDS)
    mu = warped_distribution(logits, 0.7, 9, 0.95)
    _, _, moments, _ = _moments(model, mu, False)
    for name, k in kappa.items():
        centered = k - moments.kbar_mu[name]  # [V, *shape]
        mean = torch.tensordot(mu, centered, dims=1)
        torch.testing.assert_close(mean, torch.zeros_like(mean), rtol=0, atol=1e-12)


def test_uncentered_is_fisher_plus_squared_mean_shift(model):
    _, _, _, sums = _moments(model, lambda z: warped_distribution(z, 1.4, None, 0.8), False)
    for name in sums.names:
        torch.testing.assert_close(
            sums.stat("uncentered", name), sums.stat("fisher", name) + sums.stat("mean_shift", name).square()
        )
        torch.testing.assert_close(
            sums.stat("raw", name),
            sums.stat("fisher", name) + (sums.stat("mean_shift", name) + sums.stat("common", name)).square(),
        )


def test_mean_shift_is_zero_on_policy(model):
    _, _, _, sums = _moments(model, lambda z: torch.softmax(z, -1), True)
    for name in sums.names:
        assert torch.count_nonzero(sums.stat("mean_shift", name)) == 0
        torch.testing.assert_close(sums.stat("uncentered", name), sums.stat("fisher", name))


@pytest.mark.parametrize("k", [1, 2, 5, 9])
def test_rank_of_c_mu_is_at_most_support_minus_one(model, k):
    logits = model(input_ids=IDS[None]).logits[0, -1].detach()
    mu = warped_distribution(logits, 1.0, k, 1.0)
    cov = output_covariance(LogitJacobian(model.get_output_embeddings().weight.detach(), None), mu)
    assert cov.support == k
    assert cov.numerical_rank() <= k - 1
    assert cov.numerical_rank() == min(k - 1, model.config.hidden_size)  # generic rows: the bound is tight


def test_policy_gradient_is_capped_by_the_fisher(model):
    reward = torch.randn(model.config.vocab_size, dtype=torch.float64)
    _, _, _, sums = _moments(model, lambda z: warped_distribution(z, 0.9, 12, 1.0), False, reward)
    for name in sums.names:
        slack = sums.stat("bound", name) - sums.stat("policy_grad", name).abs()
        assert float(slack.min()) >= -1e-12


def test_on_policy_policy_gradient_is_the_gradient_of_expected_reward(model):
    reward = torch.randn(model.config.vocab_size, dtype=torch.float64)
    _, _, _, sums = _moments(model, lambda z: torch.softmax(z, -1), True, reward)
    params = dict(model.named_parameters())
    logits = model(input_ids=IDS[None]).logits[0, -1]
    expected_reward = torch.softmax(logits, -1) @ reward
    grads = torch.autograd.grad(expected_reward, list(params.values()))
    for (name, _), grad in zip(params.items(), grads, strict=True):
        torch.testing.assert_close(sums.stat("policy_grad", name), grad, rtol=1e-9, atol=1e-12)


def test_output_layer_rows_are_coin_flips(model):
    logits, p, moments, sums = _moments(model, lambda z: warped_distribution(z, 0.8, None, 0.9), False)
    mu = warped_distribution(logits, 0.8, None, 0.9)
    h = moments.hidden
    head = sums.stat("fisher", "lm_head.weight")
    torch.testing.assert_close(head, torch.outer(mu * (1 - mu), h * h))
    total = float(head.sum())
    assert total == pytest.approx(float(h.square().sum()) * (1 - float(mu.square().sum())), rel=1e-12)


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, None, 0.9), (0.7, 5, 1.0), (1.3, 8, 0.6), (1.0, 3, 0.2)]
)
def test_sampler_matches_transformers_warpers(temperature, top_k, top_p):
    torch.manual_seed(1)
    logits = torch.randn(50, dtype=torch.float64) * 2
    scores = logits[None].clone()
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = torch.softmax(scores[0], -1)
    torch.testing.assert_close(warped_distribution(logits, temperature, top_k, top_p), expected)


def test_sampler_config_rejects_bad_values():
    with pytest.raises(ValueError, match="temperature"):
        Sampler(temperature=0)
    with pytest.raises(ValueError, match="top_k"):
        Sampler(top_k=0)
    with pytest.raises(ValueError, match="top_p"):
        Sampler(top_p=1.5)
    with pytest.raises(ValueError, match="method"):
        Method.parse("newton")
    with pytest.raises(ValueError, match="method"):
        Method.parse("truncated:1.5")
    assert Method.parse("mc:64") == Method(MethodName.mc, samples=64)


def test_top_q_levels_hold_exactly_ceil_q_p_coordinates_ties_by_index():
    from backend.compare import set_comparison
    from workers.fisher.masks import top_q_levels

    a = [torch.tensor([5.0, 1.0, 1.0, 1.0]), torch.tensor([[3.0, 1.0], [0.0, 2.0]])]  # P = 8
    levels, named = top_q_levels(lambda: iter(a), 8, (0.125, 0.5, 0.75))
    # top 1: the 5; top 4: 5, 3, 2 and the first 1 by index; top 6: then the next two 1s
    assert levels.tolist() == [1, 2, 3, 3, 2, 0, 0, 2]
    assert [t.k for t in named] == [1, 4, 6] and [t.value for t in named] == [5.0, 1.0, 1.0]
    b = [torch.tensor([0.0, 9.0, 1.0, 1.0]), torch.tensor([[3.0, 1.0], [0.0, 2.0]])]
    other, _ = top_q_levels(lambda: iter(b), 8, (0.125, 0.5, 0.75))
    compared = set_comparison(levels.numpy(), other.numpy(), (0.125, 0.5, 0.75))
    top_a = [set(i for i, v in enumerate(levels.tolist()) if 0 < v <= l) for l in (1, 2, 3)]
    top_b = [set(i for i, v in enumerate(other.tolist()) if 0 < v <= l) for l in (1, 2, 3)]
    for l, (sa, sb) in enumerate(zip(top_a, top_b, strict=True)):
        assert len(sa) == len(sb) == [1, 4, 6][l]
        assert compared["overlap"][l] == len(sa & sb) / len(sa)
        assert compared["jaccard"][l] == len(sa & sb) / len(sa | sb)
    assert compared["chance_jaccard"] == [q / (2 - q) for q in (0.125, 0.5, 0.75)]


def test_c_mu_in_blocks_of_rows_is_the_covariance_of_the_rows(model, monkeypatch):
    """C_mu summed over blocks of head rows (as on a real head): sum_a mu_a (j_a - jbar)(j_a - jbar)^T."""
    monkeypatch.setattr(covariance, "ROWS_PER_BLOCK", 5)  # the tiny head's 37 rows in 8 blocks
    logits = model(input_ids=IDS[None]).logits[0, -1].detach()
    mu = warped_distribution(logits, 0.8, 30, 1.0)
    rows = model.get_output_embeddings().weight.detach().double()
    mean = mu @ rows
    want = (rows - mean).T @ ((rows - mean) * mu[:, None])
    cov = output_covariance(LogitJacobian(rows, None), mu)
    torch.testing.assert_close(cov.mean_row, mean, rtol=1e-12, atol=1e-14)
    got = (cov.eigenvectors * cov.eigenvalues) @ cov.eigenvectors.T
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # without centering: the spectrum of C_mu + jbar jbar^T, decomposed once for every record that reads it
    uncentered = cov.uncentered_eigenvalues()
    torch.testing.assert_close(
        uncentered, torch.linalg.eigvalsh(want + torch.outer(mean, mean)).flip(0), rtol=1e-10, atol=1e-12
    )
    assert cov.uncentered_eigenvalues() is uncentered


@pytest.mark.parametrize("k", [1, 2, 5, 15, 16, 30])
def test_c_mu_of_fewer_tokens_than_the_width_is_decomposed_in_their_row_space(model, k):
    """Where mu draws n < d tokens, C_mu is decomposed from its n rows (an n x n problem): the same
    eigenvalues as the d x d definition's, zeros beyond them, an orthonormal basis of R^d that rebuilds
    it, and the uncentered spectrum; from n = d on, the d x d Gram as before (16 and 30 here)."""
    logits = model(input_ids=IDS[None]).logits[0, -1].detach()
    mu = warped_distribution(logits, 1.0, k, 1.0)
    rows = model.get_output_embeddings().weight.detach().double()
    mean = mu @ rows
    want = (rows - mean).T @ ((rows - mean) * mu[:, None])
    cov = output_covariance(LogitJacobian(rows, None), mu)
    width = rows.shape[1]
    assert (cov.support_rows is not None) == (k < width)
    assert cov.eigenvalues.shape == (width,) and cov.eigenvectors.shape == (width, width)
    assert bool((cov.eigenvalues[:-1] >= cov.eigenvalues[1:]).all())  # descending
    torch.testing.assert_close(cov.eigenvalues, torch.linalg.eigvalsh(want).flip(0), rtol=1e-10, atol=1e-12)
    if k < width:
        assert bool((cov.eigenvalues[k:] == 0).all())  # beyond the rows: zeros, not rounding
    identity = torch.eye(width, dtype=torch.float64)
    torch.testing.assert_close(cov.eigenvectors.T @ cov.eigenvectors, identity, rtol=0, atol=1e-12)
    got = (cov.eigenvectors * cov.eigenvalues) @ cov.eigenvectors.T
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert cov.numerical_rank() == min(k - 1, width)
    uncentered = torch.linalg.eigvalsh(want + torch.outer(mean, mean)).flip(0)
    torch.testing.assert_close(cov.uncentered_eigenvalues(), uncentered, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_compiled_level_map_is_the_definition(seed, monkeypatch):
    """Against the definition (the top ceil(q P) by value, ties by smallest index, from one stable sort):
    ties (a coarse grid of values), zeros, rounding-level negatives and a set larger than the non-zero
    values (threshold 0)."""
    from workers.fisher.masks import top_q_levels

    generator = torch.Generator().manual_seed(seed)
    chunks = [
        (torch.randint(0, 6, shape, generator=generator).float() * 0.25)
        for shape in [(300,), (40, 17), (3, 5, 11)]
    ]
    chunks[0][:7] = -1e-9  # rounding below zero counts as zero
    total = sum(c.numel() for c in chunks)
    fractions = (0.001, 0.01, 0.1, 0.5, 0.9)
    levels, named = top_q_levels(lambda: iter(chunks), total, fractions)
    order = torch.argsort(
        torch.cat([c.reshape(-1) for c in chunks]).clamp_min(0), descending=True, stable=True
    )
    want = torch.zeros(total, dtype=torch.uint8)
    for level in range(len(fractions), 0, -1):  # largest set first; the smaller ones overwrite inside it
        want[order[: named[level - 1].k]] = level
    assert torch.equal(levels, want)
    for level, threshold in enumerate(named, start=1):
        assert int(((levels > 0) & (levels <= level)).sum()) == threshold.k
    # each tensor cut into parts across threads, as large ones are, and the ties placed from what the
    # first pass noted of them (few noted: the second pass places them; many: none is needed)
    monkeypatch.setattr(cpu_threads, "PART_MIN_VALUES", 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for kept in (1, 7, 100_000):
            monkeypatch.setattr(cpu_levels, "TIES_KEPT", kept)
            assert torch.equal(top_q_levels(lambda: iter(chunks), total, fractions)[0], levels)
    finally:
        torch.set_num_threads(threads)


def test_ties_noted_in_the_first_pass_need_no_second(monkeypatch):
    """Continuous values, a threshold tied a few times: the level map of the definition, in one pass."""
    from workers.fisher.masks import top_q_levels

    generator = torch.Generator().manual_seed(5)
    chunks = [torch.rand(shape, generator=generator) for shape in [(500,), (30, 20)]]
    chunks[1][3, :4] = chunks[0][10] = 0.98765  # five values tied, some at a set's boundary
    total = sum(c.numel() for c in chunks)
    fractions = (0.001, 0.003, 0.01, 0.1)
    flat = torch.cat([c.reshape(-1) for c in chunks])
    order = torch.argsort(flat, descending=True, stable=True)
    k_tied = int((flat > 0.98765).sum()) + 2  # a set that takes two of the five, by index
    monkeypatch.setattr(
        cpu_levels, "_tie_levels_into", lambda *args: pytest.fail("a second pass over the values")
    )
    fractions = (*fractions, k_tied / total)
    fractions = tuple(sorted(fractions))
    levels, named = top_q_levels(lambda: iter(chunks), total, fractions)
    want = torch.zeros(total, dtype=torch.uint8)
    for level in range(len(fractions), 0, -1):
        want[order[: named[level - 1].k]] = level
    assert torch.equal(levels, want)
    assert any(t.value == pytest.approx(0.98765) for t in named)
    nothing, _ = top_q_levels(lambda: iter(chunks), total, ())  # no set: no threshold read
    assert torch.equal(nothing, torch.zeros(total, dtype=torch.uint8))


def test_a_linear_heads_scale_is_ones_held_once():
    """g'(l) of a linear head: ones over the vocabulary, one value held (each response position's record
    keeps it); a softcapped head's own array."""
    weight = torch.randn(7, 3)
    ones = LogitJacobian(weight, None).head_scale()
    assert torch.equal(ones, torch.ones(7, dtype=torch.float64))
    assert ones.untyped_storage().nbytes() == ones.element_size()
    scale = torch.rand(7, dtype=torch.float64)
    assert LogitJacobian(weight, scale).head_scale() is scale
