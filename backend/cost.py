"""Cost estimate of an analysis, before it runs (torch-free).

Why: the API refuses a request whose estimate exceeds the configured budget and names cheaper methods,
instead of tying up a worker for an hour. The exact method back-propagates r directions through the
model at every analysed position, about 2 r P flop per context token (docs/design.md §3), r <= d_model.
"""

from __future__ import annotations

from typing import Protocol

from backend.memory_estimate import context_lengths, estimate_peak
from backend.schemas import AnalysisJob, CostEstimate
from backend.square_forms import prefers_ghost
from backend.vocabulary import Method, MethodName, SamplerKind, takes_a_first_pass


class SizedModel(Protocol):
    n_params: int
    d_model: int
    vocab_size: int
    tied_embeddings: bool


# What an analysis costs beyond 2 P flop per context token and direction (the r directions and the tied
# table's probes), counted in flops per parameter at the matmul rate at the model's width
# (`workers.throughput.matmul_rate`) and fitted to the seconds `benchmarks/bench_engine.py` measures on
# SmolLM2-135M (prefixes of 5 to 256 tokens, continuations up to 64, exact and Monte Carlo; it prints the
# estimate against the measured time; docs/speed.md has the fit). A term per analysed position (its
# forward, C_mu, the fold) fits at zero, the per-token term carrying it along a response and the
# once-per-analysis term for a prefix, so it is not counted.
# Why these depend on the machine: only the matmuls follow that rate; the backward's elementwise ops and
# the summary's passes do not, so the faster a machine's matmuls against the rest, the larger these are.
DIRECTION_EFFICIENCY = 1.04  # the batched backward and the block squares against 2 r P t at the matmul rate
CONTEXT_TOKEN_FLOPS_PER_PARAM = 41  # per context token of each position: activations kept, attention
GHOST_PAIR_FLOPS_PER_PARAM = 2.9  # times n (n + 1) per position in the ghost form: its squares, M
SUMMARY_FLOPS_PER_PARAM = 2000  # once: totals, concentration curves, top coordinates (a prefix's C_mu)
# A response's first pass, where partial results are asked for (``takes_a_first_pass``): per position its
# first moments' directions and its Fisher's leading one, each back-propagated over the whole response's
# context (one forward serves every position), and its totals and first moments' terms (per parameter;
# fitted to benchmarks/bench_response.py on SmolLM2-135M: 0.3-0.5 s per position at 340-380 GFLOP/s, of
# which C_mu's plans, made once for every pass, are not the first pass's own)
FIRST_PASS_DIRECTIONS = 3
FIRST_PASS_FLOPS_PER_PARAM = 600
# its refining round to 90% of every position's trace (not with a reward): the leading directions that
# carry it (on SmolLM2 7-120 of 576 per position on the policy, 3-22 of 49 under top-k 50), which the
# exact pass takes over where the workspace keeps them; what is left is their backward over the whole
# response's rows and the positions not kept, as a share of the exact directions (SmolLM2, 7 tokens
# on the policy: 63.7 s with partial results against 58.0 s without, the first pass's 3.4 s included)
REFINING_DIRECTION_SHARE = 0.05


def slowest_live_rate(rates: dict[str, float], live: set[str] | None) -> float | None:
    """The rate to turn flops into seconds: the slowest of the live workers that published one for the
    model (a job may land on any of them); None when none has (the configured rate stands in). ``live``
    None: every worker is this process, and what it published is its own."""
    found = [rate for worker, rate in rates.items() if (live is None or worker in live) and rate > 0]
    return min(found) if found else None


def sampler_directions(d_model: int, job: AnalysisJob) -> int:
    """Rank bound of C_mu: d_model, or k - 1 under top-k (at least one direction)."""
    top_k = job.sampler.top_k if job.sampler.kind == SamplerKind.model else None
    if top_k is not None:
        return max(1, min(d_model, top_k - 1))
    return d_model


def backward_directions(info: SizedModel, job: AnalysisJob) -> int:
    """Directions back-propagated per analysed position.

    Off-policy (mu != p) with ``rho`` adds the d_model directions of the Fisher under p, which rho needs.
    `truncated:F` keeps about F of the directions (an upper bound); `mc:S` uses S.
    """
    p_rank = info.d_model if job.rho else 0
    return job.method.direction_bound(sampler_directions(info.d_model, job)) + job.method.direction_bound(
        p_rank
    )


def probe_directions(info: SizedModel, job: AnalysisJob) -> list[int]:
    """Embedding-row probes back-propagated at each analysed position, besides the r directions.

    A tied table is also the input embedding, and the cross term of its rows needs one direction per
    distinct token the context reads, per Fisher formed (under mu, and under p off the policy): on a
    long response with few directions (Monte Carlo) they are most of the backward. An exact analysis
    sums a Fisher's probes from its directions where they are a complete basis (a full-rank C_q): under
    p always (full support), under mu unless top-k caps its rank below d_model (a rank that top-p's
    nucleus caps is not foreseen). A token that mu (or p) gives no mass needs none, and a response still
    to be sampled counts as all distinct.
    """
    fishers = 2 if job.rho else 1
    if job.method.name == MethodName.exact:
        fishers = 0 if sampler_directions(info.d_model, job) == info.d_model else 1
    if not info.tied_embeddings or not fishers:
        return [0] * len(context_lengths(job))
    if not job.continuation_ids and job.continuation_sample:
        return [fishers * n for n in context_lengths(job)]
    ids = [*job.input_ids, *job.continuation_ids]
    return [fishers * len(set(ids[:n])) for n in context_lengths(job)]


def estimate_flops(info: SizedModel, job: AnalysisJob) -> float:
    """About 2 P flop per context token and direction (the r directions and the probes), plus the
    forward pass (docs/design.md §3)."""
    r = backward_directions(info, job)
    per_position = zip(context_lengths(job), probe_directions(info, job), strict=True)
    return 2.0 * info.n_params * sum(n * (r + probes + 1) for n, probes in per_position)


def ghost_context_pairs(info: SizedModel, job: AnalysisJob) -> int:
    """sum of n (n + 1) over the positions whose n context rows take the ghost form (the engine's rule,
    on a d_model x d_model block): that form's squares cost about P n (n + 1) flop per pass."""
    directions = backward_directions(info, job)
    d = info.d_model
    return sum(n * (n + 1) for n in context_lengths(job) if prefers_ghost(directions, n, d, d))


def estimate_seconds(
    info: SizedModel, job: AnalysisJob, flops_per_second: float, partials: bool = False
) -> float:
    """The direction pass at its measured efficiency, plus the per-token, ghost-form and summary work,
    and with ``partials`` a response's first pass."""
    lengths = context_lengths(job)
    overhead = info.n_params * (
        CONTEXT_TOKEN_FLOPS_PER_PARAM * sum(lengths)
        + GHOST_PAIR_FLOPS_PER_PARAM * ghost_context_pairs(info, job)
        + SUMMARY_FLOPS_PER_PARAM
    )
    directions = DIRECTION_EFFICIENCY * estimate_flops(info, job)
    if partials and takes_a_first_pass(job.method, job.sampler, len(lengths)):
        per_position = DIRECTION_EFFICIENCY * 2.0 * FIRST_PASS_DIRECTIONS * max(lengths)
        overhead += info.n_params * len(lengths) * (per_position + FIRST_PASS_FLOPS_PER_PARAM)
        if not job.reward:
            overhead += REFINING_DIRECTION_SHARE * directions
    return (directions + overhead) / max(flops_per_second, 1.0)


def estimate_cost(
    info: SizedModel,
    job: AnalysisJob,
    flops_per_second: float,
    workspace_bytes: int = 2 << 30,
    partials: bool = False,
    sums_memory_bytes: int | None = None,
) -> CostEstimate:
    """Flops of the direction pass, and seconds of the whole analysis, of `job` at `flops_per_second`;
    its peak memory with the engine's workspace of ``workspace_bytes`` and a response's sums in memory up to
    ``sums_memory_bytes`` (``backend.memory_estimate``). ``partials``: the analysis gives partial results
    (the service's do), and a response's seconds count its first pass."""
    flops = estimate_flops(info, job)
    return CostEstimate(
        flops=flops,
        seconds=estimate_seconds(info, job, flops_per_second, partials),
        directions=backward_directions(info, job),
        upper_bound=job.method.name == MethodName.truncated,
        peak_bytes=estimate_peak(info, job, workspace_bytes, sums_memory_bytes).total,
    )


def cheaper_methods(info: SizedModel, job: AnalysisJob, budget_flops: float) -> list[str]:
    """Methods that would fit the budget for this job, cheapest last (mc:16 is always offered)."""
    offers: list[str] = []
    for method in ("truncated:0.5", "truncated:0.25", "truncated:0.1", "mc:64", "mc:16"):
        if estimate_flops(info, job.model_copy(update={"method": Method.parse(method)})) <= budget_flops:
            offers.append(method)
    return offers
