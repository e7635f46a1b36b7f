"""Sharded checkpoints on 2 CPU ranks (tests/ranks.py): every ZeRO stage (0-3) resumes into itself (bit-identical)
and into the next stage (3 into 0), so every stage's checkpoint is read by another stage and every stage reads
another's, ZeRO-3 over 6 steps stopped at 3 with lifecycle replacements and asynchronous saves, activation
checkpointing switched on and off, the consolidated format of before 2026-12-03 once moep-convert has turned it
into a sharded checkpoint, and the old 1-D sharded layout (train.compile on <-> off: in one process,
tests/training/test_blocks.py).

One run of the ranks trains the sources (a checkpoint at step 3 each), a second resumes them."""
import json
import pathlib

import pytest
import torch

from moep_ds.cli import convert

from tiny import DS_CONFIGS, losses, run_jobs, write_recipe

pytestmark = pytest.mark.slow
STAGES = (0, 1, 2, 3)


def targets(source: int) -> list[int]:
    """The stages a source stage's checkpoint resumes into: itself (ZeRO-3: test_zero3_resume_is_bit_identical...)
    and the next one."""
    return [t for t in (source, (source + 1) % 4) if (source, t) != (3, 3)]


def ds(stage: int, precision: str = "fp32") -> str:
    return str(DS_CONFIGS / f"zero{stage}_{precision}.json")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    sources, jobs = {}, []
    for s in STAGES:
        out = tmp / f"src{s}"
        # ZeRO-3 runs the stack with every routed block (lifecycle replacements fire at step 3) for 6 steps; ZeRO-1
        # stops at 4 (its step-4 checkpoint, also in the older layouts, is resumed below)
        layers, steps = ("mixed", 6) if s == 3 else ("top2", 5)
        recipe = write_recipe(tmp / f"src{s}.yaml", layers, out, max_steps=steps, checkpoint={"every_steps": 3},
                              exit_at_step=4 if s == 1 else None)
        jobs.append({"recipe": str(recipe), "ds_config": ds(s)})
        sources[s] = (recipe, out)
    # the same with experts sharded over an expert-parallel group of 2 (a rank reads its experts' rows only)
    ep = write_recipe(tmp / "src_ep.yaml", "top2", tmp / "src_ep", max_steps=5, exit_at_step=4,
                      checkpoint={"every_steps": 3}, expert_parallel_size=2)
    jobs.append({"recipe": str(ep), "ds_config": ds(1)})
    sources["ep"] = (ep, tmp / "src_ep")
    bf16 = write_recipe(tmp / "src_bf16.yaml", "top2", tmp / "src_bf16", max_steps=5, exit_at_step=4,
                        checkpoint={"every_steps": 3})
    jobs.append({"recipe": str(bf16), "ds_config": ds(1, "bf16")})
    sources["bf16"] = (bf16, tmp / "src_bf16")
    # ZeRO-0 bf16: fp32 masters beside the model's bf16 parameters (DeepSpeed's FP16_UnfusedOptimizer)
    z0bf16 = write_recipe(tmp / "src_z0bf16.yaml", "top2", tmp / "src_z0bf16", max_steps=5, exit_at_step=4,
                          checkpoint={"every_steps": 3})
    jobs.append({"recipe": str(z0bf16), "ds_config": ds(0, "bf16")})
    sources["z0bf16"] = (z0bf16, tmp / "src_z0bf16")
    # activation checkpointing on under ZeRO-3 (parameters fetched again for the recomputation)
    recomputed = write_recipe(tmp / "src_ac.yaml", "top2", tmp / "src_ac", max_steps=5, exit_at_step=4,
                              checkpoint={"every_steps": 3}, activation_checkpointing=True)
    jobs.append({"recipe": str(recomputed), "ds_config": ds(3)})
    sources["ac"] = (recomputed, tmp / "src_ac")
    run_jobs(2, jobs)
    resumed, jobs = {}, []
    for s in STAGES:
        recipe, out = sources[s]
        for t in targets(s):
            dest = tmp / f"res{s}to{t}"
            # two resumed steps: the loss of step 5 shows the restored Adam moments (step 4's only the weights)
            jobs.append({"recipe": str(recipe), "ds_config": ds(t), "resume": str(out / "checkpoints/step_00000003"),
                         "overrides": [f"train.output_dir={dest}", "train.exit_at_step=5"]})
            resumed[(s, t)] = dest
    part = tmp / "z3_part"
    # with asynchronous saves (every 2 steps and at the requested exit, which waits for it)
    async_every_2 = {"every_steps": 2, "async_save": True, "keep_last": 2}
    write_recipe(tmp / "z3_part.yaml", "mixed", part, max_steps=6, exit_at_step=3, checkpoint=async_every_2)
    write_recipe(tmp / "z3_rest.yaml", "mixed", part, max_steps=6, checkpoint=async_every_2)
    jobs += [{"recipe": str(tmp / "z3_part.yaml"), "ds_config": ds(3)},
             {"recipe": str(tmp / "z3_rest.yaml"), "ds_config": ds(3), "resume": "auto"}]
    resumed[(3, 3)] = part
    # fp32 masters <-> bf16 masters (the checkpoint always holds fp32 masters)
    for s, t, precision in ((2, 2, "bf16"), ("bf16", 2, "fp32"), ("z0bf16", 0, "bf16"), ("z0bf16", 2, "bf16")):
        recipe, out = sources[s]
        dest = tmp / f"res{s}to{t}{precision}"
        jobs.append({"recipe": str(recipe), "ds_config": ds(t, precision), "resume": str(out / "checkpoints/step_00000003"),
                     "overrides": [f"train.output_dir={dest}", "train.exit_at_step=4"]})
        resumed[(s, precision)] = resumed[(s, t, precision)] = dest
    # activation checkpointing on -> off (ZeRO-3) and off -> on (ZeRO-2)
    for s, switch in (("ac", "false"), (2, "true")):
        recipe, out = sources[s]
        dest = tmp / f"res{s}_ac_{switch}"
        jobs.append({"recipe": str(recipe), "ds_config": ds(3 if s == "ac" else s),
                     "resume": str(out / "checkpoints/step_00000003"),
                     "overrides": [f"train.output_dir={dest}", "train.exit_at_step=4",
                                   f"train.activation_checkpointing={switch}"]})
        resumed[(s, "ac")] = dest
    # the consolidated format (ZeRO-1's step-4 checkpoint as it would have been written), converted by moep-convert,
    # and the 1-D sharded layout of before 2026-12-03 resume the same
    for source, suffix in ((1, ""), ("ep", "_ep")):
        sharded_ckpt = sources[source][1] / "checkpoints/step_00000004"
        consolidated = to_consolidated(sharded_ckpt, tmp / f"consolidated{suffix}")
        assert convert.main([str(consolidated), "--out", str(tmp / f"converted{suffix}")]) == 0
        for name, ckpt in ((f"from_converted{suffix}", tmp / f"converted{suffix}"),
                           (f"from_sharded{suffix}", sharded_ckpt),
                           (f"from_legacy{suffix}", to_legacy(sharded_ckpt, tmp / f"legacy{suffix}"))):
            jobs.append({"recipe": str(sources[source][0]), "ds_config": ds(2), "resume": str(ckpt),
                         "overrides": [f"train.output_dir={tmp / name}", "train.exit_at_step=null"]})
    run_jobs(2, jobs)
    return tmp, sources, resumed


def to_legacy(ckpt: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """`ckpt` as the sharded writer of before 2026-12-03 laid it out (here from one process): every tensor
    flattened to 1-D, model tensors under model/<name>, optimizer state under optim/<name>/<key>, the shapes in
    tensors.json, no aliases and no extra-state entries."""
    import shutil

    from moep_ds import build_model, load_config
    from moep_ds.checkpointing import model_state, sharded

    # (no MANIFEST.json either: checksums came after that format)
    shutil.copytree(ckpt, out, ignore=shutil.ignore_patterns("*.distcp", ".metadata", "MANIFEST.json"))
    with torch.device("meta"):
        shapes = model_state.shapes(build_model(load_config(ckpt / "config.yaml").model))
    stored, pieces = sharded.read_metadata(ckpt), {}
    for key, entry in stored.items():
        if key in shapes or key.startswith(sharded.OPTIM_PREFIX):
            t = torch.empty(entry.size, dtype=entry.properties.dtype)
            sharded.load({key: sharded.whole(t)}, ckpt)
            pieces[sharded.legacy_key(key)] = sharded.whole(t).flat()
    sharded.dcp.save(pieces, storage_writer=sharded.writer(out), planner=sharded.ShardSavePlanner(), no_dist=True)
    sharded.save_json({k: list(v) for k, v in shapes.items()}, out / sharded.TENSORS_FILE)
    return out


def flat_state(state: dict) -> dict:
    """A version 4 trainer state as the flat record of version 2, which the consolidated layout's writer wrote."""
    module = {k: v for k, v in state["train_module"].items() if k != "global_steps"}
    data = dict(state["data_loader"])
    batch = data.pop("global_batch_size")
    return {"version": 2, **state["trainer"], **module, "data": data, "global_batch_size": batch}


def to_consolidated(ckpt: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """`ckpt` in the consolidated layout of before 2026-12-03 (its writer's files, here from one process):
    model.safetensors (fp32 masters and buffers, the tied head left out), extra_state.pt, optimizer.pt
    ({"moments": {name: {exp_avg, exp_avg_sq}}, "step"}), trainer_state.json without Adam's step, the rng files,
    config.yaml, meta.json, COMPLETE."""
    import shutil

    from safetensors.torch import save_file

    from moep_ds import build_model, load_config
    from moep_ds.checkpointing import model_state, sharded

    out.mkdir()
    with torch.device("meta"):
        meta_model = build_model(load_config(ckpt / "config.yaml").model)
    tensors = {}
    for key, entry in sharded.read_metadata(ckpt).items():
        if key in model_state.tied_names(meta_model) or key.endswith(sharded.EXTRA_STATE_SUFFIX):
            continue
        tensors[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        sharded.load({key: sharded.whole(tensors[key])}, ckpt)
    moments = {}
    for key in [k for k in tensors if k.startswith(sharded.OPTIM_PREFIX)]:
        name, moment = key.removeprefix(sharded.OPTIM_PREFIX).rsplit("/", 1)
        moments.setdefault(name, {})[moment] = tensors.pop(key)
    save_file(tensors, str(out / "model.safetensors"))
    torch.save(json.loads((ckpt / "extra_state.json").read_text()), out / "extra_state.pt")
    state = flat_state(json.loads((ckpt / "trainer_state.json").read_text()))
    torch.save({"moments": moments, "step": state.pop("optimizer_step")}, out / "optimizer.pt")
    (out / "trainer_state.json").write_text(json.dumps(state))
    for f in [*ckpt.glob("rng_rank*.pt"), ckpt / "config.yaml", ckpt / "meta.json", ckpt / "COMPLETE"]:
        shutil.copyfile(f, out / f.name)
    return out


@pytest.mark.parametrize("source", STAGES)
def test_every_zero_stage_resumes_into_itself_and_the_next(matrix, source):
    """Two resumed steps: step 4's loss depends on the restored weights only, step 5's also on the Adam moments and
    step count (each rank's whole copy of them under ZeRO-0, its partition otherwise). The ZeRO-1 source stopped at
    step 4: its step 5 is the uninterrupted ZeRO-2 run's of the same recipe."""
    _, sources, resumed = matrix
    reference = losses(sources[source][1])
    borrowed = 5 not in reference
    if borrowed:
        reference[5] = losses(sources[2][1])[5]
    for target in targets(source):
        got = losses(resumed[(source, target)])
        assert sorted(got) == [4, 5]
        for step in (4, 5):
            if target == source and not (borrowed and step == 5):
                assert got[step] == reference[step], (source, target, step)
            else:
                assert got[step] == pytest.approx(reference[step], abs=1e-5), (source, target, step, got, reference)


def test_zero3_resume_is_bit_identical_with_lifecycle_replacements(matrix):
    tmp, sources, resumed = matrix
    full, part = losses(sources[3][1]), losses(resumed[(3, 3)])
    assert sorted(full) == list(range(1, 7))
    assert part == full
    events = [l for l in (resumed[(3, 3)] / "expert_utilization.jsonl").read_text().splitlines() if '"event"' in l]
    assert any(json.loads(e)["step"] == 3 for e in events)  # replacements fired before the checkpoint
    kept = sorted(p.name for p in (resumed[(3, 3)] / "checkpoints").iterdir())
    assert kept == ["step_00000004", "step_00000006"]  # async saves completed, cleanup kept the last 2


def test_a_converted_consolidated_checkpoint_and_the_old_sharded_layout_resume_alike(matrix):
    """The consolidated format after moep-convert, and the 1-D sharded layout of before 2026-12-03 (ZeRO-1, and ZeRO-1
    with expert parallelism 2); the consolidated directory itself is refused, naming moep-convert."""
    from moep_ds.checkpointing import sharded
    from moep_ds.checkpointing.model_dir import load_model_dir
    from moep_ds.errors import UserError

    tmp, sources, _ = matrix
    for suffix in ("", "_ep"):
        reference = losses(tmp / f"from_sharded{suffix}")
        for old in ("converted", "legacy"):
            got = losses(tmp / f"from_{old}{suffix}")
            assert sorted(got) == [5] and got == reference, (old, suffix)
    assert all(len(m.size) == 1 for m in sharded.read_metadata(tmp / "legacy_ep").values())
    for old in ("converted", "legacy"):
        model, cfg, _, meta = load_model_dir(tmp / old)
        assert meta["step"] == 4
    with pytest.raises(UserError, match=r"run moep-convert .*consolidated --out DST"):
        load_model_dir(tmp / "consolidated")


def test_sharded_checkpoint_files_and_model_dir(matrix):
    from moep_ds.checkpointing import layout
    from moep_ds.checkpointing.model_dir import load_model_dir

    tmp, sources, _ = matrix
    ckpt = sources[3][1] / "checkpoints" / "step_00000006"
    shards = sorted(p.name for p in ckpt.glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    sizes = [p.stat().st_size for p in ckpt.glob("*.distcp")]
    assert max(sizes) < 0.6 * sum(sizes)  # each rank wrote its half
    mode = 0o666 & ~layout.umask()
    assert all(p.stat().st_mode & 0o777 == mode for p in ckpt.iterdir())  # the user's umask, as any file
    model, cfg, tokenizer, meta = load_model_dir(sources[3][1])  # a run directory: its newest checkpoint
    assert meta["step"] == 6 and tokenizer is not None
    from moep_ds.training.checkpoint import TRAINER_STATE_FILE

    state = json.loads((ckpt / TRAINER_STATE_FILE).read_text())
    assert (state["trainer"]["step"], state["trainer"]["max_steps"]) == (6, cfg.raw["train"]["max_steps"])
    from moep_ds.cli.export import main as export

    assert export([str(sources[3][1]), "--out", str(tmp / "export")]) == 0  # one process, weights only
    from safetensors.torch import load_file

    exported = load_file(str(tmp / "export" / "model.safetensors"))  # for readers outside moep_ds
    for name, a in model.state_dict().items():
        if isinstance(a, torch.Tensor) and not (name == "head.weight" and cfg.model.tie_embeddings):
            torch.testing.assert_close(a, exported[name], rtol=0, atol=0, msg=name)
    assert all(p.stat().st_mode & 0o777 == mode for p in (tmp / "export").iterdir())


def test_weights_load_into_a_fresh_models_state_dict_with_torch_alone(matrix, tmp_path):
    """The README's snippet on checkpoints of 2 processes: ZeRO-3 (every routed block type, lifecycle events
    logged; saved synchronously, and asynchronously after a resume), ZeRO-1, ZeRO-2 and expert parallelism 2
    (ZeRO-1). moep_ds only builds the empty model; torch's DCP fills its state_dict(), tied head included; the
    tensors equal the export's (this project's reader) bit for bit, and the extra state the checkpoint's
    extra_state.json."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from moep_ds import build_model, load_config
    from moep_ds.cli.export import main as export

    _, sources, resumed = matrix
    runs = {source: sources[source][1] for source in (3, 1, 2, "ep")} | {"async": resumed[(3, 3)]}
    for source, step in ((3, 6), (1, 4), (2, 3), ("ep", 4), ("async", 6)):
        ckpt = str(runs[source] / "checkpoints" / f"step_{step:08d}")
        model = build_model(load_config(f"{ckpt}/config.yaml").model)  # the README's snippet, as written there
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=ckpt)
        model.load_state_dict(sd)  # applies the extra state (not a tensor: DCP replaced the entry)
        assert export([ckpt, "--out", str(tmp_path / str(source))]) == 0
        exported = load_file(tmp_path / str(source) / "model.safetensors")
        tensors = {k for k, v in sd.items() if isinstance(v, torch.Tensor)}
        assert set(exported) == tensors - {"head.weight"} and model.head.weight is model.embed.weight
        for key, value in exported.items():
            assert torch.equal(sd[key], value), (source, key)
        extra = {k: v for k, v in model.state_dict().items() if k not in tensors}
        assert json.loads(json.dumps(extra)) == json.loads(pathlib.Path(ckpt, "extra_state.json").read_text())
        assert bool(extra) == (source in (3, "async"))  # the lifecycle of the ssm_moe block


def test_masters_move_between_bf16_and_fp32(matrix):
    """bf16 compute rounds the forward pass: the first resumed loss is close to the source's, not equal."""
    _, sources, resumed = matrix
    for source, precision in ((2, "bf16"), ("bf16", "fp32")):
        got, reference = losses(resumed[(source, precision)])[4], losses(sources[source][1])[4]
        assert got == pytest.approx(reference, abs=2e-2), (source, precision, got, reference)
        assert got != reference


def test_zero0_bf16_trains_and_resumes_as_the_partitioned_stages(matrix):
    """ZeRO-0 bf16 keeps fp32 masters outside the model: its Adam starts as a fresh one (DeepSpeed's zero-gradient
    initialisation step undone), so it follows ZeRO-1 bf16 step for step; its checkpoint holds those masters and
    moments, so it resumes bit-identically and into ZeRO-2 bf16."""
    _, sources, resumed = matrix
    z0, z1 = losses(sources["z0bf16"][1]), losses(sources["bf16"][1])
    assert sorted(z0) == [1, 2, 3, 4]
    for step in z0:
        assert z0[step] == pytest.approx(z1[step], abs=1e-4), (step, z0[step], z1[step])
    assert losses(resumed[("z0bf16", 0, "bf16")]) == {4: z0[4]}
    assert losses(resumed[("z0bf16", 2, "bf16")])[4] == pytest.approx(z0[4], abs=1e-4)


def test_activation_checkpointing_switches_on_and_off_at_resume(matrix):
    """The checkpoint does not depend on the recomputation: the first resumed loss is the uninterrupted run's."""
    _, sources, resumed = matrix
    for source in ("ac", 2):
        got, reference = losses(resumed[(source, "ac")]), losses(sources[source][1])
        assert sorted(got) == [4] and sorted(reference)[:4] == [1, 2, 3, 4]
        assert got[4] == reference[4], (source, got[4], reference[4])


def test_resume_names_model_settings_that_changed_since_the_checkpoint(tmp_path, caplog):
    """Shapes are checked when weights load; a setting without a shape (here the GELU variant, which the gpt2
    flavour's default changed) is named in a warning."""
    import copy

    from moep_ds.checkpointing.model_dir import save_model_dir
    from moep_ds.config import config_from_dict
    from moep_ds.models.causal_lm import build_model
    from moep_ds.training.checkpoint import warn_model_changes

    raw = {"model": {"flavour": "gpt2", "vocab_size": 64, "d_model": 32, "max_seq_len": 16,
                     "layers": [{"type": "dense", "repeat": 2, "attention": {"num_heads": 2}}]}}
    cfg = config_from_dict(raw)
    ckpt = save_model_dir(build_model(cfg.model), cfg, tmp_path / "m")
    assert warn_model_changes(cfg.model, ckpt) == [] and "differs" not in caplog.text
    edited = copy.deepcopy(raw)
    edited["model"]["layers"][0]["ffn"] = {"type": "gelu"}
    edited["model"]["layers"][0]["norm"] = {"type": "layernorm", "eps": 1e-6}
    changes = warn_model_changes(config_from_dict(edited).model, ckpt)
    assert changes == ["model.layers[0].ffn.type ('gelu_tanh' there, 'gelu' now)",
                       "model.layers[0].norm.eps (1e-05 there, 1e-06 now)"]
    assert f"the model differs from the one {ckpt} was trained with: {'; '.join(changes)}" in caplog.text


def test_resume_warns_when_the_run_length_changed(tmp_path, caplog, monkeypatch):
    import logging

    from moep_ds.training.checkpoint import warn_length_change
    from moep_ds.training.trainer_state import TrainerState

    def state(**saved):
        return TrainerState.from_state_dict({"global_samples": 0, "data": {"epoch": 0, "global_batch": 0}, **saved})

    monkeypatch.setattr(logging.getLogger("moep_ds"), "propagate", True)  # a trainer in this process turns it off

    ckpt = tmp_path / "step_00000003"
    with caplog.at_level("WARNING", logger="moep_ds"):
        assert not warn_length_change(state(step=3, max_steps=6), 6, ckpt)
        assert not warn_length_change(state(step=3), 6, ckpt)  # saved before the length was kept
        assert warn_length_change(state(step=3, max_steps=6), 8, ckpt)
    assert caplog.messages == [f"the run is 8 steps long now, 6 when {ckpt} was saved: the lr schedule follows 8 "
                               "from step 3 on"]
