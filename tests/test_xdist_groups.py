"""The suite's own xdist scheduling (xdist_groups.py, conftest.py): the tests of a module or folder that defines a shared fixture run
on one worker, so the fixture is built once."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from xdist_groups import FixtureGroupScheduling, fixture_groups

TESTS = Path(__file__).parent


def test_groups_are_the_modules_and_folders_defining_a_shared_fixture():
    groups = fixture_groups(TESTS)
    assert "tests/cluster" in groups  # its conftest.py: the session's SLURM cluster
    assert "tests/training/test_expert_comm.py" in groups  # module-scoped trained runs
    assert "tests/moe/test_clamped_swiglu.py" in groups
    assert "tests/test_config.py" not in groups and "tests/routing/test_expert_choice.py" not in groups  # function scope only


def test_a_grouped_test_is_scheduled_by_its_group_and_any_other_alone():
    scheduler = FixtureGroupScheduling.__new__(FixtureGroupScheduling)
    scheduler.groups = ["tests/cluster", "tests/moe/test_clamped_swiglu.py"]
    assert scheduler._split_scope("tests/cluster/test_slurm_cluster.py::test_srun[a]") == "tests/cluster"
    assert scheduler._split_scope("tests/moe/test_clamped_swiglu.py::test_x[1]") == "tests/moe/test_clamped_swiglu.py"
    assert scheduler._split_scope("tests/test_config.py::test_y") == "tests/test_config.py::test_y"


@pytest.mark.slow
def test_the_readme_command_runs_a_group_on_one_worker():
    """Two workers, as the README's command: every test of a module with a module-scoped fixture on one of them (spread,
    as xdist 3.8's own loadgroup marks leave them under pytest 9, both would build the fixture), while single tests
    go to both."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p",
                           "no:cacheprovider", "tests/moe/test_clamped_swiglu.py", "tests/test_fsutil.py"],
                          cwd=TESTS.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    ran = re.findall(r"^\[(gw\d)\] \[ *\d+%\] PASSED (tests/[\w/]+\.py)::", proc.stdout, re.M)
    workers = {path: {w for w, p in ran if p == path} for _, path in ran}
    assert len(workers["tests/moe/test_clamped_swiglu.py"]) == 1, ran
    assert {w for w, _ in ran} == {"gw0", "gw1"}, ran
