"""How many optimizer steps a run takes: max_steps, else epochs over the prepared windows."""
import logging

import pytest

from moep_ds.config import config_from_dict
from moep_ds.errors import UserError
from moep_ds.training.startup import total_steps

MODEL = {"vocab_size": 64, "d_model": 32, "max_seq_len": 16, "layers": [{"type": "dense", "attention": {"num_heads": 2}}]}


def cfg(**train):
    """The train section total_steps reads, as a recipe parses it."""
    return config_from_dict({"model": MODEL, "train": train}).train


def test_epochs_give_the_steps_and_max_steps_overrides_them_with_a_warning(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("moep_ds"), "propagate", True)  # a trainer in this process turns it off
    assert total_steps(cfg(epochs=2), num_windows=100, global_batch=8) == 24  # 2 x 12 full global batches
    assert total_steps(cfg(epochs=0.01), num_windows=100, global_batch=8) == 1
    assert total_steps(cfg(max_steps=7), num_windows=100, global_batch=8) == 7 and "overrides" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="moep_ds"):
        assert total_steps(cfg(max_steps=5, epochs=8), num_windows=100, global_batch=8) == 5
    assert "train.max_steps (5) overrides train.epochs (8), as max_steps does in HF's Trainer" in caplog.text
    with pytest.raises(UserError, match=r"train.max_steps \(None\) must be set when train.epochs is not"):
        total_steps(cfg(), num_windows=100, global_batch=8)


@pytest.mark.parametrize("num_windows, global_batch", [(100, 8), (96, 8), (61, 4), (7, 7)])
def test_whole_epochs_end_where_the_sampler_starts_the_next_epoch(num_windows, global_batch):
    """`epochs: k` trains exactly the k epochs the BatchLoader serves (each its full global batches only), and a
    fraction of an epoch the whole batches of that fraction."""
    import numpy as np

    from moep_ds.data.sampler import BatchLoader

    loader = BatchLoader(np.zeros(num_windows), micro_batch_size=global_batch, grad_accum=1, dp_rank=0, dp_size=1,
                         seed=0)
    served = 0  # optimizer steps the sampler has served since the start
    for epochs in (1, 2, 3):
        while loader.epoch < epochs:
            loader.next_indices()
            served += 1
        assert total_steps(cfg(epochs=epochs), num_windows=num_windows, global_batch=global_batch) == served
    per_epoch = served // 3
    for fraction in (0.5, 0.29, 1.5):
        assert total_steps(cfg(epochs=fraction), num_windows=num_windows, global_batch=global_batch) == \
            max(1, int(round(fraction * 100)) * per_epoch // 100)


MOE_MODEL = {"vocab_size": 64, "d_model": 32, "max_seq_len": 16, "layers": [
    {"type": "ffn_moe", "attention": {"num_heads": 2},
     "moe": {"num_experts": 4, "expert": {"type": "swiglu", "hidden_size": 32},
             "router": {"type": "topk", "k": 2, "load_balancing_weight": 0.5}}}]}


@pytest.mark.parametrize("num_windows, eval_batches, scored", [(9, 1, 4), (9, 8, 8), (10, 8, 8)])
def test_validation_loss_is_the_mean_token_loss_over_the_same_windows_at_any_rank_count(
        tmp_path, monkeypatch, num_windows, eval_batches, scored):
    """TrainModule.evaluate (over the windows the validation callback opened) on 1 and 2 simulated ranks (the all-reduce stubbed out: rank r's share is total_r / all
    windows, so the shares add up to the mean), micro-batches of 2, a global batch of 4 (on 1 rank: 2 accumulation
    steps): the first eval_batches x 4 validation windows (all whole global batches when fewer: 10 windows are 8 on
    1 rank too, where whole micro-batch steps would be 10), in file order, the mean next-token cross-entropy without the auxiliary loss, routers in eval mode;
    the model is back in train mode after."""
    import json
    import types

    import numpy as np
    import torch
    import torch.nn.functional as F

    from moep_ds.models.causal_lm import build_model
    from moep_ds.training import train_module as train_module_mod
    from moep_ds.training.train_module import TrainModule

    seq_len = 8
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    tokens = np.random.default_rng(0).integers(0, 64, num_windows * seq_len + 1).astype(np.uint16)
    tokens.tofile(tmp_path / "val.bin")
    cfg = config_from_dict({"model": MOE_MODEL, "data": {"seq_len": seq_len},
                            "train": {"max_steps": 1, "eval_every": 1, "eval_batches": eval_batches}})
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.train()
    monkeypatch.setattr(train_module_mod.dist, "all_reduce", lambda tensor: None)

    def evaluate(rank, world):
        module = types.SimpleNamespace(engine=model, rank=rank, world=world, device=torch.device("cpu"),
                                       ds={"train_micro_batch_size_per_gpu": 2, "train_batch_size": 4})
        validation = validation_callback(tmp_path, cfg, module)
        value = TrainModule.evaluate(module, validation.val, validation.windows)
        assert model.training
        return value

    one, two = evaluate(0, 1), evaluate(0, 2) + evaluate(1, 2)
    windows = torch.from_numpy(tokens.astype(np.int64))
    model.eval()
    with torch.no_grad():
        naive = []
        for w in range(scored):
            x = windows[w * seq_len:(w + 1) * seq_len + 1]
            logits = model(x[None, :-1]).logits[0]
            naive.append(F.cross_entropy(logits.double(), x[1:]).item())
        aux = model(windows[None, :seq_len], labels=windows[None, 1:seq_len + 1])
    assert float(aux.loss) != pytest.approx(float(aux.ce_loss), abs=1e-6)  # the auxiliary loss is not nothing
    assert one == pytest.approx(sum(naive) / len(naive), abs=1e-5)
    assert two == pytest.approx(one, abs=1e-5)


def test_too_few_validation_windows_for_one_evaluation_step_are_refused_at_start(tmp_path):
    import json
    import types

    import numpy as np

    from moep_ds.data.errors import DataError

    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    np.zeros(3 * 8 + 1, dtype=np.uint16).tofile(tmp_path / "val.bin")
    cfg = config_from_dict({"model": MOE_MODEL, "data": {"seq_len": 8}, "train": {"max_steps": 1, "eval_every": 5}})
    module = types.SimpleNamespace(world=2, ds={"train_micro_batch_size_per_gpu": 2, "train_batch_size": 4})
    with pytest.raises(DataError, match=r"^train.eval_every \(5\): 3 validation windows in '.*' are fewer than one "
                                        r"global batch \(4\); hold out more \(data.val_fraction\) or give a "
                                        r"data.val_source$"):
        validation_callback(tmp_path, cfg, module)
    cfg = config_from_dict({"model": MOE_MODEL, "data": {"seq_len": 8}, "train": {"max_steps": 1}})
    assert validation_callback(tmp_path, cfg, module).val is None  # no evaluation: the split is not read


def validation_callback(prepared, cfg, module):
    """The built-in validation callback set up on a trainer of `cfg` whose prepared corpus is `prepared`."""
    import types

    from moep_ds.training.callbacks.builtin import Validation, callback_configs

    callback = Validation(callback_configs(cfg.train, seq_len=cfg.data.seq_len)["validation"])
    callback.trainer = types.SimpleNamespace(prepared=prepared, module=module)
    callback.setup()
    return callback


def fake_preparation(monkeypatch, copies):
    """assemble's dist and preparation replaced by recorders; `copies` is what all_gather_object gathers."""
    import types

    from moep_ds.training import assemble as trainer_mod

    calls = []

    def gather(out, obj, group):
        calls.append(("all_gather_object", group))
        out[:] = [obj if c is None else c for c in copies]

    fake = types.SimpleNamespace(
        new_group=lambda **kw: calls.append(("new_group", kw)) or "waiting",
        monitored_barrier=lambda **kw: calls.append(("barrier", kw)),
        all_gather_object=gather, get_world_size=lambda: len(copies),
        destroy_process_group=lambda group: calls.append(("destroy", group)))
    monkeypatch.setattr(trainer_mod, "dist", fake)
    monkeypatch.setattr(trainer_mod, "prepare", lambda data: calls.append(("prepare", None)) or "dir")
    monkeypatch.setattr(trainer_mod, "check_meta", lambda prepared, vocab_size: {
        "vocab_size": vocab_size, "tokenizer_sha256": "abc", "train_tokens": 100})
    return trainer_mod, calls


def test_ranks_wait_for_the_preparation_in_a_group_of_a_long_timeout(monkeypatch):
    """Tokenizing a large corpus on first use can outlast the collectives' timeout (DeepSpeed's 10 minutes): the
    ranks wait in monitored barriers of a group of their own with PREPARE_TIMEOUT, then leave it. Rank 0 prepares
    first, then the first rank of each other node (its node's copy, where the nodes do not share the cache), then
    the rest."""
    trainer_mod, calls = fake_preparation(monkeypatch, [None, None])
    cfg = config_from_dict({"model": MODEL, "train": {"max_steps": 1}})
    for rank, local_rank, turn in ((0, 0, 0), (1, 1, 2), (4, 0, 1), (5, 1, 2)):  # two nodes of four
        calls.clear()
        prepared, meta = trainer_mod.prepare_data(cfg, rank, local_rank)
        assert (prepared, meta["vocab_size"]) == ("dir", 64)
        barriers = ["barrier"] * 3
        assert [name for name, _ in calls] == ["new_group", *barriers[:turn], "prepare", *barriers[turn:],
                                               "all_gather_object", "destroy"], rank
        assert calls[0][1] == {"backend": "gloo"}
        assert all(kw == {"group": "waiting", "timeout": trainer_mod.PREPARE_TIMEOUT, "wait_all_ranks": True}
                   for name, kw in calls if name == "barrier")
        assert calls[-1] == ("destroy", "waiting")
    assert trainer_mod.PREPARE_TIMEOUT.total_seconds() >= 6 * 3600


def test_copies_prepared_on_several_nodes_must_agree(monkeypatch):
    from moep_ds.errors import SharedUserError

    trainer_mod, calls = fake_preparation(monkeypatch, [None, ("other", 100)])
    cfg = config_from_dict({"model": MODEL, "train": {"max_steps": 1}})
    with pytest.raises(SharedUserError, match=r"^the ranks prepared different corpora \(2 tokenizers / token counts "
                                              r"for 'dir'\): nodes that do not share \$MOEP_CACHE_DIR"):
        trainer_mod.prepare_data(cfg, 0, 0)
    assert calls[-1] == ("destroy", "waiting")  # the group is left before the error
