"""A simulated SLURM cluster for the launcher tests: stub sbatch / srun / scontrol / deepspeed first on PATH,
a clean environment (no SLURM_* or rendezvous variables from the machine running the tests), and helpers to run
a launcher and read what the stubs recorded."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import slurm_stubs

REPO = pathlib.Path(__file__).resolve().parents[2]
LAUNCHERS = REPO / "launchers"
FAKE_TRAINER = pathlib.Path(__file__).resolve().parent / "fake_trainer" / "pretrain.py"
LEAKY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MOEP_ROOT", "CONFIG", "DS_CONFIG",
         "RUN_DIR", "RESUME", "NODES", "GPUS_PER_NODE", "NPROC", "NPROC_PER_NODE", "LAUNCHER", "HOSTFILE",
         "DEEPSPEED_ARGS", "SLURM_CONF")


class Cluster:
    def __init__(self, tmp: pathlib.Path):
        self.tmp = tmp
        self.log = tmp / "calls.jsonl"
        self.bin = slurm_stubs.install(tmp / "bin")
        self.started: list[subprocess.Popen] = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_")) and k not in LEAKY}
        self.env.update(
            PATH=os.pathsep.join([str(self.bin), str(pathlib.Path(sys.executable).parent), os.environ["PATH"]]),
            PYTHON=sys.executable, STUB_LOG=str(self.log), STUB_SEEN=str(tmp / "seen"), TMPDIR=str(tmp),
            OMP_NUM_THREADS="1",
            HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
        )

    def command(self, script: str, *args: str) -> list[str]:
        return ["bash", str(LAUNCHERS / script), *args]

    def run(self, script: str, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(script, *args), env={**self.env, **env}, cwd=self.tmp,
                              capture_output=True, text=True, timeout=timeout)

    def start(self, script: str, *args: str, **env: str) -> subprocess.Popen:
        """Start a launcher in the background, output to tmp/launch.log; its pid is the batch shell's."""
        return self.spawn(self.command(script, *args), **env)

    def spawn(self, command: list[str], **env: str) -> subprocess.Popen:
        with open(self.tmp / "launch.log", "w") as out:
            proc = subprocess.Popen(command, env={**self.env, **env}, cwd=self.tmp, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.started.append(proc)
        return proc

    def kill_leftovers(self) -> None:
        """Kill the process group of every launch this test started that is still running (failed tests)."""
        for proc in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def calls(self, prog: str | None = None) -> list[dict]:
        return slurm_stubs.calls(self.log, prog)

    def argv(self, prog: str) -> list[list[str]]:
        return [c["argv"] for c in self.calls(prog)]


def wait_for(predicate, proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Poll until predicate() holds; fail early if the launch exits first."""
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the launch exited ({proc.returncode}) before {what}")
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)

