"""A Fisher mask in the forms other training code reads, and back as trainable coordinates.

Masks circulate in two polarities besides fisherscope's own (``q<q>/<param>`` uint8, 1 = trainable):
LoTA's ``torch.save`` of ``{name: bool}`` with True = frozen, and FISH / T-Few's ``torch.save`` of
``{name: float}`` with 1 = trainable. A file of the wrong polarity trains exactly the complement, so an
export states its polarity twice: in the file's name and in a JSON file beside it (with the model, its
digest, the density and the statistic the mask was cut from).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.mask_files import MaskFile


@dataclass(frozen=True)
class MaskFormat:
    name: str
    polarity: str
    slug: str  # in the file's name
    frozen_is_true: bool
    dtype: torch.dtype


FORMATS = {
    "lota": MaskFormat(
        "lota", "True = frozen (not trained), False = trainable", "true-is-frozen", True, torch.bool
    ),
    "fish": MaskFormat("fish", "1.0 = trainable, 0.0 = frozen", "1-is-trainable", False, torch.float32),
}


def density_of(masks: MaskFile, q: float | None) -> float:
    """The file's density ``q``; with none given, its only one."""
    if q is not None:
        return masks.check_fraction(q)
    if len(masks.fractions) > 1:
        listed = ", ".join(f"{f:g}" for f in masks.fractions)
        raise ValueError(f"{masks.path.name} holds several densities ({listed}); choose one with --q")
    return masks.fractions[0]


def default_export_path(source: Path, q: float, fmt: str) -> Path:
    return source.with_name(f"{source.stem}.q{q:g}.{fmt}.{FORMATS[fmt].slug}.pt")


def export_masks(
    source: Path, fmt: str, q: float | None = None, out: Path | None = None
) -> tuple[Path, Path]:
    """Write the mask of density q of ``source`` as ``fmt``; returns (the masks, the JSON beside them)."""
    masks = MaskFile.open(source)
    q = density_of(masks, q)
    form = FORMATS[fmt]
    out = out or default_export_path(source, q, fmt)
    tensors = {}
    for name, mask in masks.masks(q):
        trainable = torch.from_numpy(mask).bool()
        tensors[name] = (~trainable if form.frozen_is_true else trainable).to(form.dtype)
    torch.save(tensors, out)
    meta = masks.metadata
    sidecar = out.with_name(out.name + ".json")
    sidecar.write_text(
        json.dumps(
            {
                "format": fmt,
                "polarity": form.polarity,
                "q": q,
                "trainable": sum(int(t.sum()) for t in tensors.values())
                if not form.frozen_is_true
                else sum(int((~t).sum()) for t in tensors.values()),
                "parameters": masks.n_params,
                "model_id": meta.get("model_id"),
                "digest": meta.get("digest"),
                "statistic": meta.get("statistic"),
                "source": str(source),
            },
            indent=1,
        )
        + "\n"
    )
    return out, sidecar


def trainable_masks(source: str | Path, q: float | None = None) -> dict[str, torch.Tensor]:
    """{name: bool, True = trainable} from a fisherscope mask file (density q, or its only one)."""
    masks = MaskFile.open(Path(source))
    q = density_of(masks, q)
    return {name: torch.from_numpy(mask).bool() for name, mask in masks.masks(q)}
