"""Loops of the math core compiled for the CPU (numba), where torch's ops would pass over memory
several times; one module per kernel, each stating the torch expression that defines it. GPU tensors
take the torch path of the callers, which these loops are tested against: ``compiled_for`` is the one
test of which path a tensor's values take, and ``torch_ops_only`` sends CPU tensors down the GPU's path
(tests/test_torch_path.py runs whole analyses both ways).

- ``histogram`` (``tensor_pass``), ``totals`` (``tensor_totals``, ``square_sum``, ``extra_share_mean``)
  and ``selection`` (``select_grouped``): up to three stats given as their terms (``StatTerms``) are
  binned, summed or selected, never formed as arrays, each array read once for all of them, in float64.
- ``largest`` (``largest_sum``): the exact top-k of a histogram's boundary bin.
- ``top`` (``largest_indices``): a tensor's k largest values or magnitudes, for its top coordinates.
- ``levels`` (``nested_levels``, ``threshold_levels``): the top-q level map.
- ``block_sums``: pooled views, from a stat's terms in one pass.
- ``pair_moments``: the ghost form's M with few rows, in register blocks.
- ``threads``, ``llvm``, ``arrays``: where the loops run, the LLVM helpers they share, how they see
  their inputs.
"""

from workers.fisher.cpu_kernels.block_sums import block_sums
from workers.fisher.cpu_kernels.histogram import TensorPass, histogram, tensor_pass
from workers.fisher.cpu_kernels.largest import largest_sum
from workers.fisher.cpu_kernels.levels import TIES_KEPT, nested_levels, threshold_levels
from workers.fisher.cpu_kernels.pair_moments import pair_moments
from workers.fisher.cpu_kernels.selection import HIT_BINS, _hit_bins, select_grouped
from workers.fisher.cpu_kernels.threads import (
    PART_MIN_VALUES,
    _busy,
    _in_parts,
    compiled_for,
    each_in_threads,
    torch_ops_only,
)
from workers.fisher.cpu_kernels.top import largest_indices
from workers.fisher.cpu_kernels.totals import TensorTotals, extra_share_mean, square_sum, tensor_totals

__all__ = [
    "HIT_BINS",
    "PART_MIN_VALUES",
    "TIES_KEPT",
    "TensorPass",
    "TensorTotals",
    "_busy",
    "_hit_bins",
    "_in_parts",
    "block_sums",
    "compiled_for",
    "each_in_threads",
    "extra_share_mean",
    "histogram",
    "largest_indices",
    "largest_sum",
    "nested_levels",
    "pair_moments",
    "select_grouped",
    "square_sum",
    "tensor_pass",
    "tensor_totals",
    "threshold_levels",
    "torch_ops_only",
]
