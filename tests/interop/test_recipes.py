"""The import and upcycling recipes: their dry runs, and that they are Pythia-1B's recipe but for the model's
source (the control) or its MoE form (the upcycled ones), whose dense counterpart is pythia_1b_dense's model."""
from __future__ import annotations

import json

import pytest

from moep_ds.cli.pretrain import main as pretrain_main
from moep_ds.config import load_config
from moep_ds.interop.sources import check_same_model
from moep_ds.interop.upcycle import dense_model_config
from moep_ds.schema import to_dict

from repo_paths import CONFIGS

RECIPES = {  # name: (params_total, params_active), from the dry run
    "pythia_1b_branch_dense": (1_011_781_632, 1_011_781_632),
    "pythia_1b_branch_moe": (4_771_287_040, 1_549_078_528),
    "pythia_1b_upcycled_moe": (4_771_287_040, 1_549_078_528),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_dry_run(name, capsys):
    assert pretrain_main(["--config", str(CONFIGS / f"{name}.yaml"), "--dry_run"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["params_total"], report["params_active"]) == RECIPES[name]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_is_pythia_1b_but_for_the_model(name):
    dense = load_config(CONFIGS / "pythia_1b_dense.yaml")
    cfg = load_config(CONFIGS / f"{name}.yaml")
    ours, theirs = to_dict(cfg), to_dict(dense)
    for raw in (ours, theirs):
        raw.pop("model")
        raw["train"].pop("output_dir")
    assert ours == theirs  # data, schedule, optimizer, batch: Pythia's, as pythia_1b_dense has them
    check_same_model(dense.model, dense_model_config(cfg.model) if cfg.model.upcycle else cfg.model, name)
    assert cfg.model.init_from == {"pythia_1b_upcycled_moe": "runs/pythia_1b_dense"}.get(
        name, "hf:EleutherAI/pythia-1b@step13000")
    if cfg.model.upcycle is not None:
        router = cfg.model.layers[0].moe.router
        assert (router.type, router.k, router.renormalize, router.capacity_factor) == ("topk", 2, True, None)
