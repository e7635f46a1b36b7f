"""Shared test setup: offline hubs, one thread per process, a shorter collective timeout, paths to the repository
and the shared data."""
import os
from pathlib import Path

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
from xdist_groups import FixtureGroupScheduling, fixture_groups  # noqa: E402


@pytest.fixture
def shared_data():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA} (set MOEP_DATA_DIR to run this case)")
    return SHARED_DATA


def pytest_xdist_make_scheduler(config, log):
    """The README's test command, `-n 2 --dist loadgroup`: FixtureGroupScheduling."""
    if config.getvalue("dist") == "loadgroup":
        return FixtureGroupScheduling(config, log, fixture_groups(Path(__file__).parent))
    return None
