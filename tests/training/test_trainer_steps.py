"""How many optimizer steps a run takes: max_steps, else epochs over the prepared windows."""
import logging

import pytest

from moep_ds.config import config_from_dict
from moep_ds.errors import UserError
from moep_ds.training.trainer import total_steps

MODEL = {"vocab_size": 64, "d_model": 32, "max_seq_len": 16, "layers": [{"type": "dense", "attention": {"num_heads": 2}}]}


def cfg(**train):
    return config_from_dict({"model": MODEL, "train": train})


def test_epochs_give_the_steps_and_max_steps_overrides_them_with_a_warning(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("moep_ds"), "propagate", True)  # a trainer in this process turns it off
    assert total_steps(cfg(epochs=2), num_windows=100, global_batch=8) == 25
    assert total_steps(cfg(epochs=0.01), num_windows=100, global_batch=8) == 1
    assert total_steps(cfg(max_steps=7), num_windows=100, global_batch=8) == 7 and "overrides" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="moep_ds"):
        assert total_steps(cfg(max_steps=5, epochs=8), num_windows=100, global_batch=8) == 5
    assert "train.max_steps (5) overrides train.epochs (8), as max_steps does in HF's Trainer" in caplog.text
    with pytest.raises(UserError, match=r"train.max_steps \(None\) must be set when train.epochs is not"):
        total_steps(cfg(), num_windows=100, global_batch=8)
