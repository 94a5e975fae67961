"""From an ``AnalysisJob`` to an ``Analysis``: the one place that joins the math to the wire schemas.

``workers/fisher`` knows tensors only; this module turns a tokenized job into sampler, method and
reward tensors, runs the sequence analysis with progress, and exposes the result as the summary JSON
(docs/contract.md), per-parameter arrays, pooled views, and a safetensors file.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from backend.cost import estimate_cost
from backend.schemas import AnalysisJob, parse_method
from workers.fisher.methods import Method, MethodName
from workers.fisher.pooling import block_edges, pooled_view
from workers.fisher.position import HeadLayout
from workers.fisher.response import SequenceAnalysis, analyze_sequence
from workers.fisher.sampler import Engine, SamplerConfig, SamplerKind
from workers.fisher.stats import STATS
from workers.fisher.summary import model_summary, position_summary, response_summary
from workers.models.loading import LoadedModel

ProgressCallback = Callable[[str, float], None]
# the fraction of the progress bar each stage spans
_STAGES = {"forward": (0.0, 0.05), "directions": (0.05, 0.85), "summary": (0.85, 1.0)}


def measured_flops_per_second(size: int = 1024, repeats: int = 3) -> float:
    """The float32 matmul rate of this device, measured now (for cost estimates in seconds)."""
    a = torch.randn(size, size)
    a @ a
    start = time.perf_counter()
    for _ in range(repeats):
        a @ a
    return repeats * 2 * size**3 / (time.perf_counter() - start)


def sampler_config(job: AnalysisJob) -> SamplerConfig:
    s = job.sampler
    return SamplerConfig(
        kind=SamplerKind(s.kind.value if hasattr(s.kind, "value") else s.kind),
        temperature=float(s.temperature),
        top_k=s.top_k,
        top_p=float(s.top_p),
        engine=Engine(s.engine.value if hasattr(s.engine, "value") else s.engine),
        data_token_id=s.data_token_id,
    )


def reward_vector(job: AnalysisJob, vocab_size: int) -> torch.Tensor | None:
    if not job.reward:
        return None
    reward = torch.zeros(vocab_size, dtype=torch.float64)
    for token, value in job.reward.items():
        reward[int(token)] = float(value)
    return reward


def job_method(job: AnalysisJob) -> Method:
    name, fraction, samples = parse_method(job.method)
    # a fixed seed derived from the job keeps Monte Carlo results reproducible per cache key
    return Method(MethodName(name), fraction=fraction, samples=samples, seed=int(job.key()[:8], 16))


class Analysis:
    """A finished analysis: the summary JSON plus the per-parameter sums it was drawn from."""

    def __init__(self, job: AnalysisJob, sequence: SequenceAnalysis, layout: HeadLayout, summary: dict):
        self.job = job
        self.sequence = sequence
        self.layout = layout
        self.summary = summary

    def per_parameter(self, stat: str) -> dict[str, torch.Tensor]:
        if stat not in STATS:
            raise KeyError(f"unknown stat {stat!r}; choose from {', '.join(STATS)}")
        return {name: value.float() for name, value in self.sequence.sums.iter_stat(stat)}

    def pooled(
        self, max_rows: int = 128, max_cols: int = 128, stats: tuple[str, ...] = STATS
    ) -> dict[str, dict[str, dict]]:
        """Block sums of every stat on every tensor; stats equal to another by construction are shared."""
        sums = self.sequence.sums
        out: dict[str, dict[str, dict]] = {}
        for stat in stats:
            if sums.alias(stat) in out:
                out[stat] = out[sums.alias(stat)]
            elif sums.identically_zero(stat):
                out[stat] = {name: _zero_view(sums.shapes[name], max_rows, max_cols) for name in sums.names}
            else:
                out[stat] = {
                    name: pooled_view(value, max_rows, max_cols) for name, value in sums.iter_stat(stat)
                }
        return out

    def save(self, path: str | Path) -> None:
        """safetensors: ``<stat>/<param name>`` for every stat and parameter, plus the token ids."""
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for stat in STATS:
            for name, value in self.sequence.sums.iter_stat(stat):
                value = value.float().contiguous().cpu()
                if value.data_ptr() in seen:  # stats equal by construction share storage; files may not
                    value = value.clone()
                seen.add(value.data_ptr())
                tensors[f"{stat}/{name}"] = value
        tensors["input_ids"] = torch.tensor(self.job.input_ids, dtype=torch.int64)
        if self.job.continuation_ids:
            tensors["continuation_ids"] = torch.tensor(self.job.continuation_ids, dtype=torch.int64)
        metadata = {"job": self.job.canonical_json(), "summary_totals": json.dumps(self.summary["totals"])}
        save_file(tensors, str(path), metadata=metadata)


def _zero_view(shape: tuple[int, ...], max_rows: int, max_cols: int) -> dict:
    rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[0], math.prod(shape[1:]))
    row_edges, col_edges = block_edges(rows, max_rows), block_edges(cols, max_cols)
    grid = np.zeros((len(row_edges) - 1, len(col_edges) - 1), dtype=np.float32)
    return {"shape": list(grid.shape), "row_edges": row_edges, "col_edges": col_edges, "values": grid}


def _staged(progress: ProgressCallback | None) -> ProgressCallback:
    def report(stage: str, fraction: float) -> None:
        if progress is None:
            return
        lo, hi = _STAGES.get(stage, (0.0, 1.0))
        progress(stage, lo + (hi - lo) * min(max(fraction, 0.0), 1.0))

    return report


def run_analysis(
    loaded: LoadedModel,
    job: AnalysisJob,
    progress: ProgressCallback | None = None,
    memory_budget_bytes: int = 1 << 30,
) -> Analysis:
    """Compute every quantity of DESIGN.md section 2 for ``job`` on ``loaded``'s model."""
    started = time.perf_counter()
    report = _staged(progress)
    model = loaded.model
    sampler = sampler_config(job)
    method = job_method(job)
    vocab = model.get_output_embeddings().weight.shape[0]
    reward = reward_vector(job, vocab)
    engine_model = (
        loaded.bf16() if sampler.engine == Engine.BF16 and sampler.kind == SamplerKind.MODEL else None
    )
    device = next(model.parameters()).device  # a worker puts the model on the GPU when it has one
    reward = None if reward is None else reward.to(device)
    prefix = torch.tensor(job.input_ids, dtype=torch.long, device=device)
    continuation = torch.tensor(job.continuation_ids, dtype=torch.long, device=device)
    sequence = analyze_sequence(
        model, prefix, continuation, sampler, method, reward, engine_model, memory_budget_bytes, report
    )
    report("summary", 0.0)
    layout = HeadLayout.of(model)
    summary = build_summary(loaded, job, sequence, layout, method, reward)
    summary["timing"] = {"seconds": time.perf_counter() - started}
    report("summary", 1.0)
    return Analysis(job, sequence, layout, summary)


def build_summary(
    loaded: LoadedModel,
    job: AnalysisJob,
    sequence: SequenceAnalysis,
    layout: HeadLayout,
    method: Method,
    reward: torch.Tensor | None,
) -> dict:
    decode = loaded.decode_token
    info = loaded.info
    on_policy = sampler_config(job).is_on_policy
    whole = model_summary(
        sequence.sums, layout.head_name, layout.embedding_name, ("fisher", "uncentered", "raw")
    )
    positions = [position_summary(r, i, decode, reward) for i, r in enumerate(sequence.positions)]
    first = sequence.positions[0]
    data_token = job.sampler.data_token_id
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
        "tokens": {
            "prefix": [{"id": t, "text": decode(t)} for t in job.input_ids],
            "continuation": [{"id": t, "text": decode(t)} for t in job.continuation_ids],
        },
        "sampler": {
            **job.sampler.model_dump(mode="json"),
            "data_token_text": decode(data_token) if data_token is not None else None,
            "on_policy": on_policy,
        },
        "reward": [{"id": int(t), "text": decode(int(t)), "value": v} for t, v in job.reward.items()],
        "method": {
            "name": method.name.value,
            "fraction": method.fraction,
            "samples": method.samples,
            "directions": first.directions,
            "kept_share": min(r.kept_share for r in sequence.positions),
            "missing_estimate": max(r.missing_estimate for r in sequence.positions),
        },
        "cost": estimate_cost(info, job).model_dump(mode="json"),
        "positions": positions,
        **whole,
        "response": response_summary(sequence, decode),
    }
