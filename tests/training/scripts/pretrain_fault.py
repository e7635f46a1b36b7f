"""pretrain.py with a fault injected while checkpoint step N is written, on rank r:

    MOEP_TEST_FAULT=kill|enospc|raise|eval MOEP_TEST_FAULT_STEP=N MOEP_TEST_FAULT_RANK=r torchrun ... pretrain_fault.py <args>

kill: the process kills itself (SIGKILL) once its shard is written; enospc: writing its shard fails with
"No space left on device" (as DCP's file writer would on a full disk); raise: rank r alone fails with a one-line
error after training step N (no checkpoint involved), while the other ranks go on into step N + 1; eval: every
evaluation fails (as a torch.compile error in the evaluation forward did).
"""
import errno
import os
import signal

from moep_ds.checkpointing import layout, sharded
from moep_ds.cli.pretrain import main as pretrain_main
from moep_ds.errors import UserError
from moep_ds.training.train_module import TrainModule

FAULT = os.environ["MOEP_TEST_FAULT"]
STEP = int(os.environ["MOEP_TEST_FAULT_STEP"])
TAG = layout.checkpoint_tag(STEP)
RANK = int(os.environ.get("MOEP_TEST_FAULT_RANK", "0"))
original_save, original_writer = sharded.save, sharded.writer


def here(path) -> bool:
    return str(path).endswith(TAG) and int(os.environ.get("RANK", "0")) == RANK


def save_then_die(state, path, group=None, **kwargs):
    original_save(state, path, group, **kwargs)
    if here(path):
        os.kill(os.getpid(), signal.SIGKILL)


class FullDiskWriter(sharded.dcp.FileSystemWriter):
    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))


def writer(path, *args, **kwargs):
    return FullDiskWriter(path, single_file_per_rank=True) if here(path) else original_writer(path, *args, **kwargs)


original_train_step = TrainModule.train_step


def train_step_then_fail(self):
    out = original_train_step(self)
    self.fault_steps = getattr(self, "fault_steps", 0) + 1
    if self.fault_steps == STEP and self.rank == RANK:
        raise UserError(f"simulated: rank {RANK} cannot go on after step {self.fault_steps}")
    return out


def failing_evaluate(self, val, max_windows):
    raise RuntimeError("simulated: the evaluation forward failed")


if FAULT == "eval":
    TrainModule.evaluate = failing_evaluate
elif FAULT == "kill":
    sharded.save = save_then_die
elif FAULT == "raise":
    TrainModule.train_step = train_step_then_fail
else:
    sharded.writer = writer

if __name__ == "__main__":
    raise SystemExit(pretrain_main())
