"""A failed asynchronous checkpoint save is named (a full disk says so, with the path) and reported at the first step
boundary after it failed, not one save later."""
import errno
import os

import pytest
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from moep_ds import fsutil
from moep_ds.training.checkpoint import save_error_reason

from tiny import DS_CONFIGS, metrics, run_pretrain, write_recipe


def test_a_full_disk_is_named_through_dcps_wrapping(tmp_path, monkeypatch):
    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "__0_0.distcp"))
    dcp_error = CheckpointException("save failed", {0: _wrap_exception(enospc)})
    monkeypatch.setattr(fsutil, "free_bytes", lambda path: 3 << 20)
    assert save_error_reason(dcp_error, tmp_path) == \
        f"disk full (No space left on device) writing {str(tmp_path)!r}, 3 MiB free there"
    # torch.save's stream writer reports the short write of a full disk as a position mismatch
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert save_error_reason(short, tmp_path).startswith("disk full (No space left on device)")
    monkeypatch.setattr(fsutil, "free_bytes", lambda path: 100 << 30)  # space left: not a full disk
    assert save_error_reason(short, tmp_path) == "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    denied = OSError(errno.EACCES, os.strerror(errno.EACCES), "x")
    assert save_error_reason(denied, tmp_path) == "[Errno 13] Permission denied: 'x'"


@pytest.mark.slow
def test_a_failed_async_save_stops_the_run_at_the_next_step(tmp_path):
    """The save of step 4 fails (ENOSPC in DCP's writer, faults.py) while training goes on: the run
    stops within the steps the write took, with the error of the save of step 4; before, it trained on to the save
    of step 8 and failed there, with step 4's error and steps 5-8 lost."""
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=12,
                          checkpoint={"every_steps": 4, "async_save": True, "keep_last": 3})
    [proc] = run_pretrain(1, "--config", str(recipe), "--ds_config", str(DS_CONFIGS / "zero2_fp32.json"),
                          fault="enospc", step=4, rank=0, check=False)
    assert proc.exitcode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    tmp = out / "checkpoints" / ".tmp-step_00000004"
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: saving checkpoint '{out / 'checkpoints' / 'step_00000004'}' failed: disk full "
                                f"(No space left on device) writing '{tmp}', "), errors[0]
    assert errors[0].endswith(" MiB free there; the previous checkpoints are kept")
    last = max(m["step"] for m in metrics(out) if "loss" in m)
    assert 4 <= last < 8, last  # stopped at the first step boundary after the failed save (it went on to 8 before)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == []  # step 4 never marked complete
