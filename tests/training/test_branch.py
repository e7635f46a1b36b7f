"""Branching from a step (train.start_step) end to end on one CPU process: a Megatron file laid out like Pythia's
(one stored sequence per sample, read in file order) of > 13,002 global batches; a run started at step 13,000
reads global batch 13,000 first and takes its first step at GPT-NeoX v1.0's lr of iteration 13,000 (Pythia's
schedule: 143,000 steps, warm-up 1,430); its checkpoint resumes at the next batch, none replayed or skipped. The
runs train on a rank of this test (tests/ranks.py), which records what the trainer read and the lr it applied."""
import json

import numpy as np
import pytest
import yaml

from moep_ds.data.config import TokenizerConfig
from moep_ds.data.megatron import write_indexed
from moep_ds.data.tokenizer import train_tokenizer

from ranks import run_ranks
from test_schedule import pythia_lr
from tiny import DS_CONFIGS, metrics, probe

pytestmark = pytest.mark.slow
SEQ_LEN, GLOBAL_BATCH, START = 8, 2, 13_000
NUM_SEQUENCES = (START + 5) * GLOBAL_BATCH


def sequence(i: int) -> np.ndarray:
    """Stored sequence i: its number in the first two tokens (base 256), then filler; ids 10 .. 299."""
    return np.array([10 + i // 256, 10 + i % 256] + [10 + (i + j) % 290 for j in range(SEQ_LEN - 1)])


@pytest.fixture(scope="module")
def branched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("branch")
    write_indexed(tmp / "pile", [sequence(i) for i in range(NUM_SEQUENCES)], np.uint16)
    train_tokenizer(["one two three four five six. " * 40], TokenizerConfig(vocab_size=300), tmp / "tok")
    cfg = {
        "model": {"flavour": "pythia", "vocab_size": 320, "d_model": 32, "max_seq_len": SEQ_LEN, "init": "gpt_neox",
                  "layers": [{"type": "dense", "attention": {"num_heads": 4}}]},
        "data": {"source": f"megatron:{tmp / 'pile'}", "order": "sequential", "seq_len": SEQ_LEN, "val_fraction": 0.0,
                 "tokenizer": {"path": str(tmp / "tok" / "tokenizer.json"), "vocab_size": 300},
                 "prepared_dir": str(tmp / "prepared")},
        # Pythia's schedule and length, micro-batches of 1 accumulated twice: batch s = sequences 2s and 2s + 1
        "train": {"output_dir": str(tmp / "run"), "max_steps": 143_000, "start_step": START, "exit_at_step": START + 2,
                  "micro_batch_size": 1, "global_batch_size": GLOBAL_BATCH, "log_every": 1,
                  "checkpoint": {"every_steps": None, "at_end": False},
                  "optimizer": {"lr": 2.5e-4, "betas": [0.9, 0.95], "eps": 1.0e-8, "weight_decay": 0.1,
                                "no_decay": ["1d"]},
                  "schedule": {"kind": "neox_annealing", "warmup_steps": 1430, "min_lr_ratio": 0.1}},
    }
    (tmp / "branch.yaml").write_text(yaml.safe_dump(cfg))
    job = {"recipe": str(tmp / "branch.yaml"), "ds_config": str(DS_CONFIGS / "zero1_fp32.json")}
    jobs = [{**job, "probe": str(tmp / "first.json")},
            {**job, "resume": "auto", "overrides": [f"train.exit_at_step={START + 3}"], "probe": str(tmp / "resumed.json")},
            {**job, "overrides": ["train.start_step=null", "train.exit_at_step=2", f"train.output_dir={tmp / 'scratch'}"],
             "probe": str(tmp / "scratch.json")}]
    run_ranks(1, probe, jobs)
    return tmp, *(json.loads((tmp / f"{name}.json").read_text()) for name in ("first", "resumed", "scratch"))


def applied(probe) -> list[float]:
    """The lr of each optimizer step, from the optimizer's calls (one per parameter group and step), all groups of a
    step alike."""
    calls = [lr for lrs in probe["lrs"] for lr in lrs]
    steps = probe["end"] - probe["start"]
    assert calls and len(calls) % steps == 0
    per_step = [calls[i:i + len(calls) // steps] for i in range(0, len(calls), len(calls) // steps)]
    assert all(len(set(lrs)) == 1 for lrs in per_step), per_step
    return [lrs[0] for lrs in per_step]


def test_a_run_started_at_step_n_reads_batch_n_first_at_pythias_lr_of_iteration_n(branched):
    tmp, first, _, _ = branched
    assert (first["start"], first["end"]) == (START, START + 2)
    # micro-batches of one sample: batch 13000 = stored sequences 26000, 26001, then batch 13001
    assert first["indices"] == [[2 * START], [2 * START + 1], [2 * START + 2], [2 * START + 3]]
    for (i,), ids in zip(first["indices"], first["input_ids"]):
        assert ids == [sequence(i)[:SEQ_LEN].tolist()]
        assert (ids[0][0] - 10) * 256 + ids[0][1] - 10 == i  # the sequence's own number, as stored
    # the lr the optimizer applied at the first step is GPT-NeoX's at iteration 13000, then 13001, in every
    # parameter group (ZeRO steps the torch optimizer once per group: decay, no_decay)
    assert applied(first) == pytest.approx([pythia_lr(START), pythia_lr(START + 1)], abs=1e-12, rel=0)
    rows = [m for m in metrics(tmp / "run") if "loss" in m]
    assert [m["step"] for m in rows] == [START + 1, START + 2, START + 3]  # the resumed run's step after them
    # the lr logged in the row of step k is the one step k + 1 runs at (GPT-NeoX's convention, README Monitoring):
    # step 13001 applied GPT-NeoX's lr of iteration 13000 (above) and logs that of iteration 13001
    assert [m["lr"] for m in rows[:2]] == pytest.approx([pythia_lr(START + 1), pythia_lr(START + 2)], abs=1e-12,
                                                        rel=0)
    # the true token count, Pythia's steps included
    assert [m["tokens"] for m in rows] == [s * GLOBAL_BATCH * SEQ_LEN for s in (START + 1, START + 2, START + 3)]
    states = {json.loads(p.read_text())["trainer"]["step"]: json.loads(p.read_text())["data_loader"]
              for p in (tmp / "run").rglob("trainer_state.json")}
    assert states == {s: {"epoch": 0, "global_batch": s, "global_batch_size": GLOBAL_BATCH}
                      for s in (START + 2, START + 3)}


def test_the_branched_runs_checkpoint_resumes_at_the_next_batch(branched):
    _, _, resumed, _ = branched
    assert (resumed["start"], resumed["end"]) == (START + 2, START + 3)
    assert resumed["indices"] == [[2 * START + 4], [2 * START + 5]]  # batch 13002: none replayed, none skipped
    assert applied(resumed) == pytest.approx([pythia_lr(START + 2)], abs=1e-12, rel=0)


def test_the_same_recipe_from_scratch_starts_at_batch_0_at_gpt_neox_lr_of_iteration_0(branched):
    """GPT-NeoX's first iteration trains at lr 0 (warm-up lr * 0 / 1430); the trainer applies the same."""
    _, _, _, scratch = branched
    assert (scratch["start"], scratch["end"]) == (0, 2)
    assert scratch["indices"] == [[0], [1], [2], [3]]
    assert applied(scratch) == pytest.approx([0.0, pythia_lr(1)], abs=1e-12, rel=0)
    assert pythia_lr(1) == pytest.approx(2.5e-4 / 1430)
