"""Launchers against a simulated 2-node x 4-GPU SLURM cluster (stub sbatch / srun / scontrol / deepspeed):
exact hostfile and command lines, rank mapping of srun tasks, and the preemption trap with stand-in trainers."""
import json
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launcher_cluster import FAKE_TRAINER, LAUNCHERS, REPO, wait_for

SCRIPTS = sorted(LAUNCHERS.glob("*.sh")) + sorted(LAUNCHERS.glob("*.sbatch"))
RECIPE = {"CONFIG": "configs/quickstart.yaml", "DS_CONFIG": "ds_configs/quickstart.json"}
TWO_NODES = {"STUB_NODELIST": "gpu[01-02]", "NODES": "2", "GPUS_PER_NODE": "4", "MASTER_PORT": "29517", **RECIPE}
OVERRIDES = ["--set", "train.max_steps=3", "train.log_every=1"]


def expected_pretrain_args(run_dir) -> list[str]:
    return ["--config", "configs/quickstart.yaml", "--ds_config", "ds_configs/quickstart.json", "--resume", "auto",
            "--set", f"train.output_dir={run_dir}", "train.max_steps=3", "train.log_every=1"]


def test_scripts_are_valid_bash():
    assert {p.name for p in SCRIPTS} >= {"local.sh", "slurm_single_node.sbatch", "slurm_multi_node.sbatch"}
    for script in SCRIPTS:
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, (script, proc.stderr)


def test_scripts_pass_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (.ci/run installs the Debian package)")
    proc = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_multi_node_deepspeed_submits_writes_hostfile_and_launches(cluster):
    run_dir = cluster.tmp / "run"
    proc = cluster.run("slurm_multi_node.sbatch", *OVERRIDES, RUN_DIR=str(run_dir), **TWO_NODES)
    assert proc.returncode == 0, proc.stderr
    script = str(LAUNCHERS / "slurm_multi_node.sbatch")
    assert cluster.argv("sbatch") == [["--nodes=2", "--gpus-per-node=4", "--ntasks-per-node=4", script, *OVERRIDES]]
    assert cluster.argv("scontrol") == [["show", "hostnames", "gpu[01-02]"]]
    hostfile = cluster.tmp / "moep_ds-4242.hostfile"
    assert (cluster.tmp / "seen" / hostfile.name).read_text() == "gpu01 slots=4\ngpu02 slots=4\n"
    assert not hostfile.exists() and not (cluster.tmp / "moep_ds-4242.env").exists()  # removed when the job ends
    [launch] = cluster.calls("deepspeed")
    assert launch["argv"] == ["--hostfile", str(hostfile), "--master_addr", "gpu01", "--master_port", "29517",
                              "pretrain.py", *expected_pretrain_args(run_dir)]
    assert launch["cwd"] == str(REPO)
    assert launch["env"]["MASTER_ADDR"] == "gpu01" and launch["env"]["MASTER_PORT"] == "29517"
    assert launch["env"]["SLURM_JOB_ID"] == "4242" and launch["env"]["MOEP_ROOT"] == str(REPO)
    assert cluster.argv("srun") == []


def test_multi_node_deepspeed_hands_the_runs_environment_to_the_other_nodes(cluster):
    """pdsh passes DeepSpeed's few variables only: the launcher's DS_ENV_FILE holds the user's .deepspeed_env lines
    (its last newline added) and the variables a run reads, for the other nodes' processes."""
    home = cluster.tmp / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1")
    env = {"HOME": str(home), "MOEP_DATA_DIR": "/data/moep shared", "MOEP_CACHE_DIR": "/scratch/cache",
           "HF_HUB_OFFLINE": "1", "DEEPSPEED_TIMEOUT": "30", "OMP_NUM_THREADS": "4", "NOT_PASSED": "x"}
    proc = cluster.run("slurm_multi_node.sbatch", *OVERRIDES, **TWO_NODES, **env)
    assert proc.returncode == 0, proc.stderr
    [launch] = cluster.calls("deepspeed")
    env_file = cluster.tmp / "moep_ds-4242.env"
    assert launch["env"]["DS_ENV_FILE"] == str(env_file)
    lines = (cluster.tmp / "seen" / env_file.name).read_text().splitlines()
    assert lines[-1] == "NCCL_IB_DISABLE=1" and all("=" in line for line in lines)  # the user's, last: it wins
    for key in ("MOEP_DATA_DIR", "MOEP_CACHE_DIR", "HF_HUB_OFFLINE", "DEEPSPEED_TIMEOUT", "OMP_NUM_THREADS"):
        assert f"{key}={env[key]}" in lines, key
    # the run directory's lock tells a requeue of this job by them (moep_ds/training/run_lock.py)
    assert "MOEP_SLURM_JOB_ID=4242" in lines and "MOEP_SLURM_RESTART_COUNT=0" in lines
    assert not any(line.startswith(("NOT_PASSED=", "SLURM_")) for line in lines)


def test_the_deepspeed_env_file_survives_deepspeeds_quoting_and_the_remote_shell(cluster):
    """Each line goes through DeepSpeed's own reading (split at the first '=', add_export's quoting) onto a bash
    command line, as pdsh runs it on every node: the values arrive as they are; a value that would break the
    command or run on the nodes is left out with a warning, secrets are never written, nor a line of the user's
    file that DeepSpeed could not read (the others are copied as written)."""
    from types import SimpleNamespace

    from deepspeed.launcher.multinode_runner import MultiNodeRunner

    home = cluster.tmp / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_DEBUG=INFO\nnot a variable\n")
    env = {"HOME": str(home), "MOEP_DATA_DIR": "/data/with space, comma", "MOEP_CACHE_DIR": "",
           "TOKENIZERS_PARALLELISM": "false", "HF_TOKEN": "hf_secret", "MOEP_X": 'a"b', "MOEP_Y": "$(touch pwned)",
           "MOEP_Z": "line\nbreak"}
    proc = cluster.run("slurm_multi_node.sbatch", *OVERRIDES, **TWO_NODES, **env)
    assert proc.returncode == 0, proc.stderr
    env_file = cluster.tmp / "seen" / Path(cluster.calls("deepspeed")[0]["env"]["DS_ENV_FILE"]).name
    assert env_file.stat().st_mode & 0o077 == 0  # the user's own
    runner = SimpleNamespace(exports={})
    for var in env_file.read_text().splitlines():  # deepspeed/launcher/runner.py
        key, val = var.split("=", maxsplit=1)
        MultiNodeRunner.add_export(runner, key, val)
    exports = "".join(f"export {k}={v}; " for k, v in runner.exports.items())  # PDSHRunner.get_cmd
    shown = subprocess.run(["bash", "-c", exports + "env -0"], capture_output=True, text=True, cwd=cluster.tmp)
    remote = dict(item.split("=", 1) for item in shown.stdout.split("\0") if "=" in item)
    for key in ("MOEP_DATA_DIR", "MOEP_CACHE_DIR", "TOKENIZERS_PARALLELISM"):
        assert remote[key] == env[key], key
    assert remote["NCCL_DEBUG"] == "INFO"
    assert not {"HF_TOKEN", "MOEP_X", "MOEP_Y", "MOEP_Z"} & set(runner.exports)
    assert not (cluster.tmp / "pwned").exists()
    for name in ("MOEP_X", "MOEP_Y", "MOEP_Z"):
        assert f"warning: {name} is not passed to the other nodes" in proc.stderr, name
    assert "a line DeepSpeed cannot pass on is left out: not a variable" in proc.stderr
    assert "hf_secret" not in env_file.read_text()


def test_a_users_own_deepspeed_env_file_is_read_once(cluster):
    user = cluster.tmp / "mine.env"
    user.write_text("NCCL_DEBUG=INFO\n")
    proc = cluster.run("slurm_multi_node.sbatch", *OVERRIDES, **TWO_NODES, DS_ENV_FILE=str(user))
    assert proc.returncode == 0, proc.stderr
    [launch] = cluster.calls("deepspeed")
    lines = (cluster.tmp / "seen" / Path(launch["env"]["DS_ENV_FILE"]).name).read_text().splitlines()
    assert lines.count("NCCL_DEBUG=INFO") == 1 and user.read_text() == "NCCL_DEBUG=INFO\n"  # the user's is unchanged


def test_multi_node_srun_mode_launches_one_task_per_gpu(cluster):
    run_dir = cluster.tmp / "run"
    proc = cluster.run("slurm_multi_node.sbatch", *OVERRIDES, RUN_DIR=str(run_dir), LAUNCHER="srun", **TWO_NODES)
    assert proc.returncode == 0, proc.stderr
    [launch] = cluster.calls("srun")
    assert launch["argv"] == ["--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--kill-on-bad-exit=1",
                              "bash", str(LAUNCHERS / "srun_task.sh"), *expected_pretrain_args(run_dir)]
    assert launch["env"]["MASTER_ADDR"] == "gpu01" and launch["env"]["MASTER_PORT"] == "29517"
    assert launch["env"]["MOEP_ROOT"] == str(REPO)
    assert cluster.argv("deepspeed") == []


def test_sbatch_options_come_from_the_script_unless_set(cluster):
    """Submitted with plain `sbatch`: the #SBATCH defaults and SLURM's GPU count give the layout."""
    env = {**RECIPE, "STUB_NODELIST": "node[7-8]", "MASTER_PORT": "29517", "MOEP_ROOT": str(REPO)}
    proc = subprocess.run(["sbatch", str(LAUNCHERS / "slurm_multi_node.sbatch")], env={**cluster.env, **env},
                          cwd=cluster.tmp, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (cluster.tmp / "seen" / "moep_ds-4242.hostfile").read_text() == "node7 slots=8\nnode8 slots=8\n"
    assert cluster.argv("deepspeed")[0][:6] == ["--hostfile", str(cluster.tmp / "moep_ds-4242.hostfile"),
                                                "--master_addr", "node7", "--master_port", "29517"]


@pytest.mark.parametrize("env,options,slots", [
    ({}, ["--gpus-per-node=0", "--ntasks-per-node=1"], 1),  # found by sinfo: no GPU gres
    ({"NPROC_PER_NODE": "2"}, ["--gpus-per-node=0", "--ntasks-per-node=2"], 2),
    ({"GPUS_PER_NODE": "0", "NPROC_PER_NODE": "3", "STUB_GRES": "gpu:8"},
     ["--gpus-per-node=0", "--ntasks-per-node=3"], 3),
])
def test_cpu_only_clusters_get_no_gpu_request_and_tasks_per_node(cluster, env, options, slots):
    env = {"STUB_NODELIST": "cpu[1-2]", "NODES": "2", "MASTER_PORT": "29517", "STUB_GRES": "(null)", **RECIPE, **env}
    proc = cluster.run("slurm_multi_node.sbatch", *OVERRIDES, **env)
    assert proc.returncode == 0, proc.stderr
    script = str(LAUNCHERS / "slurm_multi_node.sbatch")
    assert cluster.argv("sbatch") == [["--nodes=2", *options, script, *OVERRIDES]]
    assert (cluster.tmp / "seen" / "moep_ds-4242.hostfile").read_text() == f"cpu1 slots={slots}\ncpu2 slots={slots}\n"


def test_single_node_cpu_job_runs_its_tasks_per_node(cluster):
    env = {**RECIPE, "STUB_NODELIST": "cpu1", "NPROC_PER_NODE": "2", "MASTER_PORT": "29517", "RESUME": "",
           "STUB_GRES": "(null)"}
    proc = cluster.run("slurm_single_node.sbatch", "--set", "train.max_steps=3", **env)
    assert proc.returncode == 0, proc.stderr
    assert cluster.argv("sbatch")[0][:2] == ["--gpus-per-node=0", "--ntasks-per-node=2"]
    assert cluster.argv("deepspeed")[0][:2] == ["--num_gpus", "2"]


def test_single_node_launch(cluster):
    env = {**RECIPE, "STUB_NODELIST": "gpu05", "GPUS_PER_NODE": "4", "MASTER_PORT": "29517", "RESUME": ""}
    proc = cluster.run("slurm_single_node.sbatch", "--set", "train.max_steps=3", **env)
    assert proc.returncode == 0, proc.stderr
    assert cluster.argv("sbatch") == [["--gpus-per-node=4", "--ntasks-per-node=4",
                                       str(LAUNCHERS / "slurm_single_node.sbatch"), "--set", "train.max_steps=3"]]
    assert cluster.argv("deepspeed") == [["--num_gpus", "4", "--master_port", "29517", "pretrain.py",
                                          "--config", "configs/quickstart.yaml", "--ds_config",
                                          "ds_configs/quickstart.json", "--set", "train.max_steps=3"]]


def test_local_launch_merges_every_override_into_one_set_list(cluster):
    run_dir = cluster.tmp / "run"
    proc = cluster.run("local.sh", "--set", "train.max_steps=3", "--resume", "auto", "--set=train.log_every=1",
                       NPROC="2", MASTER_PORT="29517", RUN_DIR=str(run_dir), DEEPSPEED_ARGS="--bind_cores_to_rank",
                       **RECIPE)
    assert proc.returncode == 0, proc.stderr
    assert cluster.argv("deepspeed") == [["--num_gpus", "2", "--master_port", "29517", "--bind_cores_to_rank",
                                          "pretrain.py", "--config", "configs/quickstart.yaml", "--ds_config",
                                          "ds_configs/quickstart.json", "--resume", "auto", "--set",
                                          f"train.output_dir={run_dir}", "train.max_steps=3", "train.log_every=1"]]
    assert cluster.argv("sbatch") == cluster.argv("srun") == cluster.argv("scontrol") == []


def test_a_free_port_is_chosen_when_none_is_set(cluster):
    proc = cluster.run("local.sh", **RECIPE)
    assert proc.returncode == 0, proc.stderr
    argv = cluster.argv("deepspeed")[0]
    port = int(argv[argv.index("--master_port") + 1])
    with socket.socket() as s:
        s.bind(("", port))  # still free


def test_srun_task_takes_its_rank_from_slurm(cluster):
    root = cluster.tmp / "root"
    root.mkdir()
    (root / "pretrain.py").write_text(
        "import json, os, sys\n"
        "keys = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')\n"
        "print(json.dumps({'argv': sys.argv, **{k: os.environ[k] for k in keys}}))\n")
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "MASTER_ADDR": "gpu01",
           "MASTER_PORT": "29517", "MOEP_ROOT": str(root)}
    proc = cluster.run("srun_task.sh", "--config", "c.yaml", "--set", "a=1", **env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"argv": [str(root / "pretrain.py"), "--config", "c.yaml", "--set", "a=1"],
                                       "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                       "MASTER_ADDR": "gpu01", "MASTER_PORT": "29517"}


@pytest.mark.parametrize("script,env,message", [
    ("slurm_multi_node.sbatch", {}, "no recipe: set CONFIG=configs/<name>.yaml or pass --config"),
    ("slurm_multi_node.sbatch", {**RECIPE, "LAUNCHER": "mpirun"}, "LAUNCHER (mpirun) must be deepspeed or srun"),
    ("slurm_single_node.sbatch", {**RECIPE, "NODES": "2"}, "NODES (2) must be 1 here"),
    ("slurm_multi_node.sbatch", {**RECIPE, "NODES": "0"}, "NODES (0) must be a positive integer (nodes)"),
    ("slurm_multi_node.sbatch", {**RECIPE, "GPUS_PER_NODE": "x"}, "GPUS_PER_NODE (x) must be a whole number"),
    ("slurm_multi_node.sbatch", {**RECIPE, "NPROC_PER_NODE": "0"}, "NPROC_PER_NODE (0) must be a positive integer"),
    ("slurm_single_node.sbatch", {**RECIPE, "MASTER_PORT": "70000"}, "MASTER_PORT (70000) must be an integer from 1"),
    ("local.sh", {}, "no recipe"),
])
def test_bad_settings_fail_before_submitting(cluster, script, env, message):
    proc = cluster.run(script, STUB_NODELIST="gpu01", **env)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert cluster.calls() == []


@pytest.mark.parametrize("env,message", [
    ({"NPROC": "0"}, "NPROC (0) must be a positive integer (processes on this machine)"),
    ({"NPROC": "-1"}, "NPROC (-1) must be a positive integer (processes on this machine)"),
    ({"NPROC": "abc"}, "NPROC (abc) must be a positive integer (processes on this machine)"),
    ({"MASTER_PORT": "abc"}, "MASTER_PORT (abc) must be an integer from 1 to 65535"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT (0) must be an integer from 1 to 65535"),
    ({"MASTER_PORT": "65536"}, "MASTER_PORT (65536) must be an integer from 1 to 65535"),
])
def test_local_launch_refuses_a_bad_nproc_or_port_in_one_line(cluster, env, message):
    before = sorted(cluster.tmp.rglob("*"))
    proc = cluster.run("local.sh", **RECIPE, **env)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"[launcher] error: {message}"]
    assert cluster.calls() == [] and sorted(cluster.tmp.rglob("*")) == before


def test_local_launch_passes_nproc_and_port_as_plain_numbers(cluster):
    proc = cluster.run("local.sh", NPROC="02", MASTER_PORT="029517", **RECIPE)
    assert proc.returncode == 0, proc.stderr
    argv = cluster.argv("deepspeed")[0]
    assert argv[:4] == ["--num_gpus", "2", "--master_port", "29517"]  # signal_trainers.sh matches the port as text


def test_more_nodes_than_allocated_is_an_error(cluster):
    env = {**RECIPE, "STUB_NODELIST": "gpu[01-02]", "GPUS_PER_NODE": "4", "MOEP_ROOT": str(REPO),
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NUM_NODES": "2", "NODES": "3"}
    proc = cluster.run("slurm_multi_node.sbatch", **env)
    assert proc.returncode == 2
    assert "NODES (3) exceeds the job's 2 node(s) (gpu[01-02])" in proc.stderr
    assert cluster.argv("deepspeed") == []


# Preemption with stand-in trainers: the stub deepspeed starts two copies of fake_trainer/pretrain.py (which
# record SIGUSR1 and exit 0) and a decoy with another MASTER_PORT; the stub deepspeed itself names pretrain.py
# on its command line and would die of SIGUSR1 (the real launcher does not forward it).

def start_with_fake_trainers(cluster, script, **env):
    out = cluster.tmp / "trainers"
    out.mkdir()
    env = {**RECIPE, "STUB_FAKE_TRAINER": str(FAKE_TRAINER), "FAKE_TRAINER_DIR": str(out), "MASTER_PORT": "29517",
           **env}
    proc = cluster.start(script, **env)
    wait_for(lambda: {p.name for p in out.iterdir()} >= {"started-0", "started-1", "started-9"}, proc, 60,
             "the fake trainers started")
    return proc, out


def finish(cluster, proc) -> str:
    assert proc.wait(timeout=60) == 0, (cluster.tmp / "launch.log").read_text()
    return (cluster.tmp / "launch.log").read_text()


@pytest.mark.slow
def test_usr1_in_deepspeed_mode_stops_the_trainers_on_every_node_then_requeues(cluster):
    """The stop request's srun returns after the launch has ended (STUB_SRUN_LINGER_S): the job's status is still
    the launch's (0), not the 138 of the `wait` the signal interrupted."""
    proc, out = start_with_fake_trainers(cluster, "slurm_multi_node.sbatch", STUB_NODELIST="gpu[01-02]",
                                         NODES="2", GPUS_PER_NODE="4", STUB_SRUN_SPAWN="1", STUB_SRUN_LINGER_S="3")
    proc.send_signal(signal.SIGUSR1)
    log = finish(cluster, proc)
    assert sorted(p.name for p in out.glob("stopped-*")) == ["stopped-0", "stopped-1"], log  # not the decoy
    assert cluster.argv("srun") == [["--overlap", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "bash",
                                     str(LAUNCHERS / "signal_trainers.sh"), "USR1", "29517"]]
    assert cluster.argv("scontrol") == [["show", "hostnames", "gpu[01-02]"], ["requeue", "4242"]]
    assert "received SIGUSR1" in log and "requeueing job 4242" in log


@pytest.mark.slow
def test_sigterm_stops_the_trainers_without_requeueing(cluster):
    proc, out = start_with_fake_trainers(cluster, "slurm_single_node.sbatch", STUB_NODELIST="gpu01",
                                         GPUS_PER_NODE="2")
    proc.send_signal(signal.SIGTERM)
    log = finish(cluster, proc)
    assert sorted(p.name for p in out.glob("stopped-*")) == ["stopped-0", "stopped-1"], log
    assert ["requeue", "4242"] not in cluster.argv("scontrol")
    assert cluster.argv("srun") == []  # one node: signalled from the batch shell itself


@pytest.mark.slow
def test_usr1_to_local_launch_stops_the_trainers(cluster):
    proc, out = start_with_fake_trainers(cluster, "local.sh", NPROC="2", FAKE_TRAINER_STOP_S="2")
    proc.send_signal(signal.SIGUSR1)
    launch_log = cluster.tmp / "launch.log"
    wait_for(lambda: "trainer process(es)" in launch_log.read_text(), proc, 30, "the stop request")
    proc.send_signal(signal.SIGTERM)  # while the trainers save: not forwarded again
    log = finish(cluster, proc)
    assert sorted(p.name for p in out.glob("stopped-*")) == ["stopped-0", "stopped-1"]
    assert log.count("asking the trainers to checkpoint and stop") == 1
    assert "received SIGTERM: the trainers are already stopping" in log
    assert cluster.argv("scontrol") == []


@pytest.mark.slow
def test_signal_trainers_picks_the_children_of_the_real_deepspeed_launcher(cluster):
    """The real launcher's two processes name pretrain.py and carry MASTER_PORT too; they must be left alone."""
    out = cluster.tmp / "trainers"
    out.mkdir()
    deepspeed = Path(sys.executable).parent / "deepspeed"
    proc = cluster.spawn([str(deepspeed), "--num_gpus", "2", "--master_port", "29517", str(FAKE_TRAINER)],
                         FAKE_TRAINER_DIR=str(out), MASTER_PORT="29517")
    wait_for(lambda: {p.name for p in out.iterdir()} >= {"started-0", "started-1"}, proc, 120,
             "the fake trainers started")
    stop = subprocess.run(["bash", str(LAUNCHERS / "signal_trainers.sh"), "USR1", "29517"], env=cluster.env,
                          capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0
    assert "SIGUSR1 to 2 trainer process(es) of port 29517" in stop.stderr
    assert proc.wait(timeout=60) == 0, (cluster.tmp / "launch.log").read_text()
    assert sorted(p.name for p in out.glob("stopped-*")) == ["stopped-0", "stopped-1"]
