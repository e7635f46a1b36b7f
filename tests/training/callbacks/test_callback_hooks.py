"""The trainer's callbacks (training/callbacks/): recipe entries parsed strictly (a user's own callback class named
as module:Class; running at its hooks: tests/training/test_trainer_loop.py), the typed trainer state reading the
checkpoints written before it (versions 1 to 3)."""
import pathlib

import pytest

from moep_ds.schema import ConfigError
from moep_ds.training.callbacks import CALLBACKS, Callback, parse_callback
from moep_ds.checkpointing.sharded import CheckpointError
from moep_ds.training.trainer_state import VERSION, TrainerState

V1_STATE = {"step": 4, "max_steps": 10, "global_samples": 64, "skipped_steps": 0,
            "data": {"epoch": 0, "global_batch": 4}, "global_batch_size": 16, "lr_scheduler": {"last_epoch": 4},
            "loss_scaler": None, "world_size": 2, "expert_parallel_size": 1, "seed": 1234,
            "tokenizer_sha256": "ab", "optimizer_step": 4}


def test_trainer_state_reads_versions_1_and_2_and_writes_version_4_without_losing_keys():
    state = TrainerState.from_state_dict(V1_STATE)
    assert (state.step, state.global_samples, state.global_batch_size, state.world_size) == (4, 64, 16, 2)
    assert state.data_loader == {"epoch": 0, "global_batch": 4, "global_batch_size": 16}
    assert state.train_module["optimizer_step"] == 4 and state.callbacks == {}
    assert TrainerState.from_state_dict({**V1_STATE, "version": 2, "future_key": 1}).extra == {"future_key": 1}
    out = state.state_dict()
    assert VERSION == 4 and out["version"] == 4 and set(out) == {"version", "trainer", "train_module", "data_loader",
                                                                 "callbacks"}
    assert TrainerState.from_state_dict(out) == state
    with_key = TrainerState.from_state_dict({**out, "future_key": 1})  # unknown keys of version 4 are kept too
    assert with_key.state_dict() == {**out, "future_key": 1}
    oldest = {"step": 3, "global_samples": 48, "data": {"epoch": 0, "global_batch": 3}}  # before max_steps existed
    assert TrainerState.from_state_dict(oldest).max_steps is None
    with pytest.raises(CheckpointError, match=r"^ckpt: trainer state version 9 is newer than this moep_ds reads \(1 to 4\)$"):
        TrainerState.from_state_dict({**V1_STATE, "version": 9}, "ckpt")
    with pytest.raises(CheckpointError, match=r"^ckpt: trainer state lacks data$"):
        TrainerState.from_state_dict({"step": 1, "global_samples": 8}, "ckpt")


def test_recipe_entries_are_parsed_strictly_and_user_classes_imported(monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "fixtures"))  # user_callbacks.py
    cfg = parse_callback({"type": "downstream_eval", "tasks": ["grammar_pairs"], "every": 10, "limit": 4}, "x[0]")
    assert (cfg.tasks, cfg.every, cfg.limit) == (["grammar_pairs"], 10, 4)
    with pytest.raises(ConfigError, match=r"^train.callbacks\[0\].evry: unknown key; did you mean 'every'\?"):
        parse_callback({"type": "downstream_eval", "evry": 10}, "train.callbacks[0]")
    with pytest.raises(ConfigError, match=r"^t\[1\].every \(0\) must be > 0$"):
        parse_callback({"type": "downstream_eval", "every": 0}, "t[1]")
    with pytest.raises(ConfigError, match=r"^t\[0\].type: unknown callback 'nope'; known: .*downstream_eval"):
        parse_callback({"type": "nope"}, "t[0]")
    for name in ("user_callbacks:Recorder", "user_callbacks.Recorder"):
        assert parse_callback({"type": name, "out": "f"}, "t[0]").out == "f"
        assert issubclass(CALLBACKS.get(name), Callback)
    with pytest.raises(ConfigError, match=r"^t\[0\].out: required key is missing$"):
        parse_callback({"type": "user_callbacks:Recorder"}, "t[0]")
    with pytest.raises(ConfigError, match=r"^t\[0\].type: 'user_callbacks:NotACallback' is not a subclass of "):
        parse_callback({"type": "user_callbacks:NotACallback"}, "t[0]")
    with pytest.raises(ConfigError, match=r"^t\[0\].type: cannot import 'no_such_module:X'"):
        parse_callback({"type": "no_such_module:X"}, "t[0]")


def test_train_callbacks_are_read_by_name_and_parsed_into_their_configs_before_the_trainer_is_built(tmp_path):
    """The mapping form names each callback (null removes a built-in one); the list form names each by its type.
    Reading the recipe checks that shape only: resolving a type imports its module, which the root recipe does not
    (tests/test_import_contract.py). build_trainer parses each entry into its config class first, so that a wrong
    option fails before anything is built (no run directory); the trainer builds from those configs."""
    from moep_ds.config import config_from_dict, dump_config
    from moep_ds.training.callbacks import parse_callbacks
    from moep_ds.training.callbacks.downstream_eval import DownstreamEvalConfig
    from moep_ds.training.trainer import build_trainer

    model = {"vocab_size": 64, "d_model": 32, "max_seq_len": 16, "layers": [{"type": "dense", "attention": {"num_heads": 2}}]}
    cfg = config_from_dict({"model": model, "train": {"callbacks": {
        "validation": None, "evals": {"type": "downstream_eval", "every": 5}}}})
    assert cfg.train.callbacks == {"validation": None, "evals": {"type": "downstream_eval", "every": 5}}
    parsed = parse_callbacks(cfg.train.callbacks, "train.callbacks")
    assert parsed == {"validation": None, "evals": DownstreamEvalConfig(every=5)}
    again = config_from_dict({"model": model, "train": {"callbacks": parsed}})  # parsed configs, read back
    assert parse_callbacks(again.train.callbacks, "train.callbacks") == parsed and "validation: null" in dump_config(cfg)
    listed = config_from_dict({"model": model, "train": {"callbacks": [{"type": "downstream_eval"}] * 2}})
    assert list(listed.train.callbacks) == ["downstream_eval", "downstream_eval_2"]
    with pytest.raises(ConfigError, match=r"^train.callbacks: 'x' must be a mapping of names to callbacks"):
        config_from_dict({"model": model, "train": {"callbacks": "x"}})
    with pytest.raises(ConfigError, match=r"^train.callbacks.evals: \{'every': 1\} must be a mapping with a 'type' key"):
        config_from_dict({"model": model, "train": {"callbacks": {"evals": {"every": 1}}}})
    output_dir = tmp_path / "run"
    wrong = config_from_dict({"model": model, "train": {"output_dir": str(output_dir), "callbacks": {
        "evals": {"type": "downstream_eval", "evry": 1}}}})
    with pytest.raises(ConfigError, match=r"^train.callbacks.evals.evry: unknown key; did you mean 'every'\?"):
        build_trainer(wrong)
    unknown = config_from_dict({"model": model, "train": {"output_dir": str(output_dir), "callbacks": ["no_such"]}})
    with pytest.raises(ConfigError, match=r"^train.callbacks.no_such.type: unknown callback 'no_such'"):
        build_trainer(unknown)
    assert not output_dir.exists()

