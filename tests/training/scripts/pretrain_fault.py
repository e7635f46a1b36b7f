"""pretrain.py with a fault injected: the process kills itself (SIGKILL) while writing checkpoint step N.

    MOEP_TEST_KILL_AT_STEP=N MOEP_TEST_KILL_RANK=r torchrun ... pretrain_fault.py <pretrain args>
"""
import os
import signal

from moep_ds.cli import pretrain_main
from moep_ds.training import checkpoint

KILL_STEP = int(os.environ["MOEP_TEST_KILL_AT_STEP"])
KILL_RANK = int(os.environ.get("MOEP_TEST_KILL_RANK", "0"))
original = checkpoint.collect_full_state


def collect_then_die(engine, model, ep_group):
    out = original(engine, model, ep_group)
    if engine.global_steps == KILL_STEP and int(os.environ["RANK"]) == KILL_RANK:
        os.kill(os.getpid(), signal.SIGKILL)
    return out


checkpoint.collect_full_state = collect_then_die

if __name__ == "__main__":
    raise SystemExit(pretrain_main())
