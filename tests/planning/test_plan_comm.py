"""Communication per step as moep-plan predicts it equals what a real 2-process run moves: every torch.distributed
collective wrapped and its bytes counted (scripts/count_collectives.py) over one steady-state step, per kind of
collective and group size, for ZeRO-2 and ZeRO-3, expert parallelism 1 and 2, top-k and expert choice (and ZeRO-0/1,
bf16, accumulation, activation checkpointing, ZeRO-1 with overlap_comm, MSIT's positions, ZeRO-3 persistence and
padding, gradients reduced to their owner only with use_multi_rank_bucket_allreduce false, dispatch per expert and
once per rank, in 1, 2 (the default) or 4 chunks). All layouts train in one launch."""
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "training"))
from tiny import DS_CONFIGS, launch, write_recipe  # noqa: E402

from moep_ds.config import load_config  # noqa: E402
from moep_ds.planning.hardware import assumptions, hardware  # noqa: E402
from moep_ds.planning.layout import Cluster  # noqa: E402
from moep_ds.planning.plan import plan_run  # noqa: E402
from moep_ds.training.ds_config import read_ds_config  # noqa: E402

pytestmark = pytest.mark.slow
SCRIPT = pathlib.Path(__file__).parent / "scripts" / "count_collectives.py"
STEPS = 5  # counted: the last; ZeRO-3 records its module trace (and checks it with broadcasts) in the first ones

PER_EXPERT = {"expert_comm": {"dedup": False}}  # the per-expert all-to-all: a row per (token, expert), in 2 chunks
BLOCKING = {"expert_comm": {"dedup": False, "overlap_chunks": 1}}  # ... in one, blocking
RANK_GROUPS = ["model.layers[0].moe.router.num_groups=2", "model.layers[0].moe.router.group_topk=1"]
# name: (tiny.py layers, ds_config, recipe train fields, overrides)
LAYOUTS = {
    "expert_choice_zero2_ep1": ("nova_moe", "zero2_fp32", {}, []),
    "expert_choice_zero2_ep2": ("nova_moe", "zero2_fp32", {"expert_parallel_size": 2, **PER_EXPERT}, []),
    "expert_choice_zero3_ep1": ("nova_moe", "zero3_fp32", {}, []),
    "topk_zero2_ep1": ("top2", "zero2_fp32", {}, []),
    "topk_zero2_ep2": ("top2", "zero2_fp32", {"expert_parallel_size": 2, **PER_EXPERT}, []),
    "topk_zero3_ep1": ("top2", "zero3_fp32", {}, []),
    "topk_zero2_ep2_bf16_accumulation_checkpointing": (
        "top2", "zero2_bf16", {"expert_parallel_size": 2, "global_batch_size": 16, "activation_checkpointing": True,
                               **PER_EXPERT}, []),
    "msit_zero2_ep2": ("msit", "zero2_fp32", {"expert_parallel_size": 2, **PER_EXPERT}, []),
    "expert_choice_zero1_ep2_bf16": ("nova_moe", "zero1_bf16", {"expert_parallel_size": 2, **PER_EXPERT}, []),
    "topk_zero0_ep2": ("top2", "zero0_fp32", {"expert_parallel_size": 2, **PER_EXPERT}, []),
    "topk_zero0_ep1_bf16": ("top2", "zero0_bf16", {}, []),
    # DeepSpeed's ZeRO-3 defaults (tiny parameters persistent), a vocabulary that pads the partitions
    "expert_choice_zero3_defaults_bf16": ("nova_moe", "zero3_defaults_bf16", {},
                                          ["model.vocab_size=509", "data.tokenizer.vocab_size=509"]),
    # use_multi_rank_bucket_allreduce false: each gradient slice reduced to its owner only (issue #46 item 8)
    "topk_zero2_ep1_reduce_to_owner": ("top2", "zero2_reduce_to_owner", {}, []),
    "topk_zero1_ep1_bf16_reduce_to_owner": ("top2", "zero1_bf16_reduce_to_owner", {}, []),
    # dispatch once per destination rank (train.expert_comm.dedup, the default), with routings that fix the number of
    # (token, rank) pairs to its balanced expectation: two experts of one group, a group per rank (1 rank a token);
    # expert choice taking every token (every rank); planning/dedup.py's expectation in general: test_planning.py
    "topk_rank_groups_zero2_ep2_dedup": ("top2", "zero2_fp32", {"expert_parallel_size": 2}, RANK_GROUPS),
    "topk_rank_groups_zero2_ep2_bf16_accumulation_checkpointing_dedup": (
        "top2", "zero2_bf16", {"expert_parallel_size": 2, "global_batch_size": 16, "activation_checkpointing": True},
        RANK_GROUPS),
    "expert_choice_every_token_zero1_ep2_bf16_dedup": ("nova_moe", "zero1_bf16", {"expert_parallel_size": 2},
                                                       ["model.layers[1].moe.router.capacity_factor=4.0"]),
    "msit_every_token_zero2_ep2_dedup": ("msit", "zero2_fp32", {"expert_parallel_size": 2},
                                         ["model.layers[0].router.type=expert_choice",
                                          "model.layers[0].router.capacity_factor=4.0"]),
    # ZeRO-1 with overlap_comm: its reduction moved into the last micro-batch's backward, the same bytes once a step
    "topk_zero1_ep2_bf16_accumulation_overlap_comm": ("top2", "zero1_bf16_overlap",
                                                      {"expert_parallel_size": 2, "global_batch_size": 16,
                                                       **PER_EXPERT}, []),
    # train.expert_comm.overlap_chunks (2 above, the default): blocking; 4 chunks of one sequence each
    "topk_zero2_ep2_blocking": ("top2", "zero2_fp32", {"expert_parallel_size": 2, **BLOCKING}, []),
    "msit_every_token_zero2_ep2_dedup_4_chunks": ("msit", "zero2_fp32", {"expert_parallel_size": 2,
                                                                         "expert_comm": {"overlap_chunks": 4}},
                                                  ["model.layers[0].router.type=expert_choice",
                                                   "model.layers[0].router.capacity_factor=4.0"]),
}
TO_OWNER = {"contiguous_gradients": True, "use_multi_rank_bucket_allreduce": False}


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("collectives")
    (tmp / "zero3_defaults_bf16.json").write_text(json.dumps({"zero_optimization": {"stage": 3},
                                                              "bf16": {"enabled": True}}))
    (tmp / "zero2_reduce_to_owner.json").write_text(json.dumps({"zero_optimization": {"stage": 2, **TO_OWNER}}))
    (tmp / "zero1_bf16_reduce_to_owner.json").write_text(json.dumps({"zero_optimization": {"stage": 1, **TO_OWNER},
                                                                     "bf16": {"enabled": True}}))
    jobs = []
    for name, (layers, ds, train, overrides) in LAYOUTS.items():
        recipe = write_recipe(tmp / f"{name}.yaml", layers, tmp / name, max_steps=STEPS, **train)
        ds_path = DS_CONFIGS / f"{ds}.json" if (DS_CONFIGS / f"{ds}.json").exists() else tmp / f"{ds}.json"
        jobs.append({"name": name, "recipe": str(recipe), "ds_config": str(ds_path), "overrides": overrides})
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    launch(2, SCRIPT, str(tmp / "jobs.json"), str(tmp / "counted.json"))
    return {job["name"]: job for job in jobs}, json.loads((tmp / "counted.json").read_text())


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_predicted_bytes_per_collective_equal_the_counted(counted, name):
    jobs, results = counted
    job, result = jobs[name], results[name]
    cfg = load_config(job["recipe"], job["overrides"])
    run = plan_run(cfg, read_ds_config(job["ds_config"]), Cluster(2, 2), hardware("h100"), assumptions())
    # the mean over the ranks: a top-k rank receives what its routing gives it, the two together what was sent
    measured = {key: sum(rank[i] for rank in result["per_rank"]) / 2 for i, key in enumerate(result["keys"])}
    assert run.comm.by_kind_and_group() == measured
    if LAYOUTS[name][2].get("expert_parallel_size") == 2:
        assert measured["all_to_all/2"] > 0
    if name.endswith("reduce_to_owner"):
        assert measured["reduce/2"] > 0 and "all_reduce/2" in measured  # the trainer's and the norm's remain
