"""The quick-start recipes of the 2026 families (configs/gpt_oss_tiny.yaml, glm4_moe_tiny.yaml, qwen3_next_tiny.yaml)
train on CPU under the quick start's settings: 2 processes, ds_configs/quickstart.json (ZeRO-2), the embedded corpus,
the recipe as shipped but for its length (30 of its 300 steps) and where it writes. Each one's loss falls from about
ln(vocab) and stays finite. Their new layers (attention sinks, clamped SwiGLU, router bias; Gated DeltaNet, gated
attention) train alike under ZeRO-3 with activation checkpointing and at expert-parallel size 2: the first 5 steps
within 1e-5 of the ZeRO-2 run's. Their imports and exports: tests/interop/test_moe_import.py."""
import math

import pytest

from moep_ds.config import load_config
from tiny import DS_CONFIGS, REPO, losses, run_jobs

pytestmark = pytest.mark.slow
RECIPES = ["gpt_oss_tiny", "glm4_moe_tiny", "qwen3_next_tiny"]
STEPS = 30


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("family_tiny")
    jobs = []
    for name in RECIPES:
        for way, ds_config, extra in WAYS:
            jobs.append({"recipe": str(REPO / "configs" / f"{name}.yaml"), "ds_config": str(DS_CONFIGS / ds_config),
                         "overrides": [f"train.max_steps={STEPS}", "train.log_every=1", "train.eval_every=null",
                                       "train.checkpoint.every_steps=null", "train.checkpoint.at_end=false",
                                       f"train.output_dir={tmp / name / way}", *extra]})
    run_jobs(2, jobs, timeout=900)
    return {(name, way): tmp / name / way for name in RECIPES for way, _, _ in WAYS}


# (name, DeepSpeed config, overrides): the quick start (ZeRO-2 fp32), then the first 5 of its steps (the same lr
# schedule) under ZeRO-3 with activation checkpointing, and with the experts split over the 2 processes
WAYS = [("quick_start", "quickstart.json", []),
        ("zero3", "zero3_fp32.json", ["train.exit_at_step=5", "train.activation_checkpointing=true"]),
        ("expert_parallel", "quickstart.json", ["train.exit_at_step=5", "train.expert_parallel_size=2"])]


@pytest.mark.parametrize("name", RECIPES)
def test_the_quick_start_trains_the_recipe(runs, name):
    got = losses(runs[name, "quick_start"])
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in got.values())
    first, last = got[1], sum(got[s] for s in range(STEPS - 4, STEPS + 1)) / 5
    vocab = load_config(REPO / "configs" / f"{name}.yaml").model.vocab_size
    assert abs(first - math.log(vocab)) < 0.5, first  # from a uniform guess
    assert last < first - 1.0, (first, last)


@pytest.mark.parametrize("way", ["zero3", "expert_parallel"])
@pytest.mark.parametrize("name", RECIPES)
def test_zero3_with_activation_checkpointing_and_expert_parallelism_train_alike(runs, name, way):
    reference, got = losses(runs[name, "quick_start"]), losses(runs[name, way])
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in got:
        assert got[step] == pytest.approx(reference[step], rel=0, abs=1e-5), (name, way, step, reference, got)
