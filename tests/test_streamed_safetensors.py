"""Files written one tensor at a time read back with safetensors itself, exactly."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from workers.streamed_safetensors import Planned, write_streamed


def test_every_tensor_and_the_metadata_read_back_with_safetensors(tmp_path):
    tensors = {
        "fisher/w": torch.randn(3, 5),
        "fisher/b": torch.randn(7, dtype=torch.float64),
        "half/w": torch.randn(2, 3).to(torch.float16),
        "brain/w": torch.randn(4, 1).to(torch.bfloat16),
        "input_ids": torch.tensor([3, 1, 4], dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }
    planned = [Planned(key, value.dtype, tuple(value.shape)) for key, value in tensors.items()]
    asked: list[str] = []

    def tensor_of(key: str) -> torch.Tensor:
        asked.append(key)
        return tensors[key]

    path = tmp_path / "out.safetensors"
    write_streamed(path, planned, tensor_of, {"job": '{"a": 1}', "note": "x"})
    assert asked == list(tensors)  # each asked once, in order
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"job": '{"a": 1}', "note": "x"}
        assert set(handle.keys()) == set(tensors)
        for key, value in tensors.items():
            read = handle.get_tensor(key)
            assert read.dtype == value.dtype and torch.equal(read, value), key
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]


def test_a_tensor_unlike_its_plan_leaves_no_file(tmp_path):
    path = tmp_path / "out.safetensors"
    with pytest.raises(ValueError, match="planned"):
        write_streamed(path, [Planned("w", torch.float32, (2, 2))], lambda key: torch.zeros(3), {})
    assert not any(tmp_path.iterdir())
