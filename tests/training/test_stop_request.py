"""Stopping a run: the trainer's StopRequest notices that its launcher is gone (SIGTERM to the `deepspeed`
runner leaves the trainers running) and asks for a checkpoint and a clean exit."""
import os
import signal
import subprocess
import sys
import time

import pytest

from moep_ds.training.trainer import launcher_generations

from repo_paths import REPO

SCRIPT = REPO / "tests" / "training" / "scripts" / "launcher_gone.py"


def test_known_launchers_are_recognised_from_the_parent_command_line():
    deepspeed_launch = ["/venv/bin/python3", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=",
                        "--master_addr=127.0.0.1", "pretrain.py", "--config", "x.yaml"]
    assert launcher_generations(deepspeed_launch) == 2
    assert launcher_generations(["/venv/bin/python3", "/venv/bin/torchrun", "--nproc_per_node", "2", "t.py"]) == 1
    assert launcher_generations(["-bash"]) == 0  # a plain `python pretrain.py` from a shell is never stopped


def wait_for(path, seconds):
    deadline = time.time() + seconds
    while not path.exists() and time.time() < deadline:
        time.sleep(0.1)
    return path.exists()


@pytest.mark.slow
def test_trainer_stops_when_the_runner_above_its_launcher_is_killed(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    runner = subprocess.Popen([sys.executable, str(SCRIPT), "runner", str(tmp_path)], env=env)
    try:
        assert wait_for(tmp_path / "ready", 120), "worker did not start"
        assert not (tmp_path / "stopped").exists()
        runner.send_signal(signal.SIGTERM)  # what `kill <pid of deepspeed>` does: the runner dies alone
        assert runner.wait(30) == -signal.SIGTERM
        assert wait_for(tmp_path / "stopped", 30), "the worker did not notice that the runner is gone"
        assert (tmp_path / "stopped").read_text() == "True"
    finally:
        for role in ("worker", "launcher"):
            pid_file = tmp_path / f"{role}.pid"
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if runner.poll() is None:
            runner.kill()
