"""moep-convert: consolidated checkpoints (a model directory, a training checkpoint with optimizer.pt, a Hugging Face
export) become sharded checkpoints once, bit for bit; the loaders refuse a consolidated directory in one line naming
the command; a failed conversion leaves nothing behind."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from moep_ds.checkpointing import sharded
from moep_ds.checkpointing.model_dir import load_model_dir, load_recipe
from moep_ds.cli import convert
from moep_ds.config import config_from_dict, dump_config
from moep_ds.models.causal_lm import build_model

RECIPE = {"model": {"flavour": "llama", "vocab_size": 64, "d_model": 16, "max_seq_len": 16, "tie_embeddings": True,
                    "layers": [{"type": "ffn_moe", "attention": {"num_heads": 2},
                                "moe": {"num_experts": 4, "expert": {"type": "swiglu", "hidden_size": 24},
                                        "router": {"type": "topk", "k": 2,
                                                   "lifecycle": {"min_tokens": 8, "check_interval": 1}}}}]}}
EVENTS = [{"step": 4, "event": "replace", "expert": 2, "source": 0}]


def source_model():
    cfg = config_from_dict(RECIPE)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.blocks[0].moe.router.lifecycle.events = list(EVENTS)
    return model, cfg


def write_consolidated(model, cfg, out, *, training=False, hf=False):
    """The consolidated layouts as their writers left them: model.safetensors (every state_dict() tensor in fp32, the
    tied head left out; keys model.<key> in a Hugging Face export), the non-tensor state in extra_state.pt, the
    recipe as config.yaml (or its model section in config.json), meta.json; a training checkpoint also
    optimizer.pt ({"moments": {name: {exp_avg, exp_avg_sq}}, "step"}), trainer_state.json, rng_rank0.pt, COMPLETE."""
    out.mkdir(parents=True)
    prefix = "model." if hf else ""
    state = model.state_dict()
    save_file({prefix + k: v.float() if v.is_floating_point() else v for k, v in state.items()
               if isinstance(v, torch.Tensor) and k != "head.weight"}, str(out / "model.safetensors"))
    torch.save({k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}, out / "extra_state.pt")
    if hf:
        (out / "config.json").write_text(json.dumps({"model_type": "moep", "moep_model": RECIPE["model"]}))
    else:
        (out / "config.yaml").write_text(dump_config(cfg))
    (out / "meta.json").write_text(json.dumps({"step": 4}))
    if not training:
        return out
    g = torch.Generator().manual_seed(1)
    moments = {n: {k: torch.randn(p.shape, generator=g) for k in ("exp_avg", "exp_avg_sq")}
               for n, p in model.named_parameters()}
    torch.save({"moments": moments, "step": 4}, out / "optimizer.pt")
    (out / "trainer_state.json").write_text(json.dumps({"step": 4, "global_samples": 32, "world_size": 2}))
    torch.save({"torch": torch.get_rng_state()}, out / "rng_rank0.pt")
    (out / "COMPLETE").touch()
    return out, moments


def assert_same_weights(a, b):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.mark.parametrize("hf", [False, True])
def test_a_converted_model_directory_loads_bit_for_bit(tmp_path, hf, capsys):
    model, cfg = source_model()
    src = write_consolidated(model, cfg, tmp_path / "src", hf=hf)
    with pytest.raises(Exception) as err:  # a loader names the command
        load_model_dir(src)
    assert str(err.value) == (f"{str(src)!r} is a consolidated checkpoint (model.safetensors), a format moep_ds no "
                              f"longer loads: run moep-convert {src} --out DST once and use DST")
    assert convert.main([str(src), "--out", str(tmp_path / "dst")]) == 0
    again, cfg2, _, meta = load_model_dir(tmp_path / "dst")
    assert cfg2.model == cfg.model and meta["step"] == 4 and meta["converted_from"] == str(src.resolve())
    assert_same_weights(model, again)
    assert again.head.weight is again.embed.weight
    assert again.blocks[0].moe.router.lifecycle.events == EVENTS
    # readable with torch alone (README): the tied head is an alias of the embedding's chunks
    assert "head.weight" in sharded.read_metadata(tmp_path / "dst")


def test_a_converted_training_checkpoint_keeps_the_optimizer_state(tmp_path):
    model, cfg = source_model()
    src, moments = write_consolidated(model, cfg, tmp_path / "run" / "checkpoints" / "step_00000004", training=True)
    with pytest.raises(Exception, match=r"run moep-convert .*step_00000004 --out DST"):  # a run directory's newest
        load_recipe(tmp_path / "run")
    assert convert.main([str(src), "--out", str(tmp_path / "dst")]) == 0
    dst = tmp_path / "dst"
    assert (dst / "COMPLETE").is_file() and (dst / "rng_rank0.pt").read_bytes() == (src / "rng_rank0.pt").read_bytes()
    state = json.loads((dst / "trainer_state.json").read_text())
    assert state == {"step": 4, "global_samples": 32, "world_size": 2, "optimizer_step": 4}
    for name, per_key in moments.items():
        for key, value in per_key.items():
            got = torch.empty_like(value)
            sharded.load({f"optim/{name}/{key}": sharded.whole(got)}, dst)
            assert torch.equal(got, value), (name, key)
    assert_same_weights(model, load_model_dir(dst)[0])


def test_resuming_a_consolidated_checkpoint_names_moep_convert(tmp_path):
    from moep_ds.checkpointing.sharded import CheckpointError
    from moep_ds.training.checkpoint import check_checkpoint

    model, cfg = source_model()
    src, _ = write_consolidated(model, cfg, tmp_path / "ckpt", training=True)
    with pytest.raises(CheckpointError) as err:  # not DamagedCheckpoint: --resume auto must not set it aside
        check_checkpoint(src)
    assert type(err.value) is CheckpointError and "run moep-convert" in str(err.value)


def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys):
    model, cfg = source_model()
    src = write_consolidated(model, cfg, tmp_path / "src")
    wider = dict(RECIPE["model"], d_model=32)
    (src / "config.yaml").write_text(dump_config(config_from_dict({"model": wider})))
    assert convert.main([str(src), "--out", str(tmp_path / "out" / "dst")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {src / 'model.safetensors'} does not match the model built from its config.yaml: "
                   "'embed.weight' has shape [64, 16] there but [64, 32] in the model"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no DST, no parent made for it, no temporary
    (src / "config.yaml").write_text(dump_config(cfg))
    os.truncate(src / "model.safetensors", 100)
    assert convert.main([str(src), "--out", str(tmp_path / "dst")]) == 2
    assert capsys.readouterr().err == (f"error: {str(src / 'model.safetensors')!r} could not be read: Error while "
                                       "deserializing header: invalid header length\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").touch()
    assert convert.main([str(src), "--out", str(tmp_path / "taken")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    hf = write_consolidated(model, cfg, tmp_path / "hf", hf=True)
    (hf / "config.json").write_bytes(b"{\n")
    assert convert.main([str(hf), "--out", str(tmp_path / "dst")]) == 2
    assert capsys.readouterr().err == (f"error: {str(hf / 'config.json')!r} is not valid JSON: Expecting property "
                                       "name enclosed in double quotes: line 2 column 1 (char 2)\n")


def test_a_sharded_checkpoint_is_not_converted_again(tmp_path, capsys):
    model, cfg = source_model()
    src = write_consolidated(model, cfg, tmp_path / "src")
    assert convert.main([str(src), "--out", str(tmp_path / "dst")]) == 0
    assert convert.main([str(tmp_path / "dst"), "--out", str(tmp_path / "again")]) == 2
    assert capsys.readouterr().err.endswith(f"error: SRC {str(tmp_path / 'dst')!r} is a sharded checkpoint already: "
                                            "nothing to convert\n")


def test_dst_in_a_run_directory_is_refused_as_moep_export_refuses_it(tmp_path, capsys):
    """Issue 40 item 7: `--out runs/X/checkpoints/step_00000099` would put a checkpoint into another run's folder."""
    from moep_ds.checkpointing import layout

    model, cfg = source_model()
    src = write_consolidated(model, cfg, tmp_path / "src")
    run = tmp_path / "runs" / "X"
    (layout.checkpoint_root(run) / layout.checkpoint_tag(98)).mkdir(parents=True)
    for dst, reason in [
        (layout.checkpoint_root(run) / layout.checkpoint_tag(99), f"is inside the checkpoints of run directory {run}"),
        (run / "converted", f"is inside run directory {run}"),
        (src / "sharded", f"is inside the checkpoint being converted ({src})"),
    ]:
        assert convert.main([str(src), "--out", str(dst)]) == 2
        assert capsys.readouterr().err == (
            f"error: --out ({str(dst)!r}) {reason}: moep-convert never writes into a run directory or checkpoint; "
            "name a new directory outside them (then --resume DST starts a run from it)\n")
        assert not dst.exists()
    assert sorted(p.name for p in layout.checkpoint_root(run).iterdir()) == ["step_00000098"]
