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


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the marks into the node ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's `-n 2 --dist loadgroup` (the README's test command) tests go to whichever worker is free,
    but the cluster tests, which share one SLURM cluster (a session fixture), all go to the same worker."""
    for item in items:
        parts = item.path.relative_to(config.rootpath).parts
        if parts[:2] == ("tests", "cluster"):
            item.add_marker(pytest.mark.xdist_group("cluster"))
