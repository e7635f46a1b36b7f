"""Checkpoints in true shapes: flat ranges cut into boxes, read back at other ranges, into a fresh model's
state_dict() by torch.distributed.checkpoint alone, and the 1-D layout of before still read."""
import copy
import json
import math
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp

from moep_ds import build_model
from moep_ds.checkpointing import model_state, sharded
from moep_ds.checkpointing.sharded import FlatShard, flat_boxes
from moep_ds.checkpointing.streaming import sharded_entries
from moep_ds.config import config_from_dict

LIFECYCLE = {"type": "topk", "k": 2, "load_balancing_weight": 0.01,
             "lifecycle": {"min_tokens": 8, "check_interval": 1, "threshold_ratio": 1.0}}
EXPERT_CHOICE = {"type": "expert_choice", "capacity_factor": 1.25, "rounding": "ceil", "score": "softmax_tokens"}
RECIPE = {"model": {"flavour": "llama", "vocab_size": 64, "d_model": 16, "max_seq_len": 16, "tie_embeddings": True,
                    "layers": [
                        {"type": "ffn_moe", "attention": {"num_heads": 2},
                         "moe": {"num_experts": 4, "expert": {"type": "swiglu", "hidden_size": 24},
                                 "router": EXPERT_CHOICE}},
                        {"type": "ssm_moe", "mixer": {"state_size": 4, "chunk_size": 8},
                         "moe": {"num_experts": 4, "expert": {"type": "gelu", "hidden_size": 24},
                                 "router": LIFECYCLE}}]}}
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "assuming ... a single process"


def tiny(seed: int, trained: bool = False):
    torch.manual_seed(seed)
    model = build_model(config_from_dict(RECIPE).model)
    if trained:  # routers see batches: expert-choice thresholds (buffers) move, the lifecycle logs events
        with torch.no_grad():
            for _ in range(3):
                model.train()(torch.randint(0, 64, (4, 16)))
    return model


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3), (2, 2, 3, 2), ()])
def test_a_flat_range_is_a_few_boxes_covering_it_once_in_order(shape):
    numel = math.prod(shape)
    index = torch.arange(numel).view(shape)
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            boxes, covered = flat_boxes(shape, start, stop), []
            for first, offsets, sizes in boxes:
                values = index[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))].reshape(-1).tolist()
                assert first == start + len(covered) and values == list(range(first, first + len(values)))
                covered += values
            assert covered == list(range(start, stop))
            assert len(boxes) <= max(1, 2 * len(shape) - 1)


class Ranks:
    """Pieces of one tensor that several ranks hold, in one state dict entry (what DCP gathers from them)."""

    def __init__(self, pieces: list[FlatShard]):
        self.pieces = pieces

    def size(self):
        return self.pieces[0].size()

    def __create_write_items__(self, fqn, obj):
        return [item for p in self.pieces for item in p.__create_write_items__(fqn, p)]

    def __create_chunk_list__(self):
        return [c for p in self.pieces for c in p.chunks()]

    def __get_tensor_shard__(self, index):
        return next(p.box(index.offset) for p in self.pieces if torch.Size(index.offset) in p.boxes)


def cuts(numel: int, parts: int, rng: random.Random) -> list[tuple[int, int]]:
    points = sorted(rng.sample(range(1, numel), parts - 1))
    return list(zip([0, *points], [*points, numel]))


@pytest.mark.parametrize("shape", [(6, 10), (4, 6, 5)])
def test_ranges_written_by_some_ranks_read_back_at_others_and_whole_by_torch(tmp_path, shape):
    """Saved as 3 arbitrary ranges (ZeRO partitions), read as 4 others and as the plain N-d tensor."""
    rng = random.Random(sum(shape))
    numel = math.prod(shape)
    source = torch.randn(shape)
    flat = source.view(-1)
    written = Ranks([FlatShard(flat[a:b], a, numel, shape) for a, b in cuts(numel, 3, rng)])
    dcp.save({"w": written}, storage_writer=sharded.writer(tmp_path), planner=sharded.ShardSavePlanner(),
             no_dist=True)
    stored = sharded.read_metadata(tmp_path)["w"]
    assert stored.size == torch.Size(shape) and len(stored.chunks) > 3  # ranges split into boxes
    for a, b in cuts(numel, 4, rng):
        local = torch.zeros(b - a)
        sharded.load({"w": FlatShard(local, a, numel, shape)}, tmp_path)
        assert torch.equal(local, flat[a:b])
    whole = {"w": torch.zeros(shape)}
    dcp.load(whole, checkpoint_id=str(tmp_path))
    assert torch.equal(whole["w"], source)


def test_a_model_loads_into_its_own_state_dict_with_torch_alone(tmp_path):
    """Tied head, buffers (expert-choice thresholds) and the lifecycle's event log: the README's snippet."""
    source = tiny(0, trained=True)
    assert model_state.tied_names(source) == {"head.weight": "embed.weight"}
    assert any(v for k, v in model_state.extra_states(source).items())  # events were logged
    model_state.save_module(source, tmp_path / "ckpt")
    stored = sharded.read_metadata(tmp_path / "ckpt")
    expected = source.state_dict()
    for key, value in expected.items():  # the true shapes under state_dict()'s names
        assert key in stored, key
        if isinstance(value, torch.Tensor):
            assert stored[key].size == value.shape, key

    model = tiny(1)  # moep_ds builds the empty model; the rest is torch
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "ckpt"))
    model.load_state_dict(sd)  # the extra state (a dict, not a tensor) is applied here
    got = model.state_dict()
    assert list(got) == list(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key
    assert model.head.weight is model.embed.weight

    again = tiny(2)  # and this project's own reader, which never reads the bytes entries
    model_state.load_module(again, tmp_path / "ckpt")
    for key, value in expected.items():
        assert torch.equal(again.state_dict()[key], value) if isinstance(value, torch.Tensor) else \
            again.state_dict()[key] == value, key


@pytest.mark.slow
def test_every_rank_of_a_launch_loads_the_whole_model_with_torch_alone(tmp_path):
    """The snippet on 2 ranks (tests/ranks.py: a launcher's environment and a process group, so that DCP plans the
    reads collectively)."""
    from moep_ds.checkpointing.model_dir import write_recipe_files

    from ranks import run_ranks

    source = tiny(0, trained=True)
    model_state.save_module(source, tmp_path / "ckpt")
    write_recipe_files(config_from_dict(RECIPE), tmp_path / "ckpt", None, {"step": 0})
    for rank, held in enumerate(r.result for r in run_ranks(2, load_with_torch_alone, str(tmp_path / "ckpt"))):
        assert held["tied"]
        expected = {k: v for k, v in source.state_dict().items() if isinstance(v, torch.Tensor)}
        assert list(held["tensors"]) == list(expected)
        for key, value in expected.items():
            assert torch.equal(held["tensors"][key], value), (rank, key)


def load_with_torch_alone(ckpt: str) -> dict:
    """On a rank: build the empty model and fill it with torch.distributed.checkpoint alone (the README's snippet);
    what the rank holds then."""
    import torch.distributed as dist

    from moep_ds import build_model, load_config

    dist.init_process_group("gloo")
    model = build_model(load_config(f"{ckpt}/config.yaml").model)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    model.load_state_dict(sd)
    held = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    return {"tensors": held, "tied": model.head.weight is model.embed.weight}


def save_legacy(model, path):
    """What checkpoints of before 2026-12-03 held: every tensor flattened to 1-D under model/<name>, shapes in
    tensors.json (as that writer did, from the same pieces)."""
    pieces = {sharded.LEGACY_MODEL_PREFIX + k: v.flat() for k, v in model_state.module_pieces(model).items()}
    dcp.save(pieces, storage_writer=sharded.writer(path), planner=sharded.ShardSavePlanner(), no_dist=True)
    sharded.save_json({k: list(v) for k, v in model_state.shapes(model).items()}, path / sharded.TENSORS_FILE)
    sharded.save_json(model_state.extra_states(model), path / model_state.EXTRA_STATE_FILE)


def test_checkpoints_of_the_old_1d_layout_are_still_read(tmp_path):
    source = tiny(0, trained=True)
    save_legacy(source, tmp_path)
    assert all(len(m.size) == 1 for m in sharded.read_metadata(tmp_path).values())
    sharded.check_files(tmp_path)
    model = tiny(1)
    model_state.load_module(model, tmp_path)
    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], value) if isinstance(value, torch.Tensor) else \
            model.state_dict()[key] == value, key
    shapes = model_state.shapes(source)
    for entry in sharded_entries(tmp_path, shapes):  # what an export streams
        assert torch.equal(entry.read(), source.state_dict()[entry.name]), entry.name
    (tmp_path / sharded.TENSORS_FILE).unlink()
    with pytest.raises(sharded.DamagedCheckpoint, match=r"tensors.json' is missing$"):
        sharded.check_files(tmp_path)


def test_a_shape_that_differs_is_named_from_the_metadata(tmp_path):
    model_state.save_module(tiny(0), tmp_path)
    wider = copy.deepcopy(RECIPE)
    wider["model"]["layers"][0]["moe"]["expert"]["hidden_size"] = 32
    other = build_model(config_from_dict(wider).model)
    with pytest.raises(sharded.CheckpointError, match=r"tensor 'blocks.0.moe.experts.w1_EDF' has shape \[4, 16, 24\] "
                                                       r"there but \[4, 16, 32\] in this model$"):
        model_state.load_module(other, tmp_path)
    assert not (tmp_path / sharded.TENSORS_FILE).exists()
    assert json.loads((tmp_path / model_state.EXTRA_STATE_FILE).read_text()) == model_state.extra_states(tiny(0))
