"""Shared test setup: offline hubs, one thread per process, a shorter collective timeout, paths to the repository
and the shared data."""
import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# a collective of the default group that waits for a rank which never comes fails after 5 minutes (DeepSpeed's
# default is 10, as long as a launch's timeout here): the error names the collective, instead of a launch timing out
# with nothing said. Groups made later (DeepSpeed's expert groups) keep torch's own default
os.environ.setdefault("DEEPSPEED_TIMEOUT", "5")

import torch  # noqa: E402

torch.set_num_threads(1)

from repo_paths import SHARED_DATA  # noqa: E402


@pytest.fixture
def shared_data():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA} (set MOEP_DATA_DIR to run this case)")
    return SHARED_DATA


# tests/<folder> run on the second worker under `-n 2 --dist loadgroup`: the cluster tests mostly wait on SLURM's
# timers (a requeue, a time limit checked every 30 s), the launcher and bench tests on their own processes' start-up;
# and SIDE_MODULES, long multi-process runs that even out the two workers' times
SIDE = ("cluster", "launchers", "bench")
SIDE_MODULES = ("tests/training/test_expert_comm.py",)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the marks into the node ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's `-n 2 --dist loadgroup` (the README's test command): the SIDE folders' tests run in order
    on one worker while the rest of the suite runs in order on the other; one process per group, so session fixtures
    are built once."""
    # a worker learns the mode as the option xdist gives it ("loadgroup"), the controller from --dist
    if not (getattr(config.option, "loadgroup", False) or config.getoption("dist", "no") == "loadgroup"):
        return
    for item in items:
        parts = item.path.relative_to(config.rootpath).parts
        side = (len(parts) > 2 and parts[0] == "tests" and parts[1] in SIDE) or "/".join(parts) in SIDE_MODULES
        group = "side" if side else "suite"
        item.add_marker(pytest.mark.xdist_group(group))

