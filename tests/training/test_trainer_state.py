"""A trainer_state.json that parses but holds a field of the wrong type (`"step": "abc"`: edited by hand, or
corrupted in a checkpoint without a manifest) is a damaged checkpoint, named in one line with the file, the field and
the value: `--resume auto` skips it with a warning and takes the previous checkpoint, `--resume PATH` refuses it.
A resume reads the state of the checkpoint it resumes once, and the global batch, the data check and the restore all
take it from that read (so under --resume auto the global batch is that of the checkpoint resumed, not of a damaged
newer one). Versions 1-3 read as version 4's parts. (Unknown keys: tests/training/callbacks/test_callback_hooks.py.)"""
import json
import pathlib
import shutil
import sys

import pytest
import yaml

from ranks import joined, run_ranks
from tiny import DS_CONFIGS, metrics, run_pretrain, write_recipe

from moep_ds.checkpointing import layout
from moep_ds.checkpointing.sharded import DamagedCheckpoint
from moep_ds.training.trainer_state import VERSION, TrainerState

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


@pytest.mark.parametrize("part, field, value, expected", [
    ("trainer", "step", "abc", 'field trainer.step ("abc") must be an integer'),
    ("train_module", "lr_scheduler", 3, "field train_module.lr_scheduler (3) must be an object or null"),
    ("data_loader", "global_batch_size", "16", 'field data_loader.global_batch_size ("16") must be an integer or null'),
    ("data_loader", None, [0, 4], "field data_loader ([0, 4]) must be an object"),
])
def test_version_4_names_the_part_and_its_field(part, field, value, expected):
    where = "/runs/x/checkpoints/step_00000004"
    state = TrainerState.from_state_dict(STATE).state_dict()
    state[part] = value if field is None else {**state[part], field: value}
    with pytest.raises(DamagedCheckpoint) as err:
        TrainerState.from_state_dict(state, where)
    assert str(err.value) == f"checkpoint '{where}' is damaged: '{where}/trainer_state.json' " + expected


def test_a_flat_record_reads_as_the_parts_in_one_conversion():
    """Versions 1-3 (one flat record) read as version 4's parts: the trainer's position, the train module's step
    state, the data loader's position with the global batch it counts in, the callbacks'; written back as version 4,
    and read again the same."""
    state = TrainerState.from_state_dict(STATE)
    assert state.parts() == {
        "trainer": {"step": 4, "max_steps": 10, "world_size": 1, "expert_parallel_size": 1, "seed": 1234,
                    "tokenizer_sha256": "ab"},
        "train_module": {"global_samples": 64, "global_steps": 4, "skipped_steps": 0, "lr_scheduler": {"last_epoch": 4},
                         "loss_scaler": None, "optimizer_step": 4, "seq_len": 32, "tokens": 2048},
        "data_loader": {"epoch": 0, "global_batch": 4, "global_batch_size": 16},
        "callbacks": {"stop": {}}}
    assert state.state_dict()["version"] == VERSION == 4
    assert TrainerState.from_state_dict(json.loads(json.dumps(state.state_dict()))) == state
    before_the_key = {k: v for k, v in STATE.items() if k != "global_batch_size"}  # samples / steps then
    assert TrainerState.from_state_dict(before_the_key).global_batch_size == 16


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
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "trainer": {**state["trainer"], "step": "abc"}}))
    # a checkpoint without a manifest (written before checksums were): a checksum would name the edit first
    (newest / "MANIFEST.json").unlink(missing_ok=True)
    longer = write_recipe(tmp_path / "r5.yaml", "top2", out, max_steps=5, checkpoint={"every_steps": 5})
    proc = pretrain(longer, "--resume", str(newest))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    message = f"checkpoint '{newest}' is damaged: '{state_file}' field trainer.step (\"abc\") must be an integer"
    assert proc.stderr.strip().splitlines()[-1] == f"error: {message}"
    proc = pretrain(longer, "--resume", "auto")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "skipping damaged checkpoint" in line]
    assert len(warnings) == 1 and message in warnings[0]
    assert f"resumed from {out / 'checkpoints' / 'step_00000002'} at step 2" in proc.stderr


FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"


def counting_pretrain(argv: list[str], reads_out: str) -> int:
    """On a rank: pretrain.py's main, recording in `reads_out` every opening of a trainer_state.json for reading,
    one path a line (io.open, which open and Path.read_text call)."""
    import builtins
    import io
    import os

    from moep_ds.cli.pretrain import main

    sys.path.insert(0, str(FIXTURES))  # the recipe's user_callbacks
    real = io.open

    def counting(file, *args, **kwargs):
        mode = args[0] if args else kwargs.get("mode", "r")
        if isinstance(file, (str, os.PathLike)) and os.fspath(file).endswith("trainer_state.json") and "r" in mode:
            with real(reads_out, "a") as out:
                out.write(os.fspath(file) + "\n")
        return real(file, *args, **kwargs)

    builtins.open = io.open = counting
    return main(argv)


def pretrain_counting(tmp_path, recipe, *args):
    """pretrain.py on 1 rank of this test (tests/ranks.py), counting the trainer states it opens: those of
    checkpoints read, and the rank's output."""
    reads = tmp_path / "reads.txt"
    reads.write_text("")
    [rank] = run_ranks(1, counting_pretrain, ["--config", str(recipe), "--ds_config",
                                              str(DS_CONFIGS / "quickstart.json"), *args], str(reads),
                       check=False)
    assert rank.exitcode == 0 and rank.result == 0, rank.stderr[-4000:]
    # those of checkpoints read, not of the new ones hashed for their manifest as they are written
    return [r for r in reads.read_text().splitlines() if "/.tmp-" not in r], rank


def fixture_recipe(tmp_path, run, **train) -> pathlib.Path:
    recipe = yaml.safe_load((FIXTURES / "checkpoint_v3" / "recipe.yaml").read_text())
    recipe["train"].update(output_dir=str(run), **train)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return tmp_path / "recipe.yaml"


@pytest.mark.slow
def test_a_resume_opens_the_trainer_state_once(tmp_path):
    """It was read raw twice before the engine existed (the global batch, the data check), parsed a third time, and
    its checksum verified from a fourth reading; now its bytes are read once, verified and parsed."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "checkpoint_v3" / "step_00000002", run / "checkpoints" / "step_00000002")
    reads, _ = pretrain_counting(tmp_path, fixture_recipe(tmp_path, run), "--resume", "auto")
    assert reads == [str(run / "checkpoints" / "step_00000002" / "trainer_state.json")]


@pytest.mark.slow
def test_resume_auto_keeps_the_global_batch_of_the_checkpoint_it_resumes(tmp_path):
    """Steps 1-2 in global batches of 2, steps 3-4 in batches of 4 (--allow_batch_change); the checkpoint of step 4
    is damaged. --resume auto resumes step 2 and trains on in its global batch, 2: before, the global batch was read
    from the newest checkpoint before that one was skipped, and step 3 trained in batches of 4."""
    run = tmp_path / "run"
    pretrain_counting(tmp_path, fixture_recipe(tmp_path, run, max_steps=2))
    pretrain_counting(tmp_path, fixture_recipe(tmp_path, run, global_batch_size=4), "--resume", "auto",
                      "--allow_batch_change")
    shard = run / "checkpoints" / "step_00000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    reads, proc = pretrain_counting(tmp_path, fixture_recipe(tmp_path, run, max_steps=3), "--resume", "auto")
    assert "skipping damaged checkpoint" in proc.stderr and "resumed from" in proc.stderr
    step3 = [m for m in metrics(run) if m.get("step") == 3 and "loss" in m]
    assert [m["tokens"] for m in step3] == [64 + 2 * 16]  # 2 samples of 16 tokens after step 2's 64
    state = json.loads((run / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert state["data_loader"]["global_batch_size"] == 2
    assert reads == [str(run / "checkpoints" / f"step_0000000{s}" / "trainer_state.json") for s in (4, 2)]
