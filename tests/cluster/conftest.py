"""Session fixtures of the cluster tests: `slurm`, a real two-node SLURM cluster on network namespaces
(slurm_cluster.Cluster), one for the session, skipped with the reason where root or Debian's slurm-wlm / munge /
openssh-server / pdsh are missing; one prepared-corpus cache and one DeepSpeed op build folder for every job."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

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


@pytest.fixture(scope="session")
def torch_extensions(tmp_path_factory):
    """A TORCH_EXTENSIONS_DIR for every job of the session holding DeepSpeed's CPU shared-memory op, built (or copied
    from the user's cache, mtimes kept) before the first job, with the ninja the jobs use (this interpreter's, first
    on their PATH). Each trainer loads it at start; a build by another ninja version (another log format) makes it
    stale, and the next load rebuilds it (1-5 min on 2 busy cores); here nobody else builds."""
    folder = tmp_path_factory.mktemp("torch_extensions")
    # torch builds in $TORCH_EXTENSIONS_DIR/NAME, else in ~/.cache/torch_extensions/py3XX_cpu/NAME
    user = (Path(os.environ["TORCH_EXTENSIONS_DIR"]) if os.environ.get("TORCH_EXTENSIONS_DIR") else
            Path.home() / ".cache" / "torch_extensions" / f"py{sys.version_info.major}{sys.version_info.minor}_cpu")
    built = user / "deepspeed_shm_comm"
    if (built / "deepspeed_shm_comm.so").is_file():
        shutil.copytree(built, folder / built.name, symlinks=True,
                        ignore=shutil.ignore_patterns("lock"))  # a build in progress elsewhere
    subprocess.run([sys.executable, "-c", "from deepspeed.ops.op_builder import ShareMemCommBuilder as B; B().load()"],
                   env=dict(os.environ, TORCH_EXTENSIONS_DIR=str(folder),
                            PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])),
                   check=True, timeout=900,
                   stdout=subprocess.DEVNULL)
    return folder
