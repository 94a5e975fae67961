"""What the export buttons hand out that the dashboard writes itself: the per-tensor totals as CSV.

The full per-parameter arrays (safetensors) are written by the worker and downloaded from the API
(`ApiClient.arrays_url`); only this small table is formed in the browser's session, from the summary.
"""

from __future__ import annotations

from frontend.plots import Summary

CSV_FILENAME = "fisherscope_tensor_totals.csv"


def tensor_totals_csv(summary: Summary) -> str:
    """Per-tensor totals of every statistic as CSV: name, layer, kind, numel, then the summary's totals."""
    keys = list(summary["totals"].keys())
    lines = [",".join(["name", "layer", "kind", "numel", *keys])]
    for tensor in summary["tensors"]:
        values = [repr(tensor["totals"].get(key, "")) for key in keys]
        lines.append(
            ",".join([tensor["name"], str(tensor["layer"]), tensor["kind"], str(tensor["numel"]), *values])
        )
    return "\n".join(lines) + "\n"
