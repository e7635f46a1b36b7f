"""Issue 46 item 6: moep-import and moep-export stopped by a signal or a full disk while they write. Either way: one
line, the shell's status, and nothing left beside --out, also after a SIGKILL (by the next command into it)."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.checkpoint import filesystem as dcp_filesystem

from hf_models import hf_model, save
from moep_ds import fsutil
from moep_ds.checkpointing import layout, streaming
from moep_ds.cli.export import main as export_main
from moep_ds.cli.import_model import main as import_main

pytest.importorskip("transformers")
SLOW_WRITE = Path(__file__).with_name("slow_write.py")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save(hf_model("gpt2"), tmp_path_factory.mktemp("src") / "hf", "safetensors")


def start_writing(module: str, argv: list[str], marker: Path) -> subprocess.Popen:
    """`python -m MODULE ARGV` in a process of its own, returned once it writes into its temporary folder (it
    then waits there: slow_write.py)."""
    from ranks import launcher_env

    proc = subprocess.Popen([sys.executable, str(SLOW_WRITE), str(marker), module, *argv], env=launcher_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            # SIGINT as a terminal delivers it (a background `cmd &` of a script ignores it)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("sig, status, line", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                               (signal.SIGINT, 130, "interrupted"),
                                               (signal.SIGHUP, 129, "terminated (SIGHUP)")])
def test_a_signal_while_importing_leaves_nothing_and_says_one_line(tmp_path, hf_dir, sig, status, line):
    """SIGTERM left the hidden `.run.*.tmp` (29 MB of a 100 MB model); SIGINT, which DCP wraps in its
    CheckpointException, ended in a traceback."""
    out = tmp_path / "out"
    out.mkdir()
    proc = start_writing("moep_ds.cli.import_model", [str(hf_dir), "--out", str(out / "run")], tmp_path / "marker")
    assert [p.name for p in out.iterdir()][0].startswith(".run.")  # its temporary, being written
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    said = [x for x in err.splitlines() if not x.startswith(("INFO ", "WARNING "))]  # besides the command's log
    assert proc.returncode == status and said == [line], err
    assert list(out.iterdir()) == []


@pytest.mark.slow
def test_what_a_killed_import_left_goes_with_the_next_import(tmp_path, hf_dir):
    """SIGKILL runs no clean-up: the temporary stays until the next command into the same --out (its pid is gone)."""
    out = tmp_path / "out"
    proc = start_writing("moep_ds.cli.import_model", [str(hf_dir), "--out", str(out / "run")], tmp_path / "marker")
    proc.kill()
    proc.communicate(timeout=60)
    [left] = list(out.iterdir())
    assert left.name.startswith(".run.") and left.name.endswith(".tmp") and any(left.rglob("*.distcp"))
    assert import_main([str(hf_dir), "--out", str(out / "run")]) == 0
    assert [p.name for p in out.iterdir()] == ["run"] and layout.newest_checkpoint(out / "run") is not None


# ---- a full disk: one line naming --out and the space left there -------------------------------------------------


@pytest.mark.parametrize("failure", ["short write", "ENOSPC"])
def test_a_full_disk_while_importing_is_one_line(tmp_path, hf_dir, monkeypatch, capsys, failure):
    """A full disk during the import was a traceback: DCP's CheckpointException around torch.save's short write
    ("unexpected pos 704 vs 598") or around the OSError."""
    def full_disk(*args, **kwargs):
        if failure == "ENOSPC":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(dcp_filesystem, "_write_item", full_disk)
    monkeypatch.setattr(fsutil, "free_bytes", lambda path: 3 << 20)
    out = tmp_path / "out" / "run"
    assert import_main([str(hf_dir), "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: disk full (No space left on device) writing {str(out)!r}, 3 MiB free there")
    assert not (tmp_path / "out").exists()


class FullDiskFile:
    """A file opened for writing whose second write finds the disk full (as the safetensors writer's data does)."""

    def __init__(self, path, mode):
        self.file, self.writes = open(path, mode), 0

    def write(self, data):
        self.writes += 1
        if self.writes > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


@pytest.mark.parametrize("flags", [[], ["--hf", "--native"]])
def test_a_full_disk_while_exporting_is_one_line(tmp_path, hf_dir, monkeypatch, capsys, flags):
    assert import_main([str(hf_dir), "--out", str(tmp_path / "run")]) == 0
    monkeypatch.setattr(streaming, "open", FullDiskFile, raising=False)
    monkeypatch.setattr(fsutil, "free_bytes", lambda path: 3 << 20)
    out = tmp_path / "out" / "export"
    assert export_main([str(tmp_path / "run"), "--out", str(out), *flags]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: disk full (No space left on device) writing {str(out)!r}, 3 MiB free there")
    assert not (tmp_path / "out").exists()


def test_a_full_disk_while_downloading_is_not_a_missing_revision(tmp_path, monkeypatch):
    """huggingface_hub's OSError of a download into a full cache was reported as a revision not on the hub."""
    import huggingface_hub
    from huggingface_hub import constants

    from moep_ds.errors import UserError
    from moep_ds.interop.hub import resolve

    cache = tmp_path / "hub"
    blob = cache / "models--o--n" / "blobs" / "abc.incomplete"

    def full_cache(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(blob))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", full_cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(fsutil, "free_bytes", lambda path: 3 << 20)
    with pytest.raises(UserError) as err:
        resolve("hf:o/n@main", "SRC")
    assert str(err.value) == ("SRC ('hf:o/n@main'): downloading o/n@main into the Hugging Face cache failed: disk full "
                              f"(No space left on device) writing {str(cache)!r}, 3 MiB free there")
