"""A trainer_state.json that parses but holds a field of the wrong type (`"step": "abc"`: edited by hand, or
corrupted in a checkpoint without a manifest) is a damaged checkpoint, named in one line with the file, the field and
the value: `--resume auto` skips it with a warning and takes the previous checkpoint, `--resume PATH` refuses it.
The reads before the resume (the saved global batch, the data check) skip it too instead of failing on its values.
(Versions and unknown keys: tests/training/callbacks/test_callback_hooks.py.)"""
import json
import pathlib

import pytest

from ranks import joined
from tiny import DS_CONFIGS, run_pretrain, write_recipe

from moep_ds.checkpointing import layout
from moep_ds.checkpointing.sharded import DamagedCheckpoint
from moep_ds.training.resume_batch import resume_state, saved_global_batch
from moep_ds.training.resume_data import check_same_data
from moep_ds.training.trainer_state import TrainerState

STATE = {"version": 3, "step": 4, "max_steps": 10, "global_samples": 64, "skipped_steps": 0,
         "data": {"epoch": 0, "global_batch": 4}, "global_batch_size": 16, "lr_scheduler": {"last_epoch": 4},
         "loss_scaler": None, "optimizer_step": 4, "world_size": 1, "expert_parallel_size": 1, "seed": 1234,
         "tokenizer_sha256": "ab", "seq_len": 32, "tokens": 2048, "callbacks": {"stop": {}}}


@pytest.mark.parametrize("field, value, expected", [
    ("step", "abc", '"abc") must be an integer'),
    ("step", 4.0, "4.0) must be an integer"),
    ("global_samples", True, "true) must be an integer"),
    ("data", [0, 4], "[0, 4]) must be an object"),
    ("global_batch_size", "16", '"16") must be an integer or null'),
    ("tokenizer_sha256", 7, "7) must be a string or null"),
    ("lr_scheduler", "x" * 100, '"' + "x" * 56 + "...) must be an object or null"),
    ("callbacks", {"stop": 1}, '{"stop": 1}) must be an object of objects'),
    ("version", "3", '"3") must be an integer'),
])
def test_a_wrong_typed_field_is_damage_naming_file_field_and_value(field, value, expected):
    where = "/runs/x/checkpoints/step_00000004"
    with pytest.raises(DamagedCheckpoint) as err:
        TrainerState.from_state_dict({**STATE, field: value}, where)
    assert str(err.value) == (f"checkpoint '{where}' is damaged: '{where}/trainer_state.json' field {field} ("
                              + expected)
    assert TrainerState.from_state_dict(STATE, where).step == 4  # the well-typed state reads


def checkpoint(root: pathlib.Path, tag_step: int, **changes) -> pathlib.Path:
    ckpt = root / "checkpoints" / layout.checkpoint_tag(tag_step)
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({**STATE, "step": tag_step, **changes}))
    (ckpt / "COMPLETE").touch()
    return ckpt


def test_the_reads_before_the_resume_skip_a_wrong_typed_state(tmp_path):
    """They failed with tracebacks on its values (`samples % step` on a str); now --resume auto reads the previous
    checkpoint's state, as the resume will, and --resume PATH reads none, so that the resume's own read names it."""
    older = checkpoint(tmp_path, 2, global_samples=32, global_batch_size=None, seq_len=64)
    newest = checkpoint(tmp_path, 4, step="abc", global_batch_size=None)
    found = resume_state("auto", tmp_path)
    assert found is not None and found[0] == older
    assert saved_global_batch(found[1]) == 16
    with pytest.raises(Exception, match=r"data.seq_len \(32\) differs from the 64 checkpoint"):
        check_same_data(found, 32, 1234)  # the older checkpoint's values are the ones checked
    assert resume_state(str(newest), tmp_path) is None
    check_same_data(resume_state(str(newest), tmp_path), 32, 1234)


@pytest.mark.slow
def test_pretrain_resume_skips_or_refuses_a_wrong_typed_trainer_state(tmp_path):
    def pretrain(recipe, *args):
        return joined(run_pretrain(1, "--config", str(recipe), "--ds_config", str(DS_CONFIGS / "zero2_fp32.json"),
                                   *args, check=False, timeout=600))

    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=4, checkpoint={"every_steps": 2})
    proc = pretrain(recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    newest = out / "checkpoints" / "step_00000004"
    state_file = newest / "trainer_state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "step": "abc"}))
    # a checkpoint without a manifest (written before checksums were): a checksum would name the edit first
    (newest / "MANIFEST.json").unlink(missing_ok=True)
    longer = write_recipe(tmp_path / "r5.yaml", "top2", out, max_steps=5, checkpoint={"every_steps": 5})
    proc = pretrain(longer, "--resume", str(newest))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    message = f"checkpoint '{newest}' is damaged: '{state_file}' field step (\"abc\") must be an integer"
    assert proc.stderr.strip().splitlines()[-1] == f"error: {message}"
    proc = pretrain(longer, "--resume", "auto")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "skipping damaged checkpoint" in line]
    assert len(warnings) == 1 and message in warnings[0]
    assert f"resumed from {out / 'checkpoints' / 'step_00000002'} at step 2" in proc.stderr
