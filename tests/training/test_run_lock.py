"""One running job per run directory (training/run_lock.py, training/run_dir.py): the lock rank 0 holds for the life
of its process, the refusal naming the holder, a dead holder's lock taken, a requeued SLURM job waiting for its own
earlier start; and two real pretrain.py processes started together into one folder (issue 46 item 1)."""
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from moep_ds.checkpointing import layout
from moep_ds.training import run_lock
from moep_ds.training.run_dir import RunDirInUse, claim_run_dir
from moep_ds.training.run_lock import LOCK_FILE, lock_run_dir, release_run_dir

from test_run_dir import fake_run
from tiny import DS_CONFIGS, REPO, env, metrics, write_recipe


def hold(run_dir, environ=None, exit_after=None) -> int:
    """A forked process that takes the folder's lock and keeps it until killed (or for `exit_after` seconds)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no return
        try:
            os.environ.update(environ or {})
            assert lock_run_dir(run_dir) is None
            os.write(write, b"1")
            time.sleep(exit_after if exit_after is not None else 600)
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.close(read)
    return pid


def end(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)


@pytest.fixture
def slurm(monkeypatch):
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "MOEP_SLURM_JOB_ID", "MOEP_SLURM_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(logging.getLogger("moep_ds"), "propagate", True)  # a trainer in this process turns it off
    return monkeypatch


def test_a_failed_start_releases_its_lock_when_another_rank_removed_the_folder_first(tmp_path, slurm):
    """A start that fails on every rank: rank 0 lets its new lock file go while another rank removes the new folder
    (trainer.build_trainer, fsutil.remove_new_dir); seen in CI as FileNotFoundError from release_run_dir."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert lock_run_dir(run_dir) is None
    real = run_lock.is_locked_file

    def removed_meanwhile(fd, path):
        held = real(fd, path)
        (run_dir / LOCK_FILE).unlink()  # the other rank's rmtree, between the check and the unlink
        return held

    slurm.setattr(run_lock, "is_locked_file", removed_meanwhile)
    release_run_dir(run_dir)
    slurm.setattr(run_lock, "is_locked_file", real)
    assert lock_run_dir(run_dir) is None  # the folder is free again
    release_run_dir(run_dir)


def test_a_folder_a_live_run_holds_is_refused_naming_it_and_a_dead_runs_lock_is_taken(tmp_path, slurm):
    fake_run(tmp_path, steps=(2,))
    holder = hold(tmp_path)
    try:
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        with pytest.raises(RunDirInUse) as err:
            claim_run_dir(tmp_path, "auto", overwrite=False)
        assert str(err.value) == (
            f"train.output_dir ({str(tmp_path)!r}) is in use by another run (host {socket.gethostname()}, pid "
            f"{holder}, started {record['started']}): wait for it to end, stop it (touch {tmp_path / 'STOP'}), or "
            "start this run in another train.output_dir")
        with pytest.raises(RunDirInUse):  # --overwrite included: it would delete the live run's files
            claim_run_dir(tmp_path, None, overwrite=True)
        assert layout.complete_checkpoints(tmp_path)  # nothing touched
    finally:
        end(holder)
    found = (tmp_path / LOCK_FILE).read_bytes()
    claim_run_dir(tmp_path, "auto", overwrite=False)  # the holder died: its lock went with it
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    claim_run_dir(tmp_path, "auto", overwrite=False)  # a second run in this process keeps its lock
    release_run_dir(tmp_path)  # a failed start-up leaves the folder as it found it
    assert (tmp_path / LOCK_FILE).read_bytes() == found
    claim_run_dir(tmp_path / "new", None, overwrite=False)
    release_run_dir(tmp_path / "new")
    assert list((tmp_path / "new").iterdir()) == []


def test_a_requeued_slurm_job_waits_for_its_earlier_start_then_takes_over(tmp_path, slurm, caplog):
    """A requeue keeps SLURM_JOB_ID and counts SLURM_RESTART_COUNT up: the new start waits for the old one (which
    checkpoints on the requeue's signal) up to MOEP_RUN_LOCK_WAIT seconds, then takes the lock over; any other job
    is refused at once."""
    first, second, third = tmp_path / "ends", tmp_path / "hangs", tmp_path / "other"
    for folder in (first, second, third):
        folder.mkdir()
    old = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"}
    ends = hold(first, old, exit_after=1.0)
    hangs = hold(second, old)
    other = hold(third, {"SLURM_JOB_ID": "78"})
    try:
        slurm.setenv("SLURM_JOB_ID", "77")
        slurm.setenv("SLURM_RESTART_COUNT", "1")
        slurm.setenv(run_lock.WAIT_ENV, "30")
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="moep_ds"):
            assert lock_run_dir(first) is None  # its earlier start ended meanwhile
            assert time.monotonic() - started < 20
            assert "taking it over" not in caplog.text
            slurm.setenv(run_lock.WAIT_ENV, "1")
            assert lock_run_dir(second) is None
        assert "still holds the lock after 1 s; taking it over" in caplog.text
        assert f"pid {hangs}, started" in caplog.text and "SLURM job 77 (restart 0)" in caplog.text
        taken = json.loads((second / LOCK_FILE).read_text())
        assert (taken["pid"], taken["slurm_job_id"], taken["slurm_restart_count"]) == (os.getpid(), "77", 1)
        assert lock_run_dir(second) is None  # still this process's
        started = time.monotonic()
        refused = lock_run_dir(third)
        assert time.monotonic() - started < 5 and f"pid {other}" in refused and "SLURM job 78 (restart 0)" in refused
    finally:
        for pid in (ends, hangs, other):
            end(pid)


@pytest.mark.slow
def test_two_pretrain_processes_started_together_into_one_folder_one_trains(tmp_path):
    """Issue 46 item 1: two `python pretrain.py` of one tiny recipe into one train.output_dir, started together:
    exactly one trains, the other exits 2 with one line naming the holder's host, pid and start time; the folder
    holds one loss curve and one TensorBoard event file."""
    out = tmp_path / "dup"
    # the winner trains until the test stops it (RUN_DIR/STOP) once the other has exited: however slow either one
    # starts, the later one reaches the lock while the first still holds it
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=100_000,
                          checkpoint={"every_steps": 100_000, "keep_last": 3, "at_end": True})
    cmd = [sys.executable, str(REPO / "pretrain.py"), "--config", str(recipe), "--ds_config",
           str(DS_CONFIGS / "quickstart.json")]
    procs = [subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        deadline = time.monotonic() + 600
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        (out / "STOP").touch()  # the one still running checkpoints and exits 0
        results = [(p.pid, *p.communicate(timeout=600), p.returncode) for p in procs]
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
    codes = sorted(code for *_, code in results)
    assert codes == [0, 2], "\n".join(err[-3000:] for _, _, err, _ in results)
    [(winner, *_)] = [r for r in results if r[3] == 0]
    [(_, _, stderr, _)] = [r for r in results if r[3] == 2]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    started = json.loads((out / LOCK_FILE).read_text())["started"]
    assert errors[0].startswith(f"error: train.output_dir ({str(out)!r}) is in use by another run (host "
                                f"{socket.gethostname()}, pid {winner}, started {started})"), errors[0]
    steps = [m["step"] for m in metrics(out) if "loss" in m]
    assert steps == list(range(1, len(steps) + 1)), steps  # one loss curve: each step once
    assert len(list((out / "tensorboard").rglob("events.out.tfevents.*"))) == 1
    assert [c.name for c in layout.complete_checkpoints(out)] == [layout.checkpoint_tag(steps[-1])]
