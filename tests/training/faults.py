"""Faults injected into a training run in this process (tests/training/tiny.py pretrain, on the ranks of
tests/ranks.py), at checkpoint step `step` or training step `step`, on rank `rank`:

kill: the process kills itself (SIGKILL) once its shard of checkpoint `step` is written; enospc: writing its shard
fails with "No space left on device" (as DCP's file writer would on a full disk); raise: rank `rank` alone fails with
a one-line error after training step `step` (no checkpoint involved), while the other ranks go on into the next
step; eval: every evaluation fails (as a torch.compile error in the evaluation forward did); nan / inf: rank `rank`'s
loss of training step `step` is nan / inf (and so are its gradients), as a poisoned batch or weight would make it;
grad_inf: rank `rank`'s loss of step `step` is finite and its gradient infinite."""
import errno
import os
import signal

import torch

from moep_ds.checkpointing import layout, sharded
from moep_ds.errors import UserError
from moep_ds.training.train_module import TrainModule


def inject(fault: str, step: int, rank: int) -> None:
    tag = layout.checkpoint_tag(step)
    here = lambda path: str(path).endswith(tag) and int(os.environ.get("RANK", "0")) == rank  # noqa: E731
    if fault == "kill":
        save = sharded.save

        def save_then_die(state, path, group=None, **kwargs):
            save(state, path, group, **kwargs)
            if here(path):
                os.kill(os.getpid(), signal.SIGKILL)

        sharded.save = save_then_die
    elif fault == "enospc":
        writer = sharded.writer

        class FullDiskWriter(sharded.dcp.FileSystemWriter):
            def write_data(self, plan, planner):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

        sharded.writer = lambda path, *args, **kwargs: (FullDiskWriter(path, single_file_per_rank=True) if here(path)
                                                        else writer(path, *args, **kwargs))
    elif fault == "raise":
        train_step = TrainModule.train_step

        def train_step_then_fail(self):
            out = train_step(self)
            self.fault_steps = getattr(self, "fault_steps", 0) + 1
            if self.fault_steps == step and self.rank == rank:
                raise UserError(f"simulated: rank {rank} cannot go on after step {self.fault_steps}")
            return out

        TrainModule.train_step = train_step_then_fail
    elif fault in ("nan", "inf", "grad_inf"):
        train_step = TrainModule.train_step

        def poisoned_train_step(self):
            self.fault_steps = getattr(self, "fault_steps", 0) + 1
            if self.fault_steps != step or self.rank != rank:
                return train_step(self)
            engine, self.engine = self.engine, Poisoned(self.engine, fault)
            try:
                return train_step(self)
            finally:
                self.engine = engine

        TrainModule.train_step = poisoned_train_step
    elif fault == "eval":
        def failing_evaluate(self, val, max_windows):
            raise RuntimeError("simulated: the evaluation forward failed")

        TrainModule.evaluate = failing_evaluate
    else:
        raise ValueError(f"unknown fault {fault!r}")


class InfiniteGradient(torch.autograd.Function):
    """The identity, whose gradient is infinite."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class Poisoned:
    """A distributed.engine.Engine whose forward's loss is `fault` ("nan", "inf"), or finite with an infinite
    gradient ("grad_inf")."""

    def __init__(self, engine, fault: str):
        self.engine, self.fault = engine, fault

    def __call__(self, *args, **kwargs):
        out = self.engine(*args, **kwargs)
        out.loss = InfiniteGradient.apply(out.loss) if self.fault == "grad_inf" else out.loss * float(self.fault)
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def allow_fp16_on_cpu() -> None:
    """DeepSpeed refuses fp16 on its CPU accelerator; the arithmetic itself runs, so telling it otherwise exercises
    our fp16 path (dynamic loss scaling, skipped steps, scaler state in checkpoints) on machines without a GPU."""
    import torch
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: True
    accelerator.supported_dtypes = lambda: [torch.float32, torch.float16, torch.bfloat16]
