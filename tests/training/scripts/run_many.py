"""Train several (recipe, ds_config, resume) jobs one after another in the same processes.

    torchrun ... run_many.py JOBS.json      JOBS.json: [{"recipe": path, "ds_config": path, "resume": null|"auto",
                                                     "overrides": [...], "consolidated": null|dir}]

"consolidated": after training, also write today's consolidated checkpoint format to that directory.

Starting the process group once saves the launcher and DeepSpeed start-up for every job after the first.
"""
import json
import os
import pathlib
import sys

import torch.distributed as dist

from moep_ds.config import load_config
from moep_ds.training.trainer import Trainer


def main() -> None:
    for job in json.load(open(sys.argv[1])):
        cfg = load_config(job["recipe"], job.get("overrides", []))
        trainer = Trainer(cfg, job.get("ds_config"), job.get("resume"))
        trainer.fit()
        if job.get("consolidated"):
            from moep_ds.training.consolidated import save_consolidated

            state = {"step": trainer.step, "global_samples": trainer.engine.global_samples,
                     "data": trainer.loader.state_dict(), "world_size": trainer.world, "seed": cfg.train.seed,
                     "lr_scheduler": {"last_epoch": trainer.engine.lr_scheduler.last_epoch}}
            save_consolidated(trainer.engine, trainer.model, cfg, pathlib.Path(job["consolidated"]), state,
                              trainer.ep_plan.group)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
