"""The engine on CUDA against float64 on the CPU (runs where a GPU is; CI has none and skips it)."""

from __future__ import annotations

import pytest
import torch

from tests.test_architectures import IDS, _engine, _reward
from tests.tiny_models import tiny_model
from workers.fisher.reference import brute_force_logit_sensitivities, brute_force_moments, float64_throughout
from workers.fisher.sampler import warped_distribution

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "mixtral"])
def test_gpu_float32_matches_cpu_float64_brute_force(family):
    assert not torch.backends.cuda.matmul.allow_tf32  # full-precision float32 matmuls by default
    reference_model = tiny_model(family, tied=True)
    ids = torch.tensor(IDS)
    with float64_throughout():
        logits, kappa = brute_force_logit_sensitivities(reference_model, ids)
    p = torch.softmax(logits, -1)
    mu = warped_distribution(logits, 0.8, 6, 1.0)
    reward = _reward(logits.numel())
    reference = brute_force_moments(kappa, p, mu, reward)
    model = tiny_model(family, tied=True, dtype=torch.float32).cuda()
    fast = _engine(model, ids.cuda(), p.cuda(), mu.cuda(), reward.cuda(), False)
    for stat, table in reference.items():
        if stat == "rho":
            continue
        scale = max(float(v.abs().max()) for v in table.values())
        for name, want in table.items():
            got = fast.stat(stat, name).double().cpu()
            assert float((got - want).abs().max()) <= 1e-4 * scale, f"{family} {stat} {name}"
