"""Model directories (sharded checkpoints with their recipe): save/load round trip, run-directory resolution, routing
eval modes, one-line errors."""
import pathlib
import sys

import pytest
import torch
from safetensors.torch import load_file

from moep_ds.checkpointing import sharded
from moep_ds.errors import UserError
from moep_ds.checkpointing.model_dir import (
    COMPLETE_MARKER, load_model_dir, resolve_model_dir, save_model_dir,
)
from moep_ds.models.eval_modes import routing_eval_modes, summarize_routing_modes

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "evaluation"))
from eval_models import export_hf, tiny_model, truncated_model_dir  # noqa: E402


@pytest.mark.parametrize("name", ["dense_llama_window", "dense_pythia", "msit"])
def test_round_trip_keeps_logits_and_buffers(name, tmp_path):
    model, cfg = tiny_model(name)
    out = save_model_dir(model, cfg, tmp_path / "m", meta={"step": 3, "tokens": 300})
    tensors = {k for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert set(sharded.model_tensors(out)) == tensors  # a tied head as an alias
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
    with pytest.raises(UserError, match=r"is neither a model directory \(no .metadata\) nor a run directory"):
        load_model_dir(tmp_path / "empty_run")
    model, cfg = tiny_model("dense_gpt2")
    out = save_model_dir(model, cfg, tmp_path / "m")
    recipe = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(recipe.replace("repeat: 2", "repeat: 3"))
    with pytest.raises(UserError, match=rf"^checkpoint '{out}' has no tensor 'blocks.2.*' \(shape \[.*\]\) of this model$"):
        load_model_dir(out)
    (out / "config.yaml").write_text(recipe.replace("vocab_size: 61", "vocab_size: 62"))
    with pytest.raises(UserError, match=rf"^checkpoint '{out}': tensor 'embed.weight' has shape \[61, 32\] there but "
                                        r"\[62, 32\] in this model$"):
        load_model_dir(out)


def test_lifecycle_event_log_survives_the_round_trip(tmp_path):
    model, cfg = tiny_model("ssm_moe_lifecycle")
    lifecycle = model.blocks[0].moe.router.lifecycle
    lifecycle.events = [{"step": 4, "event": "replace", "expert": 2, "source": 0}]
    out = save_model_dir(model, cfg, tmp_path / "m")
    assert (out / "extra_state.json").is_file()
    again = load_model_dir(out)[0]
    assert again.blocks[0].moe.router.lifecycle.events == lifecycle.events
    (out / "extra_state.json").unlink()  # the log is history: the model still loads without it
    assert load_model_dir(out)[0].blocks[0].moe.router.lifecycle.events == []


def test_truncated_weights_are_named_as_a_damaged_checkpoint(tmp_path):
    out, message = truncated_model_dir(tmp_path)
    with pytest.raises(UserError) as err:
        load_model_dir(out)
    assert str(err.value) == message


def test_a_bf16_model_is_exported_in_fp32(tmp_path):
    """A Hugging Face export holds fp32 weights whatever precision the model ran in."""
    model, cfg = tiny_model("dense_gpt2")
    model = model.to(torch.bfloat16)
    out = export_hf(model, cfg, tmp_path / "hf")
    stored = load_file(str(out / "model.safetensors"))
    prefix = "model."
    skipped = [key for key in model.state_dict() if prefix + key not in stored]
    assert skipped == ["head.weight"] and model.head.weight is model.embed.weight  # the tied head, stored once
    for key, value in model.state_dict().items():
        if key in skipped:
            continue
        got = stored[prefix + key]
        assert got.dtype == (torch.float32 if value.is_floating_point() else value.dtype), key
        torch.testing.assert_close(got, value.float() if value.is_floating_point() else value, rtol=0, atol=0)
