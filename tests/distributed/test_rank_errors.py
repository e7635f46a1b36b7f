"""One error, one line, under a launcher: a data error on rank 0 while the other ranks wait for its preparation is
printed once by rank 0; the others exit quietly instead of ending in a collective's traceback ("monitoredBarrier
... Connection closed by peer"). On 2 ranks of the test (tests/ranks.py)."""
import pathlib
import sys

import numpy as np
import pytest
import yaml

from moep_ds.data.config import TokenizerConfig
from moep_ds.data.megatron import write_indexed
from moep_ds.data.tokenizer import train_tokenizer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "training"))
from ranks import joined  # noqa: E402
from tiny import recipe, run_pretrain  # noqa: E402


def tokenizer(tmp_path) -> str:
    train_tokenizer(["one two three four five six. " * 40], TokenizerConfig(vocab_size=300), tmp_path / "tok")
    return str(tmp_path / "tok" / "tokenizer.json")


def missing_tokenizer(tmp_path, cfg):
    cfg["data"]["tokenizer"] = {"path": str(tmp_path / "nowhere" / "tokenizer.json"), "vocab_size": 512}
    return "nowhere"


def truncated_megatron_bin(tmp_path, cfg):
    write_indexed(tmp_path / "pile", [np.arange(17) % 20 + 10 for _ in range(50)], np.uint16)
    with open(tmp_path / "pile.bin", "r+b") as f:
        f.truncate(100)
    cfg["model"]["vocab_size"], cfg["model"]["max_seq_len"] = 320, 16
    cfg["data"] = {"source": f"megatron:{tmp_path / 'pile'}", "order": "sequential", "seq_len": 16,
                   "tokenizer": {"path": tokenizer(tmp_path), "vocab_size": 300},
                   "prepared_dir": str(tmp_path / "prepared")}
    return "pile.bin"


def tokenizer_larger_than_model(tmp_path, cfg):
    cfg["model"]["vocab_size"] = 256
    cfg["data"]["tokenizer"] = {"path": tokenizer(tmp_path), "vocab_size": 300}
    return "has 300 ids, more than model.vocab_size (256)"


@pytest.mark.slow
@pytest.mark.parametrize("fault", [missing_tokenizer, truncated_megatron_bin, tokenizer_larger_than_model])
def test_a_data_error_on_rank_0_is_one_line(tmp_path, fault):
    cfg = recipe("top2", tmp_path / "run", max_steps=2)
    expected = fault(tmp_path, cfg)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(cfg))
    proc = joined(run_pretrain(2, "--config", str(tmp_path / "r.yaml"), check=False, timeout=900))
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    errors = [line for line in output.splitlines() if "error:" in line and "ChildFailedError" not in line]
    assert len(errors) == 1 and errors[0].startswith("error: ") and expected in errors[0], output[-4000:]
    assert "monitoredBarrier" not in output and "Connection closed by peer" not in output, output[-4000:]
    # no traceback comes from the trainers themselves
    assert "moep_ds" not in "".join(part.split("\n\n")[0] for part in output.split("Traceback")[1:]), output[-4000:]
    assert not (tmp_path / "run").exists()
