"""The `slurm` fixture: a real two-node SLURM cluster on network namespaces (slurm_cluster.Cluster), one for the
session; skipped, with the reason, where root or Debian's slurm-wlm / munge / openssh-server / pdsh are missing."""
import pytest

from slurm_cluster import Cluster, missing


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    reason = missing()
    if reason:
        pytest.skip(reason)
    cluster = Cluster(tmp_path_factory.mktemp("slurm"), nodes=2)
    cluster.up()
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One MOEP_CACHE_DIR for every job of the session (the nodes share it): the corpus is prepared once."""
    return tmp_path_factory.mktemp("moep_cache")
