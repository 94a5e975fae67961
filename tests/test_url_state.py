"""The URL query string holds the whole dashboard state; bad values give readable messages."""

from __future__ import annotations

import pytest

from backend.schemas import AnalysisCreate, SampleSpec
from backend.vocabulary import LANDING_PREFIX
from frontend.callbacks.controls import ALL_CONTROL_IDS, CONTROL_IDS, controls_from_state, state_from_controls
from frontend.state import (
    CENTERING_STAT,
    CENTERINGS,
    MAX_SAMPLE_TOKENS,
    MAX_SEED,
    DashboardState,
    format_reward,
    is_landing,
    parse_query,
    parse_reward,
    state_b,
    to_query,
    to_request,
)

B_ID = "ab" * 32


def test_round_trip_of_every_field():
    state = DashboardState(
        model="tiny-random",
        prefix="She drank a cup of",
        continuation=" coffee and",
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        engine="bf16",
        sampler="data",
        data_token=" tea",
        reward={" tea": 1.0, " coffee": -0.5, "a:b": 2.0},
        method="truncated:0.5",
        centering="raw",
        slide=7,
    )
    parsed, errors = parse_query(to_query(state))
    assert errors == []
    assert parsed == state


def test_empty_query_is_the_default_state():
    assert parse_query("") == (DashboardState(), [])


@pytest.mark.parametrize(
    ("query", "fragment"),
    [
        ("temperature=0", "temperature must be a number > 0"),
        ("temperature=hot", "temperature must be a number > 0"),
        ("top_p=1.5", "top_p must be a number in (0, 1]"),
        ("top_k=0", "top_k must be an integer >= 1"),
        ("slide=11", "slide must be an integer from 1 to 10"),
        ("centering=sideways", "centering must be one of on, off, raw"),
        ("engine=fp8", "engine must be one of model, bf16"),
        ("sampler=greedy", "sampler must be one of model, data, uniform"),
        ("method=magic", "method must be 'exact', 'truncated:F' with 0 < F <= 1, or 'mc:S'"),
        ("method=truncated:2", "method must be 'exact', 'truncated:F' with 0 < F <= 1"),
        ("reward=%20tea:lots", "reward for ' tea' must be a number"),
        ("model=../../etc/passwd", "is not a model id"),
        ("sample_seed=-1", "sample_seed must be an integer >= 0"),
        ("sample_seed=lucky", "sample_seed must be an integer >= 0"),
        ("sample_tokens=0", f"sample_tokens must be an integer from 1 to {MAX_SAMPLE_TOKENS}"),
        (f"sample_tokens={MAX_SAMPLE_TOKENS + 1}", "sample_tokens must be an integer from 1"),
        ("compare=../../x", "compare must be an analysis id (64 hex characters)"),
    ],
)
def test_bad_values_give_readable_messages_and_keep_defaults(query, fragment):
    state, errors = parse_query("?" + query)
    assert len(errors) == 1 and fragment in errors[0]
    key = query.split("=")[0]
    assert getattr(state, key) == getattr(DashboardState(), key)


def test_method_is_read_in_its_canonical_spelling():
    state, errors = parse_query("?method=truncated:.5")
    assert errors == [] and state.method == "truncated:0.5"


def test_centering_settings_are_the_statistics_they_show():
    assert CENTERINGS == ("on", "off", "raw")
    assert CENTERING_STAT == {"on": "fisher", "off": "uncentered", "raw": "raw"}


def test_rewards_are_written_as_the_cli_writes_them_and_both_forms_read():
    assert format_reward({" tea": 1.0, "a:b": 2.0, "x=y": -0.5}) == " tea=1;a:b=2;x=y=-0.5"
    assert parse_reward(" tea=1;a:b=2;x=y=-0.5") == ({" tea": 1.0, "a:b": 2.0, "x=y": -0.5}, [])
    assert parse_reward(" Paris=1; London:0.5") == ({" Paris": 1.0, " London": 0.5}, [])


def test_reward_parsing_keeps_colons_in_tokens():
    reward, errors = parse_reward(" tea:1; coffee:1;::2")
    assert errors == []
    assert reward == {" tea": 1.0, " coffee": 1.0, ":": 2.0}


def test_request_body_follows_the_contract():
    state = DashboardState(prefix="She drank a cup of", reward={" tea": 1.0}, top_k=None)
    body = to_request(state)
    assert body == {
        "model": "smollm2-135m",
        "prefix": "She drank a cup of",
        "continuation": None,
        "continuation_sample": None,
        "sampler": {
            "kind": "model",
            "temperature": 1.0,
            "top_k": None,
            "top_p": 1.0,
            "engine": "model",
            "data_token": None,
        },
        "reward": {" tea": 1.0},
        "method": "exact",
    }


def sampled_state() -> DashboardState:
    return DashboardState(
        model="tiny-random",
        prefix="She drank a cup of",
        sample_seed=7,
        sample_tokens=32,
        temperature=0.7,
        slide=4,
        compare=B_ID,
        b={"temperature": 1.0, "top_k": None, "engine": "bf16", "prefix": "He ate", "method": "mc:8"},
    )


def test_round_trip_of_a_sampled_response_and_a_compare():
    state = sampled_state()
    query = to_query(state)
    assert "sample_seed=7" in query and "sample_tokens=32" in query and f"compare={B_ID}" in query
    assert "b_temperature=1.0" in query and "b_top_k=off" in query and "b_model" not in query
    assert parse_query(query) == (state, [])


def test_controls_read_back_into_the_same_state():
    """The page's controls (A's and the compare panel's) show a state and validate back into it."""
    state = sampled_state()
    values = controls_from_state(state)
    assert len(values) == len(ALL_CONTROL_IDS)
    assert values[ALL_CONTROL_IDS.index("b_model")] == ""  # not overridden: the panel reads "as A"
    assert values[ALL_CONTROL_IDS.index("b_top_k")] == "off"
    assert state_from_controls(values, state.slide, state.compare) == (state, [])


def test_the_sampled_request_asks_the_api_to_draw_the_response():
    body = to_request(sampled_state())
    assert body["continuation"] is None
    assert body["continuation_sample"] == {"seed": 7, "max_tokens": 32}
    AnalysisCreate.model_validate(body)  # the wire schema accepts it as written


def test_sample_limits_are_the_wire_schemas():
    SampleSpec(seed=MAX_SEED, max_tokens=MAX_SAMPLE_TOKENS)
    for bad in ({"max_tokens": MAX_SAMPLE_TOKENS + 1}, {"seed": MAX_SEED + 1}, {"max_tokens": 0}):
        with pytest.raises(ValueError):
            SampleSpec(**bad)


def test_a_typed_and_a_sampled_continuation_exclude_each_other():
    state, errors = parse_query("?continuation=%20coffee&sample_seed=3")
    assert len(errors) == 1 and "not both" in errors[0] and "seed 3" in errors[0]
    assert state.sample_seed == 3 and state.continuation == ""


def test_b_is_a_with_the_panels_overrides():
    state = sampled_state()
    b = state_b(state)
    assert (b.temperature, b.top_k, b.engine, b.prefix, b.method) == (1.0, None, "bf16", "He ate", "mc:8")
    # what the panel leaves alone is A's, including the sampled response's seed and length
    assert (b.model, b.sample_seed, b.sample_tokens, b.top_p) == ("tiny-random", 7, 32, 1.0)
    assert to_request(b)["sampler"]["temperature"] == 1.0
    assert state_b(DashboardState()) == DashboardState()


@pytest.mark.parametrize(
    ("query", "fragment"),
    [
        ("b_temperature=0", "b_temperature must be a number > 0"),
        ("b_engine=fp8", "b_engine must be one of model, bf16"),
        ("b_method=magic", "b_method must be 'exact'"),
        ("b_top_k=-2", "b_top_k must be an integer >= 1"),
        ("b_model=../x", "b_model '../x' is not a model id"),
    ],
)
def test_bad_compare_values_name_the_b_key_and_override_nothing(query, fragment):
    state, errors = parse_query("?" + query)
    assert len(errors) == 1 and errors[0].startswith(fragment), errors
    assert state.b == {}


def test_empty_b_values_are_no_override():
    """The panel's empty fields read as A's, in a link as on the page."""
    state, errors = parse_query("?b_temperature=&b_prefix=&b_engine=")
    assert errors == [] and state.b == {}


def test_a_first_visit_is_the_landing_example():
    state, errors = parse_query("")
    assert errors == [] and state.prefix == LANDING_PREFIX
    assert is_landing("") and is_landing("?model=tiny-random")
    assert not is_landing("?prefix=x") and not is_landing("?prefix=")


def test_sample_replaces_a_typed_continuation():
    """Sample draws the response instead of the typed one, with seed 0 when the seed field is empty."""
    from frontend.callbacks.run import sampled

    values = controls_from_state(DashboardState(continuation=" tea", sample_tokens=32))[: len(CONTROL_IDS)]
    state, errors = state_from_controls(
        list(sampled(dict(zip(CONTROL_IDS, values, strict=True))).values()), 1
    )
    assert errors == [] and (state.continuation, state.sample_seed, state.sample_tokens) == ("", 0, 32)


def test_rewarded_candidate_chips_are_marked_with_their_value():
    from backend.summary import AnalysisSummary, CandidateRow, NextTokens, PositionSummary
    from frontend.callbacks.state import candidate_chips

    top = [{"id": 1, "text": " tea", "p": 0.3}, {"id": 2, "text": " coffee", "p": 0.2}]
    # only what the chips read: the first position's likeliest tokens
    rows = NextTokens.model_construct(top=[CandidateRow.model_construct(**token) for token in top])
    summary = AnalysisSummary.model_construct(positions=[PositionSummary.model_construct(p=rows)])
    chips = candidate_chips(summary, parse_reward(" tea=1")[0])
    assert [chip.className for chip in chips] == ["chip candidate rewarded", "chip candidate"]
    assert chips[0].children.endswith("= 1") and "click to remove" in chips[0].title


def test_a_new_prefix_runs_without_the_landing_response():
    from backend.vocabulary import LANDING_CONTINUATION, LANDING_PREFIX
    from frontend.callbacks.run import is_landing_response_elsewhere

    assert not is_landing_response_elsewhere({"prefix": LANDING_PREFIX, "continuation": LANDING_CONTINUATION})
    assert is_landing_response_elsewhere(
        {"prefix": "The capital of France is", "continuation": LANDING_CONTINUATION}
    )
    assert not is_landing_response_elsewhere({"prefix": "The capital of France is", "continuation": " Paris"})
