"""What the trainer trains: the model, its DeepSpeed engine and optimizer, one training step and the step's one
collective (`reduce_step`), the validation loss. `Trainer` (training/trainer.py) runs the loop and the callbacks
around it; this class holds what a step needs.

# B micro-batch, T sequence length
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict

import deepspeed
import torch
import torch.distributed as dist

from moep_ds.checkpointing import sharded
from moep_ds.data.dataset import open_split
from moep_ds.data.sampler import eval_batches
from moep_ds.models.accounting import meta_param_report
from moep_ds.training import checkpoint as ckpt_io
from moep_ds.training.balancing import install_count_reducers
from moep_ds.training.blocks import apply_block_options
from moep_ds.training.branch import resolve_start_step
from moep_ds.training.ds_config import precision, zero_stage
from moep_ds.training.resume_data import tokens_read
from moep_ds.distributed.expert_parallel import expert_parallel_plan, routed_module_classes, setup_expert_parallel
from moep_ds.training.grad_norm import ExactClipping
from moep_ds.training.host_memory import RELEASE_THRESHOLD, return_freed_buffers_to_os
from moep_ds.training.optim import build_optimizer, build_scheduler, param_groups
from moep_ds.training.startup import build_rank_model, peak_flops, scored_windows, set_aside, total_steps
from moep_ds.training.state import adopt_unfused_masters, loss_for_backward, loss_scaler

log = logging.getLogger(__name__)


class TrainModule:
    """Model, engine and optimizer of a `Trainer` (its base class: the trainer's attributes are its own)."""

    def new_model(self):
        """(The model with this rank's experts only (its expert-parallel plan, moe/plan.py), under ZeRO-3 with this
        rank's partition of every parameter only (distributed/zero3.py), the plan); initialised from the seed alike
        on every rank, at every expert-parallel size and ZeRO stage."""
        plan = expert_parallel_plan(self.cfg.model, self.cfg.train.expert_parallel_size)
        model = build_rank_model(self.cfg.model, self.ds, self.cfg.train.seed, plan)
        self.report = meta_param_report(self.cfg.model, self.cfg.data.seq_len)  # of the whole model
        setup_expert_parallel(model, plan)
        install_count_reducers(model)
        return model, plan

    def load_resumed_model(self):
        """The model, with the weights of the checkpoint to resume from (`self.resume_from`, None for a fresh
        start). `--resume auto` skips a damaged newest checkpoint: all ranks agree on each candidate before the
        engine, the only holder of optimizer state, exists. Only a run without checkpoints starts fresh: were none
        of them loadable, training from step 0 would overwrite the run's logs and its rotation delete them."""
        model, plan = self.new_model()
        self.resume_from = None
        candidates = ckpt_io.resume_candidates(self.resume, self.run_dir)
        for i, ckpt in enumerate(candidates):
            error = None
            try:
                ckpt_io.check_checkpoint(ckpt)
                ckpt_io.load_model_state(model, ckpt, plan)
            except sharded.DamagedCheckpoint as err:
                error = err
            if sharded.agree(error is None):
                self.resume_from = ckpt
                if self.rank == 0:
                    set_aside(candidates[:i])
                return model, plan
            if self.resume != "auto":
                raise error or sharded.DamagedCheckpoint(f"checkpoint {str(ckpt)!r} could not be read on every rank")
            log.warning("skipping damaged checkpoint %s: %s", ckpt, error or "unreadable on another rank")
            model, plan = self.new_model()  # a failed read may have written part of the weights
        if candidates:  # every rank agreed on each: all raise this
            raise sharded.CheckpointError(
                f"--resume auto: all {len(candidates)} checkpoint(s) in {str(candidates[0].parent)!r} are damaged, "
                f"the newest is {str(candidates[0])!r} (see the warnings above); move them away to train from step 0")
        return model, plan

    def build_engine(self):
        cfg = self.cfg
        model, plan = self.load_resumed_model()
        apply_block_options(model, activation_checkpointing=cfg.train.activation_checkpointing,
                            compile=cfg.train.compile)
        if cfg.train.activation_checkpointing and self.device.type == "cpu" and return_freed_buffers_to_os():
            # without this glibc keeps most of what checkpointing frees (training/host_memory.py)
            log.info("activation checkpointing on CPU: host buffers of >= %d KiB go back to the OS when freed",
                     RELEASE_THRESHOLD >> 10)
        if zero_stage(self.ds) == 3 and (routed := routed_module_classes(model)):
            # Expert order depends on the data: gather each MoE module's parameters as one unit so that ranks
            # routing differently never wait on different parameter fetches.
            deepspeed.utils.set_z3_leaf_modules(model, routed)
        groups = param_groups(model, cfg.train.optimizer)
        if plan.size > 1:
            from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

            groups = split_params_into_different_moe_groups_for_optimizer(groups)
        optimizer = build_optimizer(groups, cfg.train.optimizer)
        self.max_steps = total_steps(cfg, len(self.dataset), self.ds["train_batch_size"])
        self.start_step = resolve_start_step(cfg, self.max_steps, resuming=self.resume_from is not None)  # branch.py
        scheduler = build_scheduler(optimizer, cfg.train.schedule, self.max_steps, self.start_step)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=self.ds, dist_init_required=False)
        adopt_unfused_masters(engine.optimizer)  # ZeRO-0 bf16/fp16: Adam's state as a fresh optimizer's
        self.clipping = None  # ZeRO-0 fp32: the engine's clipping norm ignores expert sharding (grad_norm.py)
        if zero_stage(self.ds) == 0 and precision(self.ds) == "fp32":
            self.clipping = ExactClipping.install(engine, plan.group)
        log.info("model: %s | %s | ZeRO-%d | %d ranks | expert parallel %d | %d steps",
                 self.report.as_dict(), precision(self.ds), zero_stage(self.ds), self.world,
                 cfg.train.expert_parallel_size, self.max_steps)
        return engine, model, plan

    def start_at(self, step: int) -> int:
        """A fresh run's position at `step` (train.start_step): the data and the engine's counters; the lr schedule
        starts there already (build_scheduler). Returns the step."""
        self.loader.start_at(step)
        self.engine.global_steps, self.engine.global_samples = step, step * self.ds["train_batch_size"]
        return step

    def train_step(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One optimizer step over `accum` micro-batches: this rank's losses averaged over its micro-batches and
        the routing statistics, all left on the device (no host sync here)."""
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.device))
        stats: dict[str, torch.Tensor] = {}
        for _ in range(self.accum):
            input_ids, labels = self.loader.next_micro_batch()
            out = self.engine(input_ids.to(self.device), labels=labels.to(self.device))
            out.logits = None  # [B, T, V] is not needed by backward: free it before backward's peak
            self.engine.backward(loss_for_backward(self.engine.optimizer, out.loss))
            self.engine.step()
            sums["loss"] += out.loss.detach().float() / self.accum
            sums["ce_loss"] += out.ce_loss.detach().float() / self.accum
            for name, value in out.aux_losses.items():
                sums[f"aux/{name}"] += value.detach().float() / self.accum
            for name, value in out.stats.items():
                value = value.detach().float() / self.accum
                stats[name] = stats[name] + value if name in stats else value
        return sums, stats

    def reduce_step(self, sums: dict[str, torch.Tensor], last_save: float) -> tuple[dict[str, torch.Tensor], bool, bool]:
        """The step's one collective: losses averaged over ranks, the loss-free balancing counts summed over
        ranks (then the biases are updated: training/balancing.py), and whether any rank was asked to stop
        (`self.stop.requested`) or is due a time-based checkpoint. Only the two flags come to the host; the
        losses stay on the device (the caller brings them over on log steps)."""
        minutes = self.cfg.train.checkpoint.every_minutes
        due = minutes is not None and (time.time() - last_save) >= 60 * minutes
        keys = sorted(sums)
        flags = torch.tensor([float(self.stop.requested), float(due), float(self.checkpoints.failed())],
                             device=self.device)
        counts = self.balancing.local_counts().to(self.device)
        dtype = torch.float64 if counts.numel() else torch.float32  # counts exact beyond fp32's 2^24
        packed = torch.cat([torch.stack([sums[k] for k in keys]).to(dtype) / self.world, counts, flags.to(dtype)])
        dist.all_reduce(packed)  # sum: mean losses, global counts, and a flag is set when any rank set it
        stop, time_due, save_failed = (v > 0 for v in packed[-3:].tolist())
        if save_failed:  # an asynchronous save failed: its error on every rank now, not at the next save
            self.checkpoints.wait()
            raise ckpt_io.CheckpointError("an asynchronous checkpoint save failed on another rank (see its error)")
        self.balancing.end_step(packed[len(keys):len(keys) + counts.numel()])
        return dict(zip(keys, packed[:len(keys)].float())), stop, time_due

    def metrics(self, losses: dict[str, float], seconds: float) -> dict[str, float]:
        tokens_per_s = self.tokens_per_step / max(seconds, 1e-9)
        out = {**losses, "lr": self.engine.get_lr()[0], "tokens_per_s": tokens_per_s,
               "tokens": float(self.tokens_read())}
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None and self.clipping is not None:
            grad_norm = self.clipping.last_norm
        if grad_norm is not None:
            out["grad_norm"] = float(grad_norm)
        scaler = loss_scaler(self.engine.optimizer)
        if precision(self.ds) == "fp16" and scaler is not None:
            out["loss_scale"] = float(scaler.cur_scale)
            out["skipped_steps"] = float(self.engine.skipped_steps)
        peak = peak_flops(self.cfg, self.device)
        if peak:
            out["mfu"] = self.report.flops_per_token * tokens_per_s / (peak * self.world)
        return out

    def tokens_read(self) -> int:
        """Tokens read so far (training/resume_data.py)."""
        return tokens_read(self.engine.global_samples, self.cfg.data.seq_len, self.state)

    def open_validation(self):
        """The validation windows, when the recipe evaluates, and how many an evaluation scores (`val_windows`):
        checked now, not at the first evaluation."""
        if not self.cfg.train.eval_every:
            return None
        val = open_split(self.prepared, "val", self.cfg.data.seq_len)
        self.val_windows = scored_windows(len(val), self.cfg.train, self.ds, path=self.prepared)
        return val

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation token loss over the first `eval_batches` global batches of validation windows in file
        order (all whole global batches when fewer): the same windows at any number of ranks, each rank scoring
        its contiguous share in micro-batches (routers in their eval mode)."""
        self.engine.eval()
        total = torch.zeros((), device=self.device)
        windows = 0
        for inputs, labels in eval_batches(self.val, micro_batch_size=self.ds["train_micro_batch_size_per_gpu"],
                                           dp_rank=self.rank, dp_size=self.world, max_windows=self.val_windows):
            out = self.engine(inputs.to(self.device), labels=labels.to(self.device))
            total += out.ce_loss.float() * len(inputs)  # windows are of equal length: the token mean's share
            windows += len(inputs)
        self.engine.train()
        dist.all_reduce(total)
        return float(total) / (windows * self.world)  # every rank scores as many windows
