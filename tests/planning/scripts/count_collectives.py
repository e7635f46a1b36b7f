"""Train a few steps of several recipes in the same 2 processes and count the bytes each torch.distributed collective
moves in one steady-state step (the second), per collective and process-group size.

    torchrun --nproc_per_node 2 count_collectives.py JOBS.json OUT.json
        JOBS.json: [{"name": ..., "recipe": path, "ds_config": path, "overrides": [...]}]

Every collective is wrapped before DeepSpeed binds its backend, so DeepSpeed's calls are counted too. A tensor's
bytes are counted as NCCL's tests size them: the whole buffer (all-reduce, broadcast, reduce: the tensor;
reduce-scatter: the input of all ranks' shards; all-gather: the output; all-to-all: what this rank sends).
"""
import collections
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COUNTS: collections.Counter | None = None  # (collective, group size) -> bytes while counting


def nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(nbytes(t) for t in x)


# collective -> (name in the plan, which argument holds the counted buffer)
WRAPPED = {
    "all_reduce": ("all_reduce", 0), "all_reduce_coalesced": ("all_reduce", 0), "reduce": ("reduce", 0),
    "broadcast": ("broadcast", 0),
    "reduce_scatter": ("reduce_scatter", 1), "reduce_scatter_tensor": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1),
    "all_gather": ("all_gather", 0), "all_gather_into_tensor": ("all_gather", 0), "_all_gather_base": ("all_gather", 0),
    "all_to_all": ("all_to_all", 1), "all_to_all_single": ("all_to_all", 1),
}


def wrap(name: str, counted_as: str, arg: int):
    inner = getattr(c10d, name)

    def counted(*args, **kwargs):
        if COUNTS is not None:
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args[2:] if isinstance(a, dist.ProcessGroup)), None)
            size = dist.get_world_size(group)
            keys = {0: ("tensor", "tensor_list", "output_tensor", "output", "output_tensor_list"),
                    1: ("input_tensor", "input", "input_list", "input_tensor_list")}[arg]
            buffer = args[arg] if len(args) > arg else next(kwargs[k] for k in keys if k in kwargs)
            if size > 1:
                COUNTS[f"{counted_as}/{size}"] += nbytes(buffer)
        return inner(*args, **kwargs)

    return counted


for _name, (_as, _arg) in WRAPPED.items():
    if hasattr(c10d, _name):
        _wrapped = wrap(_name, _as, _arg)
        setattr(c10d, _name, _wrapped)
        if hasattr(dist, _name):
            setattr(dist, _name, _wrapped)

from moep_ds.config import load_config  # noqa: E402 - after the wrapping
from moep_ds.training.callbacks import Callback  # noqa: E402
from moep_ds.training.trainer import build_trainer  # noqa: E402


class CountStep(Callback):
    """Counts the collectives of step `step`: from its start to the end of its one all-reduce."""

    def __init__(self, step: int):
        self.step, self.counts = step, collections.Counter()

    def before_step(self, event) -> None:
        global COUNTS
        if event.step == self.step:
            COUNTS = self.counts

    def after_optimizer_step(self, event) -> None:
        global COUNTS
        COUNTS = None


def main() -> None:
    jobs, out = json.load(open(sys.argv[1])), sys.argv[2]
    results = {}
    for job in jobs:
        cfg = load_config(job["recipe"], job.get("overrides", []))
        counter = CountStep(cfg.train.max_steps)  # the last: a steady state
        trainer = build_trainer(cfg, job["ds_config"], None, callbacks=[counter])
        trainer.fit()
        mine = torch.tensor([[counter.counts[k] for k in sorted(counter.counts)]], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        results[job["name"]] = {"keys": sorted(counter.counts), "per_rank": [t[0].tolist() for t in every]}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
