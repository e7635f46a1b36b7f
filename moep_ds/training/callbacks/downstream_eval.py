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
    data_dir: str | None = None  # default: eval.data_dir, $MOEP_DATA_DIR, ../shared/data (as moep-eval)

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


def in_loop_lm(model: torch.nn.Module, tokenizer: Any, device: torch.device, batch_size: int, ranks: tuple[int, int]):
    """moep-eval's MoepLM over the model being trained as it is (MoepLM's own constructor would move it to one
    device and dtype), scoring rank r's share of the batches of `ranks` = (r, N)."""
    from lm_eval.api.model import TemplateLM

    from moep_ds.models.eval_modes import routing_eval_modes
    from moep_ds.evaluation.harness import MoepLM

    lm = MoepLM.__new__(MoepLM)
    TemplateLM.__init__(lm)
    lm.meta, lm.engine, lm._device, lm.model, lm.ranks = {}, None, device, model, ranks
    lm.tokenizer, lm.batch_size, lm._max_length = tokenizer, batch_size, model.cfg.max_seq_len
    lm.routing_eval_mode = routing_eval_modes(model)
    return lm


@CALLBACKS.register("downstream_eval", config=DownstreamEvalConfig)
class DownstreamEval(Callback):
    Config = DownstreamEvalConfig

    def __init__(self, cfg: DownstreamEvalConfig):
        self.cfg = cfg
        self.tasks = None  # (TaskManager, names), set up at the first evaluation
        self.tmp = None

    def task_manager(self):
        from lm_eval.tasks import TaskManager

        from moep_ds.evaluation.tasks import render_tasks, resolve_data_dir

        if self.tasks is None:
            data_dir = resolve_data_dir(self.cfg.data_dir or self.trainer.cfg.eval.data_dir, must_exist=False)
            self.tmp = tempfile.TemporaryDirectory(prefix="moep_eval_tasks_")
            rendered = render_tasks(data_dir, self.tmp.name)
            rendered.resolve(self.cfg.tasks)  # an unknown task or missing data fails here, naming it
            self.tasks = TaskManager(include_defaults=False, include_path=str(rendered.path)), list(self.cfg.tasks)
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
        from lm_eval import simple_evaluate

        from moep_ds.data.tokenizer import load_tokenizer
        from moep_ds.evaluation.report import flat_scores

        t = self.trainer
        manager, names = self.task_manager()
        model = t.engine.module
        lm = in_loop_lm(model, load_tokenizer(t.prepared), t.device, self.cfg.batch_size, (t.rank, t.world))
        restore = kept_rng()
        model.eval()
        try:
            results = simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=self.cfg.limit,
                                      num_fewshot=self.cfg.num_fewshot, bootstrap_iters=0, log_samples=False)
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
