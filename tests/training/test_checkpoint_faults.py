"""Checkpoint faults, each with its one-line error or fallback (1 process unless a second rank matters):
a damaged newest checkpoint (skipped by --resume auto, an error for --resume PATH), a full disk during a save,
an unwritable output directory; logs follow the checkpoint."""
import pathlib
import re

import pytest

from tiny import DS_CONFIGS, REPO, launch, metrics, write_recipe

pytestmark = pytest.mark.slow
SCRIPTS = pathlib.Path(__file__).parent / "scripts"
DS = str(DS_CONFIGS / "zero2_fp32.json")


def pretrain(recipe, *args, script=REPO / "pretrain.py", nproc=1, timeout=600):
    return launch(nproc, script, "--config", str(recipe), "--ds_config", DS, *args, check=False, timeout=timeout)


def inject_fault(monkeypatch, fault: str, step: int, rank: int) -> None:
    """For scripts/pretrain_fault.py, through the environment the launched processes inherit."""
    for key, value in (("MOEP_TEST_FAULT", fault), ("MOEP_TEST_FAULT_STEP", step), ("MOEP_TEST_FAULT_RANK", rank)):
        monkeypatch.setenv(key, str(value))


def last_line(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr.strip().splitlines()[-1]


def _needed(ckpt: pathlib.Path) -> int:
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(ckpt).read_metadata()
    return max(i.offset + i.length for i in md.storage_data.values() if i.relative_path == "__0_0.distcp")


def test_full_disk_during_a_save_then_a_damaged_newest_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=4, checkpoint={"every_steps": 2})
    with monkeypatch.context() as patch:
        inject_fault(patch, "enospc", step=4, rank=1)
        proc = pretrain(recipe, script=SCRIPTS / "pretrain_fault.py", nproc=2)
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: saving checkpoint '{out / 'checkpoints' / 'step_00000004'}' failed: ") and "No space left" in errors[0]
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]  # no temporary directory left
    proc = pretrain(recipe, "--resume", "auto")
    assert proc.returncode == 0 and "step_00000002" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]
    check_damaged_newest_is_skipped_by_auto_and_named_for_a_path(tmp_path, out)


def check_damaged_newest_is_skipped_by_auto_and_named_for_a_path(tmp_path, out):
    """(Continues the run above, whose checkpoints are steps 2 and 4.)"""
    newest = out / "checkpoints" / "step_00000004"
    shard = newest / "__0_0.distcp"
    needed = _needed(newest)
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    longer = write_recipe(tmp_path / "r5.yaml", "top2", out, max_steps=5, checkpoint={"every_steps": 2})
    proc = pretrain(longer, "--resume", str(newest))
    assert proc.returncode == 2
    assert last_line(proc) == f"error: checkpoint '{newest}' is damaged: '{shard}' is truncated (100 of {needed} bytes)"
    proc = pretrain(longer, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [l for l in proc.stderr.splitlines() if "skipping damaged checkpoint" in l]
    assert len(warnings) == 1 and str(shard) in warnings[0]
    assert "resumed from" in proc.stderr and "step_00000002" in proc.stderr
    # logs follow the checkpoint: rows 3 and 4 of the earlier runs were dropped, not duplicated
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4, 5]


def test_unwritable_output_dir_is_one_line_before_data_preparation(tmp_path):
    """(A changed model shape is named in one line too: tests/checkpointing/test_model_state.py.)"""
    recipe = write_recipe(tmp_path / "r.yaml", "top2", tmp_path / "run", max_steps=2)
    (tmp_path / "a_file").write_text("")
    proc = pretrain(recipe, "--set", f"train.output_dir={tmp_path / 'a_file' / 'run'}")
    assert proc.returncode == 2
    assert last_line(proc) == f"error: train.output_dir ('{tmp_path / 'a_file' / 'run'}') is not writable: Not a directory"
    assert "prepar" not in proc.stderr.lower()  # checked before any data preparation


def test_an_error_every_rank_agrees_on_exits_2_on_each_without_an_abort(tmp_path):
    """Both ranks find the output directory unwritable, agree, and exit 2 at once (cli.exit_joined); before, ~1
    launch in 10 aborted in the interpreter's teardown while gloo's worker let go of the agreement's tensor
    (training/distributed.py). A few launches, since the abort was a race."""
    recipe = write_recipe(tmp_path / "r.yaml", "top2", tmp_path / "run", max_steps=2)
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "run"
    for _ in range(3):
        proc = pretrain(recipe, "--set", f"train.output_dir={out}", nproc=2)
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)  # torchrun's report per failed rank
        assert "2" in codes and set(codes) <= {"2", "-15"}, proc.stderr[-3000:]  # -15: stopped by torchrun
        assert "terminate called" not in proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert errors == [f"error: train.output_dir ('{out}') is not writable: Not a directory"]


def test_a_rank_that_fails_alone_ends_the_launch_without_waiting_for_the_others(tmp_path, monkeypatch):
    """Rank 1 fails after step 2 while rank 0 goes on into step 3's collectives: rank 1 exits at once
    (cli.exit_joined) and the launcher stops rank 0. Waiting for the others at a barrier (as the end of training
    did) left both ranks in mismatched collectives until gloo's 30-minute timeout."""
    recipe = write_recipe(tmp_path / "r.yaml", "top2", tmp_path / "run", max_steps=6)
    inject_fault(monkeypatch, "raise", step=2, rank=1)
    proc = pretrain(recipe, script=SCRIPTS / "pretrain_fault.py", nproc=2, timeout=180)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error:" in line and "simulated" in line]
    assert errors == ["[rank 1] error: simulated: rank 1 cannot go on after step 2"], proc.stderr[-3000:]
