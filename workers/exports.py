"""One download's safetensors file: the chosen statistics of the chosen parameters, in the chosen dtype.

Why apart from ``Analysis.save`` (the CLI's file of everything in float32): a notebook wants one or two
statistics, and the file says in its metadata what it holds and what float16 did to the values, so
nobody reads a rounded or flushed value as the engine's. A float16 file whose values would overflow to
inf is never written (``Float16Overflow``); values below float16's smallest subnormal become 0 and the
metadata counts them per statistic.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from backend.export_choice import FLOAT16_MAX, overflow_detail
from backend.schemas import ExportChoice, ExportDtype
from workers.fisher.stats import MomentSums
from workers.streamed_safetensors import Planned, write_streamed

FLOAT16_NOTE = (
    "float16 keeps 11 significant bits (relative rounding error at most 2^-11 = 4.9e-4 for magnitudes "
    "from 6.1e-5 to 65504); smaller magnitudes lose bits and those below 6.0e-8 are written as 0 "
    "(counted in flushed_to_zero); ask for dtype=float32 for the engine's values"
)
FLOAT32_NOTE = "float32: the engine's sums as computed"


class Float16Overflow(ValueError):
    """A statistic whose magnitude exceeds float16's range: the file would hold inf."""


def _exported(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return value.detach().to(device="cpu", dtype=torch.float32).to(dtype)


def float16_flushes(sums: MomentSums, choice: ExportChoice) -> dict[str, int]:
    """Per stat, the nonzero values float16 makes 0; refused (``Float16Overflow``) where a value is
    beyond float16's range. A pass of its own, before anything is written: the counts go in the file's
    header, which comes first."""
    flushed: dict[str, int] = {}
    for stat in choice.stats:
        flushed[stat] = 0
        for name, value in sums.iter_stat(stat):
            if not choice.selects(name):
                continue
            exact = value.detach().to(device="cpu", dtype=torch.float32)
            peak = float(exact.abs().max()) if exact.numel() else 0.0
            if peak > FLOAT16_MAX:
                raise Float16Overflow(overflow_detail(stat, peak))
            flushed[stat] += int(((exact.to(torch.float16) == 0) & (exact != 0)).sum())
    return flushed


def write_export(
    sums: MomentSums,
    input_ids: list[int],
    continuation_ids: list[int],
    choice: ExportChoice,
    path: Path,
    job: str,
) -> None:
    """Write the choice's file at ``path``, tensor by tensor (``workers.streamed_safetensors``); its
    metadata states the stats, dtype, selection and rounding."""
    dtype = torch.float16 if choice.dtype == ExportDtype.float16 else torch.float32
    ids = {"input_ids": input_ids, "continuation_ids": continuation_ids}
    planned = [
        Planned(f"{stat}/{name}", dtype, sums.shapes[name])
        for stat in choice.stats
        for name in sums.names
        if choice.selects(name)
    ]
    planned += [Planned(key, torch.int64, (len(values),)) for key, values in ids.items() if values]

    def tensor_of(key: str) -> torch.Tensor:
        if key in ids:
            return torch.tensor(ids[key], dtype=torch.int64)
        stat, _, name = key.partition("/")
        return _exported(sums.stat(stat, name), dtype)

    metadata = {
        "job": job,
        "stats": ",".join(choice.stats),
        "dtype": choice.dtype.value,
        "tensors": "all" if choice.tensors is None else ",".join(choice.tensors),
        "rounding": FLOAT16_NOTE if choice.dtype == ExportDtype.float16 else FLOAT32_NOTE,
        "keys": "<stat>/<parameter name>, plus input_ids and continuation_ids (int64)",
    }
    if choice.dtype == ExportDtype.float16:
        metadata["flushed_to_zero"] = json.dumps(float16_flushes(sums, choice))
    write_streamed(path, planned, tensor_of, metadata)
