"""One analysis over several processes (``torchrun``): each runs a share of every position's directions
and the per-parameter results are summed once per position.

Why the directions: every moment is a sum over directions (a square group's weighted squares, a first
moment's one gradient, a probe's row), so a process that runs some of them holds a partial sum, and the
sum of the partial sums is the single process's result up to float32 rounding. Every process computes
the same forward, C_mu and plans (deterministic, float64), so they agree on the directions without
sending them. The first moments and probes (a few directions) run on rank 0; the square directions are
split into contiguous equal shares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Splitting is asked for (``split_directions``), never inferred from a process group existing: a
# notebook inside a DDP job that analyses on one rank must not wait for ranks that never come.
_splitting = False


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int

    def rows(self, lead: int, total: int) -> list[tuple[int, int]]:
        """The row ranges this process runs of ``total`` directions whose first ``lead`` are first
        moments and probes: those on rank 0, then its share of the square directions."""
        squares = total - lead
        lo = lead + squares * self.rank // self.world
        hi = lead + squares * (self.rank + 1) // self.world
        ranges = [(0, lead)] if self.rank == 0 and lead else []
        return ranges + ([(lo, hi)] if hi > lo else [])


@contextlib.contextmanager
def split_directions() -> Iterator[None]:
    """Within the block, direction passes split over the process group (every process must run the
    same passes in the same order)."""
    global _splitting
    before, _splitting = _splitting, True
    try:
        yield
    finally:
        _splitting = before


def current_shard() -> Shard | None:
    """This process's shard inside ``split_directions`` with more than one process, else None."""
    if _splitting and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return Shard(dist.get_rank(), dist.get_world_size())
    return None


def check_agreement(total: int) -> None:
    """Every process plans the same directions from the same numbers; if one did not (a kernel that is
    not deterministic, mismatched devices), the shares would leave directions out: refuse, on every
    process alike, rather than sum the wrong thing or wait forever."""
    totals = gathered(total)
    if len(set(totals)) > 1:
        raise RuntimeError(
            f"the processes planned different direction counts {totals} for one position: their forward "
            "passes or C_mu differ (run every process on the same kind of device, deterministic kernels)"
        )


def first_failure(failure: str | None, group: dist.ProcessGroup | None = None) -> tuple[int, str] | None:
    """The first process of ``group`` (the default one) whose step failed and its message, where one did.
    Every process calls this at the same step, so a process that cannot go on (no disk for its mapped
    sums) stops the others there, where they would otherwise wait for it in the next collective until
    the group's timeout."""
    reports: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, failure, group=group)
    return next(((rank, report) for rank, report in enumerate(reports) if report is not None), None)


def sum_over_processes(tables: list[dict[str, torch.Tensor]], shapes: list[dict[str, tuple]]) -> None:
    """Sum each table's tensors over the processes, in place: a name no process has stays absent, one
    that some have is summed with zeros for the others (every process ends with the same tables).

    ``tables[k]`` maps names to tensors; ``shapes[k]`` lists every name it may hold with its shape (the
    same on every process, in the same order). Every process makes the same collective calls."""
    device = collective_device()
    keys = [(k, name) for k, table_shapes in enumerate(shapes) for name in table_shapes]
    present = torch.tensor([name in tables[k] for k, name in keys], dtype=torch.int32, device=device)
    dist.all_reduce(present)
    # each table's dtype, for a process that holds none of its tensors
    codes = torch.tensor([_code(table) for table in tables], dtype=torch.int32, device=device)
    dist.all_reduce(codes, op=dist.ReduceOp.MAX)
    for (k, name), count in zip(keys, present.tolist(), strict=True):
        if not count:
            continue
        value = tables[k].get(name)
        if value is None:
            value = torch.zeros(shapes[k][name], dtype=_DTYPES[int(codes[k])], device=device)
        # a transposed view (a Conv1D block's sum) is summed in memory order: make it the layout it reads
        value = value.contiguous()
        dist.all_reduce(value)
        tables[k][name] = value


_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _code(table: dict[str, torch.Tensor]) -> int:
    found = next(iter(table.values()), None)
    return -1 if found is None else _DTYPES.index(found.dtype)


def collective_device() -> torch.device:
    """Where this process's collective tensors live: its GPU under NCCL, else the CPU (gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gathered(count: int) -> list[int]:
    """``count`` of every process, in rank order."""
    device = collective_device()
    found = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(found, torch.tensor([count], dtype=torch.int64, device=device))
    return [int(value) for value in found]
