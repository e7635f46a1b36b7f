"""The training loop over fake parts (tests/training/fake_parts.py: no DeepSpeed, no launch): the hooks in order,
callbacks named, ordered by priority, removed and replaced by the recipe, a stop flag any callback raises, the
callbacks' state kept across a stop and a resume through the checkpointer, on_error."""
import json
import sys
import pathlib

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # tests/training: fake_parts.py

from fake_parts import fake_trainer, MemoryCheckpointer, one_rank_group  # noqa: E402

from moep_ds.errors import UserError  # noqa: E402
from moep_ds.training.callbacks import Callback  # noqa: E402

@pytest.fixture
def user_module(monkeypatch):
    """tests/training/fixtures/user_callbacks.py importable as a user's module; a one-rank process group."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parent / "fixtures"))
    with one_rank_group():
        yield


def hooks_of(path: pathlib.Path) -> list[tuple[str, int]]:
    return [(r["hook"], r["step"]) for r in map(json.loads, path.read_text().splitlines())]


def test_a_users_callback_named_in_the_recipe_runs_at_its_hooks_in_the_loops_order(tmp_path, user_module):
    """A class of the user's own module named in train.callbacks: every hook in the loop's order (the step's
    checkpoint before its evaluation), on_stop at exit_at_step, on_load first when resumed."""
    log_path = tmp_path / "hooks.jsonl"
    train = {"max_steps": 4, "eval_every": 2, "exit_at_step": 3, "checkpoint": {"every_steps": 2},
             "callbacks": [{"type": "user_callbacks:Recorder", "out": str(log_path)}]}
    checkpointer = MemoryCheckpointer()
    trainer = fake_trainer(tmp_path, train, checkpointer=checkpointer)
    assert [name for name, _ in trainer.order] == [
        "router_thresholds", "lifecycle", "monitoring", "checkpointing", "validation", "stop", "user_callbacks:Recorder"]
    trainer.fit()
    step = [("before_step", 1), ("after_optimizer_step", 1), ("after_step", 1)]
    assert hooks_of(log_path) == step + [
        ("before_step", 2), ("after_optimizer_step", 2), ("on_save", 2), ("on_evaluation", 2), ("after_step", 2),
        ("before_step", 3), ("after_optimizer_step", 3), ("on_save", 3), ("after_step", 3), ("on_stop", 3),
        ("at_end", 3)]
    assert sorted(checkpointer.saved) == [2, 3]
    log_path.unlink()
    train.pop("exit_at_step")
    fake_trainer(tmp_path, train, checkpointer=checkpointer, resume_step=3).fit()
    assert hooks_of(log_path) == [("on_load", 3), ("before_step", 4), ("after_optimizer_step", 4), ("on_save", 4),
                                  ("on_evaluation", 4), ("after_step", 4), ("at_end", 4)]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3, 4]
    assert [m["step"] for m in metrics if "val_loss" in m] == [2, 4]


def test_a_callbacks_state_survives_a_stop_and_a_resume(tmp_path, user_module):
    """The checkpoint keeps every named callback's state_dict; resuming gives it back before on_load."""
    checkpointer = MemoryCheckpointer()
    train = {"max_steps": 5, "exit_at_step": 2, "callbacks": {"counter": {"type": "user_callbacks:StepCounter"}}}
    first = fake_trainer(tmp_path, train, checkpointer=checkpointer)
    first.fit()
    assert first.callbacks["counter"].count == 2
    assert checkpointer.saved[2]["callbacks"] == {"counter": {"count": 2}}
    saved = checkpointer.saved[2]  # each part's state under its own name (version 4)
    assert saved["version"] == 4 and saved["trainer"]["step"] == 2 and saved["train_module"]["global_samples"] == 2
    assert saved["data_loader"] == {"epoch": 0, "global_batch": 2, "global_batch_size": 1}
    train.pop("exit_at_step")
    second = fake_trainer(tmp_path, train, checkpointer=checkpointer, resume_step=2)
    assert second.callbacks["counter"].loaded == 2 and second.step == 2
    assert second.module.loader.loaded == saved["data_loader"]  # every part restored from its own state
    second.fit()
    assert second.callbacks["counter"].count == 5 and second.module.trained == 5
    assert checkpointer.saved[5]["callbacks"] == {"counter": {"count": 5}}


def test_the_recipe_removes_and_replaces_built_in_callbacks_by_name(tmp_path, user_module):
    removed = fake_trainer(tmp_path, {"max_steps": 3, "eval_every": 1, "callbacks": {"validation": None}})
    assert "validation" not in removed.callbacks
    removed.fit()
    assert removed.module.evaluations == 0
    assert not any("val_loss" in line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())

    import user_callbacks

    user_callbacks.QuietValidation.steps.clear()

    replaced = fake_trainer(tmp_path / "b", {"max_steps": 2, "eval_every": 1,
                                             "callbacks": {"validation": {"type": "user_callbacks:QuietValidation"}}})
    replaced.fit()
    assert type(replaced.callbacks["validation"]).__name__ == "QuietValidation"
    assert user_callbacks.QuietValidation.steps == [1, 2] and replaced.module.evaluations == 0
    with pytest.raises(UserError, match=r"^train.callbacks.valdation: null removes a built-in callback, and "
                                        r"'valdation' is none \(built-in: router_thresholds, lifecycle, "):
        fake_trainer(tmp_path / "c", {"max_steps": 1, "callbacks": {"valdation": None}})


def test_callbacks_run_by_priority_and_any_callbacks_stop_flag_stops_after_a_checkpoint(tmp_path, user_module):
    calls = []

    class Named(Callback):
        def __init__(self, name, priority, stop_at=None):
            self.name, self.priority, self.stop_at = name, priority, stop_at

        def after_step(self, event):
            calls.append((self.name, event.step))

        def flags(self):
            return {"stop": self.trainer.step == self.stop_at}

    checkpointer = MemoryCheckpointer()
    trainer = fake_trainer(tmp_path, {"max_steps": 10, "checkpoint": {"every_steps": None, "at_end": False}},
                           checkpointer=checkpointer,
                           callbacks={"late": Named("late", -5), "early": Named("early", 1000, stop_at=2),
                                      "tie_a": Named("tie_a", 0), "tie_b": Named("tie_b", 0)})
    assert [name for name, _ in trainer.order][0] == "early"
    assert [name for name, _ in trainer.order][-3:] == ["tie_a", "tie_b", "late"]
    trainer.fit()
    assert trainer.step == 2 and sorted(checkpointer.saved) == [2]  # the stop request's checkpoint
    assert calls == [(n, s) for s in (1, 2) for n in ("early", "tie_a", "tie_b", "late")]


def test_on_error_sees_the_loops_error_which_is_raised(tmp_path, user_module):
    seen = []

    class Watcher(Callback):
        def on_error(self, event):
            seen.append((event.step, str(event.error)))

    class Failing(Callback):
        def on_error(self, event):
            raise RuntimeError("a failing on_error does not hide the run's error")

    trainer = fake_trainer(tmp_path, {"max_steps": 4}, callbacks=[Failing(), Watcher()])

    def broken():
        if trainer.module.trained == 2:
            raise ValueError("step 3 failed")
        trainer.module.trained += 1
        return {"loss": trainer.module.trained * 1.0 + trainer.module.model.weight.sum() * 0}, {}

    trainer.module.train_step = broken
    with pytest.raises(ValueError, match="^step 3 failed$"):
        trainer.fit()
    assert seen == [(2, "step 3 failed")]


def test_a_non_finite_step_is_never_saved_and_fails_the_run_after_at_end(tmp_path, user_module):
    """The step whose loss is nan (reduce_step's check) gets no after_optimizer_step, after_step or save: on_stop, the
    end's at_end (which completes a save in flight) and on_error, then TrainingFailed naming it; its metrics row is
    written with null for the nan (strict JSON), though step 3 is no log step."""
    from moep_ds.errors import TrainingFailed

    log_path = tmp_path / "hooks.jsonl"
    checkpointer = MemoryCheckpointer()
    trainer = fake_trainer(tmp_path, {"max_steps": 6, "log_every": 2, "checkpoint": {"every_steps": 1},
                                      "callbacks": [{"type": "user_callbacks:Recorder", "out": str(log_path)}]},
                           checkpointer=checkpointer)
    seen = []
    trainer.callbacks["user_callbacks:Recorder"].on_error = lambda event: seen.append((event.step, event.error))
    trainer.module.nan_steps = {3}
    with pytest.raises(TrainingFailed) as info:
        trainer.fit()
    assert str(info.value) == ("non-finite loss (nan on rank 0) at step 3: training stopped without saving step 3; "
                               "the checkpoints before it are kept")
    assert seen == [(3, info.value)]
    assert hooks_of(log_path)[-4:] == [("after_step", 2), ("before_step", 3), ("on_stop", 3), ("at_end", 3)]
    assert sorted(checkpointer.saved) == [1, 2]
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))
            for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 0.5), (3, None)]
