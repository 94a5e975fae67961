"""Two analyses of the same parameters side by side (docs/design.md §8): their top-q sets and tensors.

Why in the API and numpy: the top-q sets of every finished analysis are on disk as one byte per
coordinate (level l: in the l-th smallest set; written by the worker, ``workers.fisher.masks``), so a
compare reads two files and counts, whatever the model's size, without a worker or torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def set_comparison(a: np.ndarray, b: np.ndarray, fractions: Sequence[float]) -> dict:
    """Overlap |A ∩ B| / |A| and Jaccard |A ∩ B| / |A ∪ B| of the top-q sets of two level maps, each
    beside its value for independent random sets of the same density (q and q / (2 - q))."""
    if a.shape != b.shape:
        raise ValueError(f"the two analyses cover {a.size} and {b.size} coordinates")
    counts = []
    for level in range(1, len(fractions) + 1):
        in_a = (a > 0) & (a <= level)
        in_b = (b > 0) & (b <= level)
        counts.append(
            (int(np.count_nonzero(in_a & in_b)), int(np.count_nonzero(in_a)), int(np.count_nonzero(in_b)))
        )
    return set_comparison_from_counts(fractions, counts)


def set_comparison_from_counts(fractions: Sequence[float], counts: Sequence[tuple[int, int, int]]) -> dict:
    """``set_comparison`` from (|A ∩ B|, |A|, |B|) per density."""
    overlap, jaccard = [], []
    for both, size_a, size_b in counts:
        overlap.append(both / size_a if size_a else 0.0)
        union = size_a + size_b - both
        jaccard.append(both / union if union else 0.0)
    return {
        "q": list(fractions),
        "overlap": overlap,
        "jaccard": jaccard,
        "chance_overlap": list(fractions),
        "chance_jaccard": [q / (2 - q) for q in fractions],
    }


def tensor_pairs(summary_a: dict, summary_b: dict) -> list[dict]:
    """Per tensor, both analyses' totals of the Fisher, uncentered and raw (same parameter names)."""
    b_by_name = {t["name"]: t for t in summary_b["tensors"]}
    names_a = [t["name"] for t in summary_a["tensors"]]
    if set(names_a) != set(b_by_name):
        raise ValueError("the two analyses are of models with different parameter names")
    return [
        {
            "name": t["name"],
            "layer": t["layer"],
            "kind": t["kind"],
            "a": {key: t["totals"][key] for key in ("fisher", "uncentered", "raw")},
            "b": {key: b_by_name[t["name"]]["totals"][key] for key in ("fisher", "uncentered", "raw")},
        }
        for t in summary_a["tensors"]
    ]
