"""The quick-start recipes of the 2026 families (configs/gpt_oss_tiny.yaml, glm4_moe_tiny.yaml, qwen3_next_tiny.yaml)
train on CPU under the quick start's settings: 2 processes, ds_configs/quickstart.json (ZeRO-2), the embedded corpus,
the recipe as shipped but for its length (30 of its 300 steps) and where it writes. Each one's loss falls from about
ln(vocab) and stays finite; their imports and exports: tests/interop/test_moe_import.py."""
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
    jobs = [{"recipe": str(REPO / "configs" / f"{name}.yaml"), "ds_config": str(DS_CONFIGS / "quickstart.json"),
             "overrides": [f"train.max_steps={STEPS}", "train.log_every=1", "train.eval_every=null",
                           "train.checkpoint.every_steps=null", "train.checkpoint.at_end=false",
                           f"train.output_dir={tmp / name}"]} for name in RECIPES]
    run_jobs(2, jobs, timeout=900)
    return {name: tmp / name for name in RECIPES}


@pytest.mark.parametrize("name", RECIPES)
def test_the_quick_start_trains_the_recipe(runs, name):
    got = losses(runs[name])
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in got.values())
    first, last = got[1], sum(got[s] for s in range(STEPS - 4, STEPS + 1)) / 5
    vocab = load_config(REPO / "configs" / f"{name}.yaml").model.vocab_size
    assert abs(first - math.log(vocab)) < 0.5, first  # from a uniform guess
    assert last < first - 1.0, (first, last)
