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
    """Under pytest-xdist's `-n 2 --dist loadgroup` (the README's test command) a test goes to whichever worker is
    free, except that the tests sharing a module- or session-scoped fixture of ours (a trained run, the SLURM cluster)
    go together to one worker, as one group: spread over both, each worker would build the fixture again. xdist
    hands out the groups first, largest first; the single tests follow in this order: slow (multi-process and
    end-to-end) ones first, so the last to start are short and the two workers finish together."""
    for item in items:
        shared = [d.baseid for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs
                  if d.scope != "function" and d.baseid.startswith("tests")]
        if shared:
            item.add_marker(pytest.mark.xdist_group(min(shared, key=len)))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
