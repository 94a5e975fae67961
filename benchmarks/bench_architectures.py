"""Every promised family: worst relative error of the engine against float64 brute force, and what
the generic autograd path costs where a model needs it.

Part 1 (tiny random models from transformers' own config classes, tests/tiny_models.py): for each
family, tied and untied, the worst relative error over every stat and tensor (on-policy and a
T=0.8/top-k 6/top-p 0.9 sampler with a reward), the engine's and the brute force's time, and how many
tensors each path formed.

Part 2: a mid-size random Mixtral (d_model 256, 4 layers, 8 experts) analysed exactly on a 16-token
prefix twice, once with transformers' eager expert loop (the engine's expert-slice form) and once
with its batched_mm experts (no form: every expert tensor through autograd), same numbers, two times.

    .venv/bin/python benchmarks/bench_architectures.py [--skip-generic]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.vocabulary import Method  # noqa: E402
from tests.tiny_models import FAMILIES, PAD_ID, tiny_model  # noqa: E402
from workers.fisher.capture import capture_forward  # noqa: E402
from workers.fisher.position import PositionInputs, position_moments  # noqa: E402
from workers.fisher.reference import (  # noqa: E402
    brute_force_logit_sensitivities,
    brute_force_moments,
    float64_throughout,
)
from workers.fisher.sampler import warped_distribution  # noqa: E402
from workers.fisher.stats import MomentSums  # noqa: E402

IDS = [4, 9, PAD_ID, 4, 7, 12]


def _sums(model, moments) -> MomentSums:
    sums = MomentSums(
        [n for n, _ in model.named_parameters()], {n: tuple(p.shape) for n, p in model.named_parameters()}
    )
    sums.add(moments)
    return sums


def worst_error(family: str, tied: bool) -> tuple[float, str, float, float, float, dict]:
    """Worst relative error over tensors with nonzero values, worst absolute error (relative to the
    stat's largest value) over tensors that are zero up to rounding, engine and brute-force seconds."""
    model = tiny_model(family, tied=tied)
    ids = torch.tensor(IDS)
    with float64_throughout():
        start = time.perf_counter()
        logits, kappa = brute_force_logit_sensitivities(model, ids)
        brute = time.perf_counter() - start
        p = torch.softmax(logits, -1)
        reward = torch.zeros_like(p)
        reward[2], reward[5], reward[7] = 1.0, -0.5, 2.0
        worst, where, zero_error, engine = 0.0, "", 0.0, 0.0
        samplers = (("on-policy", p, True), ("T0.8-k6-p0.9", warped_distribution(logits, 0.8, 6, 0.9), False))
        for label, mu, on_policy in samplers:
            start = time.perf_counter()
            fast = _sums(
                model, position_moments(model, PositionInputs(ids, p, mu, reward, on_policy), Method())
            )
            engine += time.perf_counter() - start
            reference = brute_force_moments(kappa, p, mu, reward)
            for stat, table in reference.items():
                if stat == "rho":
                    continue  # a ratio of fisher_p and common, both compared here
                scale = max(float(v.abs().max()) for v in table.values())
                for name, want in table.items():
                    difference = float((fast.stat(stat, name) - want).abs().max())
                    size = float(want.abs().max())
                    if size <= 1e-9 * scale:  # zero up to rounding (OPT's key biases): absolute, vs the stat
                        zero_error = max(zero_error, difference / max(scale, 1e-300))
                    elif difference / size > worst:
                        worst, where = difference / size, f"{label} {stat} {name}"
        routes = dict(Counter(capture_forward(model, ids).routes.values()))
    return worst, where, zero_error, engine, brute, routes


def generic_path_cost() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).float().eval()
    ids = torch.randint(0, 2048, (16,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        p = torch.softmax(model(input_ids=ids[None]).logits[0, -1].double(), -1)
    results = {}
    for implementation in ("eager", "batched_mm"):
        model.set_experts_implementation(implementation)
        capture = capture_forward(model, ids)
        slow = [n for n in capture.generic if len(capture.shapes[n]) >= 2]
        start = time.perf_counter()
        moments = position_moments(model, PositionInputs(ids, p, p, None, True), Method(), capture)
        results[implementation] = (time.perf_counter() - start, moments.fisher, slow)
    (fast_s, fast, _), (slow_s, slow, names) = results["eager"], results["batched_mm"]
    difference = max(
        float((fast[n] - slow[n]).abs().max() / fast[n].abs().max().clamp_min(1e-30)) for n in fast
    )
    print(
        f"\nMixtral d=256, 4 layers, 8 experts, 16 tokens, exact on-policy "
        f"({sum(p.numel() for p in model.parameters()):,} params)"
    )
    print(f"  experts as slices (eager loop):       {fast_s:7.2f} s")
    print(
        f"  experts through autograd (batched_mm): {slow_s:7.2f} s  ({slow_s / fast_s:.2f}x), "
        f"{len(names)} tensors: {', '.join(names[:2])}, ..."
    )
    print(f"  largest relative difference between the two: {difference:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-generic", action="store_true")
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    print(
        f"{'family':10s} {'tied':6s} {'worst rel. error':>16s} {'zeros err':>10s}  {'engine s':>8s} "
        f"{'brute s':>8s}  paths (tensors)"
    )
    for family, spec in FAMILIES.items():
        for tied in spec.tied_options:
            worst, where, zero, engine, brute, routes = worst_error(family, tied)
            paths = ", ".join(f"{n} {r}" for r, n in sorted(routes.items()))
            print(
                f"{family:10s} {str(tied):6s} {worst:16.2e} {zero:10.1e}  {engine:8.2f} {brute:8.2f}  {paths}"
                f"   [{where}]"
            )
    if not args.skip_generic:
        generic_path_cost()


if __name__ == "__main__":
    main()
