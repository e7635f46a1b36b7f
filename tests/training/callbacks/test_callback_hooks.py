"""The trainer's callbacks (training/callbacks/): recipe entries parsed strictly, a user's own callback class named
as module:Class and run at its hooks end to end, the typed trainer state reading the checkpoints written before it
(version 1)."""
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/training: tiny.py

from moep_ds.schema import ConfigError  # noqa: E402
from moep_ds.training.callbacks import CALLBACKS, Callback, parse_callback  # noqa: E402
from moep_ds.training.checkpoint import CheckpointError  # noqa: E402
from moep_ds.training.trainer_state import VERSION, TrainerState  # noqa: E402

from ranks import run_ranks  # noqa: E402
from tiny import REPO, pretrain, write_recipe  # noqa: E402

RECORDER = '''
import dataclasses
import json

from moep_ds.training.callbacks import Callback


@dataclasses.dataclass(kw_only=True)
class RecorderConfig:
    type: str
    out: str


class Recorder(Callback):
    Config = RecorderConfig

    def __init__(self, cfg):
        self.out = open(cfg.out, "a")

    def record(self, hook, event):
        self.out.write(json.dumps({"hook": hook, "step": event.step, "rank": self.trainer.rank,
                                   **({"metrics": event.metrics} if hook == "on_evaluation" else {}),
                                   **({"stop": event.stop} if hook == "after_step" else {})}) + "\\n")
        self.out.flush()

    def before_step(self, event): self.record("before_step", event)
    def after_optimizer_step(self, event): self.record("after_optimizer_step", event)
    def after_step(self, event): self.record("after_step", event)
    def on_save(self, event): self.record("on_save", event)
    def on_evaluation(self, event): self.record("on_evaluation", event)
    def on_load(self, event): self.record("on_load", event)
    def on_stop(self, event): self.record("on_stop", event)
    def at_end(self, event): self.record("at_end", event)


class NotACallback:
    pass
'''

V1_STATE = {"step": 4, "max_steps": 10, "global_samples": 64, "skipped_steps": 0,
            "data": {"epoch": 0, "global_batch": 4}, "global_batch_size": 16, "lr_scheduler": {"last_epoch": 4},
            "loss_scaler": None, "world_size": 2, "expert_parallel_size": 1, "seed": 1234,
            "tokenizer_sha256": "ab", "optimizer_step": 4}


def test_trainer_state_reads_version_1_and_writes_version_2_without_losing_keys():
    state = TrainerState.from_state_dict(V1_STATE)
    assert (state.step, state.global_samples, state.global_batch_size, state.world_size) == (4, 64, 16, 2)
    assert state.data == {"epoch": 0, "global_batch": 4} and state.extra == {"optimizer_step": 4}
    out = state.state_dict()
    assert out == {"version": VERSION, **V1_STATE}
    assert TrainerState.from_state_dict(out) == state
    oldest = {"step": 3, "global_samples": 48, "data": {"epoch": 0, "global_batch": 3}}  # before max_steps existed
    assert TrainerState.from_state_dict(oldest).max_steps is None
    with pytest.raises(CheckpointError, match=r"^ckpt: trainer state version 9 is newer than this moep_ds reads"):
        TrainerState.from_state_dict({**V1_STATE, "version": 9}, "ckpt")
    with pytest.raises(CheckpointError, match=r"^ckpt: trainer state lacks data$"):
        TrainerState.from_state_dict({"step": 1, "global_samples": 8}, "ckpt")


def test_recipe_entries_are_parsed_strictly_and_user_classes_imported(tmp_path, monkeypatch):
    (tmp_path / "my_callbacks.py").write_text(RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = parse_callback({"type": "downstream_eval", "tasks": ["grammar_pairs"], "every": 10, "limit": 4}, "x[0]")
    assert (cfg.tasks, cfg.every, cfg.limit) == (["grammar_pairs"], 10, 4)
    with pytest.raises(ConfigError, match=r"^train.callbacks\[0\].evry: unknown key; did you mean 'every'\?"):
        parse_callback({"type": "downstream_eval", "evry": 10}, "train.callbacks[0]")
    with pytest.raises(ConfigError, match=r"^t\[1\].every \(0\) must be > 0$"):
        parse_callback({"type": "downstream_eval", "every": 0}, "t[1]")
    with pytest.raises(ConfigError, match=r"^t\[0\].type: unknown callback 'nope'; known: .*downstream_eval"):
        parse_callback({"type": "nope"}, "t[0]")
    for name in ("my_callbacks:Recorder", "my_callbacks.Recorder"):
        assert parse_callback({"type": name, "out": "f"}, "t[0]").out == "f"
        assert issubclass(CALLBACKS.get(name), Callback)
    with pytest.raises(ConfigError, match=r"^t\[0\].out: required key is missing$"):
        parse_callback({"type": "my_callbacks:Recorder"}, "t[0]")
    with pytest.raises(ConfigError, match=r"^t\[0\].type: 'my_callbacks:NotACallback' is not a subclass of "):
        parse_callback({"type": "my_callbacks:NotACallback"}, "t[0]")
    with pytest.raises(ConfigError, match=r"^t\[0\].type: cannot import 'no_such_module:X'"):
        parse_callback({"type": "no_such_module:X"}, "t[0]")


@pytest.mark.slow
def test_a_users_callback_named_in_the_recipe_runs_at_its_hooks(tmp_path):
    """A class in the user's own module (on PYTHONPATH), named in train.callbacks: every hook in the loop's order
    (the step's checkpoint before its evaluation), on_stop at exit_at_step, on_load when resumed."""
    (tmp_path / "my_callbacks.py").write_text(RECORDER)
    log_path = tmp_path / "hooks.jsonl"
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=4, eval_every=2, exit_at_step=3,
                          checkpoint={"every_steps": 2, "keep_last": 3, "at_end": True},
                          callbacks=[{"type": "my_callbacks:Recorder", "out": str(log_path)}])
    args = ["--config", str(recipe), "--ds_config", str(REPO / "ds_configs" / "quickstart.json")]

    def run(*extra):
        run_ranks(1, pretrain_from, str(tmp_path), [*args, *extra])

    run()
    rows = [json.loads(line) for line in log_path.read_text().splitlines()]
    hooks = [(r["hook"], r["step"]) for r in rows]
    step = [("before_step", 1), ("after_optimizer_step", 1), ("after_step", 1)]
    assert hooks == step + [
        ("before_step", 2), ("after_optimizer_step", 2), ("on_save", 2), ("on_evaluation", 2), ("after_step", 2),
        ("before_step", 3), ("after_optimizer_step", 3), ("on_save", 3), ("after_step", 3), ("on_stop", 3),
        ("at_end", 3)]
    assert "val_loss" in rows[hooks.index(("on_evaluation", 2))]["metrics"]
    assert rows[hooks.index(("after_step", 3))]["stop"] is True
    log_path.unlink()
    run("--resume", "auto", "--set", "train.exit_at_step=null")
    hooks = [(r["hook"], r["step"]) for r in (json.loads(line) for line in log_path.read_text().splitlines())]
    assert hooks[0] == ("on_load", 3)
    assert hooks[1:] == [("before_step", 4), ("after_optimizer_step", 4), ("on_save", 4), ("on_evaluation", 4),
                         ("after_step", 4), ("at_end", 4)]


def pretrain_from(path: str, argv: list[str]) -> None:
    """pretrain.py with `path` on the module search path, as PYTHONPATH puts it there."""
    sys.path.insert(0, path)
    pretrain(argv)
