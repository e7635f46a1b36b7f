"""Strict config loading: overrides, repeat/groups, flavours, and one-line errors for bad recipes."""
import copy
import json
import os
import subprocess
import sys

import pytest
import yaml

from moep_ds.cli.pretrain import main as pretrain_main
from moep_ds.distributed.commands import run_guarded
from moep_ds.config import config_from_dict, load_config
from moep_ds import schema
from moep_ds.errors import UserError
from moep_ds.recipe_yaml import read_yaml
from moep_ds.schema import ConfigError

from repo_paths import CONFIGS, REPO

BASE = {
    "model": {
        "flavour": "llama",
        "vocab_size": 64,
        "d_model": 32,
        "max_seq_len": 16,
        "layers": [{"type": "dense", "repeat": 2, "attention": {"num_heads": 4, "window": 8}}],
    },
    "train": {"max_steps": 3},
}


def with_change(path: str, value):
    raw = copy.deepcopy(BASE)
    node = raw
    keys = path.split("/")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = keys[-1]
    if value is DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return raw


DELETE = object()

BAD = [
    ("unknown key with suggestion", with_change("model/layers/0/attention/num_haeds", 4),
     "model.layers[0].attention.num_haeds: unknown key; did you mean 'num_heads'?"),
    ("unknown top-level key", with_change("trian", {}), "trian: unknown key; did you mean 'train'?"),
    ("wrong type", with_change("model/d_model", "big"), "model.d_model ('big') must be an integer"),
    ("bool is not int", with_change("model/vocab_size", True), "model.vocab_size (True) must be an integer"),
    ("zero dim", with_change("model/d_model", 0), "model.d_model (0) must be > 0"),
    ("negative dim", with_change("model/layers/0/ffn", {"hidden_size": -8}),
     "model.layers[0].ffn.hidden_size (-8) must be > 0"),
    ("heads not dividing d_model", with_change("model/layers/0/attention/num_heads", 5),
     "model.layers[0].attention.num_heads (5) must divide d_model (32)"),
    ("kv heads not dividing heads", with_change("model/layers/0/attention/num_kv_heads", 3),
     "model.layers[0].attention.num_kv_heads (3) must divide num_heads (4)"),
    ("unknown block", with_change("model/layers/0/type", "densee"),
     "model.layers[0].type: unknown block 'densee'; known: "),
    ("unknown norm", with_change("model/layers/0/norm", "batchnorm"),
     "model.layers[0].norm.type: unknown norm 'batchnorm'; known: gemma_rmsnorm, layernorm, rmsnorm"),
    ("unknown ffn", with_change("model/layers/0/ffn", {"type": "relu2"}),
     "model.layers[0].ffn.type: unknown ffn 'relu2'; known: clamped_swiglu, geglu, gelu, gelu_tanh, swiglu"),
    ("window zero", with_change("model/layers/0/attention/window", 0),
     "model.layers[0].attention.window (0) must be > 0"),
    ("empty layer list", with_change("model/layers", []), "model.layers ([]) must not be empty"),
    ("repeat zero", with_change("model/layers/0/repeat", 0), "model.layers[0].repeat (0) must be > 0"),
    ("rotary fraction zero", with_change("model/layers/0/attention/rope", {"fraction": 0.0}),
     "model.layers[0].attention.rope.fraction (0.0) must be in (0.0, 1.0]"),
    ("rotary fraction above one", with_change("model/layers/0/attention/rope", {"fraction": 1.5}),
     "model.layers[0].attention.rope.fraction (1.5) must be in (0.0, 1.0]"),
    ("vocab zero", with_change("model/vocab_size", 0), "model.vocab_size (0) must be > 0"),
    ("vocab negative", with_change("model/vocab_size", -5), "model.vocab_size (-5) must be > 0"),
    ("missing required", with_change("model/d_model", DELETE), "model.d_model: required key is missing"),
    ("unknown flavour", with_change("model/flavour", "mistral"),
     "model.flavour: unknown flavour 'mistral'; known: gemma, gpt2, llama, pythia"),
    ("bad literal", with_change("model/position_embedding", "sinusoidal"),
     "model.position_embedding ('sinusoidal') must be one of none, learned"),
    ("seq_len beyond context", with_change("data", {"seq_len": 32}),
     "data.seq_len (32) must be <= model.max_seq_len (16)"),
    ("group with empty layers", with_change("model/layers/0", {"type": "group", "layers": []}),
     "model.layers[0].layers ([]) must not be empty"),
    ("beta of one", with_change("train/optimizer", {"betas": [0.9, 1.0]}),
     "train.optimizer.betas[1] (1.0) must be in [0.0, 1.0)"),
    ("quoted number", with_change("train/optimizer", {"lr": "1e-3"}), "train.optimizer.lr ('1e-3') must be a number"),
]


@pytest.mark.parametrize("name,raw,message", BAD, ids=[b[0] for b in BAD])
def test_bad_config_is_rejected_with_dotted_path(name, raw, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name,raw,message", BAD[:14], ids=[b[0] for b in BAD[:14]])
def test_pretrain_exits_nonzero_with_one_line(name, raw, message, tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert pretrain_main(["--config", str(path), "--dry_run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"error: {captured.err[7:]}" and captured.err.count("\n") == 1
    assert message in captured.err


def test_non_yaml_files_are_rejected(tmp_path, capsys):
    text = tmp_path / "recipe.txt"
    text.write_text("model: {}\n")
    assert pretrain_main(["--config", str(text), "--dry_run"]) == 2
    assert "is not a YAML file" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_bytes(b"model: [unclosed\n\x00\xff")
    assert pretrain_main(["--config", str(broken), "--dry_run"]) == 2
    assert "is not valid YAML" in capsys.readouterr().err
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    assert pretrain_main(["--config", str(scalar), "--dry_run"]) == 2
    assert "must hold a mapping of sections, got str" in capsys.readouterr().err
    assert pretrain_main(["--config", str(tmp_path / "missing.yaml"), "--dry_run"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert pretrain_main(["--config", str(tmp_path), "--dry_run"]) == 2  # a folder exists: it is not "missing"
    assert capsys.readouterr().err == f"error: config file '{tmp_path}' is a folder, not a YAML file\n"


@pytest.mark.parametrize("text,where", [
    ("model:\n  d_model: 32\n  layers: [{type: dense}\ntrain: {max_steps: 3}\n",
     "line 4, column 1: expected ',' or ']', but got '<scalar>' (while parsing a flow sequence at line 3, column 11)"),
    ("model:\n  d_model: 32\n  d_model: : 3\n", "line 3, column 12: mapping values are not allowed here"),
])
def test_malformed_yaml_names_line_and_column(text, where, tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    assert pretrain_main(["--config", str(path), "--dry_run"]) == 2
    assert capsys.readouterr().err == f"error: config file '{path}' is not valid YAML: {where}\n"


def test_under_a_launcher_config_errors_are_printed_by_rank_0_only(tmp_path, capsys, monkeypatch):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(with_change("model/d_model", -1)))
    for env, printed in [({"RANK": "1"}, False), ({"SLURM_PROCID": "3"}, False), ({"RANK": "0"}, True), ({}, True)]:
        for name in ("RANK", "SLURM_PROCID"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert pretrain_main(["--config", str(path), "--dry_run"]) == 2
        err = capsys.readouterr().err
        assert (err.startswith("error: model.d_model (-1)") and err.count("\n") == 1) if printed else err == "", env

    def missing_file():  # other bad input may differ between ranks: every rank says it, with its rank
        raise UserError("checkpoint '/x' does not exist")

    monkeypatch.setenv("RANK", "1")
    assert run_guarded(missing_file) == 2
    assert capsys.readouterr().err == "[rank 1] error: checkpoint '/x' does not exist\n"


LEAVES_ALONE_AFTER_A_FAILURE = """
import torch.distributed as dist
from moep_ds.distributed.commands import run_guarded
from moep_ds.errors import UserError
from moep_ds.distributed.process_group import free_port

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
def fails():
    raise UserError("bad input")
print(run_guarded(fails), dist.is_initialized())
"""


def test_a_failure_in_a_process_group_of_one_leaves_the_group():
    """(Several ranks exit at once instead: tests/training/test_checkpoint_faults.py.)"""
    proc = subprocess.run([sys.executable, "-c", LEAVES_ALONE_AFTER_A_FAILURE], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and proc.stdout.split() == ["2", "False"], proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == "error: bad input"


def test_pretrain_script_bad_config_has_no_traceback(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(with_change("model/layers/0/attention/num_heads", 5)))
    proc = subprocess.run([sys.executable, str(REPO / "pretrain.py"), "--config", str(path), "--dry_run"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: model.layers[0].attention.num_heads (5) must divide d_model (32)"]
    assert "Traceback" not in proc.stderr


def test_overrides_types_and_indices(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(BASE))
    cfg = load_config(path, ["train.optimizer.lr=1e-3", "model.layers[0].repeat=3",
                             "model.layers.0.attention.window=null", "train.optimizer.betas=[0.8, 0.9]"])
    assert cfg.train.optimizer.lr == 1e-3 and isinstance(cfg.train.optimizer.lr, float)
    assert len(cfg.model.expanded_layers()) == 3
    assert cfg.model.layers[0].attention.window is None
    assert cfg.train.optimizer.betas == [0.8, 0.9]
    with pytest.raises(ConfigError, match=r"index 4 is out of range"):
        load_config(path, ["model.layers[4].repeat=1"])
    with pytest.raises(ConfigError, match=r"must look like key.path=value"):
        load_config(path, ["model.d_model"])
    with pytest.raises(ConfigError, match=r"train.optimizer.lrr: unknown key; did you mean 'lr'\?"):
        load_config(path, ["train.optimizer.lrr=1"])


BAD_OVERRIDES = [
    ("model.layers[x].repeat=2",
     "override key 'model.layers[x].repeat': [x] is not a list index like [0] (e.g. model.layers[0].repeat)"),
    ("model.layers[-1].repeat=2",
     "override key 'model.layers[-1].repeat': [-1] is not a list index like [0] (e.g. model.layers[0].repeat)"),
    ("model..d_model=2", "override key 'model..d_model': it is not a dotted path (e.g. model.layers[0].repeat)"),
    ("model.layers.repeat=2",
     "override 'model.layers.repeat': model.layers is a list; pick an item, e.g. model.layers[0].repeat"),
    ("model.d_model[0]=2", "override 'model.d_model[0]': model.d_model is not a list, so [0] cannot index it"),
    ("model.layers[0].repeat.x=2", None),  # a scalar replaced by a mapping: the schema names it (below)
    ("model.layers[4].repeat=2",
     "override 'model.layers[4].repeat': index 4 is out of range (model.layers has 1 item(s))"),
    ("model.layers[1].repeat=2",
     "override 'model.layers[1].repeat': index 1 is out of range (model.layers has 1 item(s))"),
    ("model.d_model=[64", "override 'model.d_model=[64': the value is not valid YAML: line 1, column 4: expected "
                          "',' or ']', but got '<stream end>' (while parsing a flow sequence at line 1, column 1)"),
]


@pytest.mark.parametrize("override,message", BAD_OVERRIDES, ids=[b[0] for b in BAD_OVERRIDES])
def test_bad_override_paths_are_one_line(override, message, tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert pretrain_main(["--config", str(path), "--dry_run", "--set", override]) == 2
    captured = capsys.readouterr()
    message = message or "model.layers[0].repeat ({'x': 2}) must be an integer"
    assert captured.out == "" and captured.err == f"error: {message}\n"
    assert os.listdir(tmp_path) == ["recipe.yaml"]


def test_a_key_given_twice_names_its_dotted_path_and_both_lines(tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text("model:\n  d_model: 64\n  vocab_size: 64\n  d_model: 128\n"
                    "  layers:\n    - {type: dense, attention: {num_heads: 4, num_heads: 2}}\n")
    assert pretrain_main(["--config", str(path), "--dry_run"]) == 2
    assert capsys.readouterr().err == (f"error: config file '{path}' is not valid YAML: line 4, column 3: "
                                       "duplicate key model.d_model (first given at line 2, column 3)\n")
    path.write_text(path.read_text().replace("  d_model: 128\n", ""))
    assert pretrain_main(["--config", str(path), "--dry_run"]) == 2
    assert capsys.readouterr().err == (f"error: config file '{path}' is not valid YAML: line 5, column 47: duplicate "
                                       "key model.layers[0].attention.num_heads (first given at line 5, column 33)\n")


def test_anchors_and_merge_keys_are_not_duplicates(tmp_path):
    """`<<: *base` then a key of its own overrides the merged one, as YAML means; an alias is checked once."""
    path = tmp_path / "recipe.yaml"
    path.write_text("model:\n  vocab_size: 64\n  d_model: 32\n  max_seq_len: 16\n"
                    "  layers:\n    - &dense {type: dense, attention: {num_heads: 4}}\n    - *dense\n"
                    "    - {<<: *dense, attention: {num_heads: 2}}\n")
    heads = [layer.attention.num_heads for layer in load_config(path).model.expanded_layers()]
    assert heads == [4, 4, 2]


def test_flavours_fill_defaults_and_recipe_wins():
    raw = copy.deepcopy(BASE)
    raw["model"]["flavour"] = "pythia"
    raw["model"]["layers"][0]["norm"] = "rmsnorm"
    cfg = config_from_dict(raw)
    layer = cfg.model.layers[0]
    assert layer.parallel_residual and layer.attention.bias and layer.ffn.type == "gelu_tanh"  # bias-gelu-fusion
    assert layer.attention.rope.fraction == 0.25
    assert layer.norm.type == "rmsnorm"  # the recipe's choice wins over the flavour's layernorm
    assert cfg.model.tie_embeddings is False and cfg.model.final_norm.type == "layernorm"
    gpt2 = config_from_dict(with_change("model/flavour", "gpt2"))
    assert gpt2.model.position_embedding == "learned" and gpt2.model.layers[0].attention.rope is None


def test_groups_make_mixed_stacks_data():
    raw = copy.deepcopy(BASE)
    dense = {"type": "dense", "attention": {"num_heads": 4}}
    raw["model"]["layers"] = [
        {"type": "group", "repeat": 3, "layers": [dense, {**dense, "attention": {"num_heads": 2}}]},
        {**dense, "repeat": 2},
    ]
    heads = [layer.attention.num_heads for layer in config_from_dict(raw).model.expanded_layers()]
    assert heads == [4, 2, 4, 2, 4, 2, 4, 4]


def test_yaml_exponent_floats():
    cfg = config_from_dict(BASE, ["train.optimizer.eps=1e-6"])
    assert cfg.train.optimizer.eps == 1e-6


@pytest.mark.parametrize("recipe", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_recipe_loads(recipe):
    load_config(CONFIGS / recipe)


def floats_parsed(raw: dict, monkeypatch) -> list[str]:
    """The dotted path of every float the schema parses in the recipe `raw`."""
    paths: list[str] = []
    real = schema.parse_scalar

    def spy(tp, value, path):
        if tp is float:
            paths.append(path)
        return real(tp, value, path)

    with monkeypatch.context() as patch:
        patch.setattr(schema, "parse_scalar", spy)
        config_from_dict(copy.deepcopy(raw))
    return list(dict.fromkeys(paths))


@pytest.mark.parametrize("recipe", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_float_setting_refuses_inf_and_nan(recipe, monkeypatch):
    """YAML reads .inf, -.inf and .nan as floats, and range checks let some through (an lr of .inf is > 0: it trained
    on at `loss nan lr inf`): the schema refuses them for every float of every recipe, naming the path."""
    raw = json.loads(json.dumps(read_yaml(CONFIGS / recipe)))  # no anchored nodes: an override changes one place
    paths = floats_parsed(raw, monkeypatch)
    assert paths
    for path in paths:
        for text, shown in ((".inf", "inf"), ("-.inf", "-inf"), (".nan", "nan")):
            with pytest.raises(ConfigError) as info:
                config_from_dict(copy.deepcopy(raw), [f"{path}={text}"])
            assert str(info.value) == f"{path} ({shown}) must be a finite number"


@pytest.mark.parametrize("value,shown", [(".inf", "inf"), ("-.inf", "-inf"), (".nan", "nan")])
def test_pretrain_refuses_a_non_finite_lr_in_one_line_also_with_dry_run(value, shown, tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(BASE))
    run = f"train.output_dir={tmp_path / 'run'}"
    for argv in (["--dry_run"], ["--ds_config", str(tmp_path / "absent.json")]):  # refused before either is read
        assert pretrain_main(["--config", str(path), *argv, "--set", f"train.optimizer.lr={value}", run]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err == f"error: train.optimizer.lr ({shown}) must be a finite number\n"
    assert os.listdir(tmp_path) == ["recipe.yaml"]


@pytest.mark.parametrize("recipe,sets,message", [
    ("gpt2_small", [], r"^train.expert_parallel_size \(2\) must be 1: the model has no routed experts to shard$"),
    ("quickstart", ["model.layers[0].experts.windows=[8, 4, 2]"],
     r"^model.layers\[0\].experts.windows \(\[8, 4, 2\]\) must have a length divisible by expert_parallel_size \(2\)"),
    ("moep_gpt2", ["model.layers[0].num_paths=3", "model.layers[0].path_router.k=1"],
     r"^model.layers\[0\].num_paths \(3\) must be divisible by expert_parallel_size \(2\)$"),
])
def test_expert_parallel_layout_is_checked_when_the_config_is_read(recipe, sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIGS / f"{recipe}.yaml", overrides=[*sets, "train.expert_parallel_size=2"])
    load_config(CONFIGS / f"{recipe}.yaml", overrides=sets)  # fine at expert_parallel_size 1


def test_an_override_of_an_aliased_block_changes_that_block_only():
    """configs/deepseek_v3_tiny.yaml writes its attention once (&mla) and names it in each block (*mla): an override
    of one block's copy leaves the other's as written."""
    cfg = load_config(CONFIGS / "deepseek_v3_tiny.yaml", ["model.layers[0].attention.num_heads=2"])
    first, second = cfg.model.layers[0].attention, cfg.model.layers[1].attention
    assert (first.num_heads, second.num_heads) == (2, 4)
