"""The lr schedules: GPT-NeoX v1.0's AnnealingLR (Pythia's) against a transcription of its code, the re-warm-up of
a run started at a later step, and the start-step rule (training/branch.py)."""
import math
import types

import numpy as np
import pytest
import torch

from moep_ds.config import config_from_dict, load_config
from moep_ds.data.sampler import BatchLoader
from moep_ds.errors import UserError
from moep_ds.training.branch import resolve_start_step, revision_step, start_step
from moep_ds.train_config import ScheduleConfig
from moep_ds.training.optim import build_scheduler, lr_multiplier

from repo_paths import CONFIGS


class AnnealingLR:
    """GPT-NeoX v1.0 megatron/learning_rates.py AnnealingLR, transcribed (printing and checkpoint code left out):
    built with last_iter = 0 (training.py: init_step = 0), step() after each optimizer step (DeepSpeed's engine)."""

    def __init__(self, optimizer, start_lr, warmup_iter, total_iters, decay_style, last_iter, min_lr=0.0):
        self.optimizer = optimizer
        self.start_lr = start_lr
        self.min_lr = min_lr
        self.warmup_iter = warmup_iter
        self.num_iters = last_iter
        self.end_iter = total_iters
        self.decay_style = decay_style
        self.step(self.num_iters)

    def get_lr(self):
        num_iters_ = min(self.num_iters, self.end_iter - self.warmup_iter)
        if self.warmup_iter > 0 and self.num_iters <= self.warmup_iter:
            return float(self.start_lr) * num_iters_ / self.warmup_iter
        num_iters_ = num_iters_ - self.warmup_iter
        if self.decay_style == "linear":
            lr = self.start_lr * (self.end_iter - num_iters_) / self.end_iter
        elif self.decay_style == "cosine":
            lr = self.start_lr / 2.0 * (math.cos(math.pi * num_iters_ / self.end_iter) + 1)
        elif self.decay_style == "exponential":
            lr = self.start_lr * math.exp(-0.693 * num_iters_ / self.end_iter)
        else:
            lr = self.start_lr
        return max(lr, self.min_lr)

    def step(self, step_num=None):
        if step_num is None:
            step_num = self.num_iters + 1
        self.num_iters = step_num
        new_lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = new_lr


def pythia_lr(iteration: int) -> float:
    """The lr GPT-NeoX v1.0 used at `iteration` with pythia-1b.yml (lr 2.5e-4, min_lr 2.5e-5, warmup 0.01,
    train-iters = lr-decay-iters = 143,000, cosine): get_lr with num_iters = iteration."""
    opt = types.SimpleNamespace(param_groups=[{}])
    neox = AnnealingLR(opt, start_lr=0.00025, warmup_iter=0.01 * 143000, total_iters=143000, decay_style="cosine",
                       last_iter=0, min_lr=0.000025)
    neox.step(iteration)
    return opt.param_groups[0]["lr"]


STEPS = [0, 1, 1429, 1430, 1431, 71_500, 115_141, 141_570, 142_999]


def pythia_schedule():
    return load_config(CONFIGS / "pythia_1b_dense.yaml").train


@pytest.mark.parametrize("step", STEPS)
def test_neox_annealing_is_gpt_neox_v1_annealing_lr(step):
    train = pythia_schedule()
    assert train.schedule.kind == "neox_annealing"
    ours = train.optimizer.lr * lr_multiplier(step, train.schedule, train.max_steps)
    assert ours == pytest.approx(pythia_lr(step), abs=1e-12, rel=0)


def test_neox_annealing_stepped_as_deepspeed_steps_it():
    """The scheduler the trainer builds gives optimizer step s GPT-NeoX's lr of iteration s, one scheduler step per
    optimizer step from the first (lr 0: GPT-NeoX's first iteration trains at lr 0) through the floor."""
    train = pythia_schedule()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=train.optimizer.lr)
    sched = build_scheduler(opt, train.schedule, train.max_steps)
    neox_opt = types.SimpleNamespace(param_groups=[{}])
    neox = AnnealingLR(neox_opt, 0.00025, 0.01 * 143000, 143000, "cosine", 0, 0.000025)
    for s in range(1500):
        assert opt.param_groups[0]["lr"] == pytest.approx(neox_opt.param_groups[0]["lr"], abs=1e-12, rel=0), s
        opt.step()
        sched.step()
        neox.step()
    assert pythia_lr(0) == 0.0 and pythia_lr(1430) == pytest.approx(2.5e-4)
    # the floor from ~115,141 on: the cosine spans 143,000 steps from the end of warm-up
    assert pythia_lr(115_100) > 2.5e-5 and pythia_lr(115_200) == pytest.approx(2.5e-5)


@pytest.mark.parametrize("start", [13_000, 1_000, 120_000])
def test_a_scheduler_started_at_step_n_gives_gpt_neox_lr_of_iteration_n_then_n_plus_1(start):
    train = pythia_schedule()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=train.optimizer.lr)
    sched = build_scheduler(opt, train.schedule, train.max_steps, start_step=start)
    assert sched.last_epoch == start
    for s in range(start, start + 3):
        assert opt.param_groups[0]["lr"] == pytest.approx(pythia_lr(s), abs=1e-12, rel=0)
        opt.step()
        sched.step()


def test_rewarmup_ramps_linearly_to_the_schedule_at_n_plus_k():
    cfg = ScheduleConfig(kind="neox_annealing", warmup_steps=1430, min_lr_ratio=0.1, rewarmup_steps=100)
    n, k = 13_000, 100
    target = lr_multiplier(n + k, cfg, 143_000, start_step=n)
    assert target == lr_multiplier(n + k, ScheduleConfig(kind="neox_annealing", warmup_steps=1430), 143_000)
    ramp = [lr_multiplier(n + j, cfg, 143_000, start_step=n) for j in range(k)]
    assert ramp == pytest.approx([target * (j + 1) / k for j in range(k)], rel=1e-15)
    assert lr_multiplier(n + k + 5, cfg, 143_000, start_step=n) == pytest.approx(pythia_lr(n + k + 5) / 2.5e-4)
    # the trainer's scheduler, started at n: the ramp's first value at the first step, the schedule from n + k on
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.5e-4)
    sched = build_scheduler(opt, cfg, 143_000, start_step=n)
    applied = []
    for _ in range(k + 2):
        applied.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert applied[0] == pytest.approx(2.5e-4 * target / k, rel=1e-15)
    assert applied[k:] == pytest.approx([pythia_lr(n + k), pythia_lr(n + k + 1)], abs=1e-12, rel=0)


# ---- the start step: one rule -------------------------------------------------------------------------------

MODEL = {"vocab_size": 64, "d_model": 32, "max_seq_len": 16, "layers": [{"type": "dense", "attention": {"num_heads": 2}}]}


def cfg_with(init_from=None, **train):
    cfg = config_from_dict({"model": MODEL, "train": {"max_steps": 143_000, **train}})
    if init_from is not None:  # model.init_from is read with getattr: the field may not exist in this config tree
        cfg = types.SimpleNamespace(model=types.SimpleNamespace(init_from=init_from), train=cfg.train)
    return cfg


@pytest.mark.parametrize("source, step", [
    ("hf:EleutherAI/pythia-1b@step13000", 13000), ("hf:EleutherAI/pythia-1b@step0", 0),
    ("hf:EleutherAI/pythia-1b", None), ("hf:EleutherAI/pythia-1b@main", None), ("hf:org/x@step13000a", None),
    ("runs/dense/checkpoints/step13000", None), ("/data/pythia@step13000", None), (None, None),
])
def test_revision_step_reads_n_of_an_hf_revision_stepn_only(source, step):
    assert revision_step(source) == step


def test_start_step_rule(caplog):
    assert start_step(cfg_with()) == (0, "a run from scratch")
    assert start_step(cfg_with(start_step=500)) == (500, "train.start_step")
    branch = cfg_with("hf:EleutherAI/pythia-1b@step13000")
    assert start_step(branch) == (13000, "the revision of model.init_from ('hf:EleutherAI/pythia-1b@step13000')")
    both = cfg_with("hf:EleutherAI/pythia-1b@step13000", start_step=12000)
    assert start_step(both) == (12000, "train.start_step, not the 13000 of model.init_from "
                                       "('hf:EleutherAI/pythia-1b@step13000')")
    assert start_step(cfg_with("hf:EleutherAI/pythia-1b@main")) == (0, "a run from scratch")
    import logging

    logging.getLogger("moep_ds").propagate = True  # a trainer in this process may have turned it off
    with caplog.at_level(logging.INFO, logger="moep_ds"):
        assert resolve_start_step(branch, 143_000) == 13000
    assert "start step 13000 (the revision of model.init_from ('hf:EleutherAI/pythia-1b@step13000'))" in caplog.text


def test_a_run_from_an_imported_run_directory_starts_at_the_imported_step(tmp_path, caplog):
    """Issue 40 items 9 and 12: `moep-import hf:...@step13000 --out R` records step 13000; model.init_from=R starts
    there (and says so), as model.init_from=hf:...@step13000 does; a checkpoint of a trained run is a new start (0).
    A resumed branch does not announce a fresh start."""
    import json
    import logging

    from moep_ds.checkpointing import layout

    def written(run, step, **meta):
        ckpt = layout.checkpoint_root(run) / layout.checkpoint_tag(step)
        ckpt.mkdir(parents=True)
        (ckpt / layout.COMPLETE).touch()
        (ckpt / "meta.json").write_text(json.dumps({"step": step, **meta}))
        return ckpt

    ckpt = written(tmp_path / "imported", 13000, imported_from="hf:EleutherAI/pythia-1b@step13000")
    why = f"the step moep-import recorded in {str(ckpt / 'meta.json')!r}, of hf:EleutherAI/pythia-1b@step13000"
    assert start_step(cfg_with(str(tmp_path / "imported"))) == (13000, why)
    assert start_step(cfg_with(str(ckpt))) == (13000, why)  # the checkpoint folder itself
    assert start_step(cfg_with(str(tmp_path / "imported"), start_step=500))[0] == 500  # the recipe's own
    written(tmp_path / "trained", 99)  # a training checkpoint: its weights start a new run
    assert start_step(cfg_with(str(tmp_path / "trained"))) == (0, "a run from scratch")
    assert start_step(cfg_with(str(tmp_path / "missing"))) == (0, "a run from scratch")  # init_from names it later
    logging.getLogger("moep_ds").propagate = True  # a trainer in this process may have turned it off
    with caplog.at_level(logging.INFO, logger="moep_ds"):
        assert resolve_start_step(cfg_with(str(tmp_path / "imported")), 143_000) == 13000
        assert f"start step 13000 ({why})" in caplog.text
        caplog.clear()
        assert resolve_start_step(cfg_with(str(tmp_path / "imported")), 143_000, resuming=True) == 13000
    assert "start step" not in caplog.text


@pytest.mark.parametrize("train, message", [
    ({"start_step": 143_000}, "train.start_step (143000, from train.start_step) must be below the run's last step "
                              "(train.max_steps 143000)"),
    ({"start_step": 13_000, "exit_at_step": 13_000},
     "train.exit_at_step (13000) must be after the start step (13000, from train.start_step)"),
])
def test_start_step_out_of_the_run_is_one_line(train, message):
    with pytest.raises(UserError) as err:
        resolve_start_step(cfg_with(**train), 143_000)
    assert str(err.value) == message


def test_bad_start_step_in_a_recipe_names_the_field():
    with pytest.raises(UserError, match=r"train\.start_step"):
        config_from_dict({"model": MODEL, "train": {"start_step": -1}})


@pytest.mark.parametrize("dp_size, accum", [(1, 1), (2, 2)])
def test_loader_started_at_step_n_reads_global_batch_n_first(dp_size, accum):
    """start_at(N) positions the loader where an uninterrupted run is after N steps, across epoch ends too."""
    windows, micro = 100, 2
    global_batch = micro * accum * dp_size
    for n in (0, 3, 12, 13, 40):
        for rank in range(dp_size):
            fresh = BatchLoader(np.zeros(windows), micro_batch_size=micro, grad_accum=accum, dp_rank=rank,
                                dp_size=dp_size, seed=0, shuffle=False)
            walked = BatchLoader(np.zeros(windows), micro_batch_size=micro, grad_accum=accum, dp_rank=rank,
                                 dp_size=dp_size, seed=0, shuffle=False)
            fresh.start_at(n)
            for _ in range(n * accum):
                walked.next_indices()
            assert fresh.state_dict() == walked.state_dict()
            first = np.concatenate([fresh.next_indices() for _ in range(accum)])
            assert first.tolist() == np.concatenate([walked.next_indices() for _ in range(accum)]).tolist()
            if n < windows // global_batch:  # sequential order: batch n is windows n*G ... n*G + G - 1
                per_rank = global_batch // dp_size
                lo = n * global_batch + rank * per_rank
                assert first.tolist() == list(range(lo, lo + per_rank))
            for _ in range(3 * accum):
                assert fresh.next_indices().tolist() == walked.next_indices().tolist()
