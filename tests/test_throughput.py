"""The matmul rate behind the cost estimate: sustained, at the model's width, remembered per device and
width, re-measured when measured another way."""

from __future__ import annotations

import json

from backend.registry import CACHE_ENV
from workers import throughput


def test_the_rates_are_sustained_measurements():
    square = throughput.measure("cpu", size=256, seconds=0.05)
    width = throughput.measure_width("cpu", 64, seconds=0.05, rows=128)
    assert 1e8 < square < 1e14 and 1e8 < width < 1e14  # flop/s of real multiplies, neither zero nor absurd


def test_a_rate_is_remembered_per_width_and_one_measured_another_way_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    measured: list[int] = []

    def fake_width(device: str, d_model: int, seconds: float = 1.0, rows: int = 2048) -> float:
        measured.append(d_model)  # the caching is under test here, not the multiply
        return 1e9 * d_model

    monkeypatch.setattr(throughput, "measure_width", fake_width)
    key = throughput.device_key("cpu")
    # what an earlier version remembered: the 2048^2 square's rate
    (tmp_path / throughput.CACHE_NAME).write_text(
        json.dumps({key: {"flops_per_second": 9e11, "method": "sustained-1s"}})
    )
    assert throughput.matmul_rate("cpu", 576) == 5.76e11
    assert throughput.matmul_rate("cpu", 576) == 5.76e11
    assert measured == [576]
    assert throughput.matmul_rate("cpu", 2048) == 2.048e12  # another model's width is measured
    assert measured == [576, 2048]
    stored = json.loads((tmp_path / throughput.CACHE_NAME).read_text())[key]
    assert stored["method"] == throughput.METHOD
    assert stored["width_flops_per_second"] == {"576": 5.76e11, "2048": 2.048e12}
    assert throughput.matmul_rate("cpu", 576, refresh=True) == 5.76e11 and measured == [576, 2048, 576]
