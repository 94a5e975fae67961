"""The CLI under ``torchrun --nproc-per-node N``: every process joins one process group and runs the same
command; the engine splits each position's directions over them (``workers.fisher.shards``); rank 0
alone prints and writes the outputs.

Why the same command everywhere: each process loads the model and runs the forward and C_mu itself
(cheap against the directions), so nothing but the per-parameter sums crosses between processes. The
commands split only their direction passes (``shards.split_directions``): each process certifies its
model alone, since a certificate cached on one node and not another would leave the nodes waiting.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from workers.commands.common import UsageError

GROUP_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """torchrun (or any launcher of torch.distributed) set up more than one process."""
    return all(name in os.environ for name in GROUP_VARIABLES) and int(os.environ["WORLD_SIZE"]) > 1


def device_of_process(device: str) -> str:
    """A GPU per process: ``cuda`` means this process's local GPU (LOCAL_RANK) under torchrun, where a
    GPU named by index would be every process's (UsageError)."""
    if not launched_by_torchrun() or not device.startswith("cuda"):
        return device
    if device != "cuda":
        raise UsageError(
            f"--device {device}: under torchrun each process takes its own GPU; use --device cuda"
        )
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"


@contextlib.contextmanager
def process_group(device: str) -> Iterator[int]:
    """Join the process group torchrun describes (NCCL on a GPU, gloo on the CPU) for the block and
    yield this process's rank; outside torchrun yield 0 and do nothing. Ranks above 0 print nothing."""
    if not launched_by_torchrun():
        yield 0
        return
    import torch
    import torch.distributed as dist

    gpu = device.startswith("cuda")
    if gpu:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if gpu else "gloo")
    rank = dist.get_rank()
    try:
        with open(os.devnull, "w") as quiet, contextlib.ExitStack() as stack:
            if rank:
                stack.enter_context(contextlib.redirect_stdout(quiet))
                stack.enter_context(contextlib.redirect_stderr(quiet))
            yield rank
    finally:
        dist.destroy_process_group()
