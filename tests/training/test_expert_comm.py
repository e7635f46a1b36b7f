"""Dispatch once per destination rank (train.expert_comm.dedup) trains as the blocking per-expert all-to-all: on 2
processes at expert_parallel_size 2 (ZeRO-2 fp32), 5 steps give the same losses (1e-6) for top-k without and with
groups (DeepSeek-V3's routing, with a shared expert), expert choice and MSIT's branches. (Layer outputs and gradients:
tests/moe/test_all_to_all_dedup.py; the bytes it moves: tests/planning/test_plan_comm.py.) Node-aware dispatch on 4
processes as 2 nodes: the same, against the per-expert path."""
import pytest

from tiny import DS_CONFIGS, losses, run_jobs, write_recipe

pytestmark = pytest.mark.slow
STACKS = ["top2", "deepseek", "nova_moe", "msit"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("expert_comm")
    jobs, out = [], {}
    for name in STACKS:
        for dedup in (False, True):
            out[name, dedup] = tmp / f"{name}_dedup_{dedup}"
            recipe = write_recipe(tmp / f"{name}_{dedup}.yaml", name, out[name, dedup], max_steps=5,
                                  expert_parallel_size=2, global_batch_size=8, expert_comm={"dedup": dedup})
            jobs.append({"recipe": str(recipe), "ds_config": str(DS_CONFIGS / "zero2_fp32.json")})
    run_jobs(2, jobs, timeout=1200)
    return out


@pytest.mark.parametrize("name", STACKS)
def test_five_steps_once_per_rank_equal_the_per_expert_path(runs, name):
    per_expert, once = losses(runs[name, False]), losses(runs[name, True])
    assert sorted(per_expert) == sorted(once) == [1, 2, 3, 4, 5]
    for step in range(1, 6):
        assert once[step] == pytest.approx(per_expert[step], rel=0, abs=1e-6), (name, step, per_expert, once)
    assert per_expert[5] != per_expert[1]  # it trained


# Node-aware dispatch (train.expert_comm.node_aware, on by default where the group spans nodes): 4 processes as 2 nodes
# of 2 (LOCAL_WORLD_SIZE 2, as torchrun sets it; tests/ranks.py per_node) at expert_parallel_size 4. Layer outputs,
# gradients and bytes: tests/moe/test_all_to_all_nodes.py.
NODE_STACKS = ["top2", "deepseek", "nova_moe"]


@pytest.fixture(scope="module")
def node_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("expert_comm_nodes")
    jobs, out = [], {}
    for name in NODE_STACKS:
        for mode, comm in (("per_expert", {"dedup": False}), ("nodes", {})):
            out[name, mode] = tmp / f"{name}_{mode}"
            recipe = write_recipe(tmp / f"{name}_{mode}.yaml", name, out[name, mode], max_steps=5,
                                  expert_parallel_size=4, micro_batch_size=2, global_batch_size=8, expert_comm=comm)
            jobs.append({"recipe": str(recipe), "ds_config": str(DS_CONFIGS / "zero2_fp32.json")})
    run_jobs(4, jobs, timeout=1200, per_node=2)
    return out


@pytest.mark.parametrize("name", NODE_STACKS)
def test_five_steps_once_per_node_equal_the_per_expert_path(node_runs, name):
    per_expert, nodes = losses(node_runs[name, "per_expert"]), losses(node_runs[name, "nodes"])
    assert sorted(per_expert) == sorted(nodes) == [1, 2, 3, 4, 5]
    for step in range(1, 6):
        assert nodes[step] == pytest.approx(per_expert[step], rel=0, abs=1e-6), (name, step, per_expert, nodes)
    assert per_expert[5] != per_expert[1]  # it trained
