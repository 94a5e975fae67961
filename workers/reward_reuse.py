"""A reward change answered from the analysis it changes: its summary, pooled views and Fisher roots.

The Fisher does not depend on the reward, and a full analysis costs hundreds of backward directions
where a new reward costs one per position (``workers.fisher.reward_pass``). So after each analysis
the worker keeps, beside the levels file, what a later reward reads instead of the Fisher (the
``FisherRoots`` and the Fisher's ``levels_at``) in one file named by the request's key without its
reward; a job that finds that file, and the analysis it names still in the store, is answered by
``workers.engine.with_reward``. A job that finds neither runs the whole analysis: the result is the
same (tests/test_reward_reuse.py), only its cost differs.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from backend.disk import evict_to_budget, mark_used
from backend.schemas import AnalysisJob
from backend.settings import Settings
from backend.store import Store
from workers.engine import Analysis, AnalysisRequest, with_reward
from workers.fisher.reward_pass import FisherRoots
from workers.fisher.reward_summary import flat_levels
from workers.models.loading import LoadedModel

FORMAT = "fisherscope-fisher-roots-1"


def family(job: AnalysisJob) -> str:
    """The key of ``job`` without its reward: what every reward on the same analysis shares."""
    return job.model_copy(update={"reward": {}}).key()


def keep_for_rewards(analysis: Analysis, job: AnalysisJob, settings: Settings) -> None:
    """Write what a later reward on ``job`` reads (nothing when the analysis kept no roots)."""
    roots = analysis.fisher_roots
    if roots is None:
        return
    target = settings.fisher_roots_path(family(job))
    target.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"levels": analysis.fisher_levels()}
    for t, pooled in enumerate(roots.pooled):
        for name, values in pooled.items():
            arrays[f"pooled/{t}/{name}"] = np.ascontiguousarray(values)
    metadata = {
        "format": FORMAT,
        "analysis_id": job.key(),
        "grid": json.dumps(list(roots.grid)),
        "totals": json.dumps(roots.totals),
        "any_fisher": json.dumps(roots.any_fisher),
    }
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        save_file(arrays, str(partial), metadata=metadata)
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    evict_to_budget(settings.exports_dir, settings.exports_budget_bytes, keep=target)


@dataclass
class KeptFisher:
    analysis_id: str
    roots: FisherRoots
    levels: np.ndarray


def kept_for(job: AnalysisJob, settings: Settings) -> KeptFisher | None:
    """What an earlier analysis of ``job`` under another reward kept; None when there is none (or the
    file is unreadable: the job then runs whole)."""
    path = settings.fisher_roots_path(family(job))
    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("format") != FORMAT:
                return None
            totals = json.loads(metadata["totals"])
            rows, cols = json.loads(metadata["grid"])
            any_fisher = bool(json.loads(metadata["any_fisher"]))
            pooled = [
                {name: handle.get_tensor(f"pooled/{t}/{name}") for name in at} for t, at in enumerate(totals)
            ]
            levels = handle.get_tensor("levels")
    except (OSError, SafetensorError, ValueError, KeyError):
        return None
    mark_used(path)  # read: the last to be evicted
    roots = FisherRoots((rows, cols), totals, pooled, any_fisher=any_fisher)
    return KeptFisher(metadata["analysis_id"], roots, levels)


def answer_from_kept(
    loaded: LoadedModel, job: AnalysisJob, request: AnalysisRequest, store: Store, settings: Settings
) -> tuple[dict, dict, str] | None:
    """``job``'s (``request``'s) summary and pooled views from a kept analysis of it under another
    reward, and that analysis's id; None when there is none (still in the store, of this model's
    shapes)."""
    kept = kept_for(job, settings)
    if kept is None or kept.analysis_id == job.key():
        return None
    base = store.read(kept.analysis_id)
    pooled = store.get_pooled(kept.analysis_id) if base.summary_json is not None else None
    shapes = parameter_shapes(loaded)
    if (
        base.summary_json is None
        or pooled is None
        or kept.levels.size != sum(map(math.prod, shapes.values()))
    ):
        return None
    summary, views = with_reward(
        loaded,
        request,
        json.loads(base.summary_json),
        pooled,
        kept.roots,
        flat_levels(kept.levels, shapes),
        settings.engine_memory_bytes,
    )
    return summary, views, kept.analysis_id


def parameter_shapes(loaded: LoadedModel) -> dict[str, tuple[int, ...]]:
    return {name: tuple(param.shape) for name, param in loaded.model.named_parameters()}


def copy_levels(from_id: str, to_id: str, settings: Settings) -> None:
    """The top-q Fisher sets of the kept analysis are this one's too (compares read them by id), copied:
    a second name of the same file would free nothing when the exports budget removes it. Raises
    FileNotFoundError when the kept analysis's sets are gone (evicted): the caller then runs whole."""
    source, target = settings.levels_path(from_id), settings.levels_path(to_id)
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    try:
        partial.write_bytes(Path(source).read_bytes())
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    evict_to_budget(settings.exports_dir, settings.exports_budget_bytes, keep=target)
