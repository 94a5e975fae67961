"""Every promised family against float64 brute force, the certificate on each, and what it refuses.

Models come from transformers' own config classes (tests/tiny_models.py): nothing is swapped, so a
wrong form for Gemma's (1 + w) norms, Qwen3's per-head q/k norms, GPT-2's Conv1D, OPT's offset
positions, Gemma 2's softcapping or Mixtral's routed 3-D experts would show here.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from backend.vocabulary import STATS, Method, MethodName
from tests.tiny_models import BUDGET, FAMILIES, PAD_ID, tiny_model
from workers.fisher.certificate import certify
from workers.fisher.position import PositionInputs, position_moments
from workers.fisher.reference import brute_force_logit_sensitivities, brute_force_moments
from workers.fisher.response import analyze_sequence
from workers.fisher.sampler import Sampler, warped_distribution
from workers.fisher.stats import MomentSums

CASES = [(family, tied) for family, spec in FAMILIES.items() for tied in spec.tied_options]
IDS = [4, 9, PAD_ID, 4, 7, 12]  # a repeated token and the padding row


def _case_id(case: tuple[str, bool]) -> str:
    return f"{case[0]}-{'tied' if case[1] else 'untied'}"


def _reward(vocab: int) -> torch.Tensor:
    reward = torch.zeros(vocab, dtype=torch.float64)
    reward[2], reward[5], reward[7] = 1.0, -0.5, 2.0
    return reward


def _engine(model, ids, p, mu, reward, on_policy, method=None) -> MomentSums:
    inputs = PositionInputs(ids, p, mu, reward, on_policy)
    moments = position_moments(model, inputs, method or Method(), memory_budget_bytes=BUDGET)
    sums = MomentSums(
        [n for n, _ in model.named_parameters()], {n: tuple(t.shape) for n, t in model.named_parameters()}
    )
    sums.add(moments)
    return sums


def assert_stats_match(fast: MomentSums, reference: dict, kappa: dict, p: torch.Tensor, label: str) -> None:
    """Every stat, every tensor, at float64 rounding (absolute floor: 1e-12 of the stat's largest value)."""
    assert set(reference) <= set(STATS)
    for stat in reference:
        scale = max(float(v.abs().max()) for v in reference[stat].values())
        for name, want in reference[stat].items():
            got = fast.stat(stat, name)
            if stat == "rho":  # a ratio: compare where its denominator is above rounding level
                second = torch.tensordot(p, kappa[name].square(), dims=1)
                top = max(float(torch.tensordot(p, k.square(), dims=1).max()) for k in kappa.values())
                keep = second > 1e-12 * top
                got, want = got[keep], want[keep]
            torch.testing.assert_close(
                got,
                want,
                rtol=1e-9,
                atol=1e-12 * scale,
                msg=lambda m, s=stat, n=name: f"{label} {s} {n}: {m}",
            )


@pytest.mark.usefixtures("float64_reference")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_stat_matches_brute_force(case):
    family, tied = case
    model = tiny_model(family, tied=tied)
    ids = torch.tensor(IDS)
    logits, kappa = brute_force_logit_sensitivities(model, ids)
    p = torch.softmax(logits, -1)
    reward = _reward(logits.numel())
    samplers = {"on-policy": (p, True), "T0.8-k6-p0.9": (warped_distribution(logits, 0.8, 6, 0.9), False)}
    for label, (mu, on_policy) in samplers.items():
        reference = brute_force_moments(kappa, p, mu, reward)
        assert_stats_match(
            _engine(model, ids, p, mu, reward, on_policy), reference, kappa, p, f"{case} {label}"
        )


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_certificate_passes_on_the_unmodified_float32_model(case):
    family, tied = case
    certificate = certify(tiny_model(family, tied=tied, dtype=torch.float32), BUDGET)
    assert certificate.passed, certificate.reason
    assert certificate.logits_error == 0.0  # the recorder only observes: the very same logits
    assert certificate.first_moment_error <= 1e-4 and certificate.square_error <= 1e-4
    assert sum(certificate.routes.values()) == len(list(tiny_model(family, tied=tied).parameters()))


def _hidden_extra_use(model) -> str:
    """Make one projection also use its weight out of the engine's sight (torch functions disabled)."""
    proj = model.model.layers[0].mlp.down_proj

    def forward(x, weight=proj.weight):
        with torch._C.DisableTorchFunction():
            unseen = 0.5 * F.linear(x, weight)
        return F.linear(x, weight) + unseen

    proj.forward = forward
    return "model.layers.0.mlp.down_proj"


def test_certificate_refuses_a_forward_the_engine_cannot_see_and_names_the_module():
    model = tiny_model("qwen3", dtype=torch.float32)
    module = _hidden_extra_use(model)
    certificate = certify(model, BUDGET)
    assert not certificate.passed
    assert certificate.failing_module == module
    assert certificate.reason.startswith(f"module {module}:")


@pytest.mark.usefixtures("float64_reference")
def test_an_output_edited_in_place_falls_back_to_autograd_and_stays_exact():
    model = tiny_model("llama")
    proj = model.model.layers[1].self_attn.o_proj

    def forward(x, weight=proj.weight):
        y = F.linear(x, weight)
        y.mul_(1.5)  # the recorded output is no longer what F.linear produced
        return y

    proj.forward = forward
    ids = torch.tensor(IDS)
    logits, kappa = brute_force_logit_sensitivities(model, ids)
    p = torch.softmax(logits, -1)
    fast = _engine(model, ids, p, p, None, True)
    assert_stats_match(fast, brute_force_moments(kappa, p, p, None), kappa, p, "in-place")
    assert certify(model, BUDGET).autograd_matrices == ["model.layers.1.self_attn.o_proj.weight"]


@pytest.mark.usefixtures("float64_reference")
def test_experts_through_batched_mm_take_the_autograd_path_and_stay_exact():
    """Experts gathered per token (transformers' batched_mm): no fast form, exact through autograd."""
    model = tiny_model("mixtral")
    model.set_experts_implementation("batched_mm")
    ids = torch.tensor(IDS)
    logits, kappa = brute_force_logit_sensitivities(model, ids)
    p = torch.softmax(logits, -1)
    mu = warped_distribution(logits, 0.8, 6, 1.0)
    fast = _engine(model, ids, p, mu, _reward(logits.numel()), False)
    assert_stats_match(
        fast, brute_force_moments(kappa, p, mu, _reward(logits.numel())), kappa, p, "grouped_mm"
    )
    assert "expert" not in certify(model, BUDGET).routes


def test_certificate_passes_with_transformers_default_grouped_mm_experts():
    model = tiny_model("qwen3_moe", dtype=torch.float32)
    model.set_experts_implementation("grouped_mm")  # float32 only; the default when nothing is asked
    certificate = certify(model, BUDGET)
    assert certificate.passed, certificate.reason
    assert sorted(certificate.autograd_matrices) == sorted(
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
    )


@pytest.mark.usefixtures("float64_reference")
@pytest.mark.parametrize("family", ["qwen3_moe", "gemma2", "gpt2"])
def test_response_sums_match_per_position_brute_force(family):
    """Along a response each position has its own routing (MoE) and logit map (softcapping)."""
    model = tiny_model(family, tied=True)
    prefix, continuation = torch.tensor([3, 5, 3]), torch.tensor([8, 3, 1])
    reward = _reward(model.config.vocab_size)
    result = analyze_sequence(
        model,
        prefix,
        continuation,
        Sampler(temperature=0.7, top_k=5),
        Method(),
        reward,
        memory_budget_bytes=BUDGET,
    )
    full = torch.cat([prefix, continuation])
    expected: dict[str, dict[str, torch.Tensor]] = {}
    for t in range(continuation.numel()):
        logits, kappa = brute_force_logit_sensitivities(model, full[: prefix.numel() + t])
        mu = warped_distribution(logits, 0.7, 5, 1.0)
        reference = brute_force_moments(kappa, torch.softmax(logits, -1), mu, reward)
        for stat in ("fisher", "uncentered", "raw", "mean_shift", "common", "policy_grad", "bound"):
            for name, value in reference[stat].items():
                table = expected.setdefault(stat, {})
                table[name] = table[name] + value if name in table else value
    for stat, table in expected.items():
        scale = max(float(v.abs().max()) for v in table.values())
        for name, value in table.items():
            torch.testing.assert_close(result.sums.stat(stat, name), value, rtol=1e-9, atol=1e-12 * scale)


@pytest.mark.usefixtures("float64_reference")
def test_truncation_and_monte_carlo_through_a_softcapped_head():
    model = tiny_model("gemma2", tied=True)
    ids = torch.tensor(IDS)
    logits, _ = brute_force_logit_sensitivities(model, ids)
    p = torch.softmax(logits, -1)
    exact = _engine(model, ids, p, p, None, True)
    whole = _engine(model, ids, p, p, None, True, Method(MethodName.truncated, fraction=1.0))
    sampled = _engine(model, ids, p, p, None, True, Method(MethodName.mc, samples=8192, seed=1))
    num = den = 0.0
    for name in exact.names:
        torch.testing.assert_close(
            whole.stat("fisher", name), exact.stat("fisher", name), rtol=1e-9, atol=1e-14
        )
        num += float((sampled.stat("fisher", name) - exact.stat("fisher", name)).square().sum())
        den += float(exact.stat("fisher", name).square().sum())
    assert (num / den) ** 0.5 < 0.05


def test_the_wire_certificate_has_the_engine_certificate_fields():
    from dataclasses import fields

    from backend.schemas import CertificatePublic
    from workers.fisher.certificate import Certificate

    assert [f.name for f in fields(Certificate)] == list(CertificatePublic.model_fields)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_sampled_response_is_the_draw_of_full_forward_passes(family):
    """The KV cache changes nothing: every token is drawn from the mu of an uncached forward."""
    from workers.fisher.sampler import sampler_distribution
    from workers.fisher.sampling import sample_continuation

    model = tiny_model(family)
    prefix = torch.tensor([2, 5, PAD_ID, 9])
    sampler = Sampler(temperature=0.8, top_k=12)
    drawn = sample_continuation(model, prefix, sampler, seed=3, max_tokens=6, stop_ids=set())
    generator, ids = torch.Generator().manual_seed(3), prefix.tolist()
    for _ in range(6):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(ids)[None], use_cache=False).logits[0, -1]
        mu = sampler_distribution(sampler, logits, None)
        ids.append(int(torch.multinomial(mu, 1, generator=generator)))
    assert drawn == ids[prefix.numel() :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_captured_forward_computes_the_models_own_logits(family, dtype):
    """A prefix's p comes from its captured forward (the model runs once): the recording, with autograd
    on, must leave every logit as the plain no-grad forward computes it, bit for bit."""
    from workers.fisher.capture import capture_forward
    from workers.fisher.response import next_token_logits

    model = tiny_model(family, tied=FAMILIES[family].tied_options[0], seed=3, dtype=dtype)
    ids = torch.tensor(IDS)
    assert torch.equal(capture_forward(model, ids).logits[0].detach().double(), next_token_logits(model, ids))
