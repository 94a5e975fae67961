"""A safetensors file written one tensor at a time.

Why not ``safetensors.torch.save_file``: it takes every tensor at once, and an analysis's stats of every
parameter are several copies of the model (seven float32 copies of Qwen3-0.6B: 17 GB). The library
has no writer that takes tensors one by one, so this writes its documented format
(github.com/huggingface/safetensors, "Format": an 8-byte little-endian header length, the JSON header
with each tensor's dtype, shape and byte offsets, padded with spaces, then the bytes in that order),
and the tests read every file back with safetensors itself. Each tensor is formed, written and let go.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
}


@dataclass(frozen=True)
class Planned:
    """A tensor the file will hold, known before it is formed."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def write_streamed(
    path: Path, planned: Sequence[Planned], tensor_of: Callable[[str], torch.Tensor], metadata: dict[str, str]
) -> None:
    """Write ``planned``'s tensors, each asked of ``tensor_of(key)`` in turn, to ``path`` (through a
    file beside it, renamed when complete: a failure leaves nothing at ``path``)."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for entry in planned:
        header[entry.key] = {
            "dtype": SAFETENSORS_DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    partial = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        with open(partial, "wb") as out:
            out.write(struct.pack("<Q", len(text)))
            out.write(text)
            for entry in planned:
                tensor = tensor_of(entry.key).detach().to("cpu").contiguous()
                got = (tensor.dtype, tuple(tensor.shape))
                if got != (entry.dtype, entry.shape):
                    raise ValueError(f"{entry.key}: planned {entry.dtype} {entry.shape}, got {got}")
                out.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
