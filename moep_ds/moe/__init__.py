"""Mixture-of-experts machinery: grouped experts, dispatchers (local, all-to-all), the MoE layer."""
from moep_ds.moe.all_to_all import AllToAllDispatcher, ExpertCommConfig
from moep_ds.moe.dispatch import Dispatcher, ExpertBatch, LocalDispatcher
from moep_ds.moe.experts import GroupedExperts
from moep_ds.moe.layer import MoEConfig, MoELayer, MoEOutput, shard_experts
from moep_ds.moe.plan import SINGLE_PROCESS, ExpertParallelPlan

__all__ = [
    "AllToAllDispatcher",
    "Dispatcher",
    "ExpertBatch",
    "ExpertCommConfig",
    "ExpertParallelPlan",
    "GroupedExperts",
    "LocalDispatcher",
    "MoEConfig",
    "MoELayer",
    "MoEOutput",
    "SINGLE_PROCESS",
    "shard_experts",
]
