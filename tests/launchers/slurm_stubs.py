"""Stand-ins for sbatch, srun, scontrol and deepspeed, run as `python slurm_stubs.py PROG ARG...` from small
wrappers on PATH (see `install`). Every call appends {"prog", "argv", "cwd", "env"} as a JSON line to $STUB_LOG.

- sbatch: runs the job at once, in this process (exec bash), with the SLURM_* variables of an allocation of
  $STUB_NODELIST whose size comes from --nodes / --gpus-per-node (command line, else the script's #SBATCH lines).
- srun: with STUB_SRUN_SPAWN=1 starts nodes x ntasks-per-node local processes with SLURM_PROCID / SLURM_NTASKS /
  SLURM_LOCALID / SLURM_NODEID, forwards SIGUSR1 / SIGUSR2 / SIGTERM to them (as srun does) and exits with the
  first non-zero status, STUB_SRUN_LINGER_S seconds after they ended; otherwise only records.
- scontrol: `show hostnames LIST` expands a host list (`gpu[01-02],login1`); `requeue ID` records.
- sinfo: `-h -o %G` prints $STUB_GRES (default gpu:4; "(null)" is a cluster without GPU gres).
- deepspeed: records, and copies its hostfile and DS_ENV_FILE (mode kept) into $STUB_SEEN (the launcher removes
  them when the job ends); with STUB_FAKE_TRAINER=path starts 2 copies of that script as `python -u path
  --local_rank=i` with MASTER_PORT set from --master_port, plus one decoy with another port that must never
  be signalled, and waits for the two.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
PROGS = ("sbatch", "srun", "scontrol", "deepspeed", "sinfo")
RECORDED_ENV = ("MASTER_ADDR", "MASTER_PORT", "MOEP_ROOT", "OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "DS_ENV_FILE")


def install(bin_dir: pathlib.Path) -> pathlib.Path:
    """Write one executable wrapper per stubbed program into bin_dir, running this file with this Python."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for prog in PROGS:
        path = bin_dir / prog
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{__file__}" {prog} "$@"\n')
        path.chmod(0o755)
    return bin_dir


def calls(log: pathlib.Path, prog: str | None = None) -> list[dict]:
    if not log.exists():
        return []
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return [r for r in rows if prog is None or r["prog"] == prog]


def record(prog: str, argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k in RECORDED_ENV or k.startswith("SLURM_")}
    line = json.dumps({"prog": prog, "argv": argv, "cwd": os.getcwd(), "env": env}) + "\n"
    fd = os.open(os.environ["STUB_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, line.encode())  # one write per line: concurrent stubs do not interleave
    os.close(fd)


def expand_hostlist(hostlist: str) -> list[str]:
    """`gpu[01-03,07],login1` -> gpu01 gpu02 gpu03 gpu07 login1 (zero padding kept)."""
    hosts = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", hostlist):
        m = re.fullmatch(r"(.*)\[(.*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(i).zfill(len(lo))}{suffix}")
    return hosts


def split_options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """`--name=value` options up to the first non-option argument, and the rest (the command)."""
    opts = {}
    for i, arg in enumerate(argv):
        if not arg.startswith("-"):
            return opts, argv[i:]
        name, _, value = arg.lstrip("-").partition("=")
        opts[name] = value
    return opts, []


def sbatch(argv: list[str]) -> None:
    opts, command = split_options(argv)
    script = pathlib.Path(command[0])
    header = {}
    for line in script.read_text().splitlines():
        if line.startswith("#SBATCH --"):
            name, _, value = line[len("#SBATCH --"):].partition("=")
            header[name] = value
    opts = {**header, **opts}
    hosts = expand_hostlist(os.environ["STUB_NODELIST"])
    nodes = int(opts.get("nodes", 1))
    if len(hosts) != nodes:
        raise SystemExit(f"stub sbatch: --nodes={nodes} but STUB_NODELIST has {len(hosts)} hosts")
    env = dict(os.environ)
    env.update(SLURM_JOB_ID=os.environ.get("STUB_JOB_ID", "4242"), SLURM_JOB_NAME=opts.get("job-name", script.name),
               SLURM_SUBMIT_DIR=os.getcwd(), SLURM_JOB_NODELIST=os.environ["STUB_NODELIST"],
               SLURM_JOB_NUM_NODES=str(nodes), SLURM_NNODES=str(nodes))
    if "gpus-per-node" in opts and opts["gpus-per-node"] != "0":
        env["SLURM_GPUS_ON_NODE"] = opts["gpus-per-node"]
    if "ntasks-per-node" in opts:
        env["SLURM_NTASKS_PER_NODE"] = opts["ntasks-per-node"]
    os.execve("/bin/bash", ["/bin/bash", *command], env)


def spawn(cmds: list[tuple[list[str], dict]], forward_signals: bool) -> int:
    """Start the processes (optionally forwarding SIGUSR1/SIGUSR2/SIGTERM to them, as srun does; the deepspeed
    launcher does not), wait for all, and return the first non-zero exit status."""
    procs = [subprocess.Popen(cmd, env=env) for cmd, env in cmds]

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM) if forward_signals else ():
        signal.signal(sig, forward)
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c != 0), 0)


def srun(argv: list[str]) -> int:
    if os.environ.get("STUB_SRUN_SPAWN") != "1":
        return 0
    opts, command = split_options(argv)
    nodes, per_node = int(opts.get("nodes", 1)), int(opts.get("ntasks-per-node", 1))
    tasks = []
    for rank in range(nodes * per_node):
        env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_NTASKS=str(nodes * per_node),
                   SLURM_LOCALID=str(rank % per_node), SLURM_NODEID=str(rank // per_node), SLURM_STEP_ID="0")
        tasks.append((command, env))
    status = spawn(tasks, forward_signals=True)
    time.sleep(float(os.environ.get("STUB_SRUN_LINGER_S", 0)))  # a slow srun: returns after its tasks ended
    return status


def scontrol(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"]:
        print("\n".join(expand_hostlist(argv[2] if len(argv) > 2 else os.environ["SLURM_JOB_NODELIST"])))
        return 0
    if argv[:1] == ["requeue"]:
        return 0
    print(f"stub scontrol: unsupported {argv}", file=sys.stderr)
    return 1


def sinfo(argv: list[str]) -> int:
    if argv == ["-h", "-o", "%G"]:
        print(os.environ.get("STUB_GRES", "gpu:4"))
        return 0
    print(f"stub sinfo: unsupported {argv}", file=sys.stderr)
    return 1


def deepspeed(argv: list[str]) -> int:
    seen = pathlib.Path(os.environ["STUB_SEEN"])
    seen.mkdir(exist_ok=True)
    for path in (argv[argv.index("--hostfile") + 1] if "--hostfile" in argv else None, os.environ.get("DS_ENV_FILE")):
        if path and os.path.exists(path):
            shutil.copy2(path, seen / os.path.basename(path))
    fake = os.environ.get("STUB_FAKE_TRAINER")
    if not fake:
        return 0
    port = int(argv[argv.index("--master_port") + 1])
    trainers = [([sys.executable, "-u", fake, f"--local_rank={i}"], dict(os.environ, MASTER_PORT=str(port),
                                                                          LOCAL_RANK=str(i))) for i in range(2)]
    decoy = subprocess.Popen([sys.executable, "-u", fake, "--local_rank=9"],
                             env=dict(os.environ, MASTER_PORT=str(port + 1), LOCAL_RANK="9"))
    try:
        return spawn(trainers, forward_signals=False)
    finally:
        decoy.kill()
        decoy.wait()


def main() -> int:
    prog, argv = sys.argv[1], sys.argv[2:]
    record(prog, argv)
    progs = {"sbatch": sbatch, "srun": srun, "scontrol": scontrol, "deepspeed": deepspeed, "sinfo": sinfo}
    return progs[prog](argv) or 0


if __name__ == "__main__":
    raise SystemExit(main())
