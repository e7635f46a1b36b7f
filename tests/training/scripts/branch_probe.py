"""Train (recipe, ds_config, resume, overrides) jobs one after another, recording for each what the trainer
actually did: the window indices, input ids and whole windows (inputs and the last label) of every micro-batch
it read, and the lr of every group at each
optimizer step as the torch optimizer applied it (a step pre-hook). Writes job["probe"] (JSON; on several
processes each rank its own, job["probe"] + ".rank<N>").

    python branch_probe.py JOBS.json
"""
import json
import os
import sys

import torch.distributed as dist

from moep_ds.config import load_config
from moep_ds.distributed.optimizer_state import inner_optimizer
from moep_ds.training.trainer import build_trainer


def main() -> None:
    for job in json.load(open(sys.argv[1])):
        cfg = load_config(job["recipe"], job.get("overrides", []))
        trainer = build_trainer(cfg, job.get("ds_config"), job.get("resume"))
        probe = {"start": trainer.step, "indices": [], "input_ids": [], "windows": [], "lrs": []}
        loader = trainer.module.loader
        read = loader.next_indices

        def next_indices():
            idx = read()
            probe["indices"].append(idx.tolist())
            windows = loader.dataset.get_batch(idx)
            probe["input_ids"].append(windows[:, :-1].tolist())
            probe["windows"].append(windows.tolist())
            return idx

        loader.next_indices = next_indices
        torch_optimizer = inner_optimizer(trainer.module.engine.optimizer)
        torch_optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: probe["lrs"].append([g["lr"] for g in opt.param_groups]))
        trainer.fit()
        probe["end"] = trainer.step
        rank = "" if dist.get_world_size() == 1 else f".rank{dist.get_rank()}"
        with open(job["probe"] + rank, "w") as f:
            json.dump(probe, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
