"""fisherscope in a notebook: the engine on a model already in memory, without the CLI or the service.

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from workers.notebook import analyze

    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    result = analyze(model, AutoTokenizer.from_pretrained(path), "She drank a cup of",
                     reward={" tea": 1.0}, temperature=0.7, top_k=50)
    result.summary["totals"]["fisher"], result.per_parameter("fisher")["lm_head.weight"]

``analyze`` and ``study`` take the options of ``fisherscope analyze`` and ``fisherscope study`` as
keyword arguments and return what the engine computes: the summary the dashboard draws (docs/contract.md)
and the per-parameter tensors by parameter name. The model is checked first, as every load is: the
certificate (docs/design.md, "The certificate") compares the engine with plain autograd on the model as
it is; a model it refuses raises ``ModelLoadError`` with the reason. Certificates are kept per weights
digest, so a model whose weights changed (a training step) is checked again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import PreTrainedModel

from backend.rewards import RewardKind, RewardRule
from backend.settings import get_settings
from backend.study_summary import StudySummary
from backend.tokens import TokenCodec
from backend.vocabulary import EngineKind, Method, Sampler, SamplerKind
from workers.engine import Analysis, AnalysisRequest, run_analysis, sums_storage
from workers.models.loading import LoadedModel, ensure_certificate, info_from_model, state_dict_digest
from workers.studies.files import averaged_arrays
from workers.studies.masks import mask_tensors
from workers.studies.prompts import EncodedPrompt
from workers.studies.runner import model_meta, run_study_part, study_model_of
from workers.studies.spec import DEFAULT_FRACTIONS, StudySpec
from workers.studies.summary import finish_study

Tokens = str | Sequence[int] | torch.Tensor


def engine_model(model: PreTrainedModel, tokenizer: Any, name: str | None = None) -> LoadedModel:
    """``model`` (a causal LM, its own dtype and device) and its tokenizer (a transformers fast tokenizer
    or a ``tokenizers.Tokenizer``) as the engine reads them, certified. The engine computes what the
    model computes in eval mode (no dropout): ``analyze`` and ``study`` put it there and back."""
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    label = name or str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
    info = info_from_model(label, model, state_dict_digest(model), "a model in memory", size)
    loaded = LoadedModel(id=label, model=model, info=info, tokenizer=_backend_tokenizer(tokenizer))
    loaded.certificate = ensure_certificate(loaded)
    return loaded


def analyze(
    model: PreTrainedModel | LoadedModel,
    tokenizer: Any,
    prefix: Tokens,
    *,
    continuation: Tokens | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    sampler: str = "model",
    engine: str = "model",
    data_token: str | int | None = None,
    method: str | Method = "exact",
    reward: Mapping[str | int, float] | None = None,
    seed: int = 0,
    rho: bool = False,
) -> Analysis:
    """Every quantity of docs/design.md section 2 at the prefix's next token, or along ``continuation``.

    ``prefix``/``continuation``: text (encoded as the service does: the prefix with the tokenizer's
    special tokens, the continuation without) or token ids. ``reward``: token (text naming exactly one
    token, ``"#ID"``, or an id) -> reward. ``sampler``: model, data or uniform; ``engine``: model or
    bf16 (the model's own weights in bfloat16 sample); ``method``: exact, truncated:F or mc:S (``seed``
    seeds its draws); ``rho``: off the policy, also the Fisher under p that rho needs (d_model
    directions more per position). The result's ``summary`` is the dashboard's JSON;
    ``per_parameter(stat)`` the tensors by name; ``save(path)`` a safetensors file as ``fisherscope
    analyze --save`` writes.
    """
    with _evaluating(model):
        loaded = model if isinstance(model, LoadedModel) else engine_model(model, tokenizer)
        codec = TokenCodec(loaded.tokenizer)
        data_id = None if data_token is None else _token_id(codec, data_token)
        request = AnalysisRequest(
            input_ids=_ids(prefix, codec.encode_prefix),
            continuation_ids=[] if continuation is None else _ids(continuation, codec.encode_continuation),
            sampler=_sampler(sampler, temperature, top_k, top_p, engine, data_id),
            method=Method.parse(method, seed=seed),
            reward={_token_id(codec, token): float(value) for token, value in (reward or {}).items()},
            rho=rho,
        )
        settings = get_settings()
        return run_analysis(
            loaded, request, settings.engine_memory_bytes, sums_storage=sums_storage(settings)
        )


@dataclass
class StudyResult:
    """A study's summary (as ``fisherscope study --summary`` writes it), its masks by density and
    parameter name (uint8, 1 = trainable) and its sums F, U, M by parameter name (``averaged_arrays``)."""

    summary: dict
    masks: dict[float, dict[str, torch.Tensor]]
    sums: dict[str, dict[str, torch.Tensor]]

    def typed_summary(self) -> StudySummary:
        """The summary as the typed model the API sends (``backend.study_summary``)."""
        return StudySummary.model_validate(self.summary)


def study(
    model: PreTrainedModel | LoadedModel,
    tokenizer: Any,
    prompts: Iterable[str | tuple[str, str]],
    *,
    samples: int = 4,
    max_tokens: int = 16,
    seed: int = 0,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    sampler: str = "model",
    engine: str = "model",
    method: str | Method = "exact",
    reward_exact: bool = False,
    reward_regex: str | None = None,
    q: Sequence[float] = DEFAULT_FRACTIONS,
) -> StudyResult:
    """``fisherscope study`` on ``prompts`` (texts, or (prompt, target) pairs; a reward needs targets):
    ``samples`` responses of at most ``max_tokens`` per prompt drawn from the sampler, the sequence
    Fisher summed over them, masks at the densities ``q``, the estimators and the paper's statistics."""
    rule = None
    if reward_exact or reward_regex is not None:
        rule = RewardRule(RewardKind.exact) if reward_exact else RewardRule(RewardKind.regex, reward_regex)
    spec = StudySpec(
        _sampler(sampler, temperature, top_k, top_p, engine),
        samples=samples,
        max_tokens=max_tokens,
        seed=seed,
        method=Method.parse(method),
        reward=rule,
        fractions=tuple(q),
    )
    with _evaluating(model):
        loaded = model if isinstance(model, LoadedModel) else engine_model(model, tokenizer)
        encoded = _study_prompts(prompts, TokenCodec(loaded.tokenizer), rule)
        part = run_study_part(
            study_model_of(loaded, spec),
            spec,
            encoded,
            memory_budget_bytes=get_settings().engine_memory_bytes,
        )
    finished = finish_study(part, spec, model_meta(loaded))
    masks = {
        fraction: mask_tensors(finished.fisher_levels, fraction, part.sums) for fraction in spec.fractions
    }
    return StudyResult(finished.summary, masks, averaged_arrays(part))


def _study_prompts(
    prompts: Iterable[str | tuple[str, str]], codec: TokenCodec, rule: RewardRule | None
) -> list[EncodedPrompt]:
    """Each prompt (a text, or a (prompt, target) pair) as the study reads it; a reward needs targets."""
    encoded = []
    for index, item in enumerate(prompts):
        text, target = (item, None) if isinstance(item, str) else item
        if rule is not None and not target:
            raise ValueError(f"prompt {index} has no target; the reward compares each response with it")
        if rule is not None:
            rule.check_target(target or "")
        target_ids = codec.encode_continuation(target) if target else None
        encoded.append(EncodedPrompt(index, index + 1, codec.encode_prefix(text), target, target_ids))
    if not encoded:
        raise ValueError("no prompts: give at least one")
    return encoded


@contextmanager
def _evaluating(model: PreTrainedModel | LoadedModel) -> Iterator[None]:
    """The model in eval mode while the engine reads it, then back in the mode it was in (a training
    loop that calls ``analyze`` keeps its dropout)."""
    module = model.model if isinstance(model, LoadedModel) else model
    training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(training)


def _sampler(
    kind: str, temperature: float, top_k: int | None, top_p: float, engine: str, data_id: int | None = None
) -> Sampler:
    """The sampler mu of the keyword arguments (a bad value raises ValueError naming it)."""
    return Sampler(
        SamplerKind(kind),
        float(temperature),
        None if top_k is None else int(top_k),
        float(top_p),
        EngineKind(engine),
        data_id,
    )


def _backend_tokenizer(tokenizer: Any) -> Tokenizer:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return backend
    raise TypeError("give a transformers fast tokenizer (AutoTokenizer) or a tokenizers.Tokenizer")


def _ids(tokens: Tokens, encode) -> list[int]:
    if isinstance(tokens, str):
        ids = encode(tokens)
    elif isinstance(tokens, torch.Tensor):
        ids = [int(t) for t in tokens.reshape(-1).tolist()]
    else:
        ids = [int(t) for t in tokens]
    if not ids and encode.__name__ == "encode_prefix":
        raise ValueError("the prefix has no tokens; give some text or ids")
    return ids


def _token_id(codec: TokenCodec, token: str | int) -> int:
    return int(token) if isinstance(token, int) else codec.single_token_id(token)
