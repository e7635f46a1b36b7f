"""Two ranks (plain processes, env:// rendezvous): start-up checks that every rank makes alike, each run through
run_guarded as pretrain.py runs its body (its exit replaced by a return, so that one launch checks them all):

    python agreed_errors.py MISSING_DIR      (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set per process)

Each case prints `case NAME exit CODE` on stderr after run_guarded's own output."""
import sys
from types import SimpleNamespace

import torch.distributed as dist

from moep_ds.distributed import commands
from moep_ds.training.callbacks import StepEvent, build_callback, parse_callback
from moep_ds.training.init_from import initialise_from_source

commands.exit_joined = lambda code: code  # print as run_guarded does, then go on to the next case


def unknown_downstream_task():
    callback = build_callback(parse_callback({"type": "downstream_eval", "tasks": ["grammar_pairs", "no_such_task"]},
                                             "train.callbacks[0]"))
    callback.trainer = SimpleNamespace(cfg=SimpleNamespace(eval=SimpleNamespace(data_dir=None)))
    callback.before_step(StepEvent(1))


def missing_init_from():
    cfg = SimpleNamespace(model=SimpleNamespace(init_from=sys.argv[1], upcycle=None),
                          data=SimpleNamespace(tokenizer=None))
    initialise_from_source(None, None, cfg)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for case in (unknown_downstream_task, missing_init_from):
        code = commands.run_guarded(case)
        print(f"case {case.__name__} exit {code}", file=sys.stderr, flush=True)
        dist.barrier()
    dist.destroy_process_group()
