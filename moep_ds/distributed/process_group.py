"""Process-group setup for `deepspeed`, `torchrun`, `srun` (via env), MPI launchers (DeepSpeed's MPI discovery) and
plain single-process runs."""
from __future__ import annotations

import logging
import os
import socket

import torch

from moep_ds.distributed.launcher import mpi_world_size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_size_to_be() -> int:
    """The world init_distributed will join, known before it does: the launcher's WORLD_SIZE, an MPI launcher's
    size, or 1 for a process started by neither (init_distributed makes it a world of one)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else mpi_world_size()


def init_distributed() -> torch.device:
    """Initialise torch.distributed through DeepSpeed (gloo on CPU, nccl on GPU) and return this rank's device."""
    import deepspeed

    # a plain `python pretrain.py`: a world of one; under an MPI launcher DeepSpeed's MPI discovery sets RANK & co.
    if "RANK" not in os.environ and mpi_world_size() == 1:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=backend, dist_init_required=True)
    return device


def leave_process_group() -> None:
    """Leave torch.distributed at the end of a command, on every rank, so that the interpreter exits cleanly.

    Gloo runs each collective on a worker thread, which lets go of the collective's tensors just after the
    caller's wait() has returned; letting go of a tensor that Python knows needs the GIL. When that comes while
    the main thread is already finalising the interpreter, CPython ends the worker thread and C++ aborts the
    process ("terminate called without an active exception"): seen at exit in ~1 of 15 two-process evaluations
    before this, whose last step was an all-reduce. `destroy_process_group` does not stop gloo's threads. The
    barrier lets every earlier collective's worker finish while this thread waits without the GIL; the barrier
    holds no tensors. A command that fails with the group still joined exits through `cli.exit_joined`."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


class RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(rank: int, all_ranks: bool = False) -> None:
    """INFO from rank 0 (every rank with MOEP_LOG_ALL_RANKS=1), each line prefixed with `[rank N]`."""
    handler = logging.StreamHandler()
    handler.addFilter(RankFilter(rank))
    handler.setFormatter(logging.Formatter("%(asctime)s [rank %(rank)d] %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("moep_ds")
    root.handlers[:] = [handler]
    root.propagate = False
    verbose = rank == 0 or all_ranks or os.environ.get("MOEP_LOG_ALL_RANKS") == "1"
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
