"""Stopping a run: the trainer's StopRequest notices that its launcher is gone (SIGTERM to the `deepspeed`
runner leaves the trainers running) and asks for a checkpoint and a clean exit; Ctrl-C and the STOP file do the
same; a run without a launcher trains on when its shell exits."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from moep_ds.checkpointing import layout
from moep_ds.training.trainer import StopRequest, launcher_chain, launcher_generations

from repo_paths import REPO
from tiny import env, metrics, write_recipe

SCRIPT = REPO / "tests" / "training" / "scripts" / "launcher_gone.py"


def test_known_launchers_are_recognised_from_the_parent_command_line():
    deepspeed_launch = ["/venv/bin/python3", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=",
                        "--master_addr=127.0.0.1", "pretrain.py", "--config", "x.yaml"]
    assert launcher_generations(deepspeed_launch) == 2
    assert launcher_generations(["/venv/bin/python3", "/venv/bin/torchrun", "--nproc_per_node", "2", "t.py"]) == 1
    assert launcher_generations(["-bash"]) == 0  # a plain `python pretrain.py` from a shell is never stopped


def test_a_process_without_a_launcher_watches_nothing():
    """Before: the chain of a plain process was [its own pid], so its shell exiting (nohup ... &) stopped it."""
    assert launcher_chain() == []  # pytest's parent is a shell or a CI runner, no launcher


def test_ctrl_c_asks_for_a_stop_and_a_second_one_aborts():
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        stop = StopRequest(watch=[])
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        os.kill(os.getpid(), signal.SIGINT)  # at once: the same Ctrl-C, forwarded by a launcher (torchrun)
        time.sleep(1.1)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs between bytecodes of this thread
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_stop_file_asks_for_a_stop(tmp_path):
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        stop = StopRequest(watch=[], poll_s=0.05, stop_file=tmp_path / "STOP")
        time.sleep(0.3)
        assert not stop.requested
        (tmp_path / "STOP").touch()
        assert wait_until(lambda: stop.requested, 10)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def wait_until(condition, seconds):
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline:
        time.sleep(0.05)
    return condition()


def steps_logged(run_dir):
    try:
        return [m["step"] for m in metrics(run_dir) if "loss" in m]
    except (OSError, ValueError):
        return []


@pytest.mark.slow
def test_background_run_trains_on_after_its_shell_exits(tmp_path):
    """`nohup python pretrain.py ... &` from a shell that exits once the run trains: the run goes to its end."""
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=40, checkpoint={"every_steps": None,
                                                                                       "at_end": True})
    log = tmp_path / "log"
    shell = (f"nohup {sys.executable} pretrain.py --config {recipe} > {log} 2>&1 & "
             f"while [ ! -s {out}/metrics.jsonl ]; do sleep 0.1; done; exit 0")
    subprocess.run(["bash", "-c", shell], env={**env(), "MOEP_STOP_POLL_S": "0.1"}, cwd=REPO, timeout=300, check=True)
    assert wait_until(lambda: (out / "checkpoints" / "step_00000040" / layout.COMPLETE).exists()
                      or "Traceback" in log.read_text() or "stopping" in log.read_text(), 300), log.read_text()[-3000:]
    assert "launcher process" not in log.read_text() and steps_logged(out)[-1] == 40, log.read_text()[-3000:]


@pytest.mark.slow
def test_ctrl_c_under_deepspeed_checkpoints_at_the_next_step(tmp_path):
    """SIGINT to the launch's process group (what Ctrl-C in its terminal does): the trainers checkpoint at the next
    step and exit 0 without a traceback; before, every step since the last checkpoint was lost."""
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=100000, checkpoint={"every_steps": None,
                                                                                           "at_end": False})
    log = open(tmp_path / "log", "w")  # a file, not a pipe nobody reads while the run goes on
    proc = subprocess.Popen([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                             str(free_port()), "pretrain.py", "--config", str(recipe)], env=env(), cwd=REPO,
                            start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: len(steps_logged(out)) >= 3 or proc.poll() is not None, 300)
        launch = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGINT)
        # DeepSpeed's runner dies of the SIGINT at once (a shell's 130, as the README says; launchers/local.sh exits
        # 0: tests/launchers/test_ctrl_c.py); its per-node launcher and the trainers finish after it
        assert proc.wait(timeout=120) == -signal.SIGINT
        assert not psutil.wait_procs(launch, timeout=120)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    output = (tmp_path / "log").read_text()
    saved = layout.complete_checkpoints(out)
    assert len(saved) == 1, output[-4000:]
    step = layout.step_of(saved[0])
    assert step >= 3 and steps_logged(out)[-1] == step
    assert f"stopped at step {step} on request" in output
    # DeepSpeed's runner prints its own KeyboardInterrupt; the trainers none
    assert "pretrain.py" not in "".join(chunk for chunk in output.split("Traceback")[1:]), output[-4000:]
    state = json.loads((saved[0] / "trainer_state.json").read_text())
    assert state["trainer"]["step"] == step


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
