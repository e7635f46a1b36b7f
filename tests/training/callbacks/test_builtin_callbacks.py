"""The built-in callbacks' own configs (training/callbacks/builtin.py: the recipe fields they stand for and
train.callbacks, combined in one place, one source of truth per setting) and their own state: each callback's state
saved in the checkpoint under its name and given back to the callback of that name on resume, the every_minutes
clock counting training time across a stop and a resume, a user's callback with a config and a state of its own run
by the unchanged trainer. Over fake parts (tests/training/fake_parts.py: no DeepSpeed, no launch)."""
import dataclasses
import pathlib
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/training: fake_parts.py

from fake_parts import MODEL, MemoryCheckpointer, fake_trainer, one_rank_group  # noqa: E402

from moep_ds.config import config_from_dict  # noqa: E402
from moep_ds.schema import ConfigError  # noqa: E402
from moep_ds.training.callbacks.builtin import (  # noqa: E402
    CheckpointingConfig, MonitoringConfig, ValidationConfig, callback_configs,
)
from moep_ds.training.callbacks.downstream_eval import DownstreamEvalConfig  # noqa: E402


@pytest.fixture
def user_module(monkeypatch):
    """tests/training/fixtures/user_callbacks.py importable as a user's module; a one-rank process group."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "fixtures"))
    with one_rank_group():
        yield


def configs(train: dict, eval_data_dir: str | None = None) -> dict:
    cfg = config_from_dict({"model": MODEL, "data": {"seq_len": 8}, "train": train})
    return callback_configs(cfg.train, seq_len=cfg.data.seq_len, eval_data_dir=eval_data_dir)


def test_recipe_fields_and_train_callbacks_give_the_built_in_callbacks_their_configs_once():
    """Each setting from the recipe field it stands for or from the callback's entry; both at once with different
    values is an error naming both; the result read back as train.callbacks gives itself again."""
    defaults = configs({})
    assert defaults["monitoring"] == MonitoringConfig() and defaults["checkpointing"] == CheckpointingConfig()
    assert defaults["validation"] == ValidationConfig(seq_len=8)  # data.seq_len, which the recipe always has
    assert list(defaults) == ["router_thresholds", "lifecycle", "monitoring", "checkpointing", "validation", "stop"]

    train = {"log_every": 5, "eval_every": 4, "eval_batches": 3, "checkpoint": {"every_steps": None, "every_minutes": 2.5}}
    got = configs(train)
    assert got["monitoring"] == MonitoringConfig(log_every=5)
    assert got["checkpointing"] == CheckpointingConfig(every_steps=None, every_minutes=2.5, at_end=True)
    assert got["validation"] == ValidationConfig(every=4, batches=3, seq_len=8)

    entries = {"checkpointing": {"type": "checkpointing", "every_minutes": 30, "at_end": False},
               "monitoring": {"type": "monitoring", "log_every": 5}, "validation": None,
               "evals": {"type": "downstream_eval", "every": 7}}
    got = configs({"log_every": 5, "callbacks": entries}, eval_data_dir="/data")
    assert got["checkpointing"] == CheckpointingConfig(every_minutes=30, at_end=False)
    assert got["monitoring"] == MonitoringConfig(log_every=5)  # given in both, alike
    assert got["validation"] is None
    assert got["evals"] == DownstreamEvalConfig(every=7, data_dir="/data")  # eval.data_dir
    cfg = config_from_dict({"model": MODEL, "data": {"seq_len": 8}, "train": {"log_every": 5, "callbacks": entries}})
    again = dataclasses.replace(cfg.train, callbacks=got)
    assert callback_configs(again, seq_len=8, eval_data_dir="/data") == got

    with pytest.raises(ConfigError, match=r"^train.callbacks.monitoring.log_every \(7\) and train.log_every \(5\) set "
                                          r"the same setting with different values: give it in one of them$"):
        configs({"log_every": 5, "callbacks": {"monitoring": {"type": "monitoring", "log_every": 7}}})
    with pytest.raises(ConfigError, match=r"^train.callbacks.ckpt.every_steps \(500\) and "
                                          r"train.checkpoint.every_steps \(None\) set the same setting"):
        configs({"checkpoint": {"every_steps": None}, "callbacks": {"ckpt": {"type": "checkpointing", "every_steps": 500}}})
    with pytest.raises(ConfigError, match=r"^train.callbacks.validation.seq_len \(4\) and data.seq_len \(8\) set "):
        configs({"callbacks": {"validation": {"type": "validation", "seq_len": 4}}})
    with pytest.raises(ConfigError, match=r"^train.callbacks.evals.data_dir \('/b'\) and eval.data_dir \('/a'\) set "):
        configs({"callbacks": {"evals": {"type": "downstream_eval", "data_dir": "/b"}}}, eval_data_dir="/a")
    with pytest.raises(ConfigError, match=r"^train.callbacks.monitoring.log_evry: unknown key; did you mean "):
        configs({"callbacks": {"monitoring": {"type": "monitoring", "log_evry": 7}}})


def test_a_conflicting_setting_fails_build_trainer_before_anything_is_built(tmp_path):
    from moep_ds.training.trainer import build_trainer

    cfg = config_from_dict({"model": MODEL, "train": {"output_dir": str(tmp_path / "run"), "max_steps": 2,
                                                      "checkpoint": {"every_minutes": 5},
                                                      "callbacks": {"checkpointing": {"type": "checkpointing",
                                                                                      "every_minutes": 10}}}})
    with pytest.raises(ConfigError, match=r"^train.callbacks.checkpointing.every_minutes \(10.0\) and "
                                          r"train.checkpoint.every_minutes \(5.0\) set the same setting"):
        build_trainer(cfg)
    assert not (tmp_path / "run").exists()


class FakeClock:
    """time.time() that moves only when a step trains (a minute each) or the test says so."""

    def __init__(self, monkeypatch):
        self.now = 1_000_000.0
        monkeypatch.setattr(time, "time", lambda: self.now)

    def training_minutes(self, trainer) -> None:
        train_step = trainer.module.train_step

        def step():
            self.now += 60
            return train_step()

        trainer.module.train_step = step


def test_every_minutes_counts_training_time_across_a_stop_and_a_resume(tmp_path, user_module, monkeypatch):
    """every_minutes: 5, a step a minute: stopped after minute 3 (its checkpoint holds the clock, 3 minutes), a day
    in the queue, resumed: saves at minute 5 and 10 of training (steps 5 and 10), not 5 minutes after the resume
    (step 8), nor at once for the day of waiting; only its own saves restart the clock (the stop's did not)."""
    clock = FakeClock(monkeypatch)
    checkpointer = MemoryCheckpointer()
    train = {"max_steps": 20, "exit_at_step": 3,
             "checkpoint": {"every_steps": None, "every_minutes": 5, "at_end": False}}
    first = fake_trainer(tmp_path, train, checkpointer=checkpointer)
    clock.training_minutes(first)
    first.fit()
    assert sorted(checkpointer.saved) == [3]
    assert checkpointer.saved[3]["callbacks"] == {"checkpointing": {"trained_seconds": 180.0}}
    clock.now += 24 * 3600
    second = fake_trainer(tmp_path, {**train, "exit_at_step": 11}, checkpointer=checkpointer, resume_step=3)
    assert second.callbacks["checkpointing"].state_dict() == {"trained_seconds": 180.0}  # by its name
    clock.training_minutes(second)
    second.fit()
    assert sorted(checkpointer.saved) == [3, 5, 10, 11]
    assert [checkpointer.saved[s]["callbacks"]["checkpointing"]["trained_seconds"] for s in (5, 10, 11)] == [0, 0, 60]


def test_a_users_callback_with_its_own_config_and_state_needs_no_change_to_the_trainer(tmp_path, user_module):
    """user_callbacks:LossLog named twice in train.callbacks, with two configs: each gets its config parsed, its
    state is saved under its own name and given back to the callback of that name on resume."""
    from user_callbacks import LossLog, LossLogConfig

    checkpointer = MemoryCheckpointer()
    train = {"max_steps": 6, "exit_at_step": 4, "callbacks": {
        "halves": {"type": "user_callbacks:LossLog", "every": 2, "scale": 10},
        "fourths": {"type": "user_callbacks:LossLog", "every": 4}}}
    first = fake_trainer(tmp_path, train, checkpointer=checkpointer)
    assert isinstance(first.callbacks["halves"], LossLog)
    assert first.callbacks["halves"].cfg == LossLogConfig(type="user_callbacks:LossLog", every=2, scale=10.0)
    first.fit()
    saved = checkpointer.saved[4]["callbacks"]
    assert saved == {"halves": {"kept": [[2, 5.0], [4, 2.5]]}, "fourths": {"kept": [[4, 0.25]]}}
    second = fake_trainer(tmp_path, {**train, "exit_at_step": None}, checkpointer=checkpointer, resume_step=4)
    assert {name: second.callbacks[name].loaded for name in ("halves", "fourths")} == saved
    second.fit()
    assert checkpointer.saved[6]["callbacks"]["halves"]["kept"] == [[2, 5.0], [4, 2.5], [6, pytest.approx(10 / 6)]]
    with pytest.raises(ConfigError, match=r"^train.callbacks.mine.every \(0\) must be > 0$"):
        fake_trainer(tmp_path, {"max_steps": 1, "callbacks": {"mine": {"type": "user_callbacks:LossLog", "every": 0}}})


class WithoutRecipe:
    """The trainer as a callback sees it, less its recipe: reading `cfg` fails the test."""

    def __init__(self, trainer):
        self.trainer = trainer

    def __getattr__(self, name):
        if name == "cfg":
            raise AssertionError("a callback read the trainer's recipe")
        return getattr(self.trainer, name)


def test_no_built_in_callback_reads_the_trainers_recipe(tmp_path, user_module):
    checkpointer = MemoryCheckpointer()
    trainer = fake_trainer(tmp_path, {"max_steps": 3, "eval_every": 2, "checkpoint": {"every_steps": 2,
                                                                                     "every_minutes": 60}},
                           checkpointer=checkpointer)
    trainer.callbacks["monitoring"].monitor.close()
    for _, callback in trainer.order:
        callback.trainer = WithoutRecipe(trainer)
        callback.setup()
    trainer.fit()
    assert sorted(checkpointer.saved) == [2, 3] and trainer.module.evaluations == 2
