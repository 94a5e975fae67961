"""The URL query string holds the whole dashboard state; bad values give readable messages."""

from __future__ import annotations

import pytest

from frontend.state import (
    CENTERING_STAT,
    CENTERINGS,
    DashboardState,
    parse_query,
    parse_reward,
    to_query,
    to_request,
)


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
