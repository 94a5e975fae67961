"""A study's files: the mask file, the per-parameter arrays, the summary JSON, and parts for a reducer.

Why all-or-nothing: a study's outputs belong together (the masks are cut from the arrays the summary
describes), so each is written to a temporary file beside its target and all are renamed only once
every one is complete; a failure leaves no output, half-written or stale-beside-new.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from backend.mask_files import MaskFile, mask_key
from backend.study_summary import PromptRecord, ResponseRecord
from workers.fisher.study import UNCENTERED, StudyStat, StudySums
from workers.studies.masks import POLARITY, mask_counts, mask_tensors
from workers.studies.runner import StudyPart
from workers.studies.spec import StudySpec
from workers.studies.summary import FinishedStudy

SAVED_ARRAYS = {"F": StudyStat.fisher, "U": UNCENTERED, "M": StudyStat.mean_shift}


@contextmanager
def atomic_outputs(targets: Sequence[Path]) -> Iterator[list[Path]]:
    """Temporary paths for ``targets``; renamed onto them when the block ends without error, else removed."""
    temporaries = [t.with_name(f".{t.name}.{os.getpid()}.part") for t in targets]
    try:
        yield temporaries
    except BaseException:
        for temporary in temporaries:
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()
        raise
    for temporary, target in zip(temporaries, targets, strict=True):
        temporary.replace(target)


def write_masks(path: Path, study: FinishedStudy, part: StudyPart, spec: StudySpec) -> None:
    """One uint8 tensor per density and parameter, ``q<q>/<name>``, 1 = in the mask (trainable)."""
    levels, sums = study.fisher_levels, part.sums
    tensors: dict[str, torch.Tensor] = {}
    counts: dict[str, dict[str, int]] = {}
    thresholds: dict[str, float] = {}
    for q in spec.fractions:
        for name, mask in mask_tensors(levels, q, sums).items():
            tensors[mask_key(q, name)] = mask
        counts[f"{q:g}"] = mask_counts(levels, q, sums)
        thresholds[f"{q:g}"] = levels.thresholds[levels.level(q) - 1].value
    model = study.summary["model"]
    save_file(
        tensors,
        str(path),
        metadata={
            "kind": "fisherscope.study.masks",
            "model_id": str(model.get("id")),
            "digest": str(model.get("digest")),
            "q": json.dumps(list(spec.fractions)),
            "thresholds": json.dumps(thresholds),
            "counts": json.dumps(counts),
            "polarity": POLARITY,
            "statistic": "F: the exact sequence Fisher of the study's sampled responses (docs/design.md §7)",
            "spec": json.dumps(spec.to_dict()),
        },
    )


def read_masks(path: Path) -> tuple[dict[float, dict[str, torch.Tensor]], dict[str, str]]:
    """({q: {name: uint8 mask}}, metadata) of a mask file."""
    masks = MaskFile.open(path)
    tensors = {q: {name: torch.from_numpy(mask) for name, mask in masks.masks(q)} for q in masks.fractions}
    return tensors, masks.metadata


def averaged_arrays(part: StudyPart) -> dict[str, dict[str, torch.Tensor]]:
    """F, U and M by parameter name: each response's sums over its positions, averaged over the
    responses (float32, on the CPU)."""
    sums = part.sums
    count = max(sums.responses, 1)
    return {
        label: {
            name: (value.double() / count).float().cpu().contiguous() for name, value in sums.iter_stat(stat)
        }
        for label, stat in SAVED_ARRAYS.items()
    }


def write_arrays(path: Path, part: StudyPart) -> None:
    """``F/<name>``, ``U/<name>``, ``M/<name>`` (``averaged_arrays``) and the sampled ids:
    ``input_ids/<prompt>`` and ``continuation_ids/<prompt>/<response>``."""
    sums = part.sums
    tensors: dict[str, torch.Tensor] = {
        f"{label}/{name}": value
        for label, arrays in averaged_arrays(part).items()
        for name, value in arrays.items()
    }
    for record in part.responses:
        tensors.setdefault(
            f"input_ids/{record.prompt_index}", torch.tensor(record.input_ids, dtype=torch.int64)
        )
        key = f"continuation_ids/{record.prompt_index}/{record.response_index}"
        tensors[key] = torch.tensor(record.continuation_ids, dtype=torch.int64)
    save_file(
        tensors,
        str(path),
        metadata={
            "normalization": "F, U, M: sums over each response's positions, "
            f"averaged over the {sums.responses} responses"
        },
    )


def write_summary(path: Path, summary: dict) -> None:
    path.write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")


def write_part(path: Path, part: StudyPart) -> None:
    """Every running sum and record of a part (for a reducer in another process): ``<stat>/<name>``."""
    sums = part.sums
    tensors = {
        f"{stat}/{name}": value.contiguous().cpu()
        for stat, table in sums.sums.items()
        for name, value in table.items()
    }
    meta = {
        "names": sums.names,
        "shapes": {n: list(s) for n, s in sums.shapes.items()},
        "dtype": str(sums.dtype).removeprefix("torch."),
        "counts": {
            key: getattr(sums, key)
            for key in ("responses", "positions", "contexts", "targets", "directions", "direction_tokens")
        },
        "head_name": part.head_name,
        "embedding_name": part.embedding_name,
        "responses": [r.model_dump() for r in part.responses],
        "prompts": [p.model_dump() for p in part.prompts],
        "seconds": part.seconds,
    }
    save_file(tensors, str(path), metadata={"part": json.dumps(meta)})


def read_part(path: Path, device: str = "cpu") -> StudyPart:
    with safe_open(str(path), framework="pt", device=device) as handle:
        meta = json.loads((handle.metadata() or {})["part"])
        sums = StudySums(
            meta["names"],
            {n: tuple(s) for n, s in meta["shapes"].items()},
            getattr(torch, meta["dtype"]),
            torch.device(device),
        )
        for key in handle.keys():  # noqa: SIM118
            stat, _, name = key.partition("/")
            sums.sums.setdefault(stat, {})[name] = handle.get_tensor(key)
    for key, value in meta["counts"].items():
        setattr(sums, key, value)
    return StudyPart(
        sums,
        meta["head_name"],
        meta["embedding_name"],
        [ResponseRecord(**r) for r in meta["responses"]],
        [PromptRecord(**p) for p in meta["prompts"]],
        meta["seconds"],
    )
