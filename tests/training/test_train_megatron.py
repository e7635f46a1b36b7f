"""End-to-end training from a Megatron-format dataset on 2 CPU ranks (tests/ranks.py): a uint16 (dtype code 8) .bin/.idx
written here, a local tokenizer.json reused as data.tokenizer.path with a larger model vocabulary, samples in
file order (data.order: sequential); a perfectly predictable sequence is learnt and a resumed run continues
the uninterrupted one exactly."""
import json

import numpy as np
import pytest
import torch
import yaml

from moep_ds.data.config import TokenizerConfig
from moep_ds.data.megatron import write_indexed
from moep_ds.data.tokenizer import train_tokenizer

from tiny import DS_CONFIGS, losses, recipe, run_jobs

pytestmark = pytest.mark.slow
SEQ_LEN, CYCLE, FIRST_ID = 16, 20, 10


def counting_sequences(num: int) -> list[np.ndarray]:
    """Sequence i counts through the ids FIRST_ID .. FIRST_ID + CYCLE - 1 from offset 7i: every next token is
    determined by the current one."""
    return [FIRST_ID + (7 * i + np.arange(SEQ_LEN + 1)) % CYCLE for i in range(num)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron")
    write_indexed(tmp / "pile", counting_sequences(400), np.uint16)
    train_tokenizer(["one two three four five six. " * 40], TokenizerConfig(vocab_size=300), tmp / "tok")
    jobs, out = [], {}
    for name, extra in (("full", {}), ("first_half", {"exit_at_step": 20})):
        out[name] = tmp / name
        cfg = recipe("top2", out[name], max_steps=40, global_batch_size=8,
                     schedule={"kind": "constant", "warmup_steps": 2}, **extra)
        cfg["model"]["vocab_size"] = 320  # the tokenizer has 300 ids: padded, as Pythia pads 50,277 to 50,304
        cfg["model"]["max_seq_len"] = SEQ_LEN
        cfg["data"] = {"source": f"megatron:{tmp / 'pile'}", "order": "sequential", "seq_len": SEQ_LEN,
                       "val_fraction": 0.1,
                       "tokenizer": {"path": str(tmp / "tok" / "tokenizer.json"), "vocab_size": 300},
                       "prepared_dir": str(tmp / "prepared")}
        (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        jobs.append({"recipe": str(tmp / f"{name}.yaml"), "ds_config": str(DS_CONFIGS / "zero1_fp32.json")})
    jobs.append({**jobs[1], "resume": "auto"})
    run_jobs(2, jobs)
    return tmp, out


def test_counting_sequence_is_learnt_from_megatron_data(runs):
    tmp, out = runs
    curve = losses(out["full"])
    assert sorted(curve) == list(range(1, 41))
    assert curve[1] > 2.5 and curve[40] < 0.5, curve
    meta = json.loads((tmp / "prepared" / "meta.json").read_text())
    assert (meta["vocab_size"], meta["train_sequences"], meta["val_sequences"]) == (300, 360, 40)
    assert meta["megatron"]["train"]["dtype_code"] == 8


def test_resume_continues_in_file_order(runs):
    _, out = runs
    full, resumed = losses(out["full"]), losses(out["first_half"])
    assert sorted(resumed) == list(range(1, 41))
    torch.testing.assert_close([resumed[s] for s in range(21, 41)], [full[s] for s in range(21, 41)],
                               rtol=1e-5, atol=1e-6)
    # the checkpoint at step 20 holds the position in file order: 20 global batches of 8 sequences read
    (state_file,) = (out["first_half"]).rglob("trainer_state.json")
    assert json.loads(state_file.read_text())["data_loader"] == {"epoch": 0, "global_batch": 20, "global_batch_size": 8}
