"""Checkpoint faults, each with its one-line error or fallback (1 rank unless a second rank matters; the ranks run in
this test, tests/ranks.py, except where the launcher's exit matters):
a damaged newest checkpoint (skipped by --resume auto, an error for --resume PATH), every checkpoint damaged (an
error, nothing touched), a full disk during a save, an unwritable output directory, a start-up that fails (no
output directory left behind); logs follow the checkpoint."""
import hashlib
import json
import math
import pathlib
import re
import shutil

import pytest

from moep_ds.checkpointing import manifest
from ranks import joined, run_ranks
from tiny import DS_CONFIGS, REPO, launch, metrics, run_pretrain, write_recipe

pytestmark = pytest.mark.slow
DS = str(DS_CONFIGS / "zero2_fp32.json")


def pretrain(recipe, *args, nproc=1, timeout=600, **fault):
    """pretrain.py on `nproc` ranks of this test; fault: fault, step, rank (faults.py)."""
    return joined(run_pretrain(nproc, "--config", str(recipe), "--ds_config", DS, *args, check=False, timeout=timeout,
                            **fault))


def last_line(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr.strip().splitlines()[-1]


def _needed(ckpt: pathlib.Path) -> int:
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(ckpt).read_metadata()
    return max(i.offset + i.length for i in md.storage_data.values() if i.relative_path == "__0_0.distcp")


def test_full_disk_during_a_save_then_a_damaged_newest_checkpoint(tmp_path):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=4, checkpoint={"every_steps": 2})
    proc = pretrain(recipe, nproc=2, fault="enospc", step=4, rank=1)
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: saving checkpoint '{out / 'checkpoints' / 'step_00000004'}' failed: ") and "No space left" in errors[0]
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]  # no temporary directory left
    proc = pretrain(recipe, "--resume", "auto")
    assert proc.returncode == 0 and "step_00000002" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]
    check_damaged_newest_is_skipped_by_auto_and_named_for_a_path(tmp_path, out)


def check_damaged_newest_is_skipped_by_auto_and_named_for_a_path(tmp_path, out):
    """(Continues the run above, whose checkpoints are steps 2 and 4.)"""
    newest = out / "checkpoints" / "step_00000004"
    shard = newest / "__0_0.distcp"
    needed = _needed(newest)
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    longer = write_recipe(tmp_path / "r5.yaml", "top2", out, max_steps=5, checkpoint={"every_steps": 3, "keep_last": 2})
    proc = pretrain(longer, "--resume", str(newest))
    assert proc.returncode == 2
    assert last_line(proc) == f"error: checkpoint '{newest}' is damaged: '{shard}' is truncated (100 of {needed} bytes)"
    proc = pretrain(longer, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [l for l in proc.stderr.splitlines() if "skipping damaged checkpoint" in l]
    assert len(warnings) == 1 and str(shard) in warnings[0]
    assert "resumed from" in proc.stderr and "step_00000002" in proc.stderr
    # the skipped checkpoint is set aside, so keep_last keeps the newest usable ones (it kept the damaged step 4
    # and deleted steps 2 and 3 before)
    assert f"moved the damaged checkpoint {newest} aside to step_00000004.damaged" in proc.stderr
    assert sorted(p.name for p in newest.parent.iterdir()) == ["step_00000003", "step_00000004.damaged",
                                                               "step_00000005"]
    # logs follow the checkpoint: rows 3 and 4 of the earlier runs were dropped, not duplicated
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4, 5]


def test_unwritable_output_dir_is_one_line_before_data_preparation(tmp_path):
    """(A changed model shape is named in one line too: tests/checkpointing/test_model_state.py.)"""
    recipe = write_recipe(tmp_path / "r.yaml", "top2", tmp_path / "run", max_steps=2)
    (tmp_path / "a_file").write_text("")
    proc = pretrain(recipe, "--set", f"train.output_dir={tmp_path / 'a_file' / 'run'}")
    assert proc.returncode == 2
    assert last_line(proc) == f"error: train.output_dir ('{tmp_path / 'a_file' / 'run'}') is not writable: Not a directory"
    assert "prepar" not in proc.stderr.lower()  # checked before any data preparation


def test_an_error_every_rank_agrees_on_exits_2_on_each_without_an_abort(tmp_path):
    """Both ranks find the output directory unwritable, agree, and exit 2 at once (cli.exit_joined); before, ~1
    launch in 10 aborted in the interpreter's teardown while gloo's worker let go of the agreement's tensor
    (distributed/process_group.py). A few launches, since the abort was a race; under torchrun, since a rank of this
    test (tests/ranks.py) never reaches the interpreter's teardown."""
    recipe = write_recipe(tmp_path / "r.yaml", "top2", tmp_path / "run", max_steps=2)
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "run"
    for _ in range(3):
        proc = launch(2, REPO / "pretrain.py", "--config", str(recipe), "--ds_config", DS, "--set",
                      f"train.output_dir={out}", check=False)
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)  # torchrun's report per failed rank
        assert "2" in codes and set(codes) <= {"2", "-15"}, proc.stderr[-3000:]  # -15: stopped by torchrun
        assert "terminate called" not in proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert errors == [f"error: train.output_dir ('{out}') is not writable: Not a directory"]


def test_a_rank_that_fails_alone_ends_the_launch_without_waiting_for_the_others(tmp_path):
    """Rank 1 fails after step 2 while rank 0 goes on into step 3's collectives: rank 1 exits at once
    (cli.exit_joined) and the launcher (here tests/ranks.py) stops rank 0. Waiting for the others at a barrier (as
    the end of training did) left both ranks in mismatched collectives until gloo's 30-minute timeout."""
    recipe = write_recipe(tmp_path / "r.yaml", "top2", tmp_path / "run", max_steps=6)
    ranks = run_pretrain(2, "--config", str(recipe), "--ds_config", DS, fault="raise", step=2, rank=1, check=False,
                         timeout=180)
    assert ranks[1].exitcode == 2, ranks[1].stderr[-3000:]
    proc = joined(ranks)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line and "simulated" in line]
    assert errors == ["[rank 1] error: simulated: rank 1 cannot go on after step 2"], proc.stderr[-3000:]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> pathlib.Path:
    """A finished 1-process run with checkpoints at steps 2 and 4 (copy it before changing anything)."""
    tmp = tmp_path_factory.mktemp("two_checkpoints")
    recipe = write_recipe(tmp / "r.yaml", "top2", tmp / "run", max_steps=4, checkpoint={"every_steps": 2})
    proc = pretrain(recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "run"


def flip(file: pathlib.Path, runs: int = 3, length: int = 64) -> None:
    """`runs` runs of `length` bytes inverted inside the largest tensor stored in `file`, a DCP data file (its raw
    data: torch.load reads them as numbers, 1e29 and the like, not as a broken record); the file's size kept."""
    from torch.distributed.checkpoint import FileSystemReader

    records = FileSystemReader(file.parent).read_metadata().storage_data.values()
    largest = max((r for r in records if r.relative_path == file.name), key=lambda r: r.length)
    invert(file, [largest.offset + i * largest.length // (runs + 2) for i in range(1, runs + 1)], length)


def invert(file: pathlib.Path, starts: list[int], length: int = 64) -> None:
    data = bytearray(file.read_bytes())
    for at in starts:
        data[at:at + length] = bytes(b ^ 0xFF for b in data[at:at + length])
    file.write_bytes(bytes(data))


def fails_checksum(ckpt: pathlib.Path, file: pathlib.Path) -> str:
    """The pattern of the line naming `file` of `ckpt` as failing its checksum."""
    return (re.escape(f"checkpoint '{ckpt}' is damaged: '{file}' fails its checksum (xxh3_128 ") +
            r"[0-9a-f]{32}, MANIFEST\.json records [0-9a-f]{32}\)")


def test_flipped_bytes_in_a_shard_make_the_checkpoint_damaged(two_checkpoints, tmp_path, capsys):
    """64-byte runs flipped inside the newest shard, its size kept: DCP reads such bytes as weights (1e29), so before
    manifests --resume trained on with loss nan (and its rotation deleted the good checkpoint) and moep-export wrote
    them. Now an explicit --resume is refused in one line naming the file, also on 2 ranks where rank 1 verifies
    it, and moep-export too, writing nothing; --resume auto skips it with a warning and resumes step 2; the
    checkpoints it then writes (asynchronously) carry their manifest."""
    from moep_ds.cli.export import main as export_main

    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    newest = out / "checkpoints" / "step_00000004"
    shard = newest / "__0_0.distcp"
    size = shard.stat().st_size
    flip(shard)
    assert shard.stat().st_size == size
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=6,
                          checkpoint={"every_steps": 2, "keep_last": 2, "async_save": True})
    proc = pretrain(recipe, "--resume", str(newest))
    assert proc.returncode == 2 and re.fullmatch("error: " + fails_checksum(newest, shard), last_line(proc))
    assert export_main([str(newest), "--out", str(tmp_path / "exported")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch("error: " + fails_checksum(newest, shard), errors[0])
    assert not (tmp_path / "exported").exists()

    other = tmp_path / "other" / "step_00000004"  # a file of the share rank 1 of 2 verifies: rank 0 names it
    shutil.copytree(two_checkpoints / "checkpoints" / "step_00000004", other)
    files = json.loads((other / manifest.MANIFEST_FILE).read_text())["files"]
    theirs = other / manifest.share(files, 1, 2)[0]
    invert(theirs, [theirs.stat().st_size // 2])
    proc = pretrain(recipe, "--resume", str(other), "--set", "train.micro_batch_size=2",  # its global batch
                    f"train.output_dir={tmp_path / 'new'}", nproc=2)
    assert proc.returncode == 2 and re.fullmatch("error: " + fails_checksum(other, theirs), last_line(proc))

    proc = pretrain(recipe, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "skipping damaged checkpoint" in line]
    assert len(warnings) == 1 and re.search(fails_checksum(newest, shard), warnings[0]), warnings
    assert re.search(r"resumed from \S+step_00000002 at step 2", proc.stderr)
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(m["loss"]) for m in metrics(out))
    for step in (4, 6):
        ckpt = out / "checkpoints" / f"step_{step:08d}"
        listed = json.loads((ckpt / manifest.MANIFEST_FILE).read_text())["files"]
        assert {"__0_0.distcp", ".metadata", "rng_rank0.pt", "trainer_state.json", "meta.json"} <= set(listed)
        manifest.check(ckpt)


def pretrain_each(runs: list[list[str]], full_disk: str | None = None) -> list[int]:
    """pretrain.py's main once per argument list, one after another on this rank; their exit statuses. A start-up
    that fails leaves its process group (cli.exit_joined), so the next one can start, at a fresh rendezvous port.
    full_disk: a folder in which opening a file for writing fails with ENOSPC, as on a full disk."""
    import builtins
    import errno
    import os

    from moep_ds.cli.pretrain import main
    from moep_ds.distributed.process_group import free_port

    if full_disk is not None:
        original_open = builtins.open

        def open_on_a_full_disk(file, mode="r", *args, **kwargs):
            if any(c in mode for c in "wax+") and os.path.abspath(str(file)).startswith(full_disk + os.sep):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
            return original_open(file, mode, *args, **kwargs)

        builtins.open = open_on_a_full_disk
    codes = []
    for argv in runs:
        os.environ["MASTER_PORT"] = str(free_port())
        codes.append(main(argv))
    return codes


def tree(root: pathlib.Path) -> dict[str, str]:
    """Every folder and file under `root`, with each file's content hash."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def test_resume_auto_refuses_to_start_over_when_every_checkpoint_is_damaged(two_checkpoints, tmp_path):
    """Training from step 0 instead would overwrite metrics.jsonl and its keep-last rotation delete the damaged
    checkpoints; --resume auto starts fresh only where there is no checkpoint at all."""
    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    root = out / "checkpoints"
    shard = root / "step_00000004" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    (root / "step_00000002" / ".metadata").write_bytes(b"not DCP metadata " * 16)
    before = tree(out)
    recipe = write_recipe(tmp_path / "r.yaml", "top2", out, max_steps=6, checkpoint={"every_steps": 2, "keep_last": 1})
    proc = pretrain(recipe, "--resume", "auto")
    assert proc.returncode == 2
    assert last_line(proc) == (f"error: --resume auto: all 2 checkpoint(s) in '{root}' are damaged, the newest is "
                               f"'{root / 'step_00000004'}' (see the warnings above); move them away to train from "
                               "step 0")
    assert len([line for line in proc.stderr.splitlines() if "skipping damaged checkpoint" in line]) == 2
    assert tree(out) == before


def test_a_failed_start_up_leaves_no_output_dir_it_created(two_checkpoints, tmp_path):
    """Bad input found before the first step: one line, exit 2, and the output directory (with the folders above it
    that the run made) is gone again, also after the engine wrote its TensorBoard files (the tokenizer case); an
    output directory that existed before is kept."""
    ckpt = two_checkpoints / "checkpoints" / "step_00000004"
    other_tokenizer = tmp_path / "other_tokenizer"
    shutil.copytree(ckpt, other_tokenizer)
    state = json.loads((other_tokenizer / "trainer_state.json").read_text())
    state["trainer"]["tokenizer_sha256"] = "0" * 64
    (other_tokenizer / "trainer_state.json").write_text(json.dumps(state))
    manifest.seal(other_tokenizer)  # a checkpoint written so, not damaged
    ds_configs = {"stage7": {"zero_optimization": {"stage": 7}}, "two": {"gradient_accumulation_steps": "two"},
                  "maybe": {"zero_optimization": {"stage": 2, "overlap_comm": "maybe"}}}
    for name, ds in ds_configs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(ds))
    recipe = write_recipe(tmp_path / "r.yaml", "top2", tmp_path / "new" / "deeper" / "run", max_steps=2)
    cases = [  # each with its whole message, or a pattern where it holds a cache path or a hash
        (["--ds_config", str(tmp_path / "stage7.json")], "ds_config zero_optimization.stage (7) must be 0, 1, 2 or 3"),
        (["--ds_config", str(tmp_path / "two.json")],
         'ds_config gradient_accumulation_steps ("two") must be a positive integer or "auto"'),
        (["--ds_config", str(tmp_path / "maybe.json")], 'ds_config zero_optimization.overlap_comm ("maybe"): Input '
                                                         "should be a valid boolean, unable to interpret input"),
        (["--set", "model.vocab_size=1024"],
         re.compile(r"/\S+/meta\.json vocab_size \(512\) differs from the model's vocab_size \(1024\)")),
        (["--resume", "/nonexistent"], "--resume '/nonexistent' is not a complete checkpoint directory"),
        (["--resume", "latest"], "--resume 'latest' is not a complete checkpoint directory"),
        (["--resume", str(ckpt), "--set", "model.d_model=64"],
         f"checkpoint '{ckpt}': tensor 'embed.weight' has shape [512, 32] there but [512, 64] in this model"),
        (["--resume", str(other_tokenizer)],
         re.compile(re.escape(f"checkpoint '{other_tokenizer}' was trained with tokenizer sha256 000000000000..., but "
                              "data.tokenizer of this run has ") + r"[0-9a-f]{12}\.\.\.; resume with the data the "
                    r"checkpoint was trained on")),
    ]
    full = tmp_path / "full" / "run"  # a full disk at start and at resume (issue 40 item 3: DeepSpeed's TensorBoard
    for args in ([], ["--resume", str(ckpt)]):  # writer's traceback, three of them with 2 processes)
        line = f"train.output_dir ('{full}'): disk full (No space left on device) writing '{full}', "
        cases.append((["--set", f"train.output_dir={full}", *args], re.compile(re.escape(line) + r"\d+ MiB free there")))
    existing = tmp_path / "existing"
    existing.mkdir()
    runs = [["--config", str(recipe), "--ds_config", DS, *args] for args, _ in cases]
    runs.append(["--config", str(recipe), "--ds_config", DS, "--resume", "latest",
                 "--set", f"train.output_dir={existing}"])
    [rank] = run_ranks(1, pretrain_each, runs, full_disk=str(tmp_path / "full"))
    proc = joined([rank])
    assert rank.result == [2] * len(runs), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == len(runs)
    for (_, message), error in zip(cases, errors):
        text = error.removeprefix("error: ")
        assert message.fullmatch(text) if isinstance(message, re.Pattern) else text == message, (message, error)
    assert errors[-1] == "error: --resume 'latest' is not a complete checkpoint directory"
    assert not (tmp_path / "new").exists() and not (tmp_path / "full").exists()
    assert existing.is_dir() and list(existing.iterdir()) == []
