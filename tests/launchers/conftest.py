"""The `cluster` fixture: a simulated SLURM cluster in the test's tmp_path (launcher_cluster.Cluster)."""
import pytest

from launcher_cluster import Cluster


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.kill_leftovers()
