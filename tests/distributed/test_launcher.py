"""The launcher a process runs under (distributed/launcher.py): what a command line runs, never a substring of it."""
from moep_ds.distributed.launcher import launcher_of


def test_launchers_are_what_the_command_line_runs_not_a_substring():
    assert launcher_of(["python", "-m", "torch.distributed.run", "--standalone", "t.py"]) == "torch.distributed.run"
    assert launcher_of(["/usr/bin/python3.12", "-u", "-W", "ignore", "-m", "deepspeed.launcher.launch", "x"]) == \
        "deepspeed.launcher.launch"
    assert launcher_of(["python", "/venv/lib/python3.12/site-packages/deepspeed/launcher/launch.py", "x"]) == \
        "deepspeed.launcher.launch"
    assert launcher_of(["/venv/bin/torchrun", "--nproc_per_node", "2", "t.py"]) == "torch.distributed.run"
    assert launcher_of(["slurmstepd: [1234.0]"]) == "slurmstepd"
    # shells, nohup and scripts whose names or arguments merely mention a launcher are none
    for cmdline in (["bash", "-c", "torchrun x"], ["nohup", "python", "pretrain.py"], ["-bash"], [],
                    ["python", "my_torchrun_tests/run.py"], ["python", "pretrain.py", "--config", "torchrun.yaml"],
                    ["python", "-c", "import deepspeed.launcher.launch"], ["tmux", "new", "deepspeed x"]):
        assert launcher_of(cmdline) is None, cmdline
