"""The CLI under ``torchrun --nproc-per-node N``: every process joins one process group and runs the same
command; the engine splits each position's directions over them (``workers.fisher.shards``); rank 0
alone prints and writes the outputs.

Why the same command everywhere: each process loads the model and runs the forward and C_mu itself
(cheap against the directions), so nothing but the per-parameter sums crosses between processes. The
commands split only their direction passes (``shards.split_directions``): each process certifies its
model alone, since a certificate cached on one node and not another would leave the nodes waiting.

``fisherscope worker`` under torchrun is one worker of N processes: rank 0 alone takes jobs from the
queue and writes the store and the files; before each engine run of a job (``together``) it sends the
others what to repeat (``follow``), and every process runs it on its share of the directions. Why at the
engine run and not the job: what a job runs depends on what rank 0 reads in the store (a cached or kept
result, a claimed response, the queued downloads), so only rank 0 can tell the others.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from workers.commands.common import UsageError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

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


# The group a worker's processes talk over while rank 0 leads (None elsewhere). Its own group, gloo on
# the CPU: its messages never pair with the engine's collectives, and the followers wait on it for the
# next job for as long as the queue stays empty (the default group's timeout would end them).
_control: ProcessGroup | None = None
IDLE_TIMEOUT = timedelta(days=365)


def _control_group() -> ProcessGroup:
    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


@contextlib.contextmanager
def leading() -> Iterator[None]:
    """Rank 0 of a worker: in the block its ``together`` runs are repeated by the other processes, which
    are told to stop when the block ends, however it ends."""
    global _control
    import torch.distributed as dist

    _control = _control_group()
    try:
        yield
    finally:
        dist.broadcast_object_list([None], src=0, group=_control)
        _control = None


def follow() -> None:
    """The other processes of a worker: repeat each engine run rank 0 sends until it says stop. A run
    that fails is rank 0's to report (in the job); this process goes on to the next one."""
    import signal

    import torch.distributed as dist

    from workers.fisher.shards import split_directions

    # Ctrl+C and torchrun's SIGTERM reach every process: rank 0's RQ worker finishes its job first, and
    # its stop ends this loop (if rank 0 dies instead, the control group's connection closes and raises)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    control = _control_group()
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=control)
        if message[0] is None:
            return
        repeat, args = message[0]
        with contextlib.suppress(Exception):
            with _told_to_all(control):
                run = repeat(*args)
            with _told_to_all(control), split_directions():
                run()


@contextlib.contextmanager
def together(repeat: Callable[..., Callable[[], object]], *args: Any) -> Iterator[None]:
    """The engine run in the block, on every process of a worker under torchrun: each of the others calls
    ``repeat(*args)`` (a module-level function: it travels by name) to load what the run needs, then the
    run it returns, the same engine calls as the block's; outside a leading worker the block runs alone.

    A failure in any process, loading or running, fails the block on rank 0 (the job ends failed with
    its message), and every process goes on to the next run (``_told_to_all``)."""
    if _control is None:
        yield
        return
    import torch.distributed as dist

    from workers.fisher.shards import split_directions

    dist.broadcast_object_list([(repeat, args)], src=0, group=_control)
    with _told_to_all(_control):
        pass  # rank 0 loaded its model before the block; the others report whether they could
    with _told_to_all(_control), split_directions():
        yield


@contextlib.contextmanager
def _told_to_all(control: ProcessGroup) -> Iterator[None]:
    """The block in every process, then each tells the others how it ended: a failure in any process
    raises in all of them, once every process is out of the block. (A process failing in the middle of
    an engine run, as one GPU out of memory, leaves the others in a collective until the process
    group's timeout: nothing can tell them sooner.)"""
    import torch.distributed as dist

    from workers.fisher.shards import first_failure

    failure: Exception | None = None
    try:
        yield
    except Exception as error:
        failure = error
    failed = first_failure(None if failure is None else _one_line(failure), group=control)
    if failure is not None:
        raise failure
    if failed is not None:
        rank, report = failed
        processes = dist.get_world_size(control)
        raise RuntimeError(f"process {rank} of {processes} of this worker failed: {report}")


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else 'no message'}"
