"""Run-directory layout: directories appear atomically and a failed write leaves nothing behind."""
import pytest

from moep_ds.checkpointing import layout


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
