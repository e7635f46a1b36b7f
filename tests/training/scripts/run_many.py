"""Train several (recipe, ds_config, resume) jobs one after another in the same processes.

    torchrun ... run_many.py JOBS.json      JOBS.json: [{"recipe": path, "ds_config": path, "resume": null|"auto",
                                                     "overrides": [...]}]

Starting the process group once saves the launcher and DeepSpeed start-up for every job after the first.
"""
import json
import os
import sys

import torch.distributed as dist

from moep_ds.config import load_config
from moep_ds.training.trainer import build_trainer


def main() -> None:
    for job in json.load(open(sys.argv[1])):
        cfg = load_config(job["recipe"], job.get("overrides", []))
        trainer = build_trainer(cfg, job.get("ds_config"), job.get("resume"))
        trainer.fit()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
