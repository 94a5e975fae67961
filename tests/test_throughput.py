"""The matmul rate behind the cost estimate: sustained, remembered per device, re-measured when stale."""

from __future__ import annotations

import json

from backend.registry import CACHE_ENV
from workers import throughput


def test_the_rate_is_a_sustained_measurement():
    rate = throughput.measure("cpu", size=256, seconds=0.05)
    assert 1e8 < rate < 1e14  # flop/s of a real multiply, neither zero nor absurd


def test_a_rate_is_remembered_and_one_measured_another_way_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    measured: list[str] = []

    def fake_measure(device: str = "cpu", size=None, seconds: float = 1.0) -> float:
        measured.append(device)  # the caching is under test here, not the multiply
        return 1.25e11

    monkeypatch.setattr(throughput, "measure", fake_measure)
    key = throughput.device_key("cpu")
    (tmp_path / throughput.CACHE_NAME).write_text(json.dumps({key: {"flops_per_second": 9e11}}))
    assert throughput.matmul_rate("cpu") == 1.25e11  # no method recorded: the old fastest-of-five
    assert throughput.matmul_rate("cpu") == 1.25e11
    assert measured == ["cpu"]
    stored = json.loads((tmp_path / throughput.CACHE_NAME).read_text())[key]
    assert stored["method"] == throughput.METHOD and stored["flops_per_second"] == 1.25e11
    assert throughput.matmul_rate("cpu", refresh=True) == 1.25e11 and measured == ["cpu", "cpu"]
