"""`downstream_eval`: downstream tasks scored during training (OLMo-core's in-loop evaluator).

    train:
      callbacks:
        - {type: downstream_eval, tasks: [grammar_pairs, blimp_filtered], every: 500, limit: 200}

Every `every` steps, after that step's checkpoint, the tasks (the local task names of `moep-eval --list_tasks`:
BLiMP-format minimal pairs and multiple-choice tasks; `grammar_pairs` is built in and needs no data folder) are
scored with moep-eval's own code (lm-eval's `simple_evaluate` over evaluation/harness.py's `MoepLM`, the same
seeds), on the model being trained, in its training precision, with the routers in their eval mode. The batches
of requests are split over the data-parallel ranks (rank r scores batches r, r + N, ...) and the scores gathered,
so every rank runs as many forward passes and gets the same numbers. Logged as `eval/<task>/acc` (and
`eval/<task>/acc_norm` where the task has it) in metrics.jsonl and TensorBoard. On a float32 run the numbers are
moep-eval's on the checkpoint of the same step (`moep-eval RUN/step_N --tasks ... --limit N`).
"""
from __future__ import annotations

import dataclasses
import logging
import random
import tempfile
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from moep_ds.distributed.rank_errors import agreed
from moep_ds.schema import PositiveInt, fail
from moep_ds.training.callbacks.base import CALLBACKS, Callback, EvalEvent, StepEvent

log = logging.getLogger(__name__)

LOGGED = ("acc", "acc_norm")


@dataclasses.dataclass(kw_only=True)
class DownstreamEvalConfig:
    type: str = "downstream_eval"
    tasks: list[str] = dataclasses.field(default_factory=lambda: ["grammar_pairs"])
    every: PositiveInt = 500  # steps
    limit: PositiveInt | None = None  # examples per task (the first ones); null: all
    batch_size: PositiveInt = 16  # requests per forward pass (the scores do not depend on it)
    num_fewshot: int | None = None
    # eval.data_dir (callbacks/builtin.py callback_configs fills it from there); null: $MOEP_DATA_DIR, ../shared/data
    # (as moep-eval)
    data_dir: str | None = None

    def validate(self, path: str) -> None:
        if not self.tasks:
            fail(f"{path}.tasks", self.tasks, "must name at least one task")


def kept_rng():
    """lm-eval seeds Python's, NumPy's and torch's generators: training's random state is put back after."""
    states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)

    def restore() -> None:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])

    return restore


@CALLBACKS.register("downstream_eval", config=DownstreamEvalConfig)
class DownstreamEval(Callback):
    Config = DownstreamEvalConfig
    priority = 150  # after validation: both after the step's checkpoint

    def __init__(self, cfg: DownstreamEvalConfig):
        self.cfg = cfg
        self.tasks = None  # (TaskManager, names), set up at the first evaluation
        self.tmp = None

    def task_manager(self):
        from moep_ds.evaluation.tasks import local_task_manager

        if self.tasks is None:
            self.tmp = tempfile.TemporaryDirectory(prefix="moep_eval_tasks_")
            manager, _ = local_task_manager(self.cfg.data_dir, self.cfg.tasks,
                                            self.tmp.name)  # an unknown task or missing data fails here, naming it
            self.tasks = manager, list(self.cfg.tasks)
        return self.tasks

    def before_step(self, event: StepEvent) -> None:
        if self.tasks is None:  # the first step: an unknown task or missing data fails now, not at step `every`,
            agreed(self.task_manager)  # on every rank together, printed once (a rank gone first: the launcher's
            # SIGTERM reached the others in their start-up)

    def after_step(self, event: StepEvent) -> None:
        if event.step % self.cfg.every == 0:
            metrics = self.evaluate()
            self.trainer.fire("on_evaluation", EvalEvent(event.step, metrics))
            log.info("step %d %s", event.step, " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """moep-eval's own scoring (evaluation/harness.py `MoepLM` and `run_tasks`) of the model being trained, as
        it is (its device and precision), the batches split over the data-parallel ranks."""
        from moep_ds.data.tokenizer import load_tokenizer
        from moep_ds.evaluation.harness import MoepLM, run_tasks
        from moep_ds.evaluation.report import flat_scores

        t = self.trainer
        manager, names = self.task_manager()
        model = t.module.model
        restore = kept_rng()
        lm = MoepLM(model=model, tokenizer=load_tokenizer(t.prepared), batch_size=self.cfg.batch_size,
                    ranks=(t.rank, t.world))
        try:
            results = run_tasks(lm, names, manager, limit=self.cfg.limit, num_fewshot=self.cfg.num_fewshot)
        finally:
            model.train()
            restore()
        # lm-eval reports on rank 0 only (its results are None elsewhere): every rank gets rank 0's numbers
        metrics = [None if results is None else {
            f"eval/{task}/{metric}": value for task, scores in flat_scores(results).items()
            for metric, value in scores.items() if metric in LOGGED}]
        if t.world > 1:
            dist.broadcast_object_list(metrics, src=0)
        return metrics[0]

    def at_end(self, event) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()
