"""The routing menu in training: every new option (sigmoid scores, scaling, loss-free balancing, group-limited
choice, sequence and global balancing scopes, both drop policies, shared experts with each gate, in FFN-MoE, SSM-MoE
with the lifecycle manager and MoEP-paths routers) trains at expert-parallel size 2 as at size 1, under ZeRO-3 with
activation checkpointing as under ZeRO-2, and resumes exactly; the loss-free balancing bias of 2 processes equals
that of 1 process over the same global batches. Two tiny recipes (tests/training/tiny.py: deepseek, qwen) trained on
2 ranks and on 1 (tests/ranks.py); plus an in-process check that a recomputed forward counts nothing."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

from moep_ds.checkpointing import sharded
from tiny import DS_CONFIGS, losses, metrics, run_jobs, write_recipe

ZERO2, ZERO3 = str(DS_CONFIGS / "zero2_fp32.json"), str(DS_CONFIGS / "zero3_fp32.json")
STEPS = 5
CHECKPOINTS = {"every_steps": 3, "at_end": True}


def biases(run_dir: pathlib.Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    """Every router's loss-free balancing bias as saved in the checkpoint of `step`."""
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    shapes = sharded.read_shapes(path)
    names = [k for k in shapes if k.endswith("balancer.bias_E")]
    out = {k: torch.zeros(shapes[k], dtype=torch.float32) for k in names}
    sharded.load({sharded.MODEL_PREFIX + k: sharded.whole(v) for k, v in out.items()}, path)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routing_options")
    out, jobs = {}, []
    for layers in ("deepseek", "qwen"):
        for name, ds, extra in (("ep1", ZERO2, {}), ("ep2", ZERO2, {"expert_parallel_size": 2}),
                                ("z3ckpt", ZERO3, {"activation_checkpointing": True})):
            out[layers, name] = tmp / f"{layers}_{name}"
            recipe = write_recipe(tmp / f"{layers}_{name}.yaml", layers, out[layers, name], max_steps=STEPS,
                                  global_batch_size=8, checkpoint=CHECKPOINTS, **extra)
            jobs.append({"recipe": str(recipe), "ds_config": ds})
        # a second run into the ep1 run's folder would be refused: resume a copy-free run from its step 3
        out[layers, "resumed"] = tmp / f"{layers}_resumed"
        recipe = write_recipe(tmp / f"{layers}_resumed.yaml", layers, out[layers, "resumed"], max_steps=STEPS,
                              global_batch_size=8, checkpoint=CHECKPOINTS)
        jobs.append({"recipe": str(recipe), "ds_config": ZERO2,
                     "resume": str(out[layers, "ep1"] / "checkpoints" / "step_00000003")})
    run_jobs(2, jobs, timeout=1800)
    out["deepseek", "1p"] = tmp / "deepseek_1p"
    recipe = write_recipe(tmp / "deepseek_1p.yaml", "deepseek", out["deepseek", "1p"], max_steps=STEPS,
                          global_batch_size=8, checkpoint=CHECKPOINTS)  # 1 process: 2 micro-batches per step
    run_jobs(1, [{"recipe": str(recipe), "ds_config": ZERO2}], timeout=900)
    return out


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layers", ["deepseek", "qwen"])
def test_expert_parallel_2_equals_1(runs, layers):
    ep1, ep2 = losses(runs[layers, "ep1"]), losses(runs[layers, "ep2"])
    assert sorted(ep1) == sorted(ep2) == list(range(1, STEPS + 1))
    for step in ep1:
        assert ep2[step] == pytest.approx(ep1[step], rel=1e-4), (layers, step, ep1, ep2)
    assert ep1[STEPS] != ep1[1]
    b1, b2 = biases(runs[layers, "ep1"]), biases(runs[layers, "ep2"])
    assert b1.keys() == b2.keys() and len(b1) == (1 if layers == "deepseek" else 3)
    for name in b1:
        assert torch.equal(b1[name], b2[name]), name  # replicated router state, updated from global counts
        assert b1[name].abs().max() > 0, name  # it moved


@pytest.mark.parametrize("layers", ["deepseek", "qwen"])
def test_zero3_with_activation_checkpointing_trains_as_zero2(runs, layers):
    z2, z3 = losses(runs[layers, "ep1"]), losses(runs[layers, "z3ckpt"])
    for step in z2:
        assert z3[step] == pytest.approx(z2[step], abs=1e-4), (layers, step, z2, z3)
    b2, b3 = biases(runs[layers, "ep1"]), biases(runs[layers, "z3ckpt"])
    for name in b2:
        assert torch.equal(b2[name], b3[name]), name


@pytest.mark.parametrize("layers", ["deepseek", "qwen"])
def test_resume_restores_the_bias_exactly(runs, layers):
    full, resumed = losses(runs[layers, "ep1"]), losses(runs[layers, "resumed"])
    assert sorted(resumed) == [4, 5]
    for step in (4, 5):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6), (layers, step, full, resumed)
    at3, resumed_end, full_end = (biases(runs[layers, "ep1"], 3), biases(runs[layers, "resumed"]),
                                  biases(runs[layers, "ep1"]))
    for name in full_end:
        assert torch.equal(resumed_end[name], full_end[name]), name
        assert not torch.equal(at3[name], full_end[name]), name  # steps 4 and 5 moved it further


def test_bias_of_two_processes_equals_one_process(runs):
    """The update uses the counts of the whole global batch: 2 ranks x 1 micro-batch = 1 rank x 2 micro-batches."""
    two, one = biases(runs["deepseek", "ep1"]), biases(runs["deepseek", "1p"])
    assert two.keys() == one.keys()
    for name in two:
        assert torch.equal(two[name], one[name]), (name, two[name], one[name])
    for step, loss in losses(runs["deepseek", "1p"]).items():
        assert loss == pytest.approx(losses(runs["deepseek", "ep1"])[step], rel=1e-4)


def test_bias_and_destination_ranks_are_logged(runs):
    rows = [json.loads(line) for line in (runs["deepseek", "ep2"] / "expert_utilization.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step" in r and "event" not in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[0]["layers.1.expert_bias"] == [0.0] * 8  # the bias a step routed with: none yet at step 1
    assert any(v != 0 for v in rows[-1]["layers.1.expert_bias"])
    for r in rows:  # 4 groups of 2 experts, 2 ranks of 4: a token's 2 experts on 1 or 2 ranks
        assert 1.0 <= r["layers.1.destination_ranks"] <= 2.0
    assert "layers.1.destination_ranks" not in json.loads(
        (runs["deepseek", "ep1"] / "expert_utilization.jsonl").read_text().splitlines()[0])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((runs["deepseek", "ep2"] / "tensorboard").rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert "moe/layers.1.expert_bias/expert_0" in tags and "moe/layers.1.destination_ranks" in tags, sorted(tags)
    assert metrics(runs["deepseek", "ep2"])[-1]["step"] == STEPS


def test_a_replaced_expert_starts_without_bias(runs):
    """qwen's SSM-MoE layer has the lifecycle manager and loss-free balancing: the step after a replacement routes
    with the replaced expert's bias at 0 (its update for the step ran first, then the reset)."""
    rows = [json.loads(line) for line in (runs["qwen", "ep1"] / "expert_utilization.jsonl").read_text().splitlines()]
    bias = {r["step"]: r["layers.2.expert_bias"] for r in rows if "event" not in r}
    replaced = [(r["step"], r["event"]["expert"]) for r in rows
                if "event" in r and r["event"]["layer"] == "blocks.2.moe" and r["step"] < STEPS]
    assert replaced  # min_tokens 64, check_interval 3 (tiny.LIFECYCLE): a replacement at step 3
    for step, expert in replaced:
        assert bias[step][expert] != 0.0 and bias[step + 1][expert] == 0.0, (step, expert, bias)
