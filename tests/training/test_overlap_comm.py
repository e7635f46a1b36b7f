"""zero_optimization.overlap_comm under ZeRO-1 and ZeRO-2 (DeepSpeed's one optimizer for both, stage_1_and_2.py):
with it the gradients are reduced in buckets by the gradient hooks as backward produces them, ZeRO-1's in the
backward of the step's last micro-batch only (the accumulation boundary), ZeRO-2's in every micro-batch's; without
it ZeRO-1 reduces after that backward (reduce_gradients). What moep-plan counts (planning/comm.py: ZeRO-1's reduction
once a step, overlappable under overlap_comm; tests/planning/test_plan_overlap.py). On 2 processes (gloo) at expert
parallel 2 with 2 micro-batches a step: where DeepSpeed reduces, and the same losses with and without it, in fp32
and in bf16 (the OLMoE recipe's ZeRO-1 bf16, configs/olmoe_1b_7b.yaml)."""
import collections
import json
import traceback

import pytest

from tiny import DS_CONFIGS, losses, train, write_recipe

pytestmark = pytest.mark.slow
RUNS = [(1, "fp32"), (2, "fp32"), (1, "bf16")]
STEPS, ACCUMULATION = 4, 2


def train_counting_reductions(jobs: list[dict]) -> list[dict[str, int]]:
    """On one rank: train each job, counting DeepSpeed's per-parameter reductions by where they ran: in the backward
    hooks or after backward (stage 1's reduce_gradients)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    counts: collections.Counter = collections.Counter()
    reduce = DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_remove_grads

    def counted(self, param, i):
        after = any(frame.name == "reduce_gradients" for frame in traceback.extract_stack())
        counts["after backward" if after else "in backward"] += 1
        return reduce(self, param, i)

    DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_remove_grads = counted
    out = []
    for job in jobs:
        counts.clear()
        train([job])
        out.append(dict(counts))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from ranks import run_ranks

    tmp = tmp_path_factory.mktemp("overlap_comm")
    jobs, out = [], {}
    for stage, precision in RUNS:
        ds = json.loads((DS_CONFIGS / f"zero{stage}_{precision}.json").read_text())
        for overlap in (False, True):
            name = f"zero{stage}_{precision}_{'overlap' if overlap else 'plain'}"
            (tmp / f"{name}.json").write_text(json.dumps({**ds, "zero_optimization": {
                **ds["zero_optimization"], "overlap_comm": overlap}}))
            out[stage, precision, overlap] = tmp / name
            recipe = write_recipe(tmp / f"{name}.yaml", "top2", tmp / name, max_steps=STEPS, expert_parallel_size=2,
                                  micro_batch_size=2, global_batch_size=2 * 2 * ACCUMULATION)
            jobs.append({"recipe": str(recipe), "ds_config": str(tmp / f"{name}.json")})
    counts = run_ranks(2, train_counting_reductions, jobs)[0].result
    return out, dict(zip(out, counts))


@pytest.mark.parametrize("stage, precision", RUNS)
def test_overlap_comm_trains_as_without(runs, stage, precision):
    out, _ = runs
    plain, overlapped = losses(out[stage, precision, False]), losses(out[stage, precision, True])
    assert sorted(plain) == sorted(overlapped) == list(range(1, STEPS + 1))
    assert overlapped == pytest.approx(plain, rel=0, abs=1e-6), (plain, overlapped)
    assert plain[STEPS] != plain[1]  # it trained


def test_zero1_reduces_once_a_step_during_backward_under_overlap_comm(runs):
    """Each parameter reduced once a step by ZeRO-1 either way (moved into the last backward by overlap_comm), once a
    micro-batch by ZeRO-2."""
    _, counts = runs
    per_step = counts[1, "fp32", False]["after backward"] // STEPS  # the parameters this rank reduces
    assert per_step > 0
    assert counts[1, "fp32", False] == counts[1, "bf16", False] == {"after backward": STEPS * per_step}
    assert counts[1, "fp32", True] == counts[1, "bf16", True] == {"in backward": STEPS * per_step}
    for overlap in (False, True):
        assert counts[2, "fp32", overlap] == {"in backward": STEPS * ACCUMULATION * per_step}
