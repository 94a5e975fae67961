"""``fisherscope masks info|compare|export``: read Fisher mask files without loading a model, and write
one density's mask in the polarity other training code reads (``workers.mask_formats``).

Why a command of its own: a mask file is what goes back to training, often long after the study ran and
on another machine; what it holds and how two of them agree (two samplers, prompt sets, or the exact
Fisher against an estimator's) is read from the files alone (``backend.mask_files``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from workers.commands.common import UsageError


def add_masks_parser(commands) -> None:
    masks = commands.add_parser("masks", help="what a Fisher mask file holds; two mask files compared")
    actions = masks.add_subparsers(dest="action", required=True)
    info = actions.add_parser("info", help="model, densities, thresholds and coordinates per density")
    info.add_argument("file", type=Path, metavar="MASKS.safetensors")
    compare = actions.add_parser(
        "compare", help="overlap and Jaccard of two files' masks at every density both hold, beside chance"
    )
    compare.add_argument("a", type=Path, metavar="A.safetensors")
    compare.add_argument("b", type=Path, metavar="B.safetensors")
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON")
    export = actions.add_parser(
        "export",
        help="one density's mask as other training code reads it: lota (torch.save {name: bool}, True = "
        "frozen) or fish (torch.save {name: float}, 1 = trainable), with its polarity in the name and a JSON",
    )
    export.add_argument("file", type=Path, metavar="MASKS.safetensors")
    export.add_argument("--format", required=True, choices=["lota", "fish"])
    export.add_argument("--q", type=float, default=None, help="the density (default: the file's only one)")
    export.add_argument("--out", type=Path, default=None, metavar="FILE.pt", help="default: beside the file")


def cmd_masks(args: argparse.Namespace) -> int:
    from backend.mask_files import MaskFile, MaskFileError, compare_mask_files

    if args.action == "export":
        return _export(args)
    try:
        if args.action == "info":
            print(format_info(MaskFile.open(_existing(args.file))))
            return 0
        a, b = MaskFile.open(_existing(args.a)), MaskFile.open(_existing(args.b))
        rows = compare_mask_files(a, b)
    except MaskFileError as error:
        raise UsageError(str(error)) from None
    if args.json:
        print(json.dumps({"a": str(args.a), "b": str(args.b), **rows}, indent=1))
        return 0
    if a.model_id != b.model_id or a.metadata.get("digest") != b.metadata.get("digest"):
        print(f"note: the files name different models ({a.model_id} and {b.model_id})")
    print(f"{'q':>8} {'overlap':>9} {'chance':>8} {'Jaccard':>9} {'chance':>8}")
    for q, overlap, chance, jaccard, chance_j in zip(
        rows["q"],
        rows["overlap"],
        rows["chance_overlap"],
        rows["jaccard"],
        rows["chance_jaccard"],
        strict=True,
    ):
        print(f"{q:>8g} {overlap:>9.2%} {chance:>8.2%} {jaccard:>9.2%} {chance_j:>8.3%}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from backend.mask_files import MaskFileError
    from workers.commands.common import check_outputs
    from workers.mask_formats import export_masks

    check_outputs({"--out": args.out})
    try:
        out, sidecar = export_masks(_existing(args.file), args.format, args.q, args.out)
    except (MaskFileError, ValueError) as error:
        raise UsageError(str(error)) from None
    print(f"wrote {out} and {sidecar.name} ({args.format}: {json.loads(sidecar.read_text())['polarity']})")
    return 0


def format_info(masks) -> str:
    """What the file holds: the coordinates in each mask counted in its tensors (which checks each is 0/1)
    beside ceil(q P), and the thresholds the study recorded."""
    meta = masks.metadata
    thresholds = _json_object(meta.get("thresholds"))
    total = masks.n_params
    lines = [
        f"{masks.path}: {len(masks.shapes)} parameters, {total:,} coordinates",
        f"model: {meta.get('model_id', '?')} ({meta.get('digest', '?')})",
        f"polarity: {meta.get('polarity', '?')}",
        f"{'q':>8} {'in the mask':>12} {'ceil(qP)':>10} {'threshold':>11}",
    ]
    for q in masks.fractions:
        threshold = thresholds.get(f"{q:g}")
        shown = f"{threshold:.4g}" if isinstance(threshold, float) else "?"
        lines.append(f"{q:>8g} {masks.count(q):>12,} {math.ceil(q * total):>10,} {shown:>11}")
    return "\n".join(lines)


def _json_object(text: str | None) -> dict:
    """A metadata field's JSON object; {} where it is missing or not one (metadata is only shown)."""
    try:
        value = json.loads(text or "{}")
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _existing(path: Path) -> Path:
    if not path.is_file():
        raise UsageError(f"{path}: {'not a file' if path.exists() else 'no such file'}; give a mask file")
    return path
