"""File-system helpers (moep_ds/fsutil.py): directories appear atomically and a failed write leaves nothing behind."""
import pytest

from moep_ds import fsutil as layout
from moep_ds.checkpointing.layout import STEP_PREFIX


def test_atomic_dir_failure_leaves_the_old_folder_and_no_new_ones(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "f").write_text("old")
    for final in (tmp_path / "old", tmp_path / "a" / "b" / "new"):
        with pytest.raises(RuntimeError, match="boom"):
            with layout.atomic_dir(final) as tmp:
                (tmp / "f").write_text("half")
                raise RuntimeError("boom")
    assert [p.name for p in tmp_path.iterdir()] == ["old"] and (tmp_path / "old" / "f").read_text() == "old"


def test_atomic_dir_keeps_a_parent_that_was_filled_meanwhile(tmp_path):
    with pytest.raises(RuntimeError):
        with layout.atomic_dir(tmp_path / "a" / "b" / "new"):
            (tmp_path / "a" / "other").write_text("x")
            raise RuntimeError("boom")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["a", "a/other"]


def test_replace_dir_keeps_the_old_folder_whole_until_the_new_one_is_in(tmp_path, monkeypatch):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "f").write_text("old")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "f").write_text("new")
    real_replace = layout.os.replace

    def failing(src, dst):
        if str(src).endswith("new"):
            raise OSError("disk gone")
        real_replace(src, dst)

    monkeypatch.setattr(layout.os, "replace", failing)
    with pytest.raises(OSError, match="disk gone"):
        layout.replace_dir(tmp_path / "new", tmp_path / "final")
    assert (tmp_path / "final" / "f").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [
        "final", "new"]
    monkeypatch.setattr(layout.os, "replace", real_replace)
    layout.replace_dir(tmp_path / "new", tmp_path / "final")
    assert (tmp_path / "final" / "f").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["final"]


def folder(path, text):
    path.mkdir()
    (path / "f").write_text(text)
    return path


def test_replace_dir_removes_what_a_killed_replacement_left_aside_and_nothing_else(tmp_path, caplog):
    """A process killed between replace_dir's rename aside and its delete left `.final.old-*` for good."""
    final, new = folder(tmp_path / "final", "old"), folder(tmp_path / "new", "new")
    left = folder(tmp_path / ".final.old-0123456789ab", "older")
    (left / "sub").mkdir()
    other_names = [".final.old-0123456789a", ".final.old-0123456789abc", ".final.old-0123456789AB",
                   ".final.old-0123456789ab.tmp", "final.old-0123456789ab", ".other.old-0123456789ab",
                   ".xfinal.old-0123456789ab", ".final.tmp"]
    for name in other_names:
        folder(tmp_path / name, "not replace_dir's")
    (tmp_path / ".final.old-aaaaaaaaaaaa").write_text("a file of that name")
    elsewhere = folder(tmp_path / "elsewhere", "linked")
    (tmp_path / ".final.old-bbbbbbbbbbbb").symlink_to(elsewhere)
    with caplog.at_level("WARNING", logger=layout.__name__):
        layout.replace_dir(new, final)
    assert (final / "f").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*other_names, ".final.old-aaaaaaaaaaaa", ".final.old-bbbbbbbbbbbb", "elsewhere", "final"])
    assert all((tmp_path / name / "f").read_text() == "not replace_dir's" for name in other_names)
    assert (elsewhere / "f").read_text() == "linked"
    assert caplog.messages == [f"removing {left}: an old copy of final that an interrupted replacement left"]


def test_a_left_aside_copy_stays_until_a_new_folder_is_in_place(tmp_path, monkeypatch, caplog):
    """Killed between its two renames, a replacement leaves no `final`: the copy aside is the only one."""
    left = folder(tmp_path / ".final.old-0123456789ab", "the only copy")
    new = folder(tmp_path / "new", "new")
    real_replace = layout.os.replace

    def failing(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(layout.os, "replace", failing)
    with pytest.raises(OSError, match="disk gone"):
        layout.replace_dir(new, tmp_path / "final")
    assert (left / "f").read_text() == "the only copy" and not caplog.messages
    monkeypatch.setattr(layout.os, "replace", real_replace)
    layout.replace_dir(new, tmp_path / "final")
    assert [p.name for p in tmp_path.iterdir()] == ["final"] and (tmp_path / "final" / "f").read_text() == "new"
    assert caplog.messages == [f"removing {left}: an old copy of final that an interrupted replacement left"]


def test_output_dir_writes_an_empty_folder_in_place_and_empties_it_on_error(tmp_path, monkeypatch):
    """An existing empty folder (a mount point; a folder whose parent this process cannot write) is filled in
    place: no sibling is made, so the parent is never written."""
    out = tmp_path / "mount"
    out.mkdir()
    made = []
    monkeypatch.setattr(layout.tempfile, "mkdtemp", lambda **kw: made.append(kw) or pytest.fail("made a sibling"))
    with pytest.raises(RuntimeError, match="boom"):
        with layout.output_dir(out) as target:
            assert target == out
            (target / "sub").mkdir()
            (target / "sub" / "f").write_text("half")
            raise RuntimeError("boom")
    assert out.is_dir() and list(out.iterdir()) == []
    with layout.output_dir(out) as target:
        (target / "f").write_text("done")
    assert (out / "f").read_text() == "done" and sorted(p.name for p in tmp_path.iterdir()) == ["mount"]
    monkeypatch.undo()
    with layout.output_dir(out) as target:  # no longer empty: built beside it and swapped in
        assert target != out
        (target / "g").write_text("new")
    assert [p.name for p in out.iterdir()] == ["g"]


def test_a_replaced_link_goes_and_its_target_stays(tmp_path):
    target = folder(tmp_path / "target", "kept")
    (tmp_path / "final").symlink_to(target)
    layout.replace_dir(folder(tmp_path / "new", "new"), tmp_path / "final")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "target"]
    assert (tmp_path / "final" / "f").read_text() == "new" and (target / "f").read_text() == "kept"


def test_a_save_sweeps_any_checkpoint_left_aside(tmp_path, caplog):
    """CheckpointWriter.save tidies what any step's killed replacement left (that step is rarely replaced again):
    a copy beside its checkpoint goes, a copy whose checkpoint is missing (killed between the two renames) is the
    only one and is renamed back."""
    extra = folder(tmp_path / ".step_00000002.old-0123456789ab", "extra")
    only = folder(tmp_path / ".step_00000001.old-0123456789ab", "the only copy")
    kept = [folder(tmp_path / name, "kept") for name in (".tmp-step_00000003.old-0123456789ab", "step_00000002",
                                                          ".stepx_00000001.old-0123456789ab")]
    with caplog.at_level("WARNING", logger=layout.__name__):
        layout.remove_left_aside(tmp_path, rf"{STEP_PREFIX}\d+")
    assert sorted(tmp_path.iterdir()) == sorted([*kept, tmp_path / "step_00000001"])
    assert (tmp_path / "step_00000001" / "f").read_text() == "the only copy"
    assert caplog.messages == [f"restoring step_00000001 from {only}, where an interrupted replacement left it",
                               f"removing {extra}: an old copy of step_00000002 that an interrupted replacement left"]


def test_a_dangling_link_is_replaced(tmp_path):
    (tmp_path / "final").symlink_to(tmp_path / "gone")
    layout.replace_dir(folder(tmp_path / "new", "new"), tmp_path / "final")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"] and (tmp_path / "final" / "f").read_text() == "new"


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_temporary_whose_writer_died_is_removed_by_the_next_write_and_no_other(tmp_path, caplog):
    """Issue 46 item 6: a command killed while it wrote (SIGKILL, an out-of-memory kill) left its hidden
    `.NAME.*.tmp` for good, also after a later command wrote NAME. The temporary names its host, pid namespace and
    pid: the next atomic_dir of NAME removes those of this host and namespace whose process is gone; a running
    writer's, another host's or container's, another name's and files stay."""
    import os

    host = layout.pid_owner()  # the host name and the pid namespace
    with layout.atomic_dir(tmp_path / "run") as tmp:
        assert tmp.name.startswith(f".run.{host}-{os.getpid()}-") and tmp.name.endswith(".tmp")
        (tmp / "f").write_text("x")
    stale = folder(tmp_path / f".run.{host}-{dead_pid()}-abcd_123.tmp", "half")
    alive = folder(tmp_path / f".run.{host}-{os.getpid()}-abcd_124.tmp", "being written")
    others = [folder(tmp_path / f".run.otherhost-{host.split('-')[-1]}-{dead_pid()}-abcd_125.tmp", "another host's"),
              folder(tmp_path / f".run.{host}1-{dead_pid()}-abcd_128.tmp", "another container's"),
              folder(tmp_path / f".runs.{host}-{dead_pid()}-abcd_126.tmp", "another name's"),
              folder(tmp_path / f".run.{host}-{dead_pid()}-abcd12.tmp", "not a temporary's name")]
    (tmp_path / f".run.{host}-{dead_pid()}-abcd_127.tmp").write_text("a file")
    with caplog.at_level("WARNING"), layout.atomic_dir(tmp_path / "run") as tmp:
        (tmp / "f").write_text("y")
    assert not stale.exists() and f"removing {stale}" in caplog.text
    assert alive.exists() and all(p.exists() for p in others) and (tmp_path / "run" / "f").read_text() == "y"
    assert len(list(tmp_path.iterdir())) == 7  # run, alive, four others, the file
