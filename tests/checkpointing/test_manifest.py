"""MANIFEST.json (checkpointing/manifest.py): flipped bytes that keep a file's size make a checkpoint damaged, named
in one line, at load and at export (nothing written); a checkpoint written before manifests still loads. (Training's
writer and --resume: tests/training/test_checkpoint_faults.py::test_flipped_bytes_in_a_shard_make_the_checkpoint_damaged.)"""
import json
import pathlib
import re
import sys

import pytest

from moep_ds.checkpointing import manifest
from moep_ds.checkpointing.model_dir import load_model_dir, save_model_dir
from moep_ds.checkpointing.sharded import DamagedCheckpoint
from moep_ds.cli.export import main as export_main

TESTS = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "evaluation"))
from eval_models import tiny_model  # noqa: E402

OLD_CHECKPOINT = TESTS / "training" / "fixtures" / "checkpoint_v2" / "step_00000002"  # of before manifests


def flip(file: pathlib.Path, runs: int = 3, length: int = 64) -> None:
    """`runs` runs of `length` bytes inverted inside the largest tensor stored in `file`, a DCP data file (its raw
    data: torch.load reads them as numbers, 1e29 and the like, not as a broken record); the file's size kept."""
    from torch.distributed.checkpoint import FileSystemReader

    records = FileSystemReader(file.parent).read_metadata().storage_data.values()
    largest = max((r for r in records if r.relative_path == file.name), key=lambda r: r.length)
    data = bytearray(file.read_bytes())
    for i in range(1, runs + 1):
        at = largest.offset + i * largest.length // (runs + 2)
        data[at:at + length] = bytes(b ^ 0xFF for b in data[at:at + length])
    file.write_bytes(bytes(data))


@pytest.fixture
def sealed(tmp_path) -> pathlib.Path:
    """A complete checkpoint in a run directory, with its manifest."""
    model, cfg = tiny_model("dense_gpt2")
    ckpt = save_model_dir(model, cfg, tmp_path / "run" / "checkpoints" / "step_00000004", meta={"step": 4})
    manifest.seal(ckpt)
    (ckpt / "COMPLETE").touch()
    return ckpt


def test_every_file_is_listed_and_a_whole_checkpoint_passes(sealed):
    recorded = json.loads((sealed / manifest.MANIFEST_FILE).read_text())
    assert recorded["algorithm"] == "xxh3_128"
    assert sorted(recorded["files"]) == sorted(p.name for p in sealed.iterdir()
                                               if p.name not in ("COMPLETE", manifest.MANIFEST_FILE))
    assert all(r["bytes"] == (sealed / n).stat().st_size for n, r in recorded["files"].items())
    manifest.check(sealed)
    load_model_dir(sealed)


def test_flipped_bytes_of_the_same_size_are_named_in_one_line(sealed):
    shard = sealed / "__0_0.distcp"
    size = shard.stat().st_size
    flip(shard)
    assert shard.stat().st_size == size
    with pytest.raises(DamagedCheckpoint) as err:
        load_model_dir(sealed)
    recorded = json.loads((sealed / manifest.MANIFEST_FILE).read_text())["files"]["__0_0.distcp"]["digest"]
    assert re.fullmatch(re.escape(f"checkpoint '{sealed}' is damaged: '{shard}' fails its checksum (xxh3_128 ")
                        + r"[0-9a-f]{32}" + re.escape(f", MANIFEST.json records {recorded})"), str(err.value))


def test_other_damage_is_named(sealed):
    (sealed / "meta.json").write_text("{}")  # another size
    with pytest.raises(DamagedCheckpoint, match=re.escape(f"'{sealed / 'meta.json'}' has 2 bytes, MANIFEST.json "
                                                          "records ") + r"\d+$"):
        manifest.check(sealed)
    (sealed / "meta.json").unlink()
    with pytest.raises(DamagedCheckpoint, match=re.escape(f"'{sealed / 'meta.json'}' is missing")):
        manifest.check(sealed)
    (sealed / manifest.MANIFEST_FILE).write_text('{"format": 1, "algorithm": "crc99", "files": {}}')
    with pytest.raises(DamagedCheckpoint, match=re.escape(
            f"checkpoint '{sealed}' is damaged: '{sealed / 'MANIFEST.json'}' is unreadable (ValueError: ")):
        manifest.check(sealed)


def test_data_files_hashed_as_they_are_written_match_the_files(tmp_path):
    """The trainer's writer hashes each rank's data file on its way to disk (sharded.HashingFileSystem), not by
    reading it back: the same records as read from the file."""
    import functools

    import torch

    from moep_ds.checkpointing import sharded

    state = {"a": sharded.whole(torch.randn(300, 7)), "b": sharded.whole(torch.arange(10))}
    written = {}
    sharded.save(state, tmp_path, hasher=functools.partial(manifest.hasher, manifest.ALGORITHM), digests=written)
    assert list(written) == ["__0_0.distcp"]
    assert written == manifest.records(tmp_path, ["__0_0.distcp"])


def test_a_checkpoint_written_before_manifests_still_loads():
    assert not (OLD_CHECKPOINT / manifest.MANIFEST_FILE).exists()
    manifest.check(OLD_CHECKPOINT)


def test_the_shares_of_the_ranks_cover_every_file_once_balanced_by_bytes():
    files = {f"f{i}": {"bytes": b, "digest": ""} for i, b in enumerate([100, 90, 50, 40, 5, 1, 1])}
    shares = [manifest.share(files, r, 3) for r in range(3)]
    assert sorted(n for s in shares for n in s) == sorted(files)
    assert [sum(files[n]["bytes"] for n in s) for s in shares] == [100, 95, 92]
    assert manifest.share(files, 0, 1) == sorted(files, key=lambda n: -files[n]["bytes"])


@pytest.mark.parametrize("layout", [[], ["--hf"]])
def test_moep_export_refuses_a_flipped_checkpoint_in_one_line_writing_nothing(sealed, tmp_path, capsys, layout):
    shard = sealed / "__0_0.distcp"
    flip(shard)
    out = tmp_path / "exported"
    assert export_main([str(tmp_path / "run"), "--out", str(out), *layout]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: checkpoint '{sealed}' is damaged: '{shard}' fails its checksum (xxh3_128 "), errors
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
