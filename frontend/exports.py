"""What the export buttons hand out that the dashboard writes itself: small tables as CSV.

The per-tensor totals of one analysis, and the compare view of two. The full per-parameter arrays
(safetensors) are written by the worker and downloaded from the API (`ApiClient.arrays_url`); these
tables are formed on the dashboard's server from the overview and the compare the API returns.
"""

from __future__ import annotations

from dash import dcc, html

from backend.schemas import DEFAULT_EXPORT_STATS, ComparePublic, ExportDtype
from backend.summary import AnalysisSummary
from backend.vocabulary import STATS

ARRAYS_STATS_ID = "arrays-stats"
ARRAYS_DTYPE_ID = "arrays-dtype"


def arrays_choice() -> html.Div:
    """The statistics and precision of the safetensors download, shown beside "Prepare full arrays"."""
    return html.Div(
        className="arrays-choice",
        children=[
            dcc.Checklist(
                id=ARRAYS_STATS_ID, options=list(STATS), value=list(DEFAULT_EXPORT_STATS), inline=True
            ),
            dcc.RadioItems(
                id=ARRAYS_DTYPE_ID,
                options=[
                    {"label": "float16 (half the size, ~3 digits)", "value": ExportDtype.float16.value},
                    {"label": "float32 (as computed)", "value": ExportDtype.float32.value},
                ],
                value=ExportDtype.float16.value,
                inline=True,
            ),
        ],
    )


def arrays_query(stats: list[str] | None, dtype: str | None) -> dict[str, str]:
    """The download's query for the chosen statistics (in STATS order) and dtype; unset = the API's
    defaults (fisher and mean_shift in float16)."""
    chosen = [stat for stat in STATS if stat in (stats if stats is not None else DEFAULT_EXPORT_STATS)]
    return {"stats": ",".join(chosen), "dtype": dtype or ExportDtype.float16.value}


CSV_FILENAME = "fisherscope_tensor_totals.csv"


def tensor_totals_csv(summary: AnalysisSummary) -> str:
    """Per-tensor totals of every statistic as CSV: name, layer, kind, numel, then the summary's totals."""
    keys = list(summary.totals.keys())
    lines = [",".join(["name", "layer", "kind", "numel", *keys])]
    for tensor in summary.tensors:
        values = [repr(tensor.totals.get(key, "")) for key in keys]
        lines.append(",".join([tensor.name, str(tensor.layer), tensor.kind, str(tensor.numel), *values]))
    return "\n".join(lines) + "\n"


COMPARE_CSV_FILENAME = "fisherscope_compare.csv"
COMPARE_STATS = ("fisher", "uncentered", "raw")


def compare_csv(compare: ComparePublic, labels: tuple[str, str]) -> str:
    """The compare view as CSV: two tables, each after a '#' line that says what it is, a blank line
    between them (pandas: `read_csv(..., comment="#", nrows=...)`, or split on the blank line).

    First every tensor's totals in A and in B; then the top-q sets by centered Fisher: overlap
    |A∩B|/|A| and Jaccard |A∩B|/|A∪B|, each beside its chance value for independent random sets.
    """
    lines = [
        f"# fisherscope compare: A = {compare.a} ({labels[0]}); B = {compare.b} ({labels[1]})",
        "# per tensor: the total of each statistic in A and in B",
        ",".join(["name", "layer", "kind", *(f"{side}_{stat}" for stat in COMPARE_STATS for side in "ab")]),
    ]
    for tensor in compare.tensors:
        values = [repr(side[stat]) for stat in COMPARE_STATS for side in (tensor.a, tensor.b)]
        lines.append(",".join([tensor.name, str(tensor.layer), tensor.kind, *values]))
    sets = compare.sets
    lines += ["", "# top-q sets by the centered Fisher, against independent random sets of density q"]
    columns = {
        "overlap": sets.overlap,
        "chance_overlap": sets.chance_overlap,
        "jaccard": sets.jaccard,
        "chance_jaccard": sets.chance_jaccard,
    }
    lines.append(",".join(["q", *columns]))
    for i, q in enumerate(sets.q):
        lines.append(",".join([repr(q), *(repr(shares[i]) for shares in columns.values())]))
    return "\n".join(lines) + "\n"
