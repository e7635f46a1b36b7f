"""Model directories: save/load round trip, run-directory resolution, routing eval modes, one-line errors."""
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from moep_ds.errors import UserError
from moep_ds.checkpointing.model_dir import (
    COMPLETE_MARKER, load_model_dir, resolve_model_dir, routing_eval_modes, save_model_dir, summarize_routing_modes,
)

from eval_models import tiny_model


@pytest.mark.parametrize("name", ["dense_llama_window", "dense_pythia", "msit"])
def test_round_trip_keeps_logits_and_buffers(name, tmp_path):
    model, cfg = tiny_model(name)
    out = save_model_dir(model, cfg, tmp_path / "m", meta={"step": 3, "tokens": 300})
    keys = set(load_file(str(out / "model.safetensors")))
    assert keys == set(model.state_dict()) - ({"head.weight"} if cfg.model.tie_embeddings else set())
    again, cfg2, tokenizer, meta = load_model_dir(out)
    assert tokenizer is None and meta == {"step": 3, "tokens": 300, "model_dir": str(out)}
    assert cfg2.model == cfg.model and not again.training
    if cfg.model.tie_embeddings:
        assert again.head.weight is again.embed.weight
    for key, value in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[key], value, rtol=0, atol=0)
    x = torch.randint(0, cfg.model.vocab_size, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, model(x).logits, rtol=0, atol=0)


def test_saving_into_an_existing_checkpoint_keeps_its_other_files(tmp_path):
    model, cfg = tiny_model("dense_gpt2")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "optimizer_shard.pt").write_text("shard")
    save_model_dir(model, cfg, ckpt, meta={"step": 1})
    assert (ckpt / "optimizer_shard.pt").read_text() == "shard"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left behind
    assert json.loads((ckpt / "meta.json").read_text()) == {"step": 1}


def test_overrides_apply_to_the_stored_recipe(tmp_path):
    model, cfg = tiny_model("ffn_moe_nova")
    out = save_model_dir(model, cfg, tmp_path / "m")
    assert routing_eval_modes(load_model_dir(out)[0]) == {"blocks.1.moe.router": "threshold"}
    again = load_model_dir(out, ["model.layers[1].moe.router.eval_mode=topk"])[0]
    assert routing_eval_modes(again) == {"blocks.1.moe.router": "topk"}
    assert summarize_routing_modes({"a": "topk", "b": "threshold"}) == "mixed"
    assert summarize_routing_modes({}) == "none"
    assert summarize_routing_modes(routing_eval_modes(tiny_model("msit")[0])) == "threshold"


def test_run_directory_resolves_to_newest_complete_checkpoint(tmp_path):
    model, cfg = tiny_model("dense_gpt2")
    run = tmp_path / "run"
    for tag, step, complete in [("step_100", 100, True), ("step_300", 300, True), ("step_20", 20, True),
                                ("step_400", 400, False)]:
        save_model_dir(model, cfg, run / "checkpoints" / tag, meta={"step": step})
        if complete:
            (run / "checkpoints" / tag / COMPLETE_MARKER).touch()
    assert resolve_model_dir(run) == run / "checkpoints" / "step_300"
    assert resolve_model_dir(run / "checkpoints") == run / "checkpoints" / "step_300"
    assert load_model_dir(run)[3]["step"] == 300


def test_errors_name_the_path(tmp_path):
    with pytest.raises(UserError, match=rf"^checkpoint '{tmp_path}/missing' does not exist$"):
        load_model_dir(tmp_path / "missing")
    (tmp_path / "empty_run" / "checkpoints" / "step_1").mkdir(parents=True)
    with pytest.raises(UserError, match=r"is neither a model directory \(no model.safetensors\) nor a run directory"):
        load_model_dir(tmp_path / "empty_run")
    model, cfg = tiny_model("dense_gpt2")
    out = save_model_dir(model, cfg, tmp_path / "m")
    recipe = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(recipe.replace("repeat: 2", "repeat: 3"))
    with pytest.raises(UserError, match=r"does not match the model built from its config.yaml: missing \['blocks.2"):
        load_model_dir(out)
    (out / "config.yaml").write_text(recipe.replace("vocab_size: 61", "vocab_size: 62"))
    with pytest.raises(UserError, match=r"config.yaml: size mismatch for embed.weight"):
        load_model_dir(out)


def test_hf_export_directory_loads_back_into_moep_ds(tmp_path):
    from moep_ds.evaluation.export import export_hf

    model, cfg = tiny_model("msit")
    out = export_hf(model, cfg, tmp_path / "hf", meta={"step": 9})
    again, cfg2, tokenizer, meta = load_model_dir(out, ["model.layers[0].router.eval_mode=topk"])
    assert meta["step"] == 9 and routing_eval_modes(again)["blocks.0.router"] == "topk"
    for key, value in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[key], value, rtol=0, atol=0)


def test_lifecycle_event_log_survives_the_round_trip(tmp_path):
    model, cfg = tiny_model("ssm_moe_lifecycle")
    lifecycle = model.blocks[0].moe.router.lifecycle
    lifecycle.events = [{"step": 4, "event": "replace", "expert": 2, "source": 0}]
    out = save_model_dir(model, cfg, tmp_path / "m")
    assert (out / "extra_state.pt").is_file()
    again = load_model_dir(out)[0]
    assert again.blocks[0].moe.router.lifecycle.events == lifecycle.events
    (out / "extra_state.pt").unlink()  # the log is history: the model still loads without it
    assert load_model_dir(out)[0].blocks[0].moe.router.lifecycle.events == []


@pytest.mark.parametrize("size, cause", [(100, "invalid header length"), (0, "header too small")])
def test_truncated_weights_are_named_as_a_damaged_model_directory(tmp_path, size, cause):
    model, cfg = tiny_model("dense_gpt2")
    out = save_model_dir(model, cfg, tmp_path / "m")
    os.truncate(out / "model.safetensors", size)
    with pytest.raises(UserError) as err:  # safetensors' own error names no file
        load_model_dir(out)
    assert str(err.value) == (f"model directory '{out}' is damaged: '{out}/model.safetensors' could not be read: "
                              f"Error while deserializing header: {cause}")


@pytest.mark.parametrize("text, cause", [
    (b"{\n", "Expecting property name enclosed in double quotes: line 2 column 1 (char 2)"),
    (b"\xff{}", "'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"),
])
def test_hf_export_with_a_malformed_config_json_names_it(tmp_path, text, cause):
    """It used to read as a directory without any recipe: "has model.safetensors but no config.yaml"."""
    from moep_ds.evaluation.export import export_hf

    model, cfg = tiny_model("dense_gpt2")
    out = export_hf(model, cfg, tmp_path / "hf")
    (out / "config.json").write_bytes(text)
    with pytest.raises(UserError) as err:
        load_model_dir(out)
    assert str(err.value) == f"'{out}/config.json' is not valid JSON: {cause}"


@pytest.mark.parametrize("hf", [False, True])
def test_a_bf16_model_is_stored_in_fp32(tmp_path, hf):
    """A model directory (and a Hugging Face export) holds fp32 weights whatever precision the model ran in."""
    from moep_ds.evaluation.export import export_hf

    model, cfg = tiny_model("dense_gpt2")
    model = model.to(torch.bfloat16)
    out = export_hf(model, cfg, tmp_path / "hf") if hf else save_model_dir(model, cfg, tmp_path / "m")
    stored = load_file(str(out / "model.safetensors"))
    prefix = "model." if hf else ""
    skipped = [key for key in model.state_dict() if prefix + key not in stored]
    assert skipped == ["head.weight"] and model.head.weight is model.embed.weight  # the tied head, stored once
    for key, value in model.state_dict().items():
        if key in skipped:
            continue
        got = stored[prefix + key]
        assert got.dtype == (torch.float32 if value.is_floating_point() else value.dtype), key
        torch.testing.assert_close(got, value.float() if value.is_floating_point() else value, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(7,), (5, 6), (3, 4, 5)])
def test_read_flat_range_matches_slicing_the_flattened_tensor(tmp_path, shape):
    """Each [offset, offset + numel) range of a stored tensor (a ZeRO-3 partition, an expert shard) reads as the
    flattened tensor's elements, whatever rows it starts and ends in."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from moep_ds.checkpointing.model_dir import read_flat_range

    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    save_file({"w": t}, str(tmp_path / "w.safetensors"))
    flat = t.reshape(-1)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        for offset in range(flat.numel()):
            for numel in range(1, flat.numel() - offset + 1):
                assert torch.equal(read_flat_range(f, "w", offset, numel), flat[offset:offset + numel]), (offset, numel)
