"""Checkpoints of the earlier trainer-state format still resume, exactly, through the one checkpointer; a callback's
state survives a stop and `--resume auto`; a recipe that removes the validation callback by name trains without
validating. tests/training/fixtures/checkpoint_v2 is step 2 of a 4-step run (tiny top-2 MoE with a load-balancing
loss, ZeRO-2, 1 process) written by the trainer before TrainerState version 3, with that run's own metrics of steps
3 and 4. tests/training/fixtures/checkpoint_v3 is the same step of the same run written by the trainer of TrainerState
version 3 (the flat record, 2026-12-07, with MANIFEST.json), with a user callback's count in it."""
import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # tests/training: tiny.py

from tiny import REPO, env, metrics  # noqa: E402

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
FIXTURE = FIXTURES / "checkpoint_v2"


def assert_as_uninterrupted(row: dict, want: dict) -> None:
    """A resumed step's metrics are the uninterrupted run's, recorded with the fixture on another machine: the losses,
    lr and tokens bit-identical; the gradient norm to 1e-6 (a sum of squares over every parameter, whose order follows
    the CPU's vector width: one rounding apart on an AMD EPYC against the machine that recorded it)."""
    assert {k: row[k] for k in want if k != "grad_norm"} == {k: v for k, v in want.items() if k != "grad_norm"}, \
        row["step"]
    assert row["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6, abs=0), row["step"]


@pytest.mark.slow
def test_a_version_2_checkpoint_resumes_exactly_and_a_callbacks_count_survives_stop_and_resume(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE / "step_00000002", run / "checkpoints" / "step_00000002")
    recipe = yaml.safe_load((FIXTURE / "recipe.yaml").read_text())
    recipe["train"].update(output_dir=str(run), eval_every=1,
                           callbacks={"counter": {"type": "user_callbacks:StepCounter"}, "validation": None})
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    e = {**env(), "PYTHONPATH": f"{FIXTURE.parent}:{env()['PYTHONPATH']}", "COUNTER_OUT": str(tmp_path / "counts.jsonl"),
         "MOEP_CACHE_DIR": str(tmp_path / "cache"), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}

    def resume(*extra):
        proc = subprocess.run([sys.executable, str(REPO / "pretrain.py"), "--config", str(tmp_path / "recipe.yaml"),
                               "--ds_config", str(REPO / "ds_configs" / "quickstart.json"), "--resume", "auto",
                               *extra], env=e, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]

    resume("--set", "train.exit_at_step=3")  # resumes the version-2 checkpoint, stops after step 3
    resume()  # resumes the version-3 checkpoint of step 3
    rows = metrics(run)
    expected = json.loads((FIXTURE / "uninterrupted.json").read_text())
    for row in (r for r in rows if "loss" in r):
        want = expected[str(row["step"])]
        assert_as_uninterrupted(row, want)
    assert [r["step"] for r in rows if "loss" in r] == [3, 4]
    assert not [r for r in rows if "val_loss" in r]  # eval_every 1, validation removed by name
    counts = [json.loads(line) for line in (tmp_path / "counts.jsonl").read_text().splitlines()]
    assert counts == [{"loaded": None, "count": 1, "step": 3}, {"loaded": 1, "count": 2, "step": 4}]
    state = json.loads((run / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert state["version"] == 4 and state["callbacks"] == {"counter": {"count": 2}}  # each part under its name
    assert state["trainer"]["step"] == 4 and state["data_loader"]["global_batch"] == 4


@pytest.mark.slow
def test_a_version_3_checkpoint_resumes_exactly_with_its_callbacks_state(tmp_path):
    fixture = FIXTURES / "checkpoint_v3"
    run = tmp_path / "run"
    shutil.copytree(fixture / "step_00000002", run / "checkpoints" / "step_00000002")
    recipe = yaml.safe_load((fixture / "recipe.yaml").read_text())
    recipe["train"]["output_dir"] = str(run)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    e = {**env(), "PYTHONPATH": f"{FIXTURES}:{env()['PYTHONPATH']}", "COUNTER_OUT": str(tmp_path / "counts.jsonl"),
         "MOEP_CACHE_DIR": str(tmp_path / "cache"), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29518"}
    proc = subprocess.run([sys.executable, str(REPO / "pretrain.py"), "--config", str(tmp_path / "recipe.yaml"),
                           "--ds_config", str(REPO / "ds_configs" / "quickstart.json"), "--resume", "auto"],
                          env=e, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected = json.loads((fixture / "uninterrupted.json").read_text())
    rows = [r for r in metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [3, 4]
    for row in rows:
        want = expected[str(row["step"])]
        assert_as_uninterrupted(row, want)
    counts = [json.loads(line) for line in (tmp_path / "counts.jsonl").read_text().splitlines()]
    assert counts == [{"loaded": 2, "count": 4, "step": 4}]  # the count saved at step 2, counted on
