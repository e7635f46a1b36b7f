"""What the trainer trains: the model with this rank's experts, its DeepSpeed engine (distributed/engine.py), the
batch loader and the loss-free balancing state; one training step, the step's one collective (`reduce_step`), the
validation loss, the step's metrics, and the state a checkpoint keeps of them. Built by training/assemble.py;
`Trainer` (training/trainer.py) runs the loop and the callbacks around it and holds no step logic.

# B micro-batch, T sequence length
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from moep_ds.data.sampler import BatchLoader, eval_batches
from moep_ds.distributed.engine import Engine
from moep_ds.moe.plan import ExpertParallelPlan
from moep_ds.training.balancing import LossFreeBalancing
from moep_ds.training.resume_data import tokens_read


@dataclasses.dataclass(eq=False)
class TrainModule:
    """The DeepSpeed step of one rank (module docstring).

    engine: the model under DeepSpeed; model: the same module (this rank's experts, its ZeRO-3 partition);
    plan: the expert-parallel plan the model was built with; loader: this rank's micro-batches;
    ds: the reconciled DeepSpeed config; report: the whole model's parameter and FLOP counts;
    tokens_per_step: tokens of one global batch; seq_len: tokens per sample (data.seq_len);
    peak_flops: per device, for the MFU (None: not known)."""

    engine: Engine
    model: torch.nn.Module
    plan: ExpertParallelPlan
    loader: BatchLoader
    ds: dict[str, Any]
    report: Any
    tokens_per_step: int
    device: torch.device
    seq_len: int
    peak_flops: float | None = None
    balancing: LossFreeBalancing = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.balancing = LossFreeBalancing(self.model)
        self.resumed: dict[str, Any] | None = None  # the state this module was resumed from (tokens_read)
        self.accum = self.ds["gradient_accumulation_steps"]
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.step_grad_norm: torch.Tensor | None = None  # the last step's, as reduce_step checks it (train_step)

    def train_step(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One optimizer step over `accum` micro-batches: this rank's losses averaged over its micro-batches and
        the routing statistics, all left on the device (no host sync here)."""
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), device=self.device))
        stats: dict[str, torch.Tensor] = {}
        skipped = self.engine.skipped_steps
        for _ in range(self.accum):
            input_ids, labels = self.loader.next_micro_batch()
            out = self.engine(input_ids.to(self.device), labels=labels.to(self.device))
            out.logits = None  # [B, T, V] is not needed by backward: free it before backward's peak
            self.engine.backward(out.loss)
            self.engine.step()
            sums["loss"] += out.loss.detach().float() / self.accum
            sums["ce_loss"] += out.ce_loss.detach().float() / self.accum
            for name, value in out.aux_losses.items():
                sums[f"aux/{name}"] += value.detach().float() / self.accum
            for name, value in out.stats.items():
                value = value.detach().float() / self.accum
                stats[name] = stats[name] + value if name in stats else value
        # a step the fp16 loss scaler skipped has an inf norm: an overflow the scaler handles (it lowers the scale),
        # not a failed step; without a loss scaler DeepSpeed's skip of a non-finite gradient is one
        scaler_skip = self.engine.loss_scale() is not None and self.engine.skipped_steps > skipped
        self.step_grad_norm = None if scaler_skip else self.engine.grad_norm_tensor()
        return sums, stats

    def reduce_step(self, sums: dict[str, torch.Tensor], flags: dict[str, bool]
                    ) -> tuple[dict[str, torch.Tensor], dict[str, bool], str | None]:
        """The step's one collective: losses averaged over ranks, the loss-free balancing counts summed over
        ranks (then the biases are updated: training/balancing.py), the callbacks' `flags` (each set when any
        rank set it) and the non-finite check (Megatron's --check-for-nan-in-loss-and-grad): the ranks whose loss is
        not finite, and whether the step's gradient norm (global already) is not. Only the flags and the check come
        to the host; the losses stay on the device (the caller brings them over on log steps). Every rank must pass
        the same flag names. Returns the losses, the flags, and what was non-finite in words (None: nothing)."""
        keys, names = sorted(sums), sorted(flags)
        dtype = torch.float64  # balancing counts exact beyond fp32's 2^24; losses summed in float64
        counts = self.balancing.local_counts().to(self.device, dtype)
        local = torch.tensor([float(flags[n]) for n in names], device=self.device, dtype=dtype)
        losses = torch.stack([sums[k] for k in keys]).to(dtype) / self.world if keys else local[:0]
        packed = torch.cat([losses, counts, self.local_checks(sums, dtype), local])
        dist.all_reduce(packed)  # sum: mean losses, global counts, the checks, and a flag is set when any rank set it
        self.balancing.end_step(packed[len(keys):len(keys) + counts.numel()])
        bad_ranks, rank_sum, bad_norm, *flagged = packed[len(keys) + counts.numel():].tolist()
        reduced = dict(zip(keys, packed[:len(keys)].float()))
        return (reduced, {n: v > 0 for n, v in zip(names, flagged)},
                self.nonfinite(reduced, int(bad_ranks), int(rank_sum), bad_norm > 0))

    def local_checks(self, sums: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """This rank's part of the non-finite check, [loss not finite, this rank's number if so, norm not finite];
        summed over the ranks: how many ranks had a non-finite loss and the sum of their numbers (the rank, where
        one had). A norm below 0 is DeepSpeed's mark of a non-finite one (its group norms give -1)."""
        zero = torch.zeros((), device=self.device, dtype=dtype)
        bad_loss = (~torch.isfinite(sums["loss"])).to(dtype) if "loss" in sums else zero
        norm = self.step_grad_norm
        bad_norm = zero if norm is None else (~torch.isfinite(norm) | (norm < 0)).to(self.device, dtype)
        return torch.stack([bad_loss, bad_loss * self.rank, bad_norm])

    def nonfinite(self, losses: dict[str, torch.Tensor], bad_ranks: int, rank_sum: int, bad_norm: bool) -> str | None:
        """What the check found, in words: `loss (nan on rank 1)`, `gradient norm (inf)`, both; None: nothing."""
        found = []
        if bad_ranks:
            where = f"rank {rank_sum}" if bad_ranks == 1 else f"{bad_ranks} ranks"
            found.append(f"loss ({float(losses['loss'])} on {where})")
        if bad_norm:
            norm = float(self.step_grad_norm)
            found.append(f"gradient norm ({norm})" if not norm < 0 else "gradient norm")
        return " and ".join(found) or None

    def metrics(self, step: int, losses: dict[str, float], seconds: float) -> dict[str, float]:
        """What a log step records besides the losses: lr, throughput, tokens, gradient norm, loss scale, MFU."""
        tokens_per_s = self.tokens_per_step / max(seconds, 1e-9)
        out = {**losses, "lr": self.engine.lr(), "tokens_per_s": tokens_per_s, "tokens": float(self.tokens_read())}
        grad_norm = self.engine.grad_norm()
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        loss_scale = self.engine.loss_scale()
        if loss_scale is not None:
            out["loss_scale"] = loss_scale
            out["skipped_steps"] = float(self.engine.skipped_steps)
        if self.peak_flops:
            out["mfu"] = self.report.flops_per_token * tokens_per_s / (self.peak_flops * self.world)
        return out

    @torch.no_grad()
    def evaluate(self, val: Any, max_windows: int) -> float:
        """Mean validation token loss over the first `max_windows` windows of `val` in file order: the same windows
        at any number of ranks, each rank scoring its contiguous share in micro-batches (routers in their eval
        mode)."""
        self.engine.eval()
        total = torch.zeros((), device=self.device)
        windows = 0
        for inputs, labels in eval_batches(val, micro_batch_size=self.ds["train_micro_batch_size_per_gpu"],
                                           dp_rank=self.rank, dp_size=self.world, max_windows=max_windows):
            out = self.engine(inputs.to(self.device), labels=labels.to(self.device))
            total += out.ce_loss.float() * len(inputs)  # windows are of equal length: the token mean's share
            windows += len(inputs)
        self.engine.train()
        dist.all_reduce(total)
        return float(total) / (windows * self.world)  # every rank scores as many windows

    def tokens_read(self) -> int:
        """Tokens read so far: counted from the samples read, not the step (training/resume_data.py)."""
        return tokens_read(self.engine.global_samples, self.seq_len, self.resumed)

    def start_at(self, step: int) -> None:
        """A fresh run's position at `step` (train.start_step): the data and the engine's counters; the lr
        schedule starts there already (optim.build_scheduler)."""
        self.loader.start_at(step)
        self.engine.set_counters(step, step * self.ds["train_batch_size"])

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint's meta.json records of the model and the run: tokens read, parameter and FLOP counts."""
        return {"tokens": self.tokens_read(), **self.report.as_dict()}

    def state_dict(self) -> dict[str, Any]:
        """The step's state besides the weights and moments (those are pieces: training/checkpoint.py): engine
        counters, schedule, loss scaler, Adam's step, and the tokens read (the data loader is a part of its own)."""
        return {**self.engine.state_dict(), "seq_len": self.seq_len, "tokens": self.tokens_read()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`state_dict`'s keys (optional ones left out keep their defaults)."""
        self.engine.load_state_dict(state, state["global_steps"])
        self.resumed = state
