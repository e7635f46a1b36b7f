"""moep-import of Hugging Face checkpoints: logits equal transformers' own model of the saved weights, import ->
native export -> import is bit-identical, hf:REPO@REVISION resolves from a hub cache laid out as huggingface_hub
lays it, and bad input fails in one line.

# B batch, T tokens, V vocabulary
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hf_models import CASES, V, hf_model, recipe, save, tokens
from repo_paths import REPO
from moep_ds.checkpointing import layout, sharded
from moep_ds.checkpointing.model_dir import load_model_dir
from moep_ds.config import config_from_dict
from moep_ds.errors import UserError
from moep_ds.cli.export import main as export_main
from moep_ds.interop.importer import import_checkpoint
from moep_ds.training.branch import start_step

transformers = pytest.importorskip("transformers")

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # float32


def imported_logits(run_dir: Path) -> torch.Tensor:
    model, _, _, meta = load_model_dir(run_dir)
    assert meta["step"] == 0
    with torch.no_grad():
        return model(tokens()).logits


@pytest.mark.parametrize("fmt", ["safetensors", "bin", "sharded"])
@pytest.mark.parametrize("case", CASES)
def test_imported_logits_equal_transformers(tmp_path, case, fmt):
    reference = hf_model(case)
    src = save(reference, tmp_path / "hf", fmt)
    run = import_checkpoint(str(src), config_from_dict(recipe(case)), tmp_path / "run")
    assert layout.is_complete(run) and sharded.is_sharded(run)  # the trainer's format: a step_<N> checkpoint
    with torch.no_grad():
        expected_BTV = reference(tokens()).logits
    ours_BTV = imported_logits(tmp_path / "run")
    assert ours_BTV.shape == (2, 16, V) and float(ours_BTV.std()) > 0.1
    torch.testing.assert_close(ours_BTV, expected_BTV, **TOLERANCE)


def test_an_imported_checkpoint_loads_with_torch_alone(tmp_path):
    """The import writes the trainer's format through the same writer: torch's DCP fills a freshly built model's own
    state_dict() from it (the tied head resolved), equal to what moep_ds loads."""
    import torch.distributed.checkpoint as dcp

    from moep_ds import build_model

    case = "gpt2"  # tied embeddings: the head is an alias of the stored embedding
    src = save(hf_model(case), tmp_path / "hf", "safetensors")
    cfg = config_from_dict(recipe(case))
    ckpt = import_checkpoint(str(src), cfg, tmp_path / "run")
    model = build_model(cfg.model)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(ckpt))
    ours, _, _, _ = load_model_dir(tmp_path / "run")
    for name, tensor in ours.state_dict().items():
        assert torch.equal(sd[name], tensor), name


def stored(run: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a checkpoint, read through the export's streaming reader."""
    from moep_ds.checkpointing.model_dir import load_recipe, stored_weights

    ckpt, cfg = load_recipe(run)
    entries, _ = stored_weights(ckpt, cfg)
    return {e.name: e.read() for e in entries}


@pytest.mark.parametrize("case", CASES)
def test_import_export_import_is_bit_identical(tmp_path, case):
    reference = hf_model(case)
    save(reference, tmp_path / "hf", "safetensors")
    cfg = config_from_dict(recipe(case))
    import_checkpoint(str(tmp_path / "hf"), cfg, tmp_path / "run1")
    assert export_main([str(tmp_path / "run1"), "--out", str(tmp_path / "hf2"), "--hf", "--native"]) == 0
    import_checkpoint(str(tmp_path / "hf2"), cfg, tmp_path / "run2")
    first, second = stored(tmp_path / "run1"), stored(tmp_path / "run2")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    # the native export is the architecture's own format: transformers loads it (no remote code), same tensors
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "hf2" / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens()).logits, reference(tokens()).logits, rtol=0, atol=0)


def test_pythias_release_layout_imports_into_the_pythia_flavour(tmp_path, caplog):
    """Pythia's files as released (transformers 4.24): config.json with rotary_pct / rotary_emb_base and
    hidden_act "gelu", pytorch_model.bin with the head as embed_out and the attention buffers (causal mask,
    masked_bias, rotary inv_freq). The pythia flavour's gelu_tanh, the formula Pythia trained with, is accepted
    with a warning; the weights are the same."""
    reference = hf_model("gpt_neox")
    src = save(reference, tmp_path / "hf", "bin")
    config = json.loads((src / "config.json").read_text())
    for key in ("rope_parameters", "attention_bias"):
        config.pop(key)
    config.update(hidden_act="gelu", rotary_pct=0.25, rotary_emb_base=10000, transformers_version="4.24.0")
    (src / "config.json").write_text(json.dumps(config))
    state = torch.load(src / "pytorch_model.bin", weights_only=True)
    state["embed_out.weight"] = state.pop("lm_head.weight")
    for i in range(2):
        state[f"gpt_neox.layers.{i}.attention.bias"] = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril()
        state[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
        state[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(2)
    torch.save(state, src / "pytorch_model.bin")
    import_checkpoint(str(src), config_from_dict(recipe("gpt_neox")), tmp_path / "run")
    assert "model.layers[*].ffn.type: 'gelu_tanh' in the recipe, 'gelu' in" in caplog.text
    # issue 40 item 11: the warning says what differs, by how much, and how to get transformers' numbers
    assert "each activation differs by up to 4.7e-4, the logits by about 1e-3" in caplog.text
    assert "--set model.layers[0].ffn.type=gelu" in caplog.text
    with torch.no_grad():  # the reference computes with gelu_new, as ours: the same weights give the same logits
        ours = imported_logits(tmp_path / "run")
        torch.testing.assert_close(ours, reference(tokens()).logits, **TOLERANCE)
        # transformers reading the released config.json computes the exact GELU: another 1e-3-order number ...
        released = transformers.AutoModelForCausalLM.from_pretrained(src).float().eval()(tokens()).logits
        assert 1e-5 < float((ours - released).abs().max()) < 1e-2
    # ... which the exact-GELU reading of the same weights gives (no warning then)
    caplog.clear()
    exact = config_from_dict(recipe("gpt_neox", layers=[{**recipe("gpt_neox")["model"]["layers"][0],
                                                         "ffn": {"type": "gelu", "bias": True}}]))
    import_checkpoint(str(src), exact, tmp_path / "exact")
    assert "gelu" not in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(imported_logits(tmp_path / "exact"), released, **TOLERANCE)


# ---- hf:REPO@REVISION from a cache laid out as huggingface_hub lays it -----------------------------------------


def hub_cache(tmp_path: Path, folder: Path, repo: str, revision: str) -> Path:
    """HF_HUB_CACHE/models--ORG--NAME/{refs/REVISION, snapshots/HASH/<files>}."""
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / revision).write_text(commit)
    return cache


def moep_import(args: list[str], cache: Path):
    """`moep-import ARGS` on a rank of its own (tests/ranks.py), where huggingface_hub is first imported and so
    reads HF_HUB_CACHE."""
    from ranks import joined, run_command

    return joined(run_command(1, "moep_ds.cli.import_model", *args, env={"HF_HUB_CACHE": str(cache),
                                                                         "HF_HUB_OFFLINE": "1"},
                              check=False, timeout=300))


@pytest.mark.slow
def test_hub_revision_resolves_offline_from_the_cache(tmp_path):
    reference = hf_model("gpt_neox")
    save(reference, tmp_path / "hf", "safetensors")
    cache = hub_cache(tmp_path, tmp_path / "hf", "EleutherAI/pythia-tiny", "step13000")
    (tmp_path / "recipe.yaml").write_text(json.dumps({**recipe("gpt_neox"), "train": {"global_batch_size": 8}}))
    done = moep_import(["hf:EleutherAI/pythia-tiny@step13000", "--out", str(tmp_path / "run"),
                        "--config", str(tmp_path / "recipe.yaml")], cache)
    assert done.returncode == 0, done.stderr
    ckpt = layout.newest_checkpoint(tmp_path / "run")
    assert ckpt.name == layout.checkpoint_tag(13000)  # the revision's step
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["step"] == 13000 and meta["hf_revision"] == "step13000" and meta["hf_commit"].startswith("0123")
    assert meta["tokens"] == 13000 * 8 * 16  # step x global batch x seq_len: its place on a token axis
    branch = config_from_dict({**recipe("gpt_neox", init_from=str(tmp_path / "run")), "train": {"max_steps": 20000}})
    assert start_step(branch)[0] == 13000  # a run from the imported directory continues at its step
    with torch.no_grad():
        torch.testing.assert_close(load_model_dir(tmp_path / "run")[0](tokens()).logits,
                                   reference(tokens()).logits, **TOLERANCE)
    # a revision the cache lacks: one line, nothing written
    missing = moep_import(["hf:EleutherAI/pythia-tiny@step14000", "--out", str(tmp_path / "run2"),
                           "--config", str(tmp_path / "recipe.yaml")], cache)
    assert missing.returncode == 2 and not (tmp_path / "run2").exists()
    line = missing.stderr.strip().splitlines()[-1]
    assert line.startswith("error: SRC ('hf:EleutherAI/pythia-tiny@step14000'): revision 'step14000'"), missing.stderr
    assert "not in the Hugging Face cache" in line
    assert "local_files_only" not in line  # huggingface_hub's advice to Python callers (issue 40 item 12)
    assert "`hf download EleutherAI/pythia-tiny --revision step14000`" in line


# ---- bad input: one line each ----------------------------------------------------------------------------------


def import_error(tmp_path: Path, case: str, raw: dict, src: Path | None = None) -> str:
    if src is None:
        src = save(hf_model(case), tmp_path / "hf", "safetensors")
    with pytest.raises(UserError) as err:
        import_checkpoint(str(src), config_from_dict(raw), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    return str(err.value)


def test_an_import_at_step_n_records_the_tokens_of_step_n(caplog, monkeypatch):
    """Issue 40 item 10: the imported parent's evaluation had no token count (eval/compare.py: "-", no equal-token
    Pythia row). Pythia-1B's step 13000: 13000 x 1024 x 2048 tokens, as a run of its recipe counts them."""
    import logging

    monkeypatch.setattr(logging.getLogger("moep_ds"), "propagate", True)  # a trainer in this process turns it off
    from moep_ds.config import load_config
    from moep_ds.interop.importer import imported_tokens

    pythia = load_config(REPO / "configs" / "pythia_1b_dense.yaml")
    assert imported_tokens(13000, pythia) == 27_262_976_000
    assert imported_tokens(0, pythia) == 0
    assert imported_tokens(13000, config_from_dict(recipe("gpt_neox"))) is None  # no global batch in the recipe
    assert "records no token count for step 13000" in caplog.text


def test_a_truncated_safetensors_file_is_one_line(tmp_path):
    """Issue 40 item 8: safetensors' SafetensorError ("incomplete metadata") was a traceback."""
    src = save(hf_model("gpt2"), tmp_path / "hf", "safetensors")
    weights = src / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)
    text = import_error(tmp_path, "gpt2", recipe("gpt2"), src)
    assert text.startswith(f"{str(weights)!r} cannot be read as safetensors (") and "\n" not in text
    assert text.endswith("): the file is truncated or damaged; download it again")
    weights.write_bytes(b"\xff" * 64)  # not a safetensors header at all
    assert "cannot be read as safetensors" in import_error(tmp_path, "gpt2", recipe("gpt2"), src)


def test_a_hugging_face_folder_without_config_json_names_it(tmp_path):
    """Issue 40 item 12: it was called a consolidated moep_ds checkpoint, for moep-convert (which then failed)."""
    src = save(hf_model("gpt2"), tmp_path / "hf", "safetensors")
    (src / "config.json").unlink()
    assert import_error(tmp_path, "gpt2", recipe("gpt2"), src) == (
        f"SRC ({str(src)!r}): {str(src)!r} holds model.safetensors but no config.json: a Hugging Face model folder "
        "needs the config.json published beside its weights (copy or download it there)")


def test_hub_errors_offline_say_what_a_command_line_user_can_do(tmp_path, monkeypatch):
    """Issue 40 item 12: huggingface_hub's "pass 'local_files_only=False'" is advice for its Python API."""
    from huggingface_hub import constants

    from moep_ds.interop.hub import resolve

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(UserError) as err:
        resolve("hf:EleutherAI/pythia-tiny@step1", "SRC")
    assert str(err.value) == (
        f"SRC ('hf:EleutherAI/pythia-tiny@step1'): revision 'step1' of EleutherAI/pythia-tiny is not in the Hugging "
        f"Face cache ({tmp_path / 'empty'}) and HF_HUB_OFFLINE=1 forbids downloading it: run `hf "
        "download EleutherAI/pythia-tiny --revision step1` where the hub can be reached (into this cache), or unset "
        "HF_HUB_OFFLINE")


def test_a_weights_index_naming_files_outside_its_folder_is_refused(tmp_path):
    """Issue 46 item 5: a model.safetensors.index.json whose weight_map named `../../x.safetensors` or an absolute
    path made the import read that file. The names are checked as written: links inside the folder stay readable
    (huggingface_hub's cache links snapshots/<rev>/<file> to ../../blobs/<sha>, test below)."""
    src = save(hf_model("gpt2"), tmp_path / "hf", "sharded")
    index = src / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    key, shard = next(iter(raw["weight_map"].items()))
    (tmp_path / "elsewhere").mkdir()
    outside = tmp_path / "elsewhere" / shard
    outside.write_bytes((src / shard).read_bytes())  # a readable shard: only the path gives it away
    for name in (f"../elsewhere/{shard}", str(outside), f"sub/../../elsewhere/{shard}"):
        index.write_text(json.dumps({**raw, "weight_map": {**raw["weight_map"], key: name}}))
        assert import_error(tmp_path, "gpt2", recipe("gpt2"), src) == (
            f"{str(index)!r} names shard {name!r} (holding {key!r}), a path outside {str(src)!r}: an index names "
            "files of its own folder")


def test_weights_linked_from_elsewhere_as_in_the_hub_cache_import(tmp_path):
    """huggingface_hub's cache: every file of snapshots/<rev>/ is a link to ../../blobs/<sha> (item 5 keeps it)."""
    reference = hf_model("gpt2")
    src = save(reference, tmp_path / "saved", "sharded")
    snapshot, blobs = tmp_path / "models--o--n" / "snapshots" / "abc", tmp_path / "models--o--n" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(src.iterdir())):
        (blobs / f"sha{i}").write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", f"sha{i}"))
    import_checkpoint(str(snapshot), config_from_dict(recipe("gpt2")), tmp_path / "run")
    with torch.no_grad():
        torch.testing.assert_close(imported_logits(tmp_path / "run"), reference(tokens()).logits, **TOLERANCE)


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    text = import_error(tmp_path, "gpt2", recipe("gpt_neox"))
    assert text.splitlines()[0].endswith("(GPT2LMHeadModel) does not match the recipe's model:")
    lines = text.splitlines()[1:]
    assert ("  model.layers[*].parallel_residual: True in the recipe, False in config.json (sequential residual)"
            in lines)
    assert "  model.position_embedding: 'none' in the recipe, 'learned' in config.json (learned positions)" in lines


def test_checkpoint_of_another_shape_is_refused(tmp_path):
    raw = recipe("llama_gqa")
    raw["model"]["layers"][0]["attention"]["num_kv_heads"] = 4
    raw["model"]["d_model"] = 128
    text = import_error(tmp_path, "llama_gqa", raw)
    assert text.splitlines()[1:] == [
        "  model.d_model: 128 in the recipe, 64 in config.json (hidden size)",
        "  model.layers[*].attention.num_kv_heads: 4 in the recipe, 2 in config.json (num_key_value_heads)",
        "  model.layers[*].attention.head_dim: 32 in the recipe, 16 in config.json (head_dim)",
    ]


def test_unknown_and_missing_tensors_are_errors(tmp_path):
    src = save(hf_model("gpt2"), tmp_path / "hf", "bin")
    state = torch.load(src / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "transformer.h.0.attn.extra.weight": torch.zeros(2)}, src / "pytorch_model.bin")
    text = import_error(tmp_path, "gpt2", recipe("gpt2"), src)
    assert text == (f"SRC ({str(src)!r}) has 1 tensor(s) that GPT2LMHeadModel of this recipe has no place for: "
                    "['transformer.h.0.attn.extra.weight']")
    state.pop("transformer.h.1.mlp.c_fc.bias")
    torch.save(state, src / "pytorch_model.bin")
    from moep_ds.interop import hf_weights

    hf_weights.load_bin.cache_clear()  # the same path, rewritten
    text = import_error(tmp_path, "gpt2", recipe("gpt2"), src)
    assert text == f"SRC ({str(src)!r}) lacks 1 tensor(s) of GPT2LMHeadModel: ['transformer.h.1.mlp.c_fc.bias']"


def write_tokenizer(folder: Path, size: int) -> None:
    from tokenizers import Tokenizer, models

    vocab = {"<|endoftext|>": 0, **{f"t{i}": i + 1 for i in range(size - 1)}}
    Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>")).save(str(folder / "tokenizer.json"))


def test_tokenizer_that_differs_from_the_recipes_is_refused(tmp_path):
    src = save(hf_model("gpt2"), tmp_path / "hf", "safetensors")
    write_tokenizer(src, 50)
    text = import_error(tmp_path, "gpt2", recipe("gpt2"), src)
    assert text == f"SRC ({str(src)!r}): its tokenizer has 50 ids, data.tokenizer.vocab_size is {V}"
    other = tmp_path / "other"
    other.mkdir()
    write_tokenizer(other, 60)
    raw = recipe("gpt2")
    raw["data"]["tokenizer"] = {"path": str(other)}
    text = import_error(tmp_path, "gpt2", raw, src)
    assert text == (f"SRC ({str(src)!r}): its tokenizer (50 ids) differs from data.tokenizer.path "
                    f"({str(other)!r}, 60 ids)")
    write_tokenizer(src, V)  # the recipe's size: imported, and the checkpoint carries the tokenizer
    import_checkpoint(str(src), config_from_dict(recipe("gpt2")), tmp_path / "run")
    assert load_model_dir(tmp_path / "run")[2].vocab_size == V


def test_malformed_init_from_is_a_config_error():
    from moep_ds.schema import ConfigError

    with pytest.raises(ConfigError, match=r"^model.init_from \('hf:a/b@'\) is not hf:ORG/NAME\[@REVISION\]"):
        config_from_dict(recipe("gpt2", init_from="hf:a/b@"))
    with pytest.raises(ConfigError, match=r"^model.upcycle \('set'\) needs model.init_from"):
        config_from_dict(recipe("gpt2", upcycle={}))


def test_an_imported_checkpoint_is_not_resumed_but_initialised_from(tmp_path):
    from moep_ds.checkpointing.sharded import CheckpointError
    from moep_ds.training.checkpoint import check_checkpoint

    save(hf_model("gpt2"), tmp_path / "hf", "safetensors")
    ckpt = import_checkpoint(str(tmp_path / "hf"), config_from_dict(recipe("gpt2")), tmp_path / "run")
    with pytest.raises(CheckpointError, match=r"holds a model only \(moep-import\), no training state to resume: "
                                              r"start a run from it with model.init_from$"):
        check_checkpoint(ckpt)


@pytest.mark.parametrize("case", CASES)
def test_import_without_a_recipe_writes_the_one_config_json_stands_for(tmp_path, case):
    """moep-import SRC without --config: the recipe is config.json's (the case's own recipe, setting by setting), and
    the logits are transformers'."""
    from moep_ds.checkpointing.model_dir import load_recipe
    from moep_ds.cli.import_model import main as import_main
    from moep_ds.interop.sources import check_same_model

    reference = hf_model(case)
    src = save(reference, tmp_path / "hf", "safetensors")
    assert import_main([str(src), "--out", str(tmp_path / "run")]) == 0
    _, cfg = load_recipe(tmp_path / "run")
    check_same_model(cfg.model, config_from_dict(recipe(case)).model, "the written recipe")
    with torch.no_grad():
        torch.testing.assert_close(imported_logits(tmp_path / "run"), reference(tokens()).logits, **TOLERANCE)
