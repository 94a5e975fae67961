"""Peak memory of an analysis, before it runs (torch-free; docs/design.md §3b).

Why: an analysis that does not fit is killed by the kernel part way through (a worker and its queue
with it), after minutes of work. What it holds at its peak: the weights; the parameter-sized sums (a
prefix's Fisher, and the Fisher under p when rho is asked; along a response, every sum over positions,
whose squares are not low rank); the summary's workspace, a few arrays of a block of rows
(``PIECE_VALUES``) in each thread; the engine's workspace (``backend.workspace``): a direction chunk in
one half, in the other the ghost moments kept between chunks (reached at long contexts) and, along a
response, what its first pass and refining round keep for the exact pass; one array of the largest
tensor (the certificate's backward holds a tied table's gradient from the head until the lookup's
arrives); the runtime; and what the allocator keeps beyond the arrays alive, fitted on
`benchmarks/bench_scale.py`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

from backend.normalize import RequestError
from backend.schemas import AnalysisJob
from backend.settings import Settings
from backend.square_forms import ghost_entries
from backend.vocabulary import PIECE_VALUES, takes_a_first_pass
from backend.workspace import between_chunks_bytes, chunk_bytes

VALUE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
# Python, torch, transformers and the tokenizer, loaded (SmolLM2-135M's run peaks at 0.9 GB in all)
RUNTIME_BYTES = 700 << 20
# what the malloc arenas keep beyond the arrays alive, per parameter. With it the estimate is above every
# peak `bench_scale.py` measured, by 10-25%: Qwen3-0.6B 8.2 / 10.6 / 7.9 / 20.1 GB estimated against 6.5 /
# 9.1 / 6.3 / 18.7 (top-k, rho, on the policy, an 8-token response); Qwen3-1.7B 18.1 / 17.9 against 15.3
# (16.7 for its certificate) / 15.1
SLACK_BYTES_PER_PARAM = 0.3
SUMMARY_THREADS = 2  # each summarizing thread forms its tables into buffers of its own


class MeasuredModel(Protocol):
    n_params: int
    d_model: int
    vocab_size: int


@dataclass(frozen=True)
class PeakMemory:
    weights: int
    sums: int  # parameter-sized sums in memory
    workspace: int  # the summary's blocks, a direction chunk, the largest tensor, the runtime, the slack
    # a response's sums beyond ``sums_memory_bytes``: memory-mapped files, pages the kernel can write out,
    # so not in ``total``
    mapped: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.sums + self.workspace

    def line(self) -> str:
        mapped = f"; {self.mapped / 1e9:.1f} GB more of sums in mapped files" if self.mapped else ""
        return (
            f"~{self.total / 1e9:.1f} GB at peak (weights {self.weights / 1e9:.1f}, "
            f"sums {self.sums / 1e9:.1f}, workspace {self.workspace / 1e9:.1f}{mapped})"
        )


def along_a_response(job: AnalysisJob) -> bool:
    """Several positions (a response given or sampled), not a prefix's next token alone."""
    return len(job.continuation_ids) > 1 or job.continuation_sample is not None


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


def kept_between_passes(model: MeasuredModel, job: AnalysisJob) -> int:
    """What a response's first pass keeps for its exact pass (``response._FirstPass``), were nothing else
    in the workspace's share between chunks: per position its plans (C_mu's eigenvectors, each Fisher's
    directions: d x d float64 each, and a float64 row of the vocabulary per Fisher) and its refining
    round's ghost moments per Fisher, ``ghost_entries(n)`` values per block output, of which there are
    fewer than the parameters over d_model."""
    lengths = context_lengths(job)
    if not takes_a_first_pass(job.method, job.sampler, len(lengths)):
        return 0
    fishers = 1 + (job.rho and not job.sampler.is_on_policy)
    plans = 8 * ((1 + fishers) * model.d_model**2 + fishers * model.vocab_size)
    outputs = model.n_params // model.d_model
    value = VALUE_BYTES.get(job.dtype, 4)
    return sum(plans + fishers * outputs * ghost_entries(n) * value for n in lengths)


def ghost_moments_between_chunks(model: MeasuredModel, job: AnalysisJob) -> int:
    """What a position's exact pass keeps between its direction chunks were nothing else in the share:
    each ghost block's moments M, ``ghost_entries(n)`` values per output at the longest context
    (``block_squares.SquareAccumulator``). Small at a short context; past the share from ~30 tokens on
    Qwen3-0.6B's shape."""
    outputs = model.n_params // model.d_model
    value = VALUE_BYTES.get(job.dtype, 4)
    return outputs * ghost_entries(max(context_lengths(job))) * value


def between_chunks(model: MeasuredModel, job: AnalysisJob, workspace_bytes: int) -> int:
    """The workspace's share between chunks as the analysis fills it: the kept plans and moments and the
    ghost moments together, never above the share (``_FirstPass.held_after``: a position's ghost moments
    have what the positions after it leave)."""
    wanted = kept_between_passes(model, job) + ghost_moments_between_chunks(model, job)
    return min(between_chunks_bytes(workspace_bytes), wanted)


def position_arrays(job: AnalysisJob) -> int:
    """The parameter-sized arrays of one position: its Fisher, and under p when rho is asked off the
    policy (first moments stay small)."""
    return 1 + (job.rho and not job.sampler.is_on_policy)


def parameter_sized_sums(job: AnalysisJob) -> int:
    """How many parameter-sized arrays the analysis holds at once (``workers.fisher.stats.MomentSums``)."""
    if not along_a_response(job):
        return position_arrays(job)  # a prefix: its position's own
    # along a response: the Fisher and the common component, with its squares where something reads them
    # (the raw Fisher on the policy, rho), the mean shift with its squares and kbar_mu's, the reward's
    # two, the Fisher under p; and the position being added
    on_policy = job.sampler.is_on_policy
    common_squares = on_policy or job.rho
    fisher_p = job.rho and not on_policy
    arrays = 2 + common_squares + (0 if on_policy else 3) + (2 if job.reward else 0) + fisher_p
    return arrays + position_arrays(job)


def summary_tables(job: AnalysisJob) -> int:
    """First-moment tables the summary forms, one block-sized array each, beside its scratch array."""
    return 1 + (not job.sampler.is_on_policy) + (2 if job.reward else 0)


def estimate_peak(
    model: MeasuredModel, job: AnalysisJob, workspace_bytes: int, sums_memory_bytes: int | None = None
) -> PeakMemory:
    """``workspace_bytes``: the engine's (``Settings.engine_memory_bytes``). ``sums_memory_bytes``: what
    a response's sums over positions may hold in memory, the rest mapped from files
    (``workers.fisher.parameter_arrays.SumsStorage``: whole sums, in the order they are made); None: all
    in memory."""
    value = VALUE_BYTES.get(job.dtype, 4)
    largest_values = model.vocab_size * model.d_model
    block = min(largest_values, PIECE_VALUES)
    summary = SUMMARY_THREADS * (summary_tables(job) + 1) * block * value
    slack = int(SLACK_BYTES_PER_PARAM * model.n_params)
    engine = chunk_bytes(workspace_bytes) + between_chunks(model, job, workspace_bytes)
    workspace = summary + engine + largest_values * value + RUNTIME_BYTES + slack
    arrays = parameter_sized_sums(job)
    mapped = 0
    if along_a_response(job) and sums_memory_bytes is not None:
        kept = arrays - position_arrays(job)  # the position being added holds its own
        mapped = max(0, kept - sums_memory_bytes // (model.n_params * value))
    return PeakMemory(
        model.n_params * value,
        (arrays - mapped) * model.n_params * value,
        workspace,
        mapped * model.n_params * value,
    )


def machine_memory_bytes() -> int:
    """Physical memory of this machine (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def what_would_fit(
    model: MeasuredModel,
    job: AnalysisJob,
    workspace_bytes: int,
    limit: int,
    sums_memory_bytes: int | None = None,
) -> list[str]:
    """The changes to ``job`` that bring its peak within ``limit``, each on its own."""
    variants = {
        "without rho": job.model_copy(update={"rho": False}),
        "the prefix alone (no response)": job.model_copy(
            update={"continuation_ids": [], "continuation_sample": None}
        ),
        "in bfloat16 (`--dtype bfloat16`, or the model registered so)": job.model_copy(
            update={"dtype": "bfloat16"}
        ),
    }
    return [
        change
        for change, variant in variants.items()
        if variant != job and estimate_peak(model, variant, workspace_bytes, sums_memory_bytes).total <= limit
    ]


def refuse_over_memory(
    info: MeasuredModel, job: AnalysisJob, settings: Settings, device: str = "cpu"
) -> None:
    """422 for an analysis whose estimated peak is above the memory limit, naming what would fit; on
    ``device`` (``Settings.sums_memory_on``: what of a response's sums is mapped from files)."""
    limit = settings.memory_limit_bytes or machine_memory_bytes()
    sums_memory = settings.sums_memory_on(device)
    peak = estimate_peak(info, job, settings.engine_memory_bytes, sums_memory)
    if limit and peak.total > limit:
        fits = what_would_fit(info, job, settings.engine_memory_bytes, limit, sums_memory)
        raise RequestError(
            f"this analysis needs {peak.line()}, over the memory limit of {limit / 1e9:.1f} GB "
            f"(FISHERSCOPE_MEMORY_LIMIT_BYTES); "
            + (
                f"it would fit {' or '.join(fits)}"
                if fits
                else "nothing smaller of it fits: a smaller model does"
            ),
            status=422,
            field="model",
        )
