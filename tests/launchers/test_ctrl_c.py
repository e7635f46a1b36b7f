"""Ctrl-C at a terminal, for real: SIGINT to the whole process group of a launch started as a terminal starts a
foreground job, a few steps into the quick start on 2 CPU processes (pretrain.py --help, STOPPING; README).

Under launchers/local.sh the trainers checkpoint and the script exits 0 without a traceback (the launch runs in a
session of its own; the script passes the Ctrl-C on to the trainers). Under a bare `deepspeed` the trainers
checkpoint too, but DeepSpeed's runner prints its KeyboardInterrupt traceback and dies of the SIGINT (a shell's
130): DeepSpeed's code, documented rather than changed (tests/training/test_stop_request.py holds it)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launcher_cluster import LAUNCHERS, LEAKY, REPO

pytestmark = pytest.mark.slow
QUICK = ["train.log_every=1", "train.eval_every=null", "train.checkpoint.every_steps=null", "train.max_steps=200"]


def env() -> dict:
    out = {k: v for k, v in os.environ.items() if k not in LEAKY and not k.startswith(("SLURM_", "SBATCH_"))}
    out.update(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]), OMP_NUM_THREADS="1",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", CONFIG="configs/quickstart.yaml",
               DS_CONFIG="ds_configs/quickstart.json", NPROC="2")
    return out


def interrupted(command: list[str], run_dir: Path, log: Path) -> tuple[int, str]:
    """Start `command` as a terminal starts a foreground job (a process group of its own), send SIGINT to that
    group once the first step is logged, as Ctrl-C does; (its exit status, its output)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=env(), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    tree = psutil.Process(proc.pid)
    try:
        deadline = time.time() + 300
        while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        launch = tree.children(recursive=True)
        os.killpg(proc.pid, signal.SIGINT)
        status = proc.wait(timeout=120)
        # DeepSpeed's runner dies of the SIGINT at once; its per-node launcher and the trainers finish after it
        assert not psutil.wait_procs(launch, timeout=120)[1]
        return status, log.read_text()
    finally:
        if proc.poll() is None:  # a failed test: the launch may be in a session of its own
            for p in tree.children(recursive=True) + [tree]:
                p.kill()
            proc.wait()


def stopped_cleanly(run_dir: Path, output: str) -> int:
    """The step the trainers stopped at, after checking that both stopped there and checkpointed it."""
    step = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert output.count(f"stopped at step {step} on request") == 2, output[-3000:]
    assert (run_dir / "checkpoints" / f"step_{step:08d}" / "COMPLETE").is_file()
    return step


def test_ctrl_c_under_local_sh_checkpoints_and_exits_0(tmp_path):
    run_dir = tmp_path / "run"
    status, output = interrupted(["bash", str(LAUNCHERS / "local.sh"), "--set", f"train.output_dir={run_dir}",
                                  *QUICK], run_dir, tmp_path / "local.log")
    assert status == 0, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert "received SIGINT: passing it on to the trainers" in output
    assert stopped_cleanly(run_dir, output) < 200
