"""From an analysis request to an ``Analysis``: the math of ``workers/fisher`` and its summaries.

Why a request of its own rather than the wire's ``AnalysisJob``: the engine is used by the queue's jobs,
the CLI, studies and benchmarks, and depends on none of them; ``workers.jobs`` translates a job into an
``AnalysisRequest``. The ``Analysis`` exposes the summary JSON (docs/contract.md), per-parameter
arrays, pooled views and a safetensors file.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from backend.settings import Settings
from backend.summary import AnalysisSummary
from backend.vocabulary import STATS, EngineKind, Method, Sampler, SamplerKind
from workers.collector import earlier_objects_frozen
from workers.fisher.concentration import NAMED_FRACTIONS
from workers.fisher.model_summary import model_summary
from workers.fisher.parameter_arrays import SumsStorage
from workers.fisher.pooling import pooled_bytes, pooled_view, zero_view
from workers.fisher.position import HeadLayout
from workers.fisher.position_summary import position_summary
from workers.fisher.response import PositionRecord, SequenceAnalysis, analyze_sequence
from workers.fisher.response_summary import response_summary
from workers.fisher.reward_pass import FisherRoots, policy_gradient_pass
from workers.fisher.reward_summary import RewardParts, reward_entries, reward_vector, summary_with_reward
from workers.fisher.shards import current_shard, gathered
from workers.fisher.stats import each_tensor
from workers.fisher.top_sets import levels_at
from workers.models.loading import LoadedModel
from workers.process_memory import retain_freed_memory, returning_freed_memory
from workers.streamed_safetensors import Planned, write_streamed

ProgressCallback = Callable[[str, float], None]
PartialCallback = Callable[[dict, float], None]  # (light summary, kept share of trace(C_mu))
# the fraction of the progress bar each stage spans
_STAGES = {
    "forward": (0.0, 0.05),
    "first pass": (0.05, 0.1),  # a response's, with partial results (``response._FirstPass``)
    "refining": (0.1, 0.2),  # its round to 90% of every position's trace (``_FirstPass.refine``)
    "directions": (0.2, 0.85),
    "summary": (0.85, 1.0),
}
CURVE_STATS = ("fisher", "uncentered", "raw")


@dataclass(frozen=True)
class AnalysisRequest:
    """What to analyse: the prefix, an optional response, the sampler mu, the method, a reward."""

    input_ids: list[int]
    continuation_ids: list[int] = field(default_factory=list)
    sampler: Sampler = field(default_factory=Sampler)
    method: Method = field(default_factory=Method)
    reward: dict[int, float] = field(default_factory=dict)  # token id -> reward; others 0
    # off the policy, also the Fisher under p (d_model directions per position more): rho needs it
    rho: bool = False


class Analysis:
    """A finished analysis: the summary JSON plus the per-parameter sums it was drawn from."""

    def __init__(
        self,
        request: AnalysisRequest,
        sequence: SequenceAnalysis,
        summary: dict,
        fisher_roots: FisherRoots | None = None,
    ):
        self.request = request
        self.sequence = sequence
        self.summary = summary
        self.fisher_roots = fisher_roots  # what a later reward reads instead of the Fisher, when kept

    def fisher_levels(self) -> np.ndarray:
        """Every coordinate's ``top_sets.levels_at`` at the summary's Fisher thresholds, flat in
        the order of the parameters: with ``fisher_roots``, all a reward change reads of the Fisher."""
        named = self.summary["concentration"]["fisher"]["thresholds"]
        values = [named[f"{q:g}"] for q in NAMED_FRACTIONS]
        sums = self.sequence.sums
        return np.concatenate(
            [levels_at(sums.stat("fisher", name), values).reshape(-1).cpu().numpy() for name in sums.names]
        )

    def typed_summary(self) -> AnalysisSummary:
        """The summary as the typed model the API sends (``backend.summary``)."""
        return AnalysisSummary.model_validate(self.summary)

    @property
    def stats(self) -> tuple[str, ...]:
        """The stats this analysis has: all, but rho off the policy when it was not asked for."""
        return STATS if self.sequence.sums.has_rho else tuple(s for s in STATS if s != "rho")

    def per_parameter(self, stat: str) -> dict[str, torch.Tensor]:
        if stat not in STATS:
            raise KeyError(f"unknown stat {stat!r}; choose from {', '.join(STATS)}")
        return {name: value.float() for name, value in self.sequence.sums.iter_stat(stat)}

    def pooled(
        self, max_rows: int = 128, max_cols: int = 128, stats: tuple[str, ...] | None = None
    ) -> dict[str, dict[str, dict]]:
        """Block sums of every stat it has (``stats``: of those) on every tensor; stats equal to another by
        construction are shared."""
        sums = self.sequence.sums
        out: dict[str, dict[str, dict]] = {}
        for stat in self.stats if stats is None else stats:
            if sums.alias(stat) in out:
                out[stat] = out[sums.alias(stat)]
            elif sums.identically_zero(stat):
                out[stat] = {name: zero_view(sums.shapes[name], max_rows, max_cols) for name in sums.names}
            else:

                def view(name: str, stat: str = stat) -> dict:
                    # from the stat's stored terms where it has them: nothing parameter-sized is formed
                    if stat == "rho":  # a share of stored terms, read the same way
                        return pooled_view(sums.rho_terms(name), max_rows, max_cols, share=True)
                    terms = sums.terms(stat, name)
                    return pooled_view(sums.stat(stat, name) if terms is None else terms, max_rows, max_cols)

                out[stat] = dict(zip(sums.names, each_tensor(sums, view, sums.names), strict=True))
        return out

    def pooled_bytes(self, max_rows: int = 128, max_cols: int = 128) -> int:
        """What ``pooled`` would send (float32 values), from the shapes alone."""
        return pooled_bytes(self.sequence.sums.shapes.values(), max_rows, max_cols, len(self.stats))

    def save(self, path: str | Path, metadata: dict[str, str] | None = None) -> None:
        """safetensors: ``<stat>/<param name>`` for every stat and parameter, plus the token ids; written
        tensor by tensor (``workers.streamed_safetensors``): never more than one stat of one tensor."""
        sums = self.sequence.sums
        ids = {"input_ids": self.request.input_ids, "continuation_ids": self.request.continuation_ids}
        planned = [
            Planned(f"{stat}/{name}", torch.float32, sums.shapes[name])
            for stat in self.stats
            for name in sums.names
        ]
        planned += [Planned(key, torch.int64, (len(values),)) for key, values in ids.items() if values]

        def tensor_of(key: str) -> torch.Tensor:
            if key in ids:
                return torch.tensor(ids[key], dtype=torch.int64)
            stat, _, name = key.partition("/")
            return sums.stat(stat, name).float()

        totals = {"summary_totals": json.dumps(self.summary["totals"])}
        write_streamed(Path(path), planned, tensor_of, {**totals, **(metadata or {})})


def _staged(progress: ProgressCallback | None) -> ProgressCallback:
    def report(stage: str, fraction: float) -> None:
        if progress is None:
            return
        lo, hi = _STAGES.get(stage, (0.0, 1.0))
        progress(stage, lo + (hi - lo) * min(max(fraction, 0.0), 1.0))

    return report


@dataclass
class PositionSummaries:
    """Each position's summary (``position_summary``), made once per record. Why: a response's partial
    results keep a position's record until a pass replaces it, and summarising every position at every
    partial made 256 summaries for 16 tokens, about 2 s of the service's run."""

    decode: Callable[[int], str]
    reward: torch.Tensor | None
    made: dict[int, tuple[PositionRecord, dict]] = field(default_factory=dict)

    def __call__(self, records: list[PositionRecord]) -> list[dict]:
        summaries = []
        for index, record in enumerate(records):
            kept = self.made.get(index)
            if kept is None or kept[0] is not record:
                kept = (record, position_summary(record, index, self.decode, self.reward))
                self.made[index] = kept
            summaries.append(kept[1])
        return summaries


class _Partials:
    """Partial summaries while the directions run, no more often than their own cost allows: at least
    ``MIN_INTERVAL_S`` apart and ``COST_MULTIPLE`` times the last one's cost, so that after the first
    they slow the analysis by a tenth at most; none once 99% of the trace is in (the exact result is
    moments away). Why a tenth: a partial copies the running sums, forms the ghost squares and takes the
    totals, about a second on SmolLM2, and at three times its cost two partials made a 5-token
    analysis a fifth to two fifths slower on a CPU (benchmarks/bench_engine.py prints both)."""

    MIN_INTERVAL_S = 1.0
    COST_MULTIPLE = 9

    def __init__(self, loaded: LoadedModel, request: AnalysisRequest, reward, deliver: PartialCallback):
        self.loaded, self.request, self.reward, self.deliver = loaded, request, reward, deliver
        self.last = -math.inf
        self.cost = 0.0
        self.positions = PositionSummaries(loaded.decode_token, reward)

    def __call__(self, snapshot: Callable[[], SequenceAnalysis], kept_share: float) -> None:
        now = time.perf_counter()
        if now - self.last < max(self.MIN_INTERVAL_S, self.COST_MULTIPLE * self.cost) or kept_share >= 0.99:
            return
        layout = HeadLayout.of(self.loaded.model)
        sequence = snapshot()
        if sequence.model_part is None:  # recorded: a response's later partials carry it
            sequence.model_part = model_part(sequence, layout, light=True)
        summary = build_summary(
            self.loaded,
            self.request,
            sequence,
            layout,
            self.reward,
            light=True,
            whole=sequence.model_part,
            positions=self.positions,
        )
        self.cost = time.perf_counter() - now
        self.last = time.perf_counter()
        self.deliver(summary, kept_share)


@earlier_objects_frozen()
def run_analysis(
    loaded: LoadedModel,
    request: AnalysisRequest,
    memory_budget_bytes: int,
    progress: ProgressCallback | None = None,
    on_partial: PartialCallback | None = None,
    keep_fisher_roots: tuple[int, int] | None = None,
    sums_storage: SumsStorage | None = None,
) -> Analysis:
    """Compute every quantity of docs/design.md §2 for ``request`` on ``loaded``'s model.

    ``sums_storage``: where a response's sums over positions are kept (``analyze_sequence``); none: in
    memory.

    ``keep_fisher_roots``: the pooled grid (rows, cols) at which to keep ``FisherRoots``, so that a
    later reward on the same analysis can be answered by ``with_reward``.

    ``on_partial(summary, kept_share)``: while the directions of a prefix run, light summaries of the
    truncated result so far (totals exact as far as the directions go; no concentration, top
    coordinates or overlap) with the share of trace(C_mu) they carry.
    """
    started = time.perf_counter()
    retain_freed_memory()
    report = _staged(progress)
    model = loaded.model
    sampler = request.sampler
    device = next(model.parameters()).device  # a worker puts the model on the GPU when it has one
    reward = reward_vector(request.reward, model.get_output_embeddings().weight.shape[0], device)
    roots = None if keep_fisher_roots is None else FisherRoots(keep_fisher_roots)
    sequence = analyze_sequence(
        model,
        torch.tensor(request.input_ids, dtype=torch.long, device=device),
        torch.tensor(request.continuation_ids, dtype=torch.long, device=device),
        sampler,
        request.method,
        reward,
        _engine_model(loaded, sampler),
        memory_budget_bytes=memory_budget_bytes,
        progress=report,
        on_partial=None if on_partial is None else _Partials(loaded, request, reward, on_partial),
        observe=None if roots is None else roots.observe,
        fisher_under_p=request.rho,
        sums_storage=sums_storage,
    )
    report("summary", 0.0)
    # every process takes part in the count: the summary states how the directions were split
    per_process = gathered(sequence.directions) if current_shard() is not None else None
    summary = build_summary(
        loaded, request, sequence, HeadLayout.of(model), reward, directions_per_process=per_process
    )
    summary["timing"] = {"seconds": time.perf_counter() - started, "fisher_reused": False}
    report("summary", 1.0)
    return Analysis(request, sequence, summary, roots)


def sums_storage(settings: Settings) -> SumsStorage:
    """Where an analysis keeps a response's sums over positions: in memory up to the setting, the rest
    mapped from files (a storage per analysis: its budget counts that analysis's sums)."""
    return SumsStorage(settings.sums_dir, settings.sums_memory_bytes)


def _engine_model(loaded: LoadedModel, sampler: Sampler) -> torch.nn.Module | None:
    """The model the sampler draws from when it is not the analysed one (the bf16 engine)."""
    if sampler.engine == EngineKind.bf16 and sampler.kind == SamplerKind.model:
        return loaded.bf16()
    return None


def with_reward(
    loaded: LoadedModel,
    request: AnalysisRequest,
    summary: dict,
    pooled: dict[str, dict[str, dict]],
    roots: FisherRoots,
    fisher_levels_of: Callable[[str], torch.Tensor],
    memory_budget_bytes: int,
) -> tuple[dict, dict[str, dict[str, dict]]]:
    """The summary and pooled views of ``request`` from those of an analysis that differs from it in its
    reward only, with that analysis's ``fisher_roots`` and ``fisher_levels()``: one backward direction per
    position (the policy gradient), none for the Fisher (``workers.fisher.reward_pass``)."""
    started = time.perf_counter()
    model = loaded.model
    device = next(model.parameters()).device
    vector = reward_vector(request.reward, model.get_output_embeddings().weight.shape[0], device)
    computed = None
    if vector is not None:
        computed = policy_gradient_pass(
            model,
            torch.tensor(request.input_ids, dtype=torch.long, device=device),
            torch.tensor(request.continuation_ids, dtype=torch.long, device=device),
            request.sampler,
            vector,
            _engine_model(loaded, request.sampler),
            memory_budget_bytes=memory_budget_bytes,
        )
    parts = RewardParts(reward_entries(request.reward, loaded.decode_token), vector, computed)
    out, out_pooled = summary_with_reward(
        summary, pooled, roots, fisher_levels_of, HeadLayout.of(model).shapes, parts
    )
    out["timing"] = {"seconds": time.perf_counter() - started, "fisher_reused": True}
    return out, out_pooled


def model_part(sequence: SequenceAnalysis, layout: HeadLayout, light: bool = False) -> dict:
    """The summary's part about the whole model (``model_summary``) of ``sequence``'s sums."""
    with returning_freed_memory():
        return model_summary(sequence.sums, layout.head_name, layout.embedding_name, CURVE_STATS, light=light)


def build_summary(
    loaded: LoadedModel,
    request: AnalysisRequest,
    sequence: SequenceAnalysis,
    layout: HeadLayout,
    reward: torch.Tensor | None,
    light: bool = False,
    directions_per_process: list[int] | None = None,
    whole: dict | None = None,
    positions: PositionSummaries | None = None,
) -> dict:
    """The summary of ``sequence``; ``directions_per_process``: the directions each process ran (under
    torchrun; alone, this one's); ``whole``: the model's part (``model_summary``) when already taken of
    these sums; ``positions``: where the positions' summaries are kept between partial results."""
    per_process = directions_per_process or [sequence.directions]
    decode = loaded.decode_token
    info = loaded.info
    sampler = request.sampler
    method = request.method
    if whole is None:
        whole = model_part(sequence, layout, light)
    summarised = positions or PositionSummaries(decode, reward)
    first = sequence.positions[0]

    def tokens(ids: list[int]) -> list[dict]:
        return [{"id": int(t), "text": decode(int(t))} for t in ids]

    return {
        "model": {
            "id": info.id,
            "digest": info.digest,
            "n_params": info.n_params,
            "d_model": info.d_model,
            "vocab_size": info.vocab_size,
            "n_layers": info.n_layers,
            "tied_embeddings": layout.tied,
            "architecture": info.architecture,
            "dtype": info.dtype,
        },
        "tokens": {"prefix": tokens(request.input_ids), "continuation": tokens(request.continuation_ids)},
        "sampler": {
            **{
                key: str(value) if isinstance(value, str) else value for key, value in asdict(sampler).items()
            },
            "data_token_text": decode(sampler.data_token_id) if sampler.data_token_id is not None else None,
            "on_policy": sampler.is_on_policy,
        },
        "reward": reward_entries(request.reward, decode),
        "method": {
            "name": method.name.value,
            "fraction": method.fraction,
            "samples": method.samples,
            "directions": first.directions,
            "kept_share": min(r.kept_share for r in sequence.positions),
            "missing_estimate": max(r.missing_estimate for r in sequence.positions),
        },
        # where the totals have rho's mean: not in a response's first partial, which sums no per-parameter
        # ratio (``response.first_pass_model_part``)
        "rho_available": whole["totals"]["rho_mean"] is not None,
        "processes": len(per_process),
        "directions_per_process": per_process,
        "positions": summarised(sequence.positions),
        **whole,
        "response": response_summary(sequence, decode),
        "cost": None,  # the caller's estimate (workers.jobs)
        "timing": None,  # a finished analysis's
    }
