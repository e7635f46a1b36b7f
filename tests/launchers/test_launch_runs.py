"""Real training through slurm_multi_node.sbatch in srun mode: the stub srun starts 2 local CPU processes with
SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, as srun would on one node with 2 tasks."""
import json
import re
import signal

import pytest

from launcher_cluster import LAUNCHERS, wait_for

pytestmark = pytest.mark.slow
QUICK = ["train.log_every=1", "train.eval_every=null", "train.checkpoint.every_steps=null"]


def srun_job(run_dir) -> dict:
    return {"CONFIG": "configs/quickstart.yaml", "DS_CONFIG": "ds_configs/quickstart.json", "LAUNCHER": "srun",
            "STUB_NODELIST": "localhost", "NODES": "1", "GPUS_PER_NODE": "2", "STUB_SRUN_SPAWN": "1",
            "RUN_DIR": str(run_dir)}


def logged_steps(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_srun_mode_trains_the_quickstart_on_two_processes(cluster):
    run_dir = cluster.tmp / "run"
    proc = cluster.run("slurm_multi_node.sbatch", "--set", "train.max_steps=3", *QUICK, timeout=500,
                       **srun_job(run_dir))
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert logged_steps(run_dir) == [1, 2, 3]
    assert (run_dir / "checkpoints" / "step_00000003" / "COMPLETE").is_file()
    [launch] = cluster.argv("srun")
    assert launch[:6] == ["--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--kill-on-bad-exit=1", "bash",
                          str(LAUNCHERS / "srun_task.sh")]
    assert "| 2 ranks |" in proc.stderr  # both tasks joined one process group


def test_usr1_checkpoints_requeues_and_the_requeued_job_resumes(cluster):
    run_dir = cluster.tmp / "run"
    args = ["--set", "train.max_steps=1000", *QUICK]
    proc = cluster.start("slurm_multi_node.sbatch", *args, **srun_job(run_dir))
    wait_for(lambda: len(logged_steps(run_dir)) >= 3, proc, 500, "3 logged steps")
    proc.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@90` does before the time limit
    assert proc.wait(timeout=180) == 0
    log = (cluster.tmp / "launch.log").read_text()
    stopped = int(re.search(r"stopped at step (\d+) on request; resume with --resume auto", log).group(1))
    checkpoint = run_dir / "checkpoints" / f"step_{stopped:08d}"
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == [checkpoint.name]
    assert (checkpoint / "COMPLETE").is_file()
    assert cluster.argv("scontrol")[-1] == ["requeue", "4242"]
    assert logged_steps(run_dir) == list(range(1, stopped + 1))

    # the requeued job: the same submission, run 2 more steps
    again = cluster.run("slurm_multi_node.sbatch", *args, f"train.exit_at_step={stopped + 2}", timeout=500,
                        **srun_job(run_dir))
    assert again.returncode == 0, again.stderr[-6000:]
    assert f"resumed from {checkpoint} at step {stopped}" in again.stderr
    assert logged_steps(run_dir) == list(range(1, stopped + 3))
    assert [argv for argv in cluster.argv("scontrol") if argv[0] == "requeue"] == [["requeue", "4242"]]
