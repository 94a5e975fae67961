"""The matmul rate behind the cost estimate: sustained, at the model's width, remembered per device and
width, re-measured when measured another way."""

from __future__ import annotations

import json

import pytest

from backend.registry import CACHE_ENV
from workers import throughput


def test_the_rates_are_sustained_measurements():
    square = throughput.measure("cpu", size=256, seconds=0.05)
    width = throughput.measure_width("cpu", 64, seconds=0.05, rows=128)
    assert 1e8 < square < 1e14 and 1e8 < width < 1e14  # flop/s of real multiplies, neither zero nor absurd


def test_the_width_rate_counts_a_blocks_products(monkeypatch):
    counted: list[float] = []

    def fake_sustained(target, step, units: float, seconds: float) -> float:
        step()
        counted.append(units)
        return units

    monkeypatch.setattr(throughput, "_sustained", fake_sustained)
    # rows through d x d, d x 3d and 3d x d: 2 rows (d^2 + 3 d^2 + 3 d^2) flop
    assert throughput.measure_width("cpu", 8, rows=4) == counted[0] == 2 * 4 * 7 * 8**2


def test_a_rate_is_remembered_per_width_and_one_measured_another_way_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    measured: list[int] = []

    def fake_width(device: str, d_model: int, seconds: float = 1.0, rows: int = 2048) -> float:
        measured.append(d_model)  # the caching is under test here, not the multiply
        return 1e9 * d_model

    monkeypatch.setattr(throughput, "measure_width", fake_width)
    key = throughput.device_key("cpu")
    cache = tmp_path / throughput.CACHE_NAME
    # what an earlier version remembered (the 2048^2 square's rate), and another device's entry
    cache.write_text(
        json.dumps({key: {"flops_per_second": 9e11, "method": "sustained-1s"}, "cuda:other": {"x": 1}})
    )
    assert throughput.matmul_rate("cpu", 576) == 5.76e11
    assert throughput.matmul_rate("cpu", 576) == 5.76e11
    assert measured == [576]
    assert throughput.matmul_rate("cpu", 2048) == 2.048e12  # another model's width is measured
    assert measured == [576, 2048]
    stored = json.loads(cache.read_text())
    assert stored["cuda:other"] == {"x": 1}
    assert stored[key]["method"] == throughput.METHOD
    assert {width: m["flops_per_second"] for width, m in stored[key]["widths"].items()} == {
        "576": 5.76e11,
        "2048": 2.048e12,
    }
    assert throughput.matmul_rate("cpu", 576, refresh=True) == 5.76e11 and measured == [576, 2048, 576]


@pytest.mark.parametrize(
    "damaged",
    [
        "[1, 2]",
        "{not json",
        json.dumps({"KEY": {"method": throughput.METHOD, "widths": {"576": None}}}),
        json.dumps({"KEY": {"method": throughput.METHOD, "widths": {"576": {"flops_per_second": "fast"}}}}),
        json.dumps({"KEY": {"method": throughput.METHOD, "widths": [576]}}),
    ],
)
def test_a_damaged_cache_is_measured_again_not_a_crash(tmp_path, monkeypatch, damaged: str):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(throughput, "measure_width", lambda device, d_model, **_: 3e11)
    cache = tmp_path / throughput.CACHE_NAME
    cache.write_text(damaged.replace("KEY", throughput.device_key("cpu")))
    assert throughput.matmul_rate("cpu", 576) == 3e11
    assert (
        json.loads(cache.read_text())[throughput.device_key("cpu")]["widths"]["576"]["flops_per_second"]
        == 3e11
    )


def test_a_rate_an_estimate_missed_by_more_than_twice_is_measured_again(tmp_path, monkeypatch):
    """A rate measured while the machine was busy is too low for good; a run that shows it (its estimate
    off by more than MISS_FACTOR either way) drops it, and the next estimate measures again."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    measured: list[int] = []
    rates = iter([5.3e10, 1.9e11])  # busy, then quiet

    def fake_width(device: str, d_model: int, seconds: float = 1.0, rows: int = 2048) -> float:
        measured.append(d_model)
        return next(rates)

    monkeypatch.setattr(throughput, "measure_width", fake_width)
    assert throughput.matmul_rate("cpu", 1024) == 5.3e10
    assert not throughput.check_estimate("cpu", 1024, 40.0, 73.0)  # 1.8x: within the factor, kept
    assert not throughput.check_estimate("cpu", 1024, 40.0, 21.0)
    assert throughput.matmul_rate("cpu", 1024) == 5.3e10 and measured == [1024]
    assert throughput.check_estimate("cpu", 1024, 150.0, 43.0)  # 3.5x faster than estimated: dropped
    assert throughput.matmul_rate("cpu", 1024) == 1.9e11 and measured == [1024, 1024]
    assert not throughput.check_estimate("cpu", 576, 1.0, 30.0)  # nothing remembered there: nothing to drop
    assert not throughput.check_estimate("cpu", 1024, 0.5, 5.0)  # a short run is fixed costs: not judged
    assert throughput.check_estimate("cpu", 1024, 1.0, 30.0)  # too slow by 30x: dropped as well
    assert (
        "1024"
        not in json.loads((tmp_path / throughput.CACHE_NAME).read_text())[throughput.device_key("cpu")][
            "widths"
        ]
    )
