"""Canonical checkpoint names, expert-parallel offsets and sharded round trips in one process."""
import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from moep_ds import build_model
from moep_ds.checkpointing import model_state, sharded
from moep_ds.checkpointing.model_state import canonical_name
from moep_ds.config import config_from_dict
from moep_ds.moe.layer import MoELayer, shard_experts
from moep_ds.moe.plan import ExpertParallelPlan

MOE = {"num_experts": 4, "expert": {"type": "swiglu", "hidden_size": 24},
       "router": {"type": "topk", "k": 2, "load_balancing_weight": 0.01}}
RECIPE = {"model": {"flavour": "llama", "vocab_size": 64, "d_model": 16, "max_seq_len": 16,
                    "layers": [{"type": "ffn_moe", "attention": {"num_heads": 2}, "moe": MOE}]}}


def tiny(seed: int):
    torch.manual_seed(seed)
    return build_model(config_from_dict(RECIPE).model)


def save_whole(model, path):
    """What the trainer writes, from one process: every tensor whole."""
    model_state.save_module(model, path)


def test_compile_and_activation_checkpoint_wrappers_do_not_change_names():
    model = tiny(0)
    names = set(model_state.shapes(model))
    model.blocks[0] = checkpoint_wrapper(torch.compile(model.blocks[0]))  # wrapped, never run: no compilation
    assert any("_orig_mod" in n for n, _ in model.named_parameters())
    assert set(model_state.shapes(model)) == names
    assert canonical_name("blocks.0._checkpoint_wrapped_module._orig_mod.moe.router.w") == "blocks.0.moe.router.w"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_experts_load_by_global_index_at_any_expert_parallel_rank(tmp_path):
    source = tiny(0)
    save_whole(source, tmp_path)
    full = source.blocks[0].moe.experts.w1_EDF.detach().clone()
    for rank in (0, 1):
        target = tiny(1)
        layer = next(m for m in target.modules() if isinstance(m, MoELayer))
        shard_experts(layer, ExpertParallelPlan(size=2, rank=rank))
        for p in layer.experts.parameters():
            p.allreduce = False
        model_state.load_module(target, tmp_path, ExpertParallelPlan(size=2, rank=rank))
        torch.testing.assert_close(layer.experts.w1_EDF, full[2 * rank:2 * rank + 2], rtol=0, atol=0)
        torch.testing.assert_close(target.blocks[0].moe.router.state_dict(), source.blocks[0].moe.router.state_dict())


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_shape_change_and_damage_are_named(tmp_path):
    save_whole(tiny(0), tmp_path)
    wider = {**MOE, "expert": {"type": "swiglu", "hidden_size": 32}}
    recipe = {"model": {**RECIPE["model"], "layers": [{**RECIPE["model"]["layers"][0], "moe": wider}]}}
    other = build_model(config_from_dict(recipe).model)
    with pytest.raises(sharded.CheckpointError, match=r"tensor 'blocks.0.moe.experts.w1_EDF' has shape \[4, 16, 24\] "
                                                       r"there but \[4, 16, 32\] in this model$"):
        model_state.load_module(other, tmp_path)
    data = next(tmp_path.glob("*.distcp"))
    stored = data.read_bytes()
    data.write_bytes(stored[:2000] + b"\xff" * (len(stored) - 2000))  # corrupt, same size
    with pytest.raises(sharded.DamagedCheckpoint, match=r"could not be read: corrupt tensor data \(Unsupported "
                                                        r"operand \d+\)$"):
        model_state.load_module(tiny(1), tmp_path)
    data.write_bytes(data.read_bytes()[:10])
    with pytest.raises(sharded.DamagedCheckpoint, match=rf"'{data}' is truncated \(10 of \d+ bytes\)$"):
        sharded.check_files(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(sharded.DamagedCheckpoint, match="unreadable metadata"):
        sharded.check_files(tmp_path)


class Planted:
    """Pickles as a call of os.mkdir: what a crafted `.metadata` can make pickle.load run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        import os

        return os.mkdir, (self.path,)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_metadata_is_read_without_running_code_from_it(tmp_path):
    """DCP's own reader unpickles `.metadata` with pickle.load; ours resolves only DCP's data classes, torch
    sizes, dtypes and layouts, so a planted call is refused (as damage, one line) instead of run."""
    import pickle

    ckpt = tmp_path / "ckpt"
    save_whole(tiny(0), ckpt)
    metadata = sharded.read_metadata(ckpt)  # a real one reads through the restricted unpickler
    assert metadata and all(hasattr(m, "properties") or hasattr(m, "size") for m in metadata.values())
    model_state.load_module(tiny(1), ckpt)

    marker = tmp_path / "ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    for read in (sharded.check_files, sharded.read_metadata):
        with pytest.raises((sharded.DamagedCheckpoint, pickle.UnpicklingError), match=r"posix\.mkdir is not allowed"):
            read(ckpt)
    with pytest.raises(sharded.DamagedCheckpoint, match=r"could not be read: .*posix\.mkdir is not allowed"):
        model_state.load_module(tiny(1), ckpt)
    assert not marker.exists()
    (ckpt / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(sharded.DamagedCheckpoint, match=r"unreadable metadata \(holds a dict, not DCP metadata\)"):
        sharded.check_files(ckpt)
    pickle.loads(pickle.dumps(Planted(marker)))  # what torch's own reader would have done with the planted file
    assert marker.is_dir()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_metadata_may_name_only_stored_tensors_in_the_checkpoints_own_files(tmp_path):
    """Allowed classes can still describe a harmful read: a bytes entry (DCP's default planner unpickles those
    with torch.load, weights_only off), a record pointing outside the folder, or a decompression transform."""
    import copy
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    save_whole(tiny(0), tmp_path)
    original = sharded.SafeReader(tmp_path).read_metadata()
    assert all(type(m) is sharded.TensorStorageMetadata for m in original.state_dict_metadata.values())
    key = next(iter(original.state_dict_metadata))
    index, info = next(iter(original.storage_data.items()))

    def tampered(change):
        metadata = copy.deepcopy(original)
        change(metadata)
        (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))

    tampered(lambda m: m.state_dict_metadata.__setitem__(key, BytesStorageMetadata()))
    with pytest.raises(sharded.DamagedCheckpoint, match=rf"entry '{key}' is a BytesStorageMetadata, not a stored "
                                                        r"tensor"):
        sharded.check_files(tmp_path)
    for field, value in (("relative_path", "/etc/passwd"), ("relative_path", "../__0_0.distcp"), ("offset", -1),
                         ("transform_descriptors", ["zstd"])):
        tampered(lambda m: setattr(m.storage_data[index], field, value))
        with pytest.raises(sharded.DamagedCheckpoint, match=r"is not one of this project's data files"):
            model_state.load_module(tiny(1), tmp_path)
    with pytest.raises(pickle.UnpicklingError, match="stored as bytes, not as a tensor"):
        sharded.ShardLoadPlanner().load_bytes(type("Item", (), {"dest_index": index})(), None)
    assert info.relative_path == "__0_0.distcp"


@pytest.mark.parametrize("numel, world", [(10, 3), (9, 3), (7, 4), (2, 4), (1, 1)])
def test_zero3_partitions_tile_the_parameter_without_the_padding(monkeypatch, numel, world):
    """DeepSpeed's ZeRO-3 layout: `world` equal partitions of ceil(numel / world) elements, the last padded; the
    valid parts (what a rank saves and loads) cover the flattened parameter once, in rank order."""
    import types

    import torch.distributed as dist

    part = -(-numel // world)
    p = types.SimpleNamespace(ds_tensor=torch.empty(part), ds_numel=numel, ds_process_group=None)
    covered = []
    for rank in range(world):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, r=rank: r)
        start, valid = model_state.zero3_partition(p)
        assert start == rank * part and 0 <= valid <= part
        covered += range(start, start + valid)
    assert covered == list(range(numel))
