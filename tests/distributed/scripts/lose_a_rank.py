"""Two ranks (plain processes, env:// rendezvous; no launcher that would kill the survivor): a few all_reduces,
then rank $VICTIM (default 1) kills itself with SIGKILL while the other goes on all-reducing, through run_guarded as
pretrain.py is. Rank 0 holds the rendezvous store (as under deepspeed and srun)."""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from moep_ds.distributed.commands import run_guarded


def body():
    dist.init_process_group("gloo")
    x = torch.ones(4096)
    for _ in range(3):
        dist.all_reduce(x)
    if dist.get_rank() == int(os.environ.get("VICTIM", "1")):
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(600):
        dist.all_reduce(x)
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(body))
