"""``fisherscope updates BEFORE AFTER``: where a fine-tuning run changed the weights, and whether that is
where a Fisher mask points (``workers.weight_updates``)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from workers.commands.common import UsageError, check_outputs, progress_bar


def densities(text: str) -> tuple[float, ...]:
    """argparse type of ``--q``: comma-separated densities in (0, 1]."""
    try:
        values = tuple(float(q) for q in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers, e.g. 0.001,0.01"
        ) from None
    if any(not 0 < q <= 1 or math.isnan(q) for q in values):
        raise argparse.ArgumentTypeError(f"densities must lie in (0, 1], got {text!r}")
    return values


def add_updates_parser(commands) -> None:
    updates = commands.add_parser(
        "updates",
        help="where a fine-tuning run changed the weights: per tensor, layer and kind; top |delta| sets; "
        "overlap with a Fisher mask file",
    )
    updates.add_argument("before", metavar="BEFORE", help="the starting checkpoint: registered id or folder")
    updates.add_argument("after", metavar="AFTER", help="the fine-tuned checkpoint: registered id or folder")
    updates.add_argument(
        "--masks", type=Path, default=None, metavar="MASKS.safetensors", help="a study's Fisher mask file"
    )
    updates.add_argument(
        "--q",
        type=densities,
        default=None,
        metavar="Q,...",
        help="densities of the top-|delta| sets (default: the mask file's, else 0.001,0.01,0.05)",
    )
    updates.add_argument("--summary", type=Path, default=None, metavar="OUT.json", help="write the summary")


def cmd_updates(args: argparse.Namespace) -> int:
    from workers.commands.common import quiet_transformers
    from workers.weight_updates import Comparison, UpdatesError, summarize

    check_outputs({"--summary": args.summary})
    if args.masks is not None and not args.masks.is_file():
        raise UsageError(
            f"--masks {args.masks}: no such file; give a mask file from fisherscope study --masks"
        )
    quiet_transformers()
    try:
        comparison = Comparison.open(args.before, args.after, args.masks)
    except UpdatesError as error:
        raise UsageError(str(error)) from None
    with progress_bar("updates") as progress:
        summary = summarize(comparison, args.q, progress)
    if args.summary is not None:
        args.summary.write_text(json.dumps(summary, indent=1) + "\n")
    print(format_updates(summary))
    return 0


def format_updates(summary: dict) -> str:
    total = summary["total"]
    lines = [
        f"{summary['before']['model']} -> {summary['after']['model']}: {total['params']:,} parameters",
        f"changed: {total['changed']:,} ({total['changed_share']:.2%}); visible in bf16: "
        f"{total['changed_bf16']:,} ({total['changed_bf16_share']:.2%})",
        f"  ({summary['tolerance']['changed_bf16']})",
        f"{'kind':>10} {'params':>13} {'changed':>9} {'in bf16':>9}",
    ]
    for row in summary["kinds"]:
        shares = f"{row['changed_share']:>9.2%} {row['changed_bf16_share']:>9.2%}"
        lines.append(f"{row['group']:>10} {row['params']:>13,} {shares}")
    lines.append(f"{'top q':>10} {'k':>13} {'|delta| >=':>11}")
    for row in summary["top_q"]:
        lines.append(f"{row['q']:>10g} {row['k']:>13,} {row['threshold']:>11.3g}")
    masks = summary["masks"]
    if masks is not None:
        lines.append(f"against the masks of {masks['file']} (overlap: share of the set inside the mask)")
        header = "".join(f" {'q=' + format(q, 'g'):>16}" for q in masks["q"])
        lines.append(f"{'set':>20}{header}")
        for row in masks["sets"]:
            cells = "".join(
                f" {o:>7.2%} ({c:>6.2%})" for o, c in zip(row["overlap"], row["chance_overlap"], strict=True)
            )
            lines.append(f"{row['set']:>20}{cells}")
        lines.append("(chance in parentheses: an independent random set of the same size)")
    return "\n".join(lines)
