"""From what a person sends (`AnalysisCreate`) to the job the worker runs (`AnalysisJob`).

Why here and not in the worker: everything wrong with a request's content is found before it is
queued, and answered with a 4xx whose message says what to fix. Normalization also makes equivalent
requests identical (canonical method spelling, sampler knobs that do not matter dropped), so they share
one cache key.
"""

from __future__ import annotations

from typing import Protocol

from backend.schemas import AnalysisCreate, AnalysisJob, SamplerSpec, SampleSpec
from backend.settings import RequestLimits
from backend.tokens import TokenCodec, TokenError
from backend.vocabulary import Sampler, SamplerKind, is_model_id


class RequestError(ValueError):
    """A request the service refuses; `str(error)` says what to fix. `status` is the HTTP code."""

    def __init__(self, message: str, status: int = 422, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.field = field
        self.estimate: object | None = None
        self.cheaper_methods: list[str] | None = None

    def with_estimate(self, estimate: object, cheaper_methods: list[str]) -> RequestError:
        """Attach a cost estimate and the methods that would fit the budget (cost refusals)."""
        self.estimate = estimate
        self.cheaper_methods = cheaper_methods
        return self


class DigestedModel(Protocol):
    id: str
    digest: str
    dtype: str


def check_model_id(model_id: str, allowed: list[str]) -> str:
    """The id itself if the operator allows it; path-like or unknown ids are refused."""
    if not is_model_id(model_id):
        raise RequestError(
            f"model must be one of the allowed ids {sorted(allowed)}, not a path or URL; got {model_id!r}",
            field="model",
        )
    if model_id not in allowed:
        raise RequestError(f"unknown model {model_id!r}; allowed ids: {sorted(allowed)}", field="model")
    return model_id


def check_text(text: str, field: str) -> str:
    """Refuse text that is not valid Unicode (lone surrogates from `\\ud800` escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(
            f"{field} is not valid Unicode (lone surrogate); send UTF-8 text", field=field
        ) from None
    return text


def normalize(
    create: AnalysisCreate, codec: TokenCodec, info: DigestedModel, limits: RequestLimits
) -> AnalysisJob:
    """Tokenize and canonicalize `create`; raises RequestError for every bad content."""
    prefix = check_text(create.prefix, "prefix")
    if not prefix.strip():
        raise RequestError("prefix is empty; type the text the model should continue", field="prefix")
    input_ids = codec.encode_prefix(prefix)
    if not input_ids:
        raise RequestError("prefix encodes to no tokens; type some text", field="prefix")
    if len(input_ids) > limits.max_prefix_tokens:
        raise RequestError(
            f"prefix is {len(input_ids)} tokens, over the limit of {limits.max_prefix_tokens}; shorten it",
            field="prefix",
        )
    continuation_ids: list[int] = []
    if create.continuation:
        continuation_ids = codec.encode_continuation(check_text(create.continuation, "continuation"))
        if len(continuation_ids) > limits.max_continuation_tokens:
            raise RequestError(
                f"continuation is {len(continuation_ids)} tokens, over the limit of "
                f"{limits.max_continuation_tokens}; shorten it",
                field="continuation",
            )
    sample = _check_sample(create, limits)
    sampler = normalize_sampler(create.sampler, codec, bool(continuation_ids) or sample is not None)
    return AnalysisJob(
        model=info.id,
        weights_digest=info.digest,
        dtype=info.dtype,
        input_ids=input_ids,
        continuation_ids=continuation_ids,
        continuation_sample=sample,
        sampler=sampler,
        reward=_normalize_reward(create.reward, codec),
        method=create.method,
        rho=create.rho and not sampler.is_on_policy,  # on the policy rho is free: one key for both
    )


def _check_sample(create: AnalysisCreate, limits: RequestLimits) -> SampleSpec | None:
    sample = create.continuation_sample
    if sample is None:
        return None
    if create.continuation:
        raise RequestError(
            "give either continuation (a typed response) or continuation_sample (a sampled one), not both",
            field="continuation_sample",
        )
    if create.sampler.kind == SamplerKind.data:
        raise RequestError(
            "the data sampler is one-hot on given tokens, so it cannot draw a response; type the "
            "continuation, or sample with the model or uniform sampler",
            field="continuation_sample",
        )
    if sample.max_tokens > limits.max_continuation_tokens:
        raise RequestError(
            f"continuation_sample.max_tokens is {sample.max_tokens}, over the limit of "
            f"{limits.max_continuation_tokens}; ask for fewer",
            field="continuation_sample.max_tokens",
        )
    return sample


def normalize_sampler(spec: SamplerSpec, codec: TokenCodec, has_continuation: bool) -> Sampler:
    if spec.kind != SamplerKind.data:
        if spec.data_token is not None:
            raise RequestError(
                "sampler.data_token is only used with sampler.kind 'data'; remove it or set kind 'data'",
                field="sampler.data_token",
            )
        if spec.kind == SamplerKind.uniform:  # mu is uniform: temperature and truncation do not apply
            return Sampler(kind=SamplerKind.uniform)
        top_k = spec.top_k if spec.top_k is not None and spec.top_k < codec.vocab_size else None
        return Sampler(
            kind=SamplerKind.model,
            temperature=float(spec.temperature),
            top_k=top_k,
            top_p=float(spec.top_p),
            engine=spec.engine,
        )
    if has_continuation:
        if spec.data_token is not None:
            raise RequestError(
                "with a continuation the data sampler is one-hot on each continuation token; "
                "remove sampler.data_token",
                field="sampler.data_token",
            )
        return Sampler(kind=SamplerKind.data)
    if spec.data_token is None:
        raise RequestError(
            "the data sampler needs something to be one-hot on: give sampler.data_token "
            "(one token, text or '#ID') or a continuation",
            field="sampler.data_token",
        )
    return Sampler(
        kind=SamplerKind.data, data_token_id=_single_token(codec, spec.data_token, "sampler.data_token")
    )


def _normalize_reward(reward: dict[str, float], codec: TokenCodec) -> dict[str, float]:
    by_id: dict[int, float] = {}
    for text, value in reward.items():
        token_id = _single_token(codec, text, f"reward[{text!r}]")
        if token_id in by_id:
            raise RequestError(f"reward names token #{token_id} twice; give each token once", field="reward")
        by_id[token_id] = float(value)
    return {str(token_id): by_id[token_id] for token_id in sorted(by_id)}


def _single_token(codec: TokenCodec, text: str, field: str) -> int:
    check_text(text, field)
    try:
        return codec.single_token_id(text)
    except TokenError as error:
        raise RequestError(f"{field}: {error}", field=field) from None
