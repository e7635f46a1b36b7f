"""The DeepSpeed engine as the rest of moep_ds sees it: `Engine` wraps the object `deepspeed.initialize` returns and
is the only way to it, so that every access to the engine (forward, backward and step, the learning rate, the
gradient norm, the loss scaler, the step counters, the schedule's position, the data-parallel group, the TensorBoard
monitor) is written here, beside distributed/deepspeed_adapter.py (DeepSpeed's internals) and
optimizer_state.py / owned_state.py (the partitioned masters and moments). tests/test_import_contract.py walks
every module outside distributed/ and fails on a deepspeed import or an engine attribute that `Engine` does not
offer.

# B micro-batch, T sequence length
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import deepspeed
import torch
from torch import nn

from moep_ds.distributed import optimizer_state as st
from moep_ds.distributed.ds_fields import precision, zero_stage
from moep_ds.distributed.expert_parallel import routed_module_classes
from moep_ds.distributed.grad_norm import ExactClipping
from moep_ds.moe.plan import ExpertParallelPlan


class Engine:
    """A DeepSpeed engine and what moep_ds reads and writes of it (module docstring)."""

    def __init__(self, ds_engine: Any, clipping: ExactClipping | None, ds: dict[str, Any]):
        self._engine = ds_engine
        self._clipping = clipping
        self._fp16 = precision(ds) == "fp16"
        self.module: nn.Module = ds_engine.module

    # ---- the step -----------------------------------------------------------------------------------------

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        return self._engine(input_ids, labels=labels)

    def backward(self, loss: torch.Tensor) -> None:
        self._engine.backward(st.loss_for_backward(self._engine.optimizer, loss))

    def step(self) -> None:
        self._engine.step()

    def train(self) -> None:
        self._engine.train()

    def eval(self) -> None:
        self._engine.eval()

    # ---- what the step's metrics read -----------------------------------------------------------------------

    def lr(self) -> float:
        return self._engine.get_lr()[0]

    def grad_norm(self) -> float | None:
        """The norm of the last step's gradient (DeepSpeed's, or ExactClipping's under ZeRO-0 fp32); None when the
        engine keeps none."""
        norm = self.grad_norm_tensor()
        return None if norm is None else float(norm)

    def grad_norm_tensor(self) -> torch.Tensor | None:
        """`grad_norm` where the engine keeps it (on the device, or a float as a CPU tensor), without waiting for it:
        the same on every rank (DeepSpeed's norm is global). inf after a step the fp16 loss scaler skipped; -1 or NaN
        where DeepSpeed's group norms met a non-finite gradient."""
        norm = self._engine.get_global_grad_norm()
        if norm is None and self._clipping is not None:
            norm = self._clipping.last_norm
        return None if norm is None else torch.as_tensor(norm)

    def loss_scale(self) -> float | None:
        """The current fp16 loss scale; None without fp16 loss scaling."""
        scaler = st.loss_scaler(self._engine.optimizer)
        return float(scaler.cur_scale) if self._fp16 and scaler is not None else None

    @property
    def global_samples(self) -> int:
        """Samples trained on since the run's start (all ranks), as the engine counts them."""
        return int(self._engine.global_samples)

    @property
    def skipped_steps(self) -> int:
        """Steps the fp16 loss scaler skipped (an overflow): the optimizer did not step."""
        return int(self._engine.skipped_steps)

    @property
    def optimizer(self) -> Any:
        """DeepSpeed's optimizer (the ZeRO, bf16 or fp16 wrapper): for optimizer_state.py and owned_state.py."""
        return self._engine.optimizer

    @property
    def data_parallel_group(self) -> Any:
        return getattr(self._engine, "data_parallel_group", None)

    # ---- state a checkpoint keeps -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The engine's counters, the schedule's position, the loss scaler and Adam's step: plain data for JSON."""
        scheduler = self._engine.lr_scheduler
        scaler = st.loss_scaler(self._engine.optimizer)
        return {
            "global_steps": int(self._engine.global_steps), "global_samples": self.global_samples,
            "skipped_steps": self.skipped_steps,
            "lr_scheduler": {"last_epoch": scheduler.last_epoch} if scheduler is not None else None,
            "loss_scaler": None if scaler is None else {
                k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool))},
            "optimizer_step": st.optimizer_step_count(self._engine.optimizer),
        }

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        """Counters, schedule, loss scaler and Adam's step from `state` (`state_dict`'s keys; missing optional
        ones keep their defaults), at optimizer step `step`."""
        if self._engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            restore_schedule(self._engine.lr_scheduler, state["lr_scheduler"]["last_epoch"])
        scaler = st.loss_scaler(self._engine.optimizer)
        if scaler is not None and state.get("loss_scaler"):
            for key, value in state["loss_scaler"].items():
                setattr(scaler, key, value)
        if "optimizer_step" in state:
            st.set_optimizer_step_count(self._engine.optimizer, list(self.module.parameters()),
                                        state["optimizer_step"])
        self.set_counters(step, state["global_samples"], state.get("skipped_steps") or 0)

    def set_counters(self, steps: int, samples: int, skipped: int = 0) -> None:
        """The engine's step and sample counters (a fresh run that starts at step N, a resume)."""
        self._engine.global_steps, self._engine.global_samples = steps, samples
        self._engine.skipped_steps = skipped

    # ---- TensorBoard (DeepSpeed's monitor) -------------------------------------------------------------------

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """(tag, value, step) scalars into DeepSpeed's monitor (TensorBoard), when it is enabled."""
        monitor = getattr(self._engine, "monitor", None)
        if monitor is not None and monitor.enabled:
            monitor.write_events(events)

    def flush_events(self) -> None:
        monitor = getattr(self._engine, "monitor", None)
        for writer in getattr(monitor, "monitors", []) if monitor is not None else []:
            summary = getattr(writer, "summary_writer", None)
            if summary is not None:
                summary.flush()


def initialize(model: nn.Module, param_groups: list[dict[str, Any]],
               make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
               make_scheduler: Callable[[torch.optim.Optimizer], Any], ds: dict[str, Any],
               plan: ExpertParallelPlan) -> Engine:
    """`deepspeed.initialize` of `model` under the reconciled config `ds`, as moep_ds trains it:
    - ZeRO-3: each routed module gathered as one unit (its expert order depends on the data: ranks routing
      differently must never wait on different parameter fetches);
    - expert parallelism: expert parameters in optimizer groups of their own (DeepSpeed's MoE groups);
    - ZeRO-0 bf16/fp16: Adam's state as a fresh optimizer's (optimizer_state.adopt_unfused_masters);
    - ZeRO-0 fp32: the engine's clipping replaced by the norm of the whole gradient (grad_norm.py)."""
    if zero_stage(ds) == 3 and (routed := routed_module_classes(model)):
        deepspeed.utils.set_z3_leaf_modules(model, routed)
    if plan.size > 1:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        param_groups = split_params_into_different_moe_groups_for_optimizer(param_groups)
    optimizer = make_optimizer(param_groups)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=make_scheduler(optimizer),
                                           config=ds, dist_init_required=False)
    st.adopt_unfused_masters(engine.optimizer)
    clipping = None
    if zero_stage(ds) == 0 and precision(ds) == "fp32":
        clipping = ExactClipping.install(engine, plan.group)
    return Engine(engine, clipping, ds)


def restore_schedule(scheduler: Any, last_epoch: int) -> None:
    """Put the schedule at `last_epoch` and set every group's lr from it. The schedule is a function of the
    step alone, so this works whatever the number of parameter groups (expert parallelism adds MoE groups),
    unlike LRScheduler.load_state_dict, which also leaves the groups' current lr stale."""
    scheduler.last_epoch = last_epoch - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": intended here
        scheduler.step()


__all__ = ["Engine", "initialize", "restore_schedule"]
