"""A Trainer over fake parts: a TrainModule without DeepSpeed (its losses a function of the step) and a
checkpointer that keeps checkpoints in memory, so that the loop, the callbacks and the checkpoint seam are tested in
one process, without a launch. One gloo process group of one rank (the callbacks' collectives need one)."""
from __future__ import annotations

import contextlib
import json
import math
import pathlib
import tempfile

import numpy as np
import torch
import torch.distributed as dist

from moep_ds.config import config_from_dict
from moep_ds.moe.plan import SINGLE_PROCESS
from moep_ds.training.assemble import RunParts
from moep_ds.training.trainer import Trainer
from moep_ds.training.trainer_state import TrainerState

MODEL = {"vocab_size": 64, "d_model": 16, "max_seq_len": 8, "layers": [{"type": "dense", "attention": {"num_heads": 2}}]}


class FakeEngine:
    """What the built-in callbacks read of a distributed.engine.Engine."""

    def __init__(self):
        self.module = torch.nn.Linear(2, 2)
        self.optimizer = None
        self.data_parallel_group = None
        self.events: list[tuple[str, float, int]] = []
        self.training = None

    def train(self) -> None:
        self.training = True

    def eval(self) -> None:
        self.training = False

    def write_events(self, events) -> None:
        self.events += events

    def flush_events(self) -> None:
        pass


class FakeModule:
    """A TrainModule whose step's loss is 1 / step (nan at the steps in `nan_steps`), whose flags pass through its one
    'all-reduce' unchanged, and whose non-finite check finds a non-finite loss (on rank 0)."""

    def __init__(self):
        self.engine = FakeEngine()
        self.model = self.engine.module
        self.plan = SINGLE_PROCESS
        self.tokens_per_step = 16
        self.ds = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 1}
        self.loader = FakeLoader(self)
        self.report = type("Report", (), {"as_dict": staticmethod(lambda: {"params_total": 6})})()
        self.trained = 0  # optimizer steps taken by this module
        self.evaluations = 0
        self.nan_steps: set[int] = set()

    def train_step(self):
        self.trained += 1
        return {"loss": torch.tensor(float("nan") if self.trained in self.nan_steps else 1.0 / self.trained)}, {}

    def reduce_step(self, sums, flags):
        loss = float(sums["loss"].detach())
        return sums, dict(flags), None if math.isfinite(loss) else f"loss ({loss} on rank 0)"

    def metrics(self, step, losses, seconds):
        return {**losses, "lr": 0.1, "tokens_per_s": self.tokens_per_step / max(seconds, 1e-9)}

    def evaluate(self, val, windows):
        self.evaluations += 1
        return 0.5

    def state_dict(self):
        return {"global_samples": self.trained, "global_steps": self.trained, "seq_len": 8, "tokens": 8 * self.trained}

    def load_state_dict(self, state):
        self.trained = state["global_samples"]


class FakeLoader:
    """The data loader part: its position is the module's step count."""

    def __init__(self, module: FakeModule):
        self.module = module
        self.loaded = None

    def state_dict(self):
        return {"epoch": 0, "global_batch": self.module.trained, "global_batch_size": 1}

    def load_state_dict(self, state):
        self.loaded = state


class MemoryCheckpointer:
    """The Checkpointer's contract, in memory: `save` keeps the TrainerState the real one writes."""

    def __init__(self):
        self.saved: dict[int, dict] = {}

    def save(self, step, parts) -> pathlib.Path:
        # as the JSON file holds it
        self.saved[step] = json.loads(json.dumps(TrainerState.of(parts).state_dict()))
        return pathlib.Path(f"step_{step}")

    def restore(self, ckpt, state, parts) -> None:
        saved = state.parts()
        for name, part in parts.items():
            if name in saved:
                part.load_state_dict(saved[name])

    def failed(self) -> bool:
        return False

    def wait(self) -> None:
        pass


@contextlib.contextmanager
def one_rank_group():
    """A gloo process group of this process alone (the callbacks' collectives are then no-ops)."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def prepared_corpus(folder: pathlib.Path, windows: int = 8, seq_len: int = 8) -> pathlib.Path:
    """A prepared folder holding a validation split (what the validation callback opens)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    np.arange(windows * seq_len + 1, dtype=np.uint16).tofile(folder / "val.bin")
    return folder


def fake_trainer(tmp_path: pathlib.Path, train: dict, *, checkpointer: MemoryCheckpointer | None = None,
                 resume_step: int | None = None, callbacks=()) -> Trainer:
    """A Trainer of recipe `train` over fake parts (resuming from `checkpointer`'s checkpoint of `resume_step`)."""
    cfg = config_from_dict({"model": MODEL, "data": {"seq_len": 8, "val_fraction": 0.1},
                            "train": {"output_dir": str(tmp_path / "run"), "log_every": 1, **train}})
    checkpointer = checkpointer or MemoryCheckpointer()
    resumed = None if resume_step is None else TrainerState.from_state_dict(checkpointer.saved[resume_step])
    parts = RunParts(cfg=cfg, ds={"train_micro_batch_size_per_gpu": 1, "train_batch_size": 1}, rank=0, world=1,
                     device=torch.device("cpu"), run_dir=tmp_path / "run", prepared=prepared_corpus(tmp_path / "data"),
                     meta={}, module=FakeModule(), checkpointer=checkpointer, max_steps=cfg.train.max_steps,
                     start_step=0, resume_from=None if resumed is None else pathlib.Path(f"step_{resume_step}"),
                     resumed=resumed)
    return Trainer(parts, callbacks)
