"""Checkpoints of the earlier consolidated format (training/consolidated.py): read one tensor at a time, checked
against the model."""
import pytest
import torch

from moep_ds.checkpointing.model_dir import save_model_dir
from moep_ds.checkpointing.sharded import CheckpointError
from moep_ds.config import config_from_dict
from moep_ds.models.causal_lm import build_model
from moep_ds.training.consolidated import load_consolidated_model


def config(hidden: int):
    return config_from_dict({"model": {"flavour": "llama", "vocab_size": 64, "d_model": 16, "max_seq_len": 16,
                                       "layers": [{"type": "ffn_moe", "attention": {"num_heads": 2},
                                                   "moe": {"num_experts": 4, "expert": {"type": "swiglu",
                                                                                        "hidden_size": hidden},
                                                           "router": {"type": "topk", "k": 2}}}]}})


def test_weights_load_one_at_a_time_and_a_changed_shape_is_one_line(tmp_path):
    torch.manual_seed(0)
    source = build_model(config(24).model)
    save_model_dir(source, config(24), tmp_path / "ckpt")
    again = build_model(config(24).model, initialise=False)
    load_consolidated_model(again, tmp_path / "ckpt")
    for (name, a), b in zip(source.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    wider = build_model(config(32).model)
    with pytest.raises(CheckpointError) as err:
        load_consolidated_model(wider, tmp_path / "ckpt")
    assert str(err.value) == (f"checkpoint {str(tmp_path / 'ckpt')!r}: tensor 'blocks.0.moe.experts.w1_EDF' has "
                              "shape [4, 16, 24] there but [4, 16, 32] in this model")
