"""Schemas, method parsing, the cache key, normalization and cost estimates (no Redis, no torch)."""

from __future__ import annotations

import json

import pytest

from backend import registry as catalog
from backend.cost import (
    CONTEXT_TOKEN_FLOPS_PER_PARAM,
    DIRECTION_EFFICIENCY,
    FIRST_PASS_DIRECTIONS,
    FIRST_PASS_FLOPS_PER_PARAM,
    GHOST_PAIR_FLOPS_PER_PARAM,
    REFINING_DIRECTION_SHARE,
    SUMMARY_FLOPS_PER_PARAM,
    estimate_cost,
    estimate_flops,
    ghost_context_pairs,
    probe_directions,
)
from backend.memory_estimate import context_lengths
from backend.normalize import RequestError, check_model_id, normalize
from backend.schemas import AnalysisCreate, AnalysisJob, SamplerSpec, SampleSpec
from backend.settings import RequestLimits
from backend.tokens import TokenCodec, TokenError
from backend.vocabulary import STATS, Method, MethodName, Sampler, SamplerKind


@pytest.fixture(scope="module")
def tiny() -> tuple[catalog.ModelInfo, TokenCodec]:
    if not catalog.is_available("tiny-random"):
        from workers.models.fetch import fetch_model

        fetch_model("tiny-random", progress=False)
    return catalog.model_info("tiny-random"), TokenCodec.from_file(catalog.tokenizer_path("tiny-random"))


def make(tiny, limits: RequestLimits | None = None, **fields) -> AnalysisJob:
    info, codec = tiny
    return normalize(AnalysisCreate(model="tiny-random", **fields), codec, info, limits or RequestLimits())


def test_stats_are_the_contract_order() -> None:
    assert STATS == ("fisher", "uncentered", "raw", "mean_shift", "common", "rho", "policy_grad", "bound")


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("exact", ("exact", None, None)),
        ("truncated:0.5", ("truncated", 0.5, None)),
        ("truncated:1", ("truncated", 1.0, None)),
        ("mc:2", ("mc", None, 2)),
        ("mc:64", ("mc", None, 64)),
    ],
)
def test_parse_method_accepts_the_three_forms(text: str, parsed: tuple) -> None:
    name, fraction, samples = parsed
    assert Method.parse(text) == Method(MethodName(name), fraction, samples)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "exactly",
        "exact:1",
        "truncated",
        "truncated:0",
        "truncated:1.5",
        "truncated:x",
        "mc:1",
        "mc:2.5",
        "mc",
        "svd:3",
    ],
)
def test_parse_method_refuses_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="method must be 'exact'"):
        Method.parse(text)


def test_key_is_sha256_of_sorted_compact_json() -> None:
    job = AnalysisJob(model="m", weights_digest="sha256:0", input_ids=[1, 2], reward={"7": 1.0})
    import hashlib

    canonical = json.dumps(job.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    assert job.key() == hashlib.sha256(canonical.encode()).hexdigest()
    assert AnalysisJob.model_validate_json(job.model_dump_json()).key() == job.key()


@pytest.mark.parametrize(
    "change",
    [
        {"model": "n"},
        {"weights_digest": "sha256:1"},
        {"input_ids": [1, 3]},
        {"continuation_ids": [4]},
        {"sampler": Sampler(temperature=0.5)},
        {"reward": {"7": 2.0}},
        {"method": "mc:8"},
        {"engine_version": "0"},
        {"dtype": "float64"},
    ],
)
def test_key_changes_with_every_field(change: dict) -> None:
    job = AnalysisJob(model="m", weights_digest="sha256:0", input_ids=[1, 2], reward={"7": 1.0})
    assert job.model_copy(update=change).key() != job.key()


def test_normalize_tokenizes_and_sorts_reward_ids(tiny) -> None:
    info, codec = tiny
    job = make(tiny, prefix="She drank a cup of", reward={" tea": 1.0, "#5": -1.0}, method="truncated:.5")
    assert job.input_ids == codec.encode_prefix("She drank a cup of")
    assert job.weights_digest == info.digest
    tea = codec.single_token_id(" tea")
    assert list(job.reward) == sorted([str(tea), "5"], key=int)
    assert job.reward[str(tea)] == 1.0 and job.reward["5"] == -1.0
    assert str(job.method) == "truncated:0.5"


def test_equivalent_requests_share_a_key(tiny) -> None:
    tea = tiny[1].single_token_id(" tea")
    a = make(tiny, prefix="a cup of", reward={" tea": 1}, sampler=SamplerSpec(kind="uniform", temperature=3))
    b = make(tiny, prefix="a cup of", reward={f"#{tea}": 1.0}, sampler=SamplerSpec(kind="uniform"))
    assert a.key() == b.key()


def test_data_sampler_one_hot_rules(tiny) -> None:
    tea = tiny[1].single_token_id(" tea")
    job = make(tiny, prefix="a cup of", sampler=SamplerSpec(kind="data", data_token=" tea"))
    assert job.sampler.data_token_id == tea
    job = make(tiny, prefix="a cup of", continuation=" tea", sampler=SamplerSpec(kind="data"))
    assert job.sampler.data_token_id is None and job.continuation_ids == [tea]
    with pytest.raises(RequestError, match="one-hot on"):
        make(tiny, prefix="a cup of", sampler=SamplerSpec(kind="data"))
    with pytest.raises(RequestError, match="remove sampler.data_token"):
        make(tiny, prefix="a", continuation=" tea", sampler=SamplerSpec(kind="data", data_token=" tea"))
    with pytest.raises(RequestError, match="only used with sampler.kind 'data'"):
        make(tiny, prefix="a", sampler=SamplerSpec(data_token=" tea"))


def test_token_limits(tiny) -> None:
    limits = RequestLimits(max_prefix_tokens=4, max_continuation_tokens=2)
    with pytest.raises(RequestError, match="over the limit of 4"):
        make(tiny, limits, prefix="She drank a cup of tea")
    with pytest.raises(RequestError, match="over the limit of 2"):
        make(tiny, limits, prefix="a", continuation=" a cup of")


def test_single_token_errors(tiny) -> None:
    codec = tiny[1]
    with pytest.raises(TokenError, match="not exactly one"):
        codec.single_token_id("zzzzqq")
    with pytest.raises(TokenError, match="outside the vocabulary"):
        codec.single_token_id(f"#{codec.vocab_size}")
    with pytest.raises(TokenError, match="must not be empty"):
        codec.single_token_id("")
    assert codec.token_text(codec.single_token_id(" tea")) == " tea"


@pytest.mark.parametrize("model", ["../tiny-random", "/etc/passwd", "tiny-random/../x", "HF/model", "gpt2"])
def test_model_ids_are_an_allow_list(model: str) -> None:
    with pytest.raises(RequestError, match="allowed ids"):
        check_model_id(model, ["tiny-random"])


def test_cost_exact_matches_design_figure() -> None:
    """docs/design.md §3: about 0.78 TFLOP for SmolLM2-135M on a 5-token prefix."""
    info = type(
        "Info", (), {"n_params": 134_515_008, "d_model": 576, "vocab_size": 49152, "tied_embeddings": True}
    )()
    job = AnalysisJob(model="smollm2-135m", weights_digest="d", input_ids=[1, 2, 3, 4, 5])
    cost = estimate_cost(info, job, flops_per_second=1e12)
    assert cost.directions == 576 and not cost.upper_bound
    # 576 directions of C_mu (the tied table's probes summed from them: exact), the forward
    assert cost.flops == pytest.approx(2 * (576 + 1) * 134_515_008 * 5)
    assert 0.7e12 < cost.flops < 0.8e12
    # the seconds add what the direction pass does not count: its 5 tokens, the ghost form of its
    # squares (576 directions over 5 rows: the engine's rule picks it), the summary
    assert ghost_context_pairs(info, job) == 5 * 6
    overhead = 134_515_008 * (
        5 * CONTEXT_TOKEN_FLOPS_PER_PARAM + 30 * GHOST_PAIR_FLOPS_PER_PARAM + SUMMARY_FLOPS_PER_PARAM
    )
    assert cost.seconds == pytest.approx((DIRECTION_EFFICIENCY * cost.flops + overhead) / 1e12)


RATE = 1e11  # flop/s; these checks are about flops and directions, not seconds


def test_cost_scales_with_sampler_and_method() -> None:
    info = type("Info", (), {"n_params": 1000, "d_model": 64, "vocab_size": 10, "tied_embeddings": False})()
    base = AnalysisJob(model="m", weights_digest="d", input_ids=[1, 2, 3])
    exact = estimate_cost(info, base, RATE)
    tempered = base.model_copy(update={"sampler": Sampler(temperature=0.7)})
    assert estimate_cost(info, tempered, RATE).directions == exact.directions  # no rho: mu's alone
    off = estimate_cost(info, tempered.model_copy(update={"rho": True}), RATE)
    assert off.directions == 2 * exact.directions
    capped = base.model_copy(update={"sampler": Sampler(top_k=5)})
    assert estimate_cost(info, capped, RATE).directions == 4
    top_k = estimate_cost(info, capped.model_copy(update={"rho": True}), RATE)
    assert top_k.directions == 4 + 64
    truncated = estimate_cost(info, base.model_copy(update={"method": Method.parse("truncated:0.25")}), RATE)
    assert truncated.directions == 16 and truncated.upper_bound
    assert estimate_cost(info, base.model_copy(update={"method": Method.parse("mc:8")}), RATE).directions == 8
    response = base.model_copy(update={"continuation_ids": [7, 8, 9]})
    assert context_lengths(response) == [3, 4, 5]
    assert estimate_cost(info, response, RATE).flops == pytest.approx(exact.flops * 12 / 3)


def test_cost_counts_the_tied_tables_probes() -> None:
    """A tied table sends one probe direction per distinct context token and Fisher formed, except in an
    exact analysis, which sums each probe's row from its complete basis of directions."""
    untied = type("Info", (), {"n_params": 1000, "d_model": 64, "vocab_size": 10, "tied_embeddings": False})()
    tied = type("Info", (), {"n_params": 1000, "d_model": 64, "vocab_size": 10, "tied_embeddings": True})()
    exact = AnalysisJob(model="m", weights_digest="d", input_ids=[5, 6, 5], continuation_ids=[6, 7])
    assert probe_directions(tied, exact) == [0, 0]
    assert estimate_flops(tied, exact) == estimate_flops(untied, exact)
    # top-k caps C_mu's rank below d_model: its directions are no complete basis, mu's probes run (p's
    # Fisher, off the policy, has full support and sums its own)
    capped = exact.model_copy(update={"sampler": Sampler(top_k=5)})
    assert probe_directions(tied, capped) == [2, 2]
    job = exact.model_copy(update={"method": Method.parse("mc:16")})
    assert probe_directions(tied, job.model_copy(update={"method": Method.parse("truncated:0.5")})) == [2, 2]
    assert probe_directions(untied, job) == [0, 0]
    assert probe_directions(tied, job) == [2, 2]  # {5, 6}, then {5, 6} again: 6 was read before
    off = job.model_copy(update={"sampler": Sampler(temperature=0.7)})
    assert probe_directions(tied, off) == [2, 2]  # without rho, mu's Fisher only
    with_rho = off.model_copy(update={"rho": True})
    assert probe_directions(tied, with_rho) == [4, 4]  # and as many for the Fisher under p
    sampled = job.model_copy(
        update={"continuation_ids": [], "continuation_sample": SampleSpec(max_tokens=3, seed=1)}
    )
    assert probe_directions(tied, sampled) == [3, 4, 5]  # not drawn yet: every token counts as new
    extra = sum(n * p for n, p in zip(context_lengths(job), probe_directions(tied, job), strict=True))
    assert estimate_flops(tied, job) - estimate_flops(untied, job) == pytest.approx(2 * 1000 * extra)


def test_a_responses_seconds_count_its_first_pass_where_partials_are_given() -> None:
    """The service's analyses give partial results: an exact response's seconds then add its first pass
    (per position, the first moments' directions over the whole response's context and the
    per-parameter work) and, without a reward, its refining round (a share of the exact directions,
    spent again); a prefix, a truncated or sampled method and the data sampler take no first pass."""
    info = type("Info", (), {"n_params": 1000, "d_model": 64, "vocab_size": 10, "tied_embeddings": False})()
    response = AnalysisJob(model="m", weights_digest="d", input_ids=[1, 2, 3], continuation_ids=[7, 8, 9])
    alone = estimate_cost(info, response, RATE)
    served = estimate_cost(info, response, RATE, partials=True)
    first_pass = (
        1000 * 3 * (DIRECTION_EFFICIENCY * 2 * FIRST_PASS_DIRECTIONS * 5 + FIRST_PASS_FLOPS_PER_PARAM)
    )
    refining = REFINING_DIRECTION_SHARE * DIRECTION_EFFICIENCY * alone.flops
    assert served.seconds == pytest.approx(alone.seconds + (first_pass + refining) / RATE)
    rewarded = response.model_copy(update={"reward": {"7": 1.0}})
    assert estimate_cost(info, rewarded, RATE, partials=True).seconds == pytest.approx(
        estimate_cost(info, rewarded, RATE).seconds + first_pass / RATE
    )  # no round: its bound would need the Fisher per parameter
    assert served.flops == alone.flops  # the budget counts the direction pass alone
    sampled = response.model_copy(
        update={"continuation_ids": [], "continuation_sample": SampleSpec(max_tokens=3, seed=1)}
    )
    assert estimate_cost(info, sampled, RATE, partials=True).seconds == pytest.approx(served.seconds)
    for without in (
        response.model_copy(update={"continuation_ids": []}),
        response.model_copy(update={"method": Method.parse("truncated:0.5")}),
        response.model_copy(update={"method": Method.parse("mc:8")}),
        response.model_copy(update={"sampler": Sampler(kind=SamplerKind.data, data_token_id=4)}),
    ):
        assert (
            estimate_cost(info, without, RATE, partials=True).seconds
            == estimate_cost(info, without, RATE).seconds
        )
