"""The fast engine against float64 brute force (one backward per vocabulary token), every stat."""

from __future__ import annotations

import pytest
import torch

from backend.vocabulary import STATS, Method, MethodName, SamplerKind
from tests.tiny_models import BUDGET, tiny_llama, tiny_qwen2
from workers.fisher.block_squares import (
    GHOST_ROWWISE_MAX_ROWS,
    direct_squares,
    ghost_entries,
    ghost_moments,
    ghost_squares,
    ghost_total,
    pair_moments_by_grams,
    pair_moments_by_products,
    pair_moments_by_rows,
)
from workers.fisher.feature_grams import FeatureGrams
from workers.fisher.position import PositionInputs, position_moments
from workers.fisher.reference import brute_force_logit_sensitivities, brute_force_moments
from workers.fisher.response import analyze_sequence, log_likelihood_gradient
from workers.fisher.sampler import (
    Sampler,
    one_hot_distribution,
    uniform_distribution,
    warped_distribution,
)
from workers.fisher.stats import MomentSums

PREFIXES = {
    "plain": [3, 5, 8, 7, 11],
    "repeated": [4, 9, 4, 4, 2, 9],
    "single": [6],
    # past GHOST_ROWWISE_MAX_ROWS: the ghost form's M by batched Grams instead of per-row products
    "long": [3, 5, 8, 7, 11, 2, 9, 4, 4, 6, 1, 12, 10, 3, 5],
}

pytestmark = pytest.mark.usefixtures("float64_reference")


def _samplers(logits: torch.Tensor) -> dict[str, tuple[torch.Tensor, bool]]:
    p = torch.softmax(logits, -1)
    vocab = logits.numel()
    return {
        "on_policy": (p, True),
        "temperature": (warped_distribution(logits, 0.6, None, 1.0), False),
        "top_k": (warped_distribution(logits, 1.0, 4, 1.0), False),
        "top_p": (warped_distribution(logits, 1.3, None, 0.7), False),
        "all_three": (warped_distribution(logits, 0.8, 6, 0.9), False),
        "data": (one_hot_distribution(5, vocab), False),
        "uniform": (uniform_distribution(vocab), False),
    }


def _reward(vocab: int) -> torch.Tensor:
    reward = torch.zeros(vocab, dtype=torch.float64)
    reward[2], reward[5], reward[7] = 1.0, -0.5, 2.0
    return reward


def _fast_stats(
    model, ids, p, mu, reward, on_policy, method: Method | None = None, memory_budget_bytes: int = BUDGET
) -> MomentSums:
    inputs = PositionInputs(ids, p, mu, reward, on_policy)
    moments = position_moments(model, inputs, method or Method(), memory_budget_bytes=memory_budget_bytes)
    names = [n for n, _ in model.named_parameters()]
    shapes = {n: tuple(t.shape) for n, t in model.named_parameters()}
    sums = MomentSums(names, shapes)
    sums.add(moments)
    return sums


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def model(request):
    return tiny_llama(tied=request.param)


@pytest.mark.parametrize("prefix", list(PREFIXES))
def test_every_stat_matches_brute_force(model, prefix):
    ids = torch.tensor(PREFIXES[prefix])
    logits, kappa = brute_force_logit_sensitivities(model, ids)
    p = torch.softmax(logits, -1)
    reward = _reward(logits.numel())
    for sampler, (mu, on_policy) in _samplers(logits).items():
        reference = brute_force_moments(kappa, p, mu, reward)
        fast = _fast_stats(model, ids, p, mu, reward, on_policy)
        for stat in STATS:
            for name in kappa:
                got, want = fast.stat(stat, name), reference[stat][name]
                if stat == "rho":  # a ratio: compare where its denominator is above rounding level
                    second = _weighted_second_moment(kappa[name], p)
                    keep = second > 1e-12 * max(
                        float(_weighted_second_moment(k, p).max()) for k in kappa.values()
                    )
                    got, want = got[keep], want[keep]
                torch.testing.assert_close(
                    got,
                    want,
                    rtol=1e-9,
                    atol=1e-11,
                    msg=lambda m, s=sampler, st=stat, n=name: f"{s} {st} {n}: {m}",
                )


def _weighted_second_moment(kappa: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """E_p[kappa^2] per coordinate: rho's denominator."""
    return torch.tensordot(p, kappa.square(), dims=1)


def test_one_direction_per_chunk_and_direct_squares_agree(model):
    """A budget of one byte forces chunks of one direction and the direct (non-ghost) squares."""
    ids = torch.tensor(PREFIXES["repeated"])
    logits, kappa = brute_force_logit_sensitivities(model, ids)
    p = torch.softmax(logits, -1)
    mu = warped_distribution(logits, 0.8, 7, 1.0)
    reference = brute_force_moments(kappa, p, mu, _reward(logits.numel()))
    fast = _fast_stats(model, ids, p, mu, _reward(logits.numel()), False, memory_budget_bytes=1)
    for stat in ("fisher", "uncentered", "raw", "mean_shift", "policy_grad", "bound"):
        for name in kappa:
            torch.testing.assert_close(fast.stat(stat, name), reference[stat][name], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("rows", [1, 5, GHOST_ROWWISE_MAX_ROWS, GHOST_ROWWISE_MAX_ROWS + 1, 20])
def test_ghost_and_direct_squares_agree_with_the_definition(rows):
    """Both ways of forming M's pairs, and both forms of the squares, against sum_b w_b (delta_b^T x)^2."""
    generator = torch.Generator().manual_seed(rows)
    delta = torch.randn(7, rows, 6, generator=generator, dtype=torch.float64)
    x = torch.randn(rows, 4, generator=generator, dtype=torch.float64)
    weights = torch.rand(7, generator=generator, dtype=torch.float64)
    want = torch.einsum("b,boi->oi", weights, torch.einsum("bro,ri->boi", delta, x).square())
    m = ghost_moments(delta, weights)
    assert m.numel() == ghost_entries(rows) * 6
    # pairs (the CPU's compiled loop, or the GPU's products), or the whole M: the same squares
    for way in (pair_moments_by_rows, pair_moments_by_products, pair_moments_by_grams):
        torch.testing.assert_close(ghost_squares(way(delta, weights), x), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ghost_squares(m, x), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(direct_squares(x, delta, weights), want, rtol=1e-12, atol=1e-12)
    # their total over the block, read from M without forming them (a refining round's), either layout
    grams = FeatureGrams()
    grams.add([x])
    for moments in (m, pair_moments_by_grams(delta, weights)):
        assert ghost_total(moments, grams.of(x)) == pytest.approx(float(want.sum()), rel=1e-12)


def test_response_sums_match_per_position_brute_force(model):
    prefix, continuation = torch.tensor([3, 5, 3]), torch.tensor([8, 3, 1])
    reward = _reward(model.config.vocab_size)
    config = Sampler(temperature=0.7, top_k=5)
    result = analyze_sequence(
        model, prefix, continuation, config, Method(), reward, memory_budget_bytes=BUDGET
    )
    full = torch.cat([prefix, continuation])
    expected: dict[str, dict[str, torch.Tensor]] = {}
    for t in range(continuation.numel()):
        ids = full[: prefix.numel() + t]
        logits, kappa = brute_force_logit_sensitivities(model, ids)
        mu = warped_distribution(logits, 0.7, 5, 1.0)
        ref = brute_force_moments(kappa, torch.softmax(logits, -1), mu, reward)
        for stat in ("fisher", "uncentered", "raw", "mean_shift", "common", "policy_grad", "bound"):
            for name, value in ref[stat].items():
                table = expected.setdefault(stat, {})
                table[name] = table[name] + value if name in table else value
    for stat, table in expected.items():
        for name, value in table.items():
            torch.testing.assert_close(result.sums.stat(stat, name), value, rtol=1e-9, atol=1e-11)


def test_sft_gradient_is_the_accumulated_mean_shift(model):
    prefix, continuation = torch.tensor([3, 5]), torch.tensor([8, 3, 1, 9])
    config = Sampler(kind=SamplerKind.data)
    result = analyze_sequence(model, prefix, continuation, config, Method(), memory_budget_bytes=BUDGET)
    gradient = log_likelihood_gradient(model, prefix, continuation)
    for name, grad in gradient.items():
        torch.testing.assert_close(result.sums.stat("mean_shift", name), grad, rtol=1e-9, atol=1e-11)
    # one-hot mu has no variance: the centered Fisher is exactly zero at every position
    for name in gradient:
        assert torch.count_nonzero(result.sums.stat("fisher", name).abs() > 1e-12) == 0


def test_truncated_to_the_whole_trace_is_exact(model):
    ids = torch.tensor(PREFIXES["plain"])
    logits, _ = brute_force_logit_sensitivities(model, ids)
    p = torch.softmax(logits, -1)
    exact = _fast_stats(model, ids, p, p, None, True)
    full = _fast_stats(model, ids, p, p, None, True, Method(MethodName.truncated, fraction=1.0))
    half = _fast_stats(model, ids, p, p, None, True, Method(MethodName.truncated, fraction=0.5))
    head = "lm_head.weight" if "lm_head.weight" in exact.names else None
    for name in exact.names:
        torch.testing.assert_close(
            full.stat("fisher", name), exact.stat("fisher", name), rtol=1e-9, atol=1e-11
        )
        if name != head and "embed" not in name:  # a lower bound outside the tied cross rows
            assert bool((half.stat("fisher", name) <= exact.stat("fisher", name) + 1e-12).all())


def test_monte_carlo_converges_to_exact():
    model = tiny_llama(tied=True)
    ids = torch.tensor(PREFIXES["plain"])
    logits, _ = brute_force_logit_sensitivities(model, ids)
    p = torch.softmax(logits, -1)
    exact = _fast_stats(model, ids, p, p, None, True)
    errors = []
    for samples in (16, 256, 4096):
        estimate = _fast_stats(model, ids, p, p, None, True, Method(MethodName.mc, samples=samples, seed=7))
        num = sum(
            float((estimate.stat("fisher", n) - exact.stat("fisher", n)).square().sum()) for n in exact.names
        )
        den = sum(float(exact.stat("fisher", n).square().sum()) for n in exact.names)
        errors.append((num / den) ** 0.5)
    assert errors[2] < errors[0] / 4, errors  # ~1/sqrt(S): 16x the samples, ~1/16 the error
    assert errors[2] < 0.1, errors


def test_biases_of_another_architecture_match_brute_force():
    model = tiny_qwen2()
    assert any(name.endswith("q_proj.bias") for name, _ in model.named_parameters())
    ids = torch.tensor([3, 5, 3, 8])
    logits, kappa = brute_force_logit_sensitivities(model, ids)
    p = torch.softmax(logits, -1)
    mu = warped_distribution(logits, 0.8, 6, 1.0)
    reward = _reward(logits.numel())
    reference = brute_force_moments(kappa, p, mu, reward)
    fast = _fast_stats(model, ids, p, mu, reward, False)
    for stat in ("fisher", "uncentered", "raw", "mean_shift", "common", "policy_grad", "bound"):
        for name in kappa:
            torch.testing.assert_close(fast.stat(stat, name), reference[stat][name], rtol=1e-9, atol=1e-11)
