"""The launcher / MPI environment of this process: its rank and world as the launcher set them (before any process
group exists) and which launcher started a trainer (the processes the trainer watches)."""
from __future__ import annotations

import os
import re


# what MPI launchers (DeepSpeed's --launcher openmpi / mpich / mvapich) set instead of RANK and WORLD_SIZE
MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def first_env(names) -> str | None:
    return next((os.environ[name] for name in names if os.environ.get(name)), None)


def launcher_rank() -> int:
    """This process's rank as a multi-process launcher sets it (deepspeed, torchrun: RANK; srun: SLURM_PROCID; MPI
    launchers: their own variables)."""
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or first_env(MPI_RANK_VARS) or 0)


def launched_world_size() -> int:
    """Processes started by a launcher (torchrun, deepspeed, srun via env); 1 for a plain process."""
    return int(os.environ.get("WORLD_SIZE", 1))


# ranks on this node: torchrun, DeepSpeed's launcher, Open MPI, MPICH / Intel MPI, srun --ntasks-per-node
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                   "SLURM_NTASKS_PER_NODE")


def ranks_per_node() -> int | None:
    """How many ranks of this launch share a node, as the launcher says (every node alike; launchers number a node's
    ranks consecutively): LOCAL_SIZE_VARS, else srun's SLURM_TASKS_PER_NODE when every node runs as many ("4(x2)");
    None when no launcher says (a plain process, or nodes that run different numbers)."""
    value = first_env(LOCAL_SIZE_VARS)
    if value:
        return int(value)
    tasks = re.fullmatch(r"(\d+)(\(x\d+\))?", os.environ.get("SLURM_TASKS_PER_NODE", ""))
    return int(tasks.group(1)) if tasks else None


def mpi_world_size() -> int:
    """The size of the MPI job this process was started in (1 when none)."""
    return int(first_env(MPI_SIZE_VARS) or 1)


# A trainer's parent that is one of these launchers, and how many generations of launcher processes to watch
# above the trainer (DeepSpeed: the per-node `deepspeed.launcher.launch` and the `deepspeed` runner above it;
# torchrun: its elastic agent; srun: the node's slurmstepd, which starts each task).
LAUNCHER_GENERATIONS = {"deepspeed.launcher.launch": 2, "torch.distributed.run": 1, "torch.distributed.launch": 1,
                        "slurmstepd": 1}
# console scripts of those launchers, by file name
LAUNCHER_SCRIPTS = {"torchrun": "torch.distributed.run"}
# script files python may run them as
LAUNCHER_FILES = {"deepspeed/launcher/launch.py": "deepspeed.launcher.launch",
                  "torch/distributed/run.py": "torch.distributed.run"}
# interpreter options that take a value (python -W ignore -m ...)
PYTHON_VALUE_OPTIONS = ("-W", "-X", "-Q")


def launcher_of(cmdline: list[str]) -> str | None:
    """The launcher a process's command line runs (a key of LAUNCHER_GENERATIONS), None for anything else: a shell,
    nohup, tmux, a plain python script. Identified by what is run, not by a substring anywhere in the line (a
    user's script or run folder named `torchrun_test` is no launcher): the program itself (`torchrun`,
    `slurmstepd`), the module after python's `-m`, or the script file python runs."""
    if not cmdline:
        return None
    program = os.path.basename(cmdline[0])
    if program.startswith("slurmstepd"):  # its command line reads "slurmstepd: [job.step]"
        return "slurmstepd"
    if program in LAUNCHER_SCRIPTS:
        return LAUNCHER_SCRIPTS[program]
    if not program.startswith("python"):
        return None
    args = iter(cmdline[1:])
    for arg in args:
        if arg == "-m" or (arg.startswith("-m") and len(arg) > 2):
            module = arg[2:] or next(args, "")
            return module if module in LAUNCHER_GENERATIONS else None
        if arg in PYTHON_VALUE_OPTIONS:
            next(args, None)
        elif arg in ("-c", "-"):
            return None
        elif not arg.startswith("-"):  # the script python runs
            path = arg.replace(os.sep, "/")
            return next((name for end, name in LAUNCHER_FILES.items() if path.endswith(end)),
                        LAUNCHER_SCRIPTS.get(os.path.basename(arg)))
    return None


def launcher_generations(parent_cmdline: list[str]) -> int:
    """How many ancestors of a trainer belong to its launcher (0: not started by a known launcher)."""
    return LAUNCHER_GENERATIONS.get(launcher_of(parent_cmdline) or "", 0)
