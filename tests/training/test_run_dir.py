"""The run directory contract (training/run_dir.py) and resumes that keep the checkpoint's global batch
(training/resume_batch.py), in-process and end to end on ranks of the test (tests/ranks.py)."""
import json
import logging
import pathlib

import pytest

from moep_ds.checkpointing import layout
from moep_ds.errors import SharedUserError
from moep_ds.train_config import TrainConfig
from moep_ds.training import trainer_state
from moep_ds.training.resume_batch import reconcile_resumed
from moep_ds.training.monitor import drop_rows_after
from moep_ds.training.resume_data import check_same_data, tokens_read
from moep_ds.training.run_dir import BRANCHES, claim_run_dir, decide, start_branch

from tiny import DS_CONFIGS, REPO, losses, metrics, run_pretrain, write_recipe


def fake_run(run_dir: pathlib.Path, steps=(2,), state=None) -> None:
    for step in steps:
        ckpt = layout.checkpoint_root(run_dir) / layout.checkpoint_tag(step)
        ckpt.mkdir(parents=True)
        (ckpt / layout.COMPLETE).touch()
        state = {"data": {"epoch": 0, "global_batch": step}, **(state or {"step": step, "global_samples": 16 * step})}
        (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 3)))


def newest(run_dir: pathlib.Path):
    """(the newest checkpoint, its trainer state read): what a resume hands the global batch and data checks."""
    ckpt = layout.complete_checkpoints(run_dir)[-1]
    return ckpt, trainer_state.read(ckpt)


def test_a_folder_with_another_run_is_refused_naming_the_ways_out(tmp_path):
    fake_run(tmp_path, steps=(2, 4))
    action, error = decide(tmp_path, None, overwrite=False)
    assert "holds another run (checkpoints step_00000002..step_00000004, metrics.jsonl)" in error
    assert "--resume auto" in error and "new train.output_dir" in error and "--overwrite" in error
    assert "\n" not in error
    assert decide(tmp_path, "auto", overwrite=False) == ("continue", None)
    own = str(layout.checkpoint_root(tmp_path) / "step_00000002")
    assert decide(tmp_path, own, overwrite=False) == ("continue", None)
    other = tmp_path.parent / "elsewhere" / "checkpoints" / "step_00000002"
    assert "--resume" in decide(tmp_path, str(other), overwrite=False)[1]
    assert "exclude each other" in decide(tmp_path, "auto", overwrite=True)[1]
    assert decide(tmp_path / "new", None, overwrite=False) == ("new", None)
    with pytest.raises(SharedUserError, match="holds another run"):
        claim_run_dir(tmp_path, None, overwrite=False)
    assert layout.complete_checkpoints(tmp_path)  # nothing touched


def test_overwrite_deletes_only_what_a_run_writes(tmp_path):
    fake_run(tmp_path)
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    claim_run_dir(tmp_path, None, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "notes.txt"]  # the lock stays (run_lock.py)


def test_resume_auto_without_a_checkpoint_empties_the_logs_it_would_append_to(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (tmp_path / "STOP").touch()
    claim_run_dir(tmp_path, "auto", overwrite=False)
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert not (tmp_path / "STOP").exists()  # an old stop request would stop the new run at once


def tensorboard_steps(tb_dir: pathlib.Path, tag: str = "train/loss") -> list[int]:
    """The steps of `tag` in the TensorBoard event files under `tb_dir`, in file order."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [event.step for path in sorted(tb_dir.rglob("events.out.tfevents.*"))
            for event in EventFileLoader(str(path)).Load() if any(v.tag == tag for v in event.summary.value)]


def test_resuming_an_older_checkpoint_moves_the_later_ones_and_their_logs_into_a_branch(tmp_path, caplog,
                                                                                        monkeypatch):
    """Issue 46 item 2: checkpoints 2, 4, 6 and the logs of steps 1-6; resuming step 2 moves 4 and 6, the rows and
    the TensorBoard events of steps 3-6 into RUN/branches/after_step_00000002-<time>/; the newest, another run's
    checkpoint, or no later complete checkpoint moves nothing."""
    from torch.utils.tensorboard import SummaryWriter

    monkeypatch.setattr(logging.getLogger("moep_ds"), "propagate", True)
    fake_run(tmp_path, steps=(2, 4, 6))
    rows = "".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in range(1, 7))
    (tmp_path / "metrics.jsonl").write_text(rows)
    (tmp_path / "expert_utilization.jsonl").write_text(rows.replace("loss", "layers.0.entropy"))
    writer = SummaryWriter(tmp_path / "tensorboard")
    for step in range(1, 7):
        writer.add_scalar("train/loss", 10.0 - step, step)
    writer.close()
    root = layout.checkpoint_root(tmp_path)
    (root / "step_00000008").mkdir()  # a later incomplete one (no COMPLETE) goes with them
    assert start_branch(tmp_path, root / "step_00000008", 8) is None  # the newest: no rollback
    assert start_branch(tmp_path, tmp_path / "other" / "checkpoints" / "step_00000002", 2) is None
    with caplog.at_level("WARNING", logger="moep_ds"):
        aside = start_branch(tmp_path, root / "step_00000002", 2)
    assert aside.parent == tmp_path / BRANCHES and aside.name.startswith("after_step_00000002-")
    assert [c.name for c in layout.complete_checkpoints(tmp_path)] == ["step_00000002"]
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_00000004", "step_00000006",
                                                                         "step_00000008"]
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2]
    assert [m["step"] for m in metrics(aside)] == [3, 4, 5, 6]
    assert [json.loads(line)["step"] for line in (aside / "expert_utilization.jsonl").read_text().splitlines()] == \
        [3, 4, 5, 6]
    assert tensorboard_steps(tmp_path / "tensorboard") == [1, 2]
    assert tensorboard_steps(aside / "tensorboard") == [3, 4, 5, 6]
    assert (f"resuming step_00000002 starts a new branch: the later checkpoints (step_00000004, step_00000006, "
            f"step_00000008) and the logs of steps after 2 are moved to {aside}") in caplog.text
    assert start_branch(tmp_path, root / "step_00000002", 2) is None  # done: nothing later is left
    assert "holds another run (checkpoints step_00000002, metrics.jsonl, expert_utilization.jsonl, branches/)" in \
        decide(tmp_path, None, overwrite=False)[1]
    drop_rows_after(tmp_path, 1)  # a plain resume (of a step 1): what is after it is dropped, TensorBoard's too
    assert [m["step"] for m in metrics(tmp_path)] == [1] and tensorboard_steps(tmp_path / "tensorboard") == [1]
    assert tensorboard_steps(aside / "tensorboard") == [3, 4, 5, 6]


def test_resume_keeps_the_saved_global_batch_unless_fixed(tmp_path):
    fake_run(tmp_path, steps=(2,), state={"step": 2, "global_samples": 32, "global_batch_size": 16})
    auto = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    train = TrainConfig(micro_batch_size=8)
    ds = reconcile_resumed(auto, train, 1, newest(tmp_path))
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (16, 2)
    assert reconcile_resumed(auto, train, 1, None)["train_batch_size"] == 8  # a new run: its own
    fixed = {**auto, "gradient_accumulation_steps": 1}
    with pytest.raises(SharedUserError, match=r"global batch 16, this run's train_micro_batch_size_per_gpu \(8\) x "
                                              r"gradient_accumulation_steps \(1\) x 1 processes = 8.*--allow_batch_change"):
        reconcile_resumed(fixed, train, 1, newest(tmp_path))
    assert reconcile_resumed(fixed, train, 1, newest(tmp_path), allow_batch_change=True)["train_batch_size"] == 8
    with pytest.raises(SharedUserError, match=r"train.global_batch_size \(32\) = 32"):
        reconcile_resumed(auto, TrainConfig(micro_batch_size=8, global_batch_size=32), 1, newest(tmp_path))
    before_the_key = {"step": 3, "global_samples": 48, "data": {"epoch": 0, "global_batch": 3}}
    assert trainer_state.TrainerState.from_state_dict(before_the_key).global_batch_size == 16  # samples / steps


def test_a_refused_resume_names_the_micro_batch_that_blocks_the_saved_global_batch(tmp_path):
    """Issue 40 item 6: a 1-process checkpoint (global batch 8 = micro-batch 8) resumed on 2 processes with the
    quick start's ds_config, whose accumulation is already "auto": the recipe's micro-batch is what blocks it."""
    fake_run(tmp_path, steps=(2,), state={"step": 2, "global_samples": 16, "global_batch_size": 8})
    quickstart = json.loads((DS_CONFIGS / "quickstart.json").read_text())
    with pytest.raises(SharedUserError) as err:
        reconcile_resumed(quickstart, TrainConfig(micro_batch_size=8), 2, newest(tmp_path))
    assert str(err.value).endswith(
        "was trained with global batch 8, this run's train_micro_batch_size_per_gpu (8) x gradient_accumulation_steps "
        "(1) x 2 processes = 16: train.micro_batch_size (8) must divide 4 (8 / 2 processes) to keep 8 (e.g. --set "
        "train.micro_batch_size=4), or pass --allow_batch_change to continue with 16 from the sample reached")
    kept = reconcile_resumed(quickstart, TrainConfig(micro_batch_size=4), 2, newest(tmp_path))
    assert (kept["train_batch_size"], kept["gradient_accumulation_steps"]) == (8, 1)  # the advice works
    in_json = {**quickstart, "train_micro_batch_size_per_gpu": 3}
    with pytest.raises(SharedUserError, match=r"ds_config train_micro_batch_size_per_gpu \(3\) must divide 4 .*"
                                              r"\(e.g. train_micro_batch_size_per_gpu 2 in the ds_config\)"):
        reconcile_resumed(in_json, TrainConfig(), 2, newest(tmp_path))
    with pytest.raises(SharedUserError, match=r"resume on a number of processes that divides 8 to keep it"):
        reconcile_resumed(quickstart, TrainConfig(micro_batch_size=1), 3, newest(tmp_path))


def test_resume_with_another_seq_len_or_seed_is_refused_naming_both_values(tmp_path, caplog, monkeypatch):
    """Issue 40 item 1: the data position is counted in windows of seq_len tokens of an order drawn from the seed."""
    monkeypatch.setattr(logging.getLogger("moep_ds"), "propagate", True)  # a trainer in this process turns it off
    fake_run(tmp_path, steps=(20,), state={"step": 20, "global_samples": 160, "seq_len": 64, "seed": 1234})
    found = newest(tmp_path)
    ckpt = str(found[0])
    check_same_data(found, 64, 1234)  # the same data: accepted
    check_same_data(None, 32, 7)  # a fresh run: nothing to compare
    with pytest.raises(SharedUserError) as err:
        check_same_data(found, 32, 1234)
    assert str(err.value) == (
        f"data.seq_len (32) differs from the 64 checkpoint {ckpt!r} was trained with: its data position, counted in "
        f"windows of 64 tokens, would replay or skip text; resume with --set data.seq_len=64, or start a new run "
        f"(another train.output_dir) from its weights with model.init_from={ckpt!r}")
    with pytest.raises(SharedUserError, match=r"^train.seed \(7\) differs from the 1234 checkpoint .*"
                                              r"--set train.seed=1234, or start a new run"):
        check_same_data(found, 64, 7)
    old = (found[0], trainer_state.TrainerState.from_state_dict(  # saved before seq_len (and seed) were recorded
        {"step": 20, "global_samples": 160, "data": {"epoch": 0, "global_batch": 20}}))
    with caplog.at_level("WARNING", logger="moep_ds"):
        check_same_data(old, 32, 7)
    assert "does not record data.seq_len" in caplog.text


def test_tokens_are_counted_from_the_samples_read_not_the_current_global_batch():
    """Issue 40 item 2: 20 steps of 8 samples of 64 tokens, then (--allow_batch_change, 2 processes) steps of 16."""
    from moep_ds.training.trainer_state import TrainerState

    assert tokens_read(160, 64) == 10_240
    data = {"epoch": 0, "global_batch": 20}
    resumed = TrainerState.from_state_dict({"step": 20, "global_samples": 160, "data": data, "seq_len": 64,
                                            "tokens": 10_240})
    assert tokens_read(160 + 16, 64, resumed.train_module) == 11_264  # step 21 (21 x 16 x 64 = 21,504 was logged)
    assert tokens_read(480, 64, resumed.train_module) == 30_720  # step 40: 480 samples x 64
    older = TrainerState.from_state_dict({"step": 20, "global_samples": 160, "data": data})  # samples x seq_len
    assert tokens_read(176, 64, older.train_module) == 11_264
    # the count travels in the trainer state
    assert TrainerState.from_state_dict(resumed.state_dict()).tokens == 10_240


QUICKSTART = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--ds_config",
              str(REPO / "ds_configs" / "quickstart.json")]


def pretrain(*args, nproc=1):
    """pretrain.py on `nproc` ranks of this test: rank 0's exit status and output (the others are quiet)."""
    return run_pretrain(nproc, *args, check=False)[0]


@pytest.mark.slow
def test_second_run_into_the_quickstart_folder_is_refused_and_overwrite_replaces_it(tmp_path):
    """The README's reproduction: the quick start, then another run into the same folder."""
    out = tmp_path / "quickstart"
    sets = ["--set", f"train.output_dir={out}", "model.layers[0].repeat=1", "train.eval_every=null",
            "train.log_every=1", "train.checkpoint.every_steps=2"]
    first = pretrain(*QUICKSTART, *sets, "train.max_steps=4")
    assert first.exitcode == 0, first.stderr[-3000:]
    second = pretrain(*QUICKSTART, *sets, "train.max_steps=2")
    assert second.exitcode == 2
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert "holds another run (checkpoints step_00000002..step_00000004, metrics.jsonl, expert_utilization.jsonl)" \
        in errors[0]
    assert [c.name for c in layout.complete_checkpoints(out)] == ["step_00000002", "step_00000004"]
    assert [m["step"] for m in metrics(out) if "loss" in m] == [1, 2, 3, 4]
    third = pretrain(*QUICKSTART, *sets, "train.max_steps=2", "--overwrite")
    assert third.exitcode == 0, third.stderr[-3000:]
    assert [c.name for c in layout.complete_checkpoints(out)] == ["step_00000002"]
    assert [m["step"] for m in metrics(out) if "loss" in m] == [1, 2]  # the new run's rows only


@pytest.mark.slow
def test_two_process_checkpoint_resumed_on_one_keeps_global_batch_and_sample(tmp_path):
    """ds_configs/quickstart.json leaves the batch `auto`: 2 processes x micro-batch 8 = global batch 16; on 1
    process gradient accumulation becomes 2 and the run continues as the 2-process one did. A JSON fixing
    accumulation at 1 is refused, and with --allow_batch_change continues at global batch 8 from sample 32."""
    two = tmp_path / "two"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", two, max_steps=4, micro_batch_size=8,
                          checkpoint={"every_steps": 2, "keep_last": 2, "at_end": True})
    run_pretrain(2, "--config", str(recipe), "--ds_config", str(DS_CONFIGS / "quickstart.json"))
    ckpt = two / "checkpoints" / "step_00000002"
    one = tmp_path / "one"
    run_pretrain(1, "--config", str(recipe), "--ds_config", str(DS_CONFIGS / "quickstart.json"),
                 "--resume", str(ckpt), "--set", f"train.output_dir={one}")
    state = json.loads((one / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert (state["train_module"]["global_samples"], state["trainer"]["world_size"]) == (64, 1)
    assert state["data_loader"] == {"epoch": 0, "global_batch": 4, "global_batch_size": 16}
    assert [losses(one)[s] for s in (3, 4)] == pytest.approx([losses(two)[s] for s in (3, 4)], abs=1e-5)

    fixed = tmp_path / "accum1.json"
    fixed.write_text(json.dumps({**json.loads((DS_CONFIGS / "quickstart.json").read_text()),
                                 "gradient_accumulation_steps": 1}))
    changed = tmp_path / "changed"
    args = ["--config", str(recipe), "--ds_config", str(fixed), "--resume", str(ckpt), "--set",
            f"train.output_dir={changed}"]
    refused = pretrain(*args)
    assert refused.exitcode == 2
    assert [line for line in refused.stderr.splitlines() if line.startswith("error:")] == [
        f"error: checkpoint {str(ckpt)!r} was trained with global batch 16, this run's train_micro_batch_size_per_gpu "
        "(8) x gradient_accumulation_steps (1) x 1 processes = 8: leave the global batch unset (ds_config "
        'gradient_accumulation_steps "auto", no train_batch_size) to keep 16, or pass --allow_batch_change to '
        "continue with 8 from the sample reached"]
    run_pretrain(1, *args, "--allow_batch_change")
    state = json.loads((changed / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    # samples 0-31 in the 2 steps of 16, then 32-47 in the 2 steps of 8: nothing replayed, nothing skipped
    assert state["train_module"]["global_samples"] == 48
    assert state["data_loader"] == {"epoch": 0, "global_batch": 6, "global_batch_size": 8}
    # tokens read: 32 samples x 32 tokens, then 8 per step (not step x 8 x 32: 768 at step 3)
    assert [m["tokens"] for m in metrics(changed) if "loss" in m] == [1280, 1536]
    assert (state["train_module"]["seq_len"], state["train_module"]["tokens"]) == (32, 1536)


@pytest.mark.slow
def test_a_rollback_through_pretrain_starts_a_branch_that_resume_auto_continues(tmp_path):
    """Issue 46 item 2 end to end: train to 6 with checkpoints 2/4/6; resume step_2 with another lr to 4; then
    `--resume auto` continues the new branch to 6 (it resumed the abandoned step 6 and ended at once). The abandoned
    4 and 6 and their logs are under RUN/branches/, never deleted."""
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=6,
                          checkpoint={"every_steps": 2, "keep_last": 5, "at_end": True})
    args = ["--config", str(recipe), "--ds_config", str(DS_CONFIGS / "quickstart.json")]
    run_pretrain(1, *args)
    first = losses(out)
    rollback = pretrain(*args, "--resume", str(out / "checkpoints" / "step_00000002"), "--set",
                        "train.optimizer.lr=3e-3", "train.exit_at_step=4")
    assert rollback.exitcode == 0, rollback.stderr[-3000:]
    [aside] = (out / BRANCHES).iterdir()
    assert f"the later checkpoints (step_00000004, step_00000006) and the logs of steps after 2 are moved to " \
           f"{aside}" in rollback.stderr
    assert [c.name for c in layout.complete_checkpoints(aside)] == ["step_00000004", "step_00000006"]
    assert losses(aside) == {s: first[s] for s in (3, 4, 5, 6)}
    assert tensorboard_steps(aside / "tensorboard") == [3, 4, 5, 6]
    resumed = pretrain(*args, "--resume", "auto", "--set", "train.optimizer.lr=3e-3")
    assert resumed.exitcode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step_00000004" in resumed.stderr
    rows = [m for m in metrics(out) if "loss" in m]
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5, 6]
    assert [m["loss"] for m in rows[:2]] == [first[1], first[2]]
    abandoned = metrics(aside)
    assert rows[2]["lr"] != abandoned[0]["lr"] and rows[3]["loss"] != first[4]  # the new branch: its lr from step 3
    assert [c.name for c in layout.complete_checkpoints(out)] == ["step_00000002", "step_00000004", "step_00000006"]
    assert sorted(tensorboard_steps(out / "tensorboard")) == [1, 2, 3, 4, 5, 6]
    assert [p.name for p in (out / BRANCHES).iterdir()] == [aside.name]  # --resume auto moved nothing
