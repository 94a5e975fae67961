"""The engine on the real SmolLM2-135M: the essay's coffee/tea rows, and a top-k brute force.

With top-k sampling mu has k tokens, so its Fisher needs only k backward passes by brute force: a
check of every parameter of the real model, tied embedding included, at float32 precision.
"""

from __future__ import annotations

import pytest
import torch

from backend.schemas import AnalysisJob
from backend.settings import Settings
from backend.vocabulary import Sampler
from workers.fisher.position import HeadLayout
from workers.fisher.sampler import warped_distribution
from workers.jobs import analyze_job

pytestmark = pytest.mark.slow
PREFIX = "She drank a cup of"


def run_analysis(loaded, job: AnalysisJob, progress=None):
    """The worker's own path from a job to an analysis, at the configured settings."""
    return analyze_job(loaded, job, Settings(), progress)


def _job(loaded, **kwargs) -> AnalysisJob:
    ids = loaded.tokenizer.encode(PREFIX).ids
    return AnalysisJob(model=loaded.id, weights_digest=loaded.info.digest, input_ids=ids, **kwargs)


def _token(loaded, text: str) -> int:
    ids = loaded.tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) == 1, (text, ids)
    return ids[0]


@pytest.fixture(scope="module")
def on_policy(smollm2):
    return run_analysis(smollm2, _job(smollm2))


def test_coffee_and_tea_rows_are_coin_flips(smollm2, on_policy):
    summary = on_policy.summary
    assert summary["positions"][0]["p"]["top"][0]["text"] == " coffee"
    head = on_policy.per_parameter("fisher")[HeadLayout.of(smollm2.model).head_name]
    ids = torch.tensor(_job(smollm2).input_ids)
    with torch.no_grad():
        hidden = smollm2.model.model(input_ids=ids[None]).last_hidden_state[0, -1]
        p = torch.softmax(smollm2.model.lm_head(hidden).double(), -1)
    h_sq = hidden.double().square()
    for text in (" coffee", " tea"):
        c = _token(smollm2, text)
        torch.testing.assert_close(head[c].double(), h_sq * p[c] * (1 - p[c]), rtol=2e-5, atol=1e-7)
    rows = {r["text"]: r for r in summary["positions"][0]["output_layer"]["rows"]}
    total = summary["positions"][0]["output_layer"]["total"]
    assert total == pytest.approx(float(h_sq.sum() * (1 - p.square().sum())), rel=1e-5)
    assert rows[" coffee"]["share"] == pytest.approx(
        float(h_sq.sum() * p[_token(smollm2, " coffee")] * (1 - p[_token(smollm2, " coffee")])) / total,
        rel=1e-5,
    )


def test_top_k_fisher_matches_k_backward_passes(smollm2):
    k = 6
    analysis = run_analysis(smollm2, _job(smollm2, sampler=Sampler(top_k=k)))
    model = smollm2.model
    ids = torch.tensor(_job(smollm2).input_ids)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    logits = model(input_ids=ids[None], use_cache=False).logits[0, -1]
    mu = warped_distribution(logits.detach(), 1.0, k, 1.0)
    support = torch.nonzero(mu).flatten().tolist()
    kappa = [torch.autograd.grad(logits[a], params, retain_graph=True) for a in support]
    fast = analysis.per_parameter("fisher")
    for index, name in enumerate(names):
        rows = torch.stack([g[index].double() for g in kappa])  # [k, *shape]
        weights = mu[support].view(-1, *([1] * (rows.dim() - 1)))
        mean = (weights * rows).sum(0)
        brute = (weights * (rows - mean).square()).sum(0)
        scale = float(brute.abs().max())
        torch.testing.assert_close(
            fast[name].double(),
            brute,
            rtol=1e-3,
            atol=1e-4 * scale + 1e-12,
            msg=lambda m, n=name: f"{n}: {m}",
        )
    assert analysis.summary["positions"][0]["spectrum"]["numerical_rank"] == k - 1
