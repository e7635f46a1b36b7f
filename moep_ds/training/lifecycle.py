"""The expert lifecycle managers run after each optimizer step (`LifecycleRunner`, used by the built-in `lifecycle`
callback): fold each step's statistics, apply replacements.

# E experts of a layer, L experts held by this rank (E under no expert parallelism)

After every optimizer step, on every rank:
    1. one all-reduce sums every managed layer's step sums over the data-parallel ranks: the router counts
       (each rank routes its own tokens to all E experts) and the impact sums (each rank adds the impact of
       the tokens its own experts processed, from whichever rank they came, into those experts' slots); the
       sum therefore covers the expert-parallel group and every token exactly once, and every rank folds
       the same numbers and makes the same decisions;
    2. where a check is due, the manager (routing/lifecycle.py) decides which expert replaces which, and this
       callback writes each replaced expert's rows: best + noise into the fp32 master and the module, zero
       Adam moments. Under expert parallelism the best expert's row travels from the rank that holds it
       (a broadcast over the expert-parallel group); only the rank holding the replaced expert writes it.
       Router rows are replicated: every rank writes the same clone.

Under ZeRO 1/2 (and DeepSpeed's bf16 optimizer) the fp32 masters and Adam moments are partitioned over the
(expert-)data-parallel ranks, and the module parameters are copies that the engine overwrites from the
masters after every step: a clone written only into the module would be reverted. Rows are therefore read
and written through DeepSpeed's partitioned-state API (distributed/optimizer_state.py over
`deepspeed.utils.safe_{get,set}_full_{fp32_param,optimizer_state}`), whose reads are collective over each
parameter's data-parallel group: every rank makes the same calls in the same order. Noise is drawn on every
rank for every row, from a generator seeded by (seed, layer, step), so all ranks and a resumed run agree.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moep_ds.routing.lifecycle import ExpertRows, LifecycleManaged, clone_with_noise, lifecycle_layers
from moep_ds.distributed import optimizer_state as st


class LifecycleRunner:
    """Runs every lifecycle manager of `model` after each optimizer step (`after_optimizer_step`).

    optimizer: a DeepSpeed optimizer (ZeRO 0-2 or 3, bf16/fp16 wrappers) or a torch optimizer, whose Adam state
        of replaced experts is reset; None resets weights only.
    dp_group: the group whose ranks see different tokens (default: all ranks, when torch.distributed is up).
    ep_group: the expert-parallel group of sharded experts (None: every rank holds all experts).
    """

    def __init__(self, model: nn.Module, optimizer: Any = None, *, dp_group: Any = None, ep_group: Any = None):
        self.layers = lifecycle_layers(model)
        self.optimizer = optimizer
        self.distributed = dist.is_available() and dist.is_initialized()
        self.dp_group = dp_group
        self.ep_group = ep_group

    @classmethod
    def for_engine(cls, engine: Any, ep_group: Any = None) -> LifecycleRunner:
        """For the model and optimizer of `engine` (a distributed.engine.Engine)."""
        return cls(engine.module, engine.optimizer, dp_group=engine.data_parallel_group, ep_group=ep_group)

    def after_optimizer_step(self, step: int | None = None) -> list[dict[str, Any]]:
        """Fold the step's statistics of every managed layer, apply due replacements; returns the new events."""
        if not self.layers:
            return []
        lifecycles = [layer.expert_lifecycle() for _, layer in self.layers]
        sums = torch.cat([lifecycle.step_sums for lifecycle in lifecycles])
        if self.distributed:
            dist.all_reduce(sums, group=self.dp_group)
        impact_scale = 1.0 / st.optimizer_loss_scale(self.optimizer)
        events = []
        layer_sums = sums.split([lifecycle.step_sums.numel() for lifecycle in lifecycles])
        for (name, layer), lifecycle, one_layer in zip(self.layers, lifecycles, layer_sums):
            lifecycle.end_step(one_layer, impact_scale)
            if not lifecycle.check_due():
                continue
            planned = lifecycle.plan_replacements(name)
            if planned:
                self.replace(layer, [(e["expert"], e["source"]) for e in planned], name)
            for event in planned:
                layer.reset_expert(event["expert"])
                lifecycle.record(event)
            events += planned
        return events

    @torch.no_grad()
    def replace(self, layer: LifecycleManaged, pairs: list[tuple[int, int]], layer_name: str) -> None:
        """Expert `dead` := expert `best` + noise, with zero Adam moments, for each (dead, best) in `pairs`."""
        lifecycle = layer.expert_lifecycle()
        rows = layer.expert_rows()
        if rows.num_local_experts != lifecycle.num_experts and self.ep_group is None:
            raise ValueError(f"{layer_name} holds {rows.num_local_experts} of {lifecycle.num_experts} experts: "
                             "replacing them needs the expert-parallel group")
        if self.optimizer is not None:
            st.link_optimizer_state(self.optimizer)
        generator = lifecycle.noise_generator(layer_name)
        everything = ExpertRows([], [], 0, lifecycle.num_experts)
        sharded = rows.num_local_experts != lifecycle.num_experts
        for p in rows.local:
            self.replace_rows(p, pairs, rows, sharded, lifecycle.cfg.noise_std, generator)
        for p in rows.replicated:
            self.replace_rows(p, pairs, everything, False, lifecycle.cfg.noise_std, generator)

    def replace_rows(
        self, p: nn.Parameter, pairs: list[tuple[int, int]], rows: ExpertRows, sharded: bool, noise_std: float,
        generator: torch.Generator,
    ) -> None:
        """Rows of one parameter stacked over `rows`' experts: clone, write the master, reset the moments.
        `sharded`: other ranks of the expert-parallel group hold the other experts (every pair's source row
        is then broadcast by its owner, so that all ranks of the group make the same calls)."""
        master = st.get_fp32_param(p)
        first = rows.first_expert
        for dead, best in pairs:
            source = master[best - first] if rows.holds(best) else torch.empty(master.shape[1:])
            if sharded:
                source = self.from_owner(source, best // rows.num_local_experts, p.device)
            clone = clone_with_noise(source, noise_std, generator)  # every rank draws: streams stay aligned
            if rows.holds(dead):
                master[dead - first] = clone
        local_dead = [dead - first for dead, _ in pairs if rows.holds(dead)]
        if not local_dead:
            return
        st.set_fp32_param(p, master)
        for key in self.moment_keys(p):
            moment = st.get_optimizer_state(p, self.optimizer, key)
            if moment is not None:
                moment[local_dead] = 0
                st.set_optimizer_state(p, self.optimizer, key, moment)

    def from_owner(self, row: torch.Tensor, owner: int, device: torch.device) -> torch.Tensor:
        """`row` as held by expert-parallel rank `owner` (a broadcast over the expert-parallel group)."""
        if self.ep_group is None:
            return row
        row = row.to(device).contiguous()
        dist.broadcast(row, src=dist.get_global_rank(self.ep_group, owner), group=self.ep_group)
        return row.cpu()

    def moment_keys(self, p: nn.Parameter) -> list[str]:
        if self.optimizer is None:
            return []
        if st.is_partitioned(p):  # the same keys on every rank, whichever fragment this rank holds
            return list(st.ADAM_KEYS)
        state = st.inner_optimizer(self.optimizer).state.get(p, {})
        return [k for k, v in state.items() if torch.is_tensor(v) and v.shape == p.shape]


__all__ = ["LifecycleRunner"]
