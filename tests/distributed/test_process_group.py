"""Joining the process group (distributed/process_group.py): the world a process is about to join, as the launcher's
environment (torchrun/deepspeed, SLURM, MPI) says."""
import os


def test_the_world_before_joining_is_the_launchers_or_one(monkeypatch):
    """As init_distributed decides: a process without RANK is a world of one whatever WORLD_SIZE says."""
    from moep_ds.distributed.process_group import world_size_to_be

    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK",
                 "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert world_size_to_be() == 1
    monkeypatch.setenv("RANK", "3")
    assert world_size_to_be() == 4


def test_under_an_mpi_launcher_deepspeeds_mpi_discovery_sets_the_ranks(monkeypatch):
    """DeepSpeed's --launcher openmpi starts the trainers without RANK: they are not worlds of one (each would train
    alone into the same output folder), DeepSpeed's MPI discovery gives them their ranks; errors are printed by the
    MPI rank 0."""
    import deepspeed

    from moep_ds.distributed.launcher import launcher_rank
    from moep_ds.distributed import process_group as distributed

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "PMI_SIZE",
                 "PMI_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"):
        monkeypatch.setenv(name, "")  # recorded, so that what init_distributed sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "5")
    assert (distributed.world_size_to_be(), launcher_rank()) == (8, 5)
    seen = {}
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: seen.update(rank=os.environ.get("RANK")))
    monkeypatch.setattr(distributed.torch.distributed, "is_initialized", lambda: False)
    distributed.init_distributed()
    assert seen == {"rank": None}  # left to DeepSpeed's MPI discovery, not made rank 0 of a world of one
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")  # a job of one MPI process is a world of one
    distributed.init_distributed()
    assert seen == {"rank": "0"}
