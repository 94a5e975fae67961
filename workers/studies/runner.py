"""Run a study over any subset of its prompts (a *part*), and add parts up.

Why parts: a study's sums are sums over prompts, and every response's draw depends only on (seed,
prompt index, response index), so a study split over workers, prompt by prompt, and merged with
``merge_parts`` gives the same responses and the same sums (to float rounding) as one run.

Per prompt: draw K responses from mu; fold the exact F, M and squared shifts of every position into the
running sums (``workers.fisher.study``); then one backward per response for its score d log pi(y|x)/dtheta,
squared into the Monte Carlo Fisher and weighted by its reward minus the prompt's mean reward into the
policy gradient; and one per target for the empirical Fisher.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from backend.study_summary import PromptRecord, ResponseRecord
from backend.vocabulary import EngineKind
from workers.collector import earlier_objects_frozen
from workers.fisher.position import HeadLayout
from workers.fisher.response import log_likelihood_gradient
from workers.fisher.sampling import sample_continuation, stop_ids
from workers.fisher.study import PromptFisher, StudyStat, StudySums, add_prompt_fisher
from workers.models.loading import LoadedModel
from workers.process_memory import retain_freed_memory
from workers.studies.prompts import EncodedPrompt
from workers.studies.spec import CompareAt, StudySpec

Progress = Callable[[str, float], None]  # (stage, fraction of the part done)
EXACT_SHARE = 0.9  # of a prompt's progress: sampling and the exact pass; the scores take the rest


@dataclass
class StudyModel:
    """The model as a study uses it: weights, text of a response, where responses stop."""

    model: nn.Module
    decode: Callable[[list[int]], str]  # response text without special tokens (what rewards read)
    stop_ids: set[int]
    engine_model: nn.Module | None = None  # the bf16 engine, when the sampler uses it


@dataclass
class StudyPart:
    """The sums and records of some prompts; ``merge_parts`` adds parts of disjoint prompts."""

    sums: StudySums
    head_name: str
    embedding_name: str
    responses: list[ResponseRecord] = field(default_factory=list)
    prompts: list[PromptRecord] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # per stage: sampling, fisher, scores


def study_model_of(loaded: LoadedModel, spec: StudySpec) -> StudyModel:
    """A loaded model as a study uses it (the bf16 engine only when the sampler reads its logits)."""
    return StudyModel(
        loaded.model,
        lambda ids: loaded.tokenizer.decode(list(ids), skip_special_tokens=True),
        stop_ids(loaded.model),
        loaded.bf16() if spec.sampler.engine == EngineKind.bf16 else None,
    )


def model_meta(loaded: LoadedModel) -> dict:
    """What the summary records of the model: identity and sizes."""
    info = loaded.info
    return {
        "id": info.id,
        "digest": info.digest,
        "n_params": info.n_params,
        "d_model": info.d_model,
        "vocab_size": info.vocab_size,
        "architecture": info.architecture,
        "dtype": info.dtype,
    }


@earlier_objects_frozen()
def run_study_part(
    study_model: StudyModel,
    spec: StudySpec,
    prompts: Sequence[EncodedPrompt],
    *,
    memory_budget_bytes: int,
    progress: Progress | None = None,
    sums_folder: Path | None = None,
) -> StudyPart:
    """Sample, compute and sum the study over ``prompts`` (any subset of the study's prompts).
    ``sums_folder``: where its running sums are memory-mapped files (``StudySums.backing``)."""
    retain_freed_memory()  # the engine's thousands of per-context arrays reuse freed memory (as an analysis)
    model = study_model.model
    layout = HeadLayout.of(model)
    part = StudyPart(StudySums.of(model, backing=sums_folder), layout.head_name, layout.embedding_name)
    report = progress or (lambda stage, fraction: None)
    n = len(prompts)
    # Every prompt's exact pass first, then every prompt's scores: the estimators' three running sums
    # are allocated only once no exact pass (with its P-sized moments per context) is still to run,
    # which keeps the peak at six P-sized arrays plus the model, whatever the number of prompts.
    drawn = []
    for done, prompt in enumerate(prompts):

        def exact_part(stage: str, fraction: float, done: int = done) -> None:
            report(stage, (done * EXACT_SHARE + fraction) / n)  # fraction runs 0 to EXACT_SHARE

        drawn.append(_sample_and_fisher(study_model, spec, prompt, part, memory_budget_bytes, exact_part))
    for done, prompt_fisher in enumerate(drawn):

        def score_part(stage: str, fraction: float, done: int = done) -> None:
            report(stage, (n * EXACT_SHARE + done * (1 - EXACT_SHARE) + fraction - EXACT_SHARE) / n)

        _score_and_record(study_model, prompt_fisher, part, score_part)
    report("done", 1.0)
    return part


def _timed(part: StudyPart, stage: str, started: float) -> float:
    now = time.perf_counter()
    part.seconds[stage] = part.seconds.get(stage, 0.0) + now - started
    return now


@dataclass
class _DrawnPrompt:
    """A prompt whose responses are drawn and whose exact pass is summed; its scores are still to come."""

    prompt: EncodedPrompt
    prompt_ids: torch.Tensor
    seeds: list[int]
    responses: list[list[int]]
    texts: list[str]
    rewards: list[float] | None
    fisher: PromptFisher


def _sample_and_fisher(
    study_model: StudyModel,
    spec: StudySpec,
    prompt: EncodedPrompt,
    part: StudyPart,
    memory_budget_bytes: int,
    progress: Progress,
) -> _DrawnPrompt:
    """One prompt's responses and exact pass (progress 0-0.1 sampling, 0.1-EXACT_SHARE the exact pass)."""
    model = study_model.model
    prompt_ids = torch.tensor(prompt.input_ids, dtype=torch.long, device=next(model.parameters()).device)
    started = time.perf_counter()
    seeds = [spec.response_seed(prompt.index, r) for r in range(spec.samples)]
    responses = _draw(study_model, spec, prompt_ids, seeds, lambda f: progress("sampling", 0.1 * f))
    texts = [study_model.decode(response) for response in responses]
    rewards = None
    if spec.reward is not None:
        assert prompt.target is not None  # checked when the prompts were read
        rewards = [spec.reward.score(text, prompt.target) for text in texts]
    started = _timed(part, "sampling", started)
    fisher = add_prompt_fisher(
        part.sums,
        model,
        prompt_ids,
        responses,
        spec.sampler,
        spec.method_config(),
        study_model.engine_model,
        seed=derived_prompt_seed(spec, prompt.index),
        references=spec.references,
        references_everywhere=spec.compare_at == CompareAt.responses,
        memory_budget_bytes=memory_budget_bytes,
        progress=lambda fraction: progress("fisher", 0.1 + (EXACT_SHARE - 0.1) * fraction),
    )
    _timed(part, "fisher", started)
    return _DrawnPrompt(prompt, prompt_ids, seeds, responses, texts, rewards, fisher)


def _score_and_record(
    study_model: StudyModel, drawn: _DrawnPrompt, part: StudyPart, progress: Progress
) -> None:
    """One prompt's scores (MC and empirical Fisher, policy gradient) and records (progress
    EXACT_SHARE-1)."""
    model, prompt, fisher = study_model.model, drawn.prompt, drawn.fisher
    started = time.perf_counter()
    _add_scores(
        part.sums,
        model,
        drawn.prompt_ids,
        drawn.responses,
        drawn.rewards,
        lambda f: progress("scores", EXACT_SHARE + (1 - EXACT_SHARE) * f),
    )
    if prompt.target_ids:
        target = torch.tensor(prompt.target_ids, dtype=torch.long, device=drawn.prompt_ids.device)
        part.sums.add_square(
            StudyStat.empirical_fisher, log_likelihood_gradient(model, drawn.prompt_ids, target)
        )
        part.sums.targets += 1
    part.sums.responses += len(drawn.responses)
    _timed(part, "scores", started)
    part.responses += [
        ResponseRecord(
            prompt_index=prompt.index,
            response_index=r,
            seed=drawn.seeds[r],
            input_ids=list(prompt.input_ids),
            continuation_ids=list(response),
            text=drawn.texts[r],
            reward=None if drawn.rewards is None else drawn.rewards[r],
            totals=fisher.response_totals[r],
        )
        for r, response in enumerate(drawn.responses)
    ]
    part.prompts.append(
        PromptRecord(
            prompt_index=prompt.index,
            line=prompt.line,
            n_tokens=len(prompt.input_ids),
            target=prompt.target,
            rewards=drawn.rewards,
            totals={key: sum(t[key] for t in fisher.response_totals) for key in ("fisher", "uncentered")},
            compared=fisher.compared,
            contexts=fisher.contexts,
            directions=fisher.directions,
        )
    )


def _draw(
    study_model: StudyModel,
    spec: StudySpec,
    prompt_ids: torch.Tensor,
    seeds: list[int],
    progress: Callable[[float], None],
) -> list[list[int]]:
    """One response per seed, from mu (the bf16 engine's logits when the sampler uses them)."""
    responses = []
    for r, seed in enumerate(seeds):
        responses.append(
            sample_continuation(
                study_model.model,
                prompt_ids,
                spec.sampler,
                seed,
                spec.max_tokens,
                study_model.stop_ids,
                study_model.engine_model,
            )
        )
        progress((r + 1) / len(seeds))
    return responses


def derived_prompt_seed(spec: StudySpec, prompt_index: int) -> int:
    """Seed of a prompt's Monte Carlo directions (a method ``mc:S``); distinct from its responses' seeds."""
    return spec.response_seed(prompt_index, -1)


def _add_scores(
    sums: StudySums,
    model: nn.Module,
    prompt_ids: torch.Tensor,
    responses: list[list[int]],
    rewards: list[float] | None,
    progress: Callable[[float], None],
) -> None:
    """Monte Carlo Fisher += score^2 per response; policy gradient += (r - mean r) score."""
    mean_reward = None if rewards is None else sum(rewards) / len(rewards)
    for r, response in enumerate(responses):
        ids = torch.tensor(response, dtype=torch.long, device=prompt_ids.device)
        score = log_likelihood_gradient(model, prompt_ids, ids)
        sums.add_square(StudyStat.mc_fisher, score)
        if rewards is not None and mean_reward is not None:
            # added even when zero, so the policy gradient exists (as zeros) whenever there is a reward
            sums.add(StudyStat.policy_gradient, score, rewards[r] - mean_reward)
        del score
        progress((r + 1) / len(responses))


def merge_parts(parts: Sequence[StudyPart]) -> StudyPart:
    """One part for all: sums added (into the first part's arrays), records ordered by prompt."""
    if not parts:
        raise ValueError("no parts to merge")
    merged = parts[0]
    for other in parts[1:]:
        merged.sums.merge(other.sums)
        merged.responses += other.responses
        merged.prompts += other.prompts
        for stage, seconds in other.seconds.items():
            merged.seconds[stage] = merged.seconds.get(stage, 0.0) + seconds
    indices = [p.prompt_index for p in merged.prompts]
    if len(set(indices)) != len(indices):
        raise ValueError("two parts cover the same prompt; a study's parts must cover disjoint prompts")
    merged.prompts.sort(key=lambda p: p.prompt_index)
    merged.responses.sort(key=lambda r: (r.prompt_index, r.response_index))
    return merged
