"""The notebook entry points on models already in memory: the brute force for every stat (tiny models
of two families, float64), the service's own numbers for text input, a study, and a refused model."""

from __future__ import annotations

import math

import pytest
import torch

from backend.settings import Settings
from backend.vocabulary import STATS, Sampler
from tests.test_engine import _job as engine_job
from tests.test_engine import _token as token_id
from tests.tiny_models import tiny_model
from workers.fisher.reference import brute_force_logit_sensitivities, brute_force_moments
from workers.fisher.sampler import warped_distribution
from workers.jobs import analyze_job
from workers.models.loading import ModelLoadError
from workers.notebook import analyze, study

PREFIX = [3, 5, 8, 7, 11]
REWARD = {2: 1.0, 5: -0.5, 7: 2.0}


@pytest.mark.usefixtures("float64_reference")
@pytest.mark.parametrize(("family", "tied"), [("llama", True), ("qwen2", False)])
def test_every_stat_equals_the_brute_force(family, tied, tiny_random):
    model = tiny_model(family, tied=tied)
    result = analyze(model, tiny_random.tokenizer, PREFIX, temperature=0.7, top_k=5, reward=REWARD)
    logits, kappa = brute_force_logit_sensitivities(model, torch.tensor(PREFIX))
    p = torch.softmax(logits, -1)
    mu = warped_distribution(logits, 0.7, 5, 1.0)
    reward = torch.zeros(logits.numel(), dtype=torch.float64)
    for token, value in REWARD.items():
        reward[token] = value
    reference = brute_force_moments(kappa, p, mu, reward)
    for stat in (s for s in STATS if s != "rho"):  # rho: a ratio, tested where its denominator is not 0
        tensors = result.per_parameter(stat)
        assert set(tensors) == set(kappa)
        for name, want in reference[stat].items():
            # per_parameter hands tensors over in float32, as a notebook plots and saves them
            torch.testing.assert_close(
                tensors[name].double(), want, rtol=2e-6, atol=1e-9, msg=f"{stat} {name}"
            )
    assert result.summary["model"]["architecture"] == type(model).__name__
    assert result.summary["totals"]["fisher"] == pytest.approx(
        sum(float(v.sum()) for v in reference["fisher"].values()), rel=1e-9
    )


def test_text_input_gives_the_services_numbers(tiny_random):
    """The notebook's analysis of a text prefix and reward is the worker's analysis of the same request;
    a model in training mode is analysed in eval mode and left in training mode."""
    tiny_random.model.train()
    try:
        result = analyze(
            tiny_random.model,
            tiny_random.tokenizer,
            "She drank a cup of",
            reward={" tea": 1.0},
            temperature=0.7,
            rho=True,
        )
        assert tiny_random.model.training
    finally:
        tiny_random.model.eval()
    tea = str(token_id(tiny_random, " tea"))
    job = engine_job(tiny_random, sampler=Sampler(temperature=0.7), reward={tea: 1.0}, rho=True)
    ids = job.input_ids
    service = analyze_job(tiny_random, job, Settings()).summary
    assert [t["id"] for t in result.summary["tokens"]["prefix"]] == ids
    assert result.summary["reward"] == service["reward"]
    for key, value in service["totals"].items():
        assert result.summary["totals"][key] == pytest.approx(value, rel=1e-6), key
    assert result.summary["model"]["digest"].startswith("sha256:")  # of the weights in memory


def test_a_study_returns_its_masks_and_sums(tiny_random):
    prompts = [("Q: 2+3=? A:", " 5"), ("Q: 4+4=? A:", " 8")]
    found = study(
        tiny_random.model,
        tiny_random.tokenizer,
        prompts,
        samples=2,
        max_tokens=3,
        top_k=20,
        reward_regex=r"^\s*{target}",
        q=(0.01, 0.05),
    )
    n_params = sum(p.numel() for p in tiny_random.model.parameters())
    assert found.summary["counts"]["responses"] == 4 and found.summary["counts"]["n_params"] == n_params
    for q, masks in found.masks.items():
        assert sum(int(m.sum()) for m in masks.values()) == math.ceil(q * n_params)
    fisher = sum(float(v.double().sum()) for v in found.sums["F"].values())
    assert fisher == pytest.approx(found.summary["totals"]["fisher"], rel=1e-5)
    with pytest.raises(ValueError, match="no target"):
        study(tiny_random.model, tiny_random.tokenizer, ["Q: 1+1=? A:"], reward_exact=True)


def test_a_model_the_certificate_refuses_is_refused_with_its_reason(tiny_random):
    model = tiny_model("llama", tied=False, dtype=torch.float32, seed=3)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(ModelLoadError, match="down_proj"):
        analyze(model, tiny_random.tokenizer, PREFIX)
