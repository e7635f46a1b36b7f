"""Continued pre-training of imported MoEs on 2 processes: an OLMoE-style and a DeepSeek-V3-style tiny
transformers model (`model.init_from`, the recipe moep-import writes for them), 5 steps each at expert-parallel
size 1 and 2 (ZeRO-2) and, for DeepSeek, under ZeRO-3. The first step's loss is transformers' loss on the batch
the two ranks read; expert parallelism and ZeRO-3 train as expert-parallel size 1 does; the checkpoints that
expert parallelism and ZeRO-3 wrote export to the architecture's own format, which transformers loads with the same
logits and which imports back bit-identically.

# B batch, T tokens
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hf_moe_models import V, hf_model
from moep_ds.interop.sources import source_recipe

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from ranks import run_ranks  # noqa: E402
from tiny import DS_CONFIGS, metrics, probe  # noqa: E402

pytestmark = pytest.mark.slow
T = 16


def training_recipe(src: Path, out: Path, **train) -> dict:
    raw = source_recipe(str(src))
    raw["model"]["init_from"] = str(src)
    raw["data"] = {"source": "builtin", "tokenizer": {"kind": "bpe", "vocab_size": V}, "seq_len": T}
    raw["train"] = {"output_dir": str(out), "max_steps": 5, "log_every": 1, "micro_batch_size": 2,
                    "checkpoint": {"every_steps": None, "at_end": False},
                    "optimizer": {"lr": 1.0e-3, "weight_decay": 0.0}, "schedule": {"warmup_steps": 1}, **train}
    return raw


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_training")
    at_end = {"checkpoint": {"every_steps": None, "at_end": True}}
    runs = {"olmoe/ep1": ("zero2_fp32", {}), "olmoe/ep2": ("zero2_fp32", {"expert_parallel_size": 2, **at_end}),
            "deepseek_v3/ep1": ("zero2_fp32", {}), "deepseek_v3/ep2": ("zero2_fp32", {"expert_parallel_size": 2}),
            "deepseek_v3/zero3": ("zero3_fp32", at_end)}
    for case in ("olmoe", "deepseek_v3"):
        hf_model(case).save_pretrained(tmp / case / "hf")
    jobs = []
    for name, (ds, train) in runs.items():
        case = name.split("/")[0]
        recipe = tmp / f"{name}.yaml"
        recipe.write_text(yaml.safe_dump(training_recipe(tmp / case / "hf", tmp / name, **train)))
        jobs.append({"recipe": str(recipe), "ds_config": str(DS_CONFIGS / f"{ds}.json"),
                     "probe": str(tmp / f"{name}.probe")})
    run_ranks(2, probe, jobs, timeout=900)
    return tmp, runs


def curve(run: Path, key: str) -> dict[int, float]:
    return {m["step"]: m[key] for m in metrics(run) if key in m}


@pytest.mark.parametrize("case", ["olmoe", "deepseek_v3"])
def test_first_loss_is_transformers_loss_on_the_same_batch(trained, case):
    tmp, _ = trained
    windows = [torch.tensor(json.loads((tmp / f"{case}/ep1.probe.rank{r}").read_text())["windows"][0])
               for r in range(2)]  # each rank's first micro-batch: [2, T + 1] (inputs, then the last label)
    model = hf_model(case)
    with torch.no_grad():
        per_rank = [torch.nn.functional.cross_entropy(model(w[:, :-1]).logits.flatten(0, 1), w[:, 1:].flatten())
                    for w in windows]
    assert all(w.shape == (2, T + 1) for w in windows)
    assert curve(tmp / f"{case}/ep1", "ce_loss")[1] == pytest.approx(float(sum(per_rank) / 2), abs=1e-5)


@pytest.mark.parametrize("name", ["olmoe/ep2", "deepseek_v3/ep2", "deepseek_v3/zero3"])
def test_expert_parallelism_and_zero3_train_as_one_rank_does(trained, name):
    tmp, _ = trained
    ours, reference = curve(tmp / name, "loss"), curve(tmp / f"{name.split('/')[0]}/ep1", "loss")
    assert sorted(ours) == sorted(reference) == [1, 2, 3, 4, 5]
    for step in reference:
        assert ours[step] == pytest.approx(reference[step], abs=1e-4), (step, ours, reference)


@pytest.mark.parametrize("name", ["olmoe/ep2", "deepseek_v3/zero3"])
def test_a_checkpoint_of_expert_parallelism_or_zero3_exports_natively_and_imports_back(trained, name):
    """The sharded checkpoint of 2 ranks (expert-parallel size 2, or ZeRO-3) -> `moep-export --hf --native` (one
    process) -> transformers without remote code: the logits of the checkpoint's model; its import: the same weights,
    bit for bit (DeepSeek's selection bias back as the loss-free balancing bias)."""
    from moep_ds.checkpointing.model_dir import load_model_dir, load_recipe, stored_weights
    from moep_ds.cli.export import main as export_main
    from moep_ds.cli.import_model import main as import_main

    tmp, _ = trained
    run, out, back = tmp / name, tmp / f"{name}.hf", tmp / f"{name}.back"
    assert export_main([str(run), "--out", str(out), "--hf", "--native"]) == 0
    assert "auto_map" not in json.loads((out / "config.json").read_text())
    ours = load_model_dir(run)[0].eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    x_BT = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x_BT).logits, ours(x_BT).logits, rtol=1e-5, atol=1e-5)
    assert import_main([str(out), "--out", str(back)]) == 0

    def weights(folder: Path) -> dict[str, torch.Tensor]:
        ckpt, cfg = load_recipe(folder)
        return {e.name: e.read() for e in stored_weights(ckpt, cfg)[0]}

    trained_weights, imported = weights(run), weights(back)
    assert trained_weights.keys() == imported.keys()
    for key, value in trained_weights.items():
        assert torch.equal(value, imported[key]), key

