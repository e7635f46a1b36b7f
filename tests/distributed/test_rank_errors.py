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
from tiny import REPO, recipe, run_pretrain  # noqa: E402


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


@pytest.mark.slow
def test_start_up_errors_every_rank_meets_are_printed_once(tmp_path):
    """Issue 40 item 5: an unknown downstream_eval task and a missing model.init_from were printed by every rank
    (`[rank 1] error: ...` and `error: ...`); under a launcher the rank that failed first ended the launch while
    the other was still starting, which the launcher's SIGTERM made print "received signal 15: checkpointing". Both
    ranks now agree (rank_errors.agreed): rank 0 prints the line, rank 1 exits quietly."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    script = pathlib.Path(__file__).parent / "scripts" / "agreed_errors.py"
    missing = tmp_path / "no_such_model"
    procs = [subprocess.Popen([sys.executable, str(script), str(missing)], cwd=REPO, text=True,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    lines = [[line for line in err.splitlines() if "error:" in line or line.startswith("case ")] for err in errs]
    assert lines[0][0].startswith("error: ") and "no_such_task" in lines[0][0], errs[0]
    assert lines[0][1:] == ["case unknown_downstream_task exit 2",
                            f"error: model.init_from ({str(missing)!r}) is not a folder (a Hugging Face model folder "
                            "or moep_ds checkpoint) nor hf:REPO[@REVISION]",
                            "case missing_init_from exit 2"], errs[0]
    assert lines[1] == ["case unknown_downstream_task exit 2", "case missing_init_from exit 2"], errs[1]
