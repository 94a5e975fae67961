"""Cost estimate of an analysis, before it runs (torch-free).

Why: the API refuses a request whose estimate exceeds the configured budget and names cheaper methods,
instead of tying up a worker for an hour. The exact method back-propagates r directions through the
model at every analysed position, about 2 r P flop per context token (DESIGN §3), r <= d_model.
"""

from __future__ import annotations

import math
from typing import Protocol

from backend.schemas import AnalysisJob, CostEstimate
from backend.square_forms import prefers_ghost
from backend.vocabulary import MethodName, SamplerKind, is_on_policy, parse_method


class SizedModel(Protocol):
    n_params: int
    d_model: int


# What an analysis costs beyond 2 r P flop per context token and direction, fitted to the seconds
# `benchmarks/bench_engine.py` measures on SmolLM2-135M (prefixes of 5 to 256 tokens, continuations up to
# 64, exact and Monte Carlo; it prints the estimate against the measured time) and counted in flops per
# parameter at the matmul rate. Why they depend on the machine: only the matmuls follow that rate; the
# backward's elementwise ops and the summary's passes follow memory, so the faster a machine's matmuls
# against its memory, the larger these are (README, Speed). Fitted on a 2-core AVX-512 AMD EPYC
# (matmuls at 110-160 GFLOP/s) to two runs of the benchmark, the second 25-30% faster throughout (the
# machine is shared); on a 2-core AVX-512 Intel Xeon (340-390 GFLOP/s) they were 1.9, 100, 180, 8.6 and
# 4300 (fitted there), and these would estimate about half the time measured there. Refitted on the
# AVX-512 EPYC to one run at 135-180 GFLOP/s after the summary got 2x faster (summary 1100 -> 600) and the
# ghost moments cheaper: the per-token term, 102 -> 130, also carries the probe directions a tied model
# sends per distinct context token, not counted in r (README, Speed), so long responses, whose probes
# grow with their length, are the least well estimated (0.83x at 5 + 64 tokens).
DIRECTION_EFFICIENCY = 1.22  # the batched backward and the block squares against 2 r P t at the matmul rate
POSITION_FLOPS_PER_PARAM = 200  # per analysed position: forward, C_mu, the moments folded into the sums
CONTEXT_TOKEN_FLOPS_PER_PARAM = 130  # per context token of each position: activations kept, probes
GHOST_PAIR_FLOPS_PER_PARAM = 4.3  # times n (n + 1) per position in the ghost form: its squares, M
SUMMARY_FLOPS_PER_PARAM = 600  # once, measured: totals, concentration curves, top coordinates


def context_lengths(job: AnalysisJob) -> list[int]:
    """Context length of every analysed position: one for a prefix, T along a continuation.

    Position t (1-based) predicts y_t from the prefix plus y_1..y_{t-1}: len(prefix) + t - 1 tokens.
    """
    n_prefix = len(job.input_ids)
    # a response still to be sampled counts at its longest: an upper bound until it is drawn
    n_response = len(job.continuation_ids) or (
        job.continuation_sample.max_tokens if job.continuation_sample else 0
    )
    if not n_response:
        return [n_prefix]
    return [n_prefix + t - 1 for t in range(1, n_response + 1)]


def sampler_directions(d_model: int, job: AnalysisJob) -> int:
    """Rank bound of C_mu: d_model, or k - 1 under top-k (at least one direction)."""
    top_k = job.sampler.top_k if job.sampler.kind == SamplerKind.model else None
    if top_k is not None:
        return max(1, min(d_model, top_k - 1))
    return d_model


def backward_directions(info: SizedModel, job: AnalysisJob) -> int:
    """Directions back-propagated per analysed position.

    Off-policy (mu != p) adds the d_model directions of the Fisher under p, which rho needs.
    `truncated:F` keeps about F of the directions (an upper bound); `mc:S` uses S.
    """
    name, fraction, samples = parse_method(job.method)
    mu_directions = sampler_directions(info.d_model, job)
    s = job.sampler
    p_directions = 0 if is_on_policy(s.kind, s.temperature, s.top_k, s.top_p, s.engine) else info.d_model
    if name == MethodName.truncated:
        assert fraction is not None
        mu_directions = max(1, math.ceil(fraction * mu_directions))
        p_directions = math.ceil(fraction * p_directions)
    elif name == MethodName.mc:
        assert samples is not None
        mu_directions = samples
        p_directions = samples if p_directions else 0
    return mu_directions + p_directions


def estimate_flops(info: SizedModel, job: AnalysisJob) -> float:
    """About 2 r P flop per context token and direction, plus the forward pass (DESIGN §3)."""
    tokens = sum(context_lengths(job))
    return 2.0 * info.n_params * tokens * (backward_directions(info, job) + 1)


def ghost_context_pairs(info: SizedModel, job: AnalysisJob) -> int:
    """sum of n (n + 1) over the positions whose n context rows take the ghost form (the engine's rule,
    on a d_model x d_model block): that form's squares cost about P n (n + 1) flop per pass."""
    directions = backward_directions(info, job)
    d = info.d_model
    return sum(n * (n + 1) for n in context_lengths(job) if prefers_ghost(directions, n, d, d))


def estimate_seconds(info: SizedModel, job: AnalysisJob, flops_per_second: float) -> float:
    """The direction pass at its measured efficiency, plus the per-position, per-token, ghost-form and
    summary work."""
    contexts = context_lengths(job)
    overhead = info.n_params * (
        POSITION_FLOPS_PER_PARAM * len(contexts)
        + CONTEXT_TOKEN_FLOPS_PER_PARAM * sum(contexts)
        + GHOST_PAIR_FLOPS_PER_PARAM * ghost_context_pairs(info, job)
        + SUMMARY_FLOPS_PER_PARAM
    )
    return (DIRECTION_EFFICIENCY * estimate_flops(info, job) + overhead) / max(flops_per_second, 1.0)


def estimate_cost(info: SizedModel, job: AnalysisJob, flops_per_second: float) -> CostEstimate:
    """Flops of the direction pass, and seconds of the whole analysis, of `job` at `flops_per_second`."""
    flops = estimate_flops(info, job)
    return CostEstimate(
        flops=flops,
        seconds=estimate_seconds(info, job, flops_per_second),
        directions=backward_directions(info, job),
        upper_bound=parse_method(job.method)[0] == MethodName.truncated,
    )


def cheaper_methods(info: SizedModel, job: AnalysisJob, budget_flops: float) -> list[str]:
    """Methods that would fit the budget for this job, cheapest last (mc:16 is always offered)."""
    offers: list[str] = []
    for method in ("truncated:0.5", "truncated:0.25", "truncated:0.1", "mc:64", "mc:16"):
        if estimate_flops(info, job.model_copy(update={"method": method})) <= budget_flops:
            offers.append(method)
    return offers
