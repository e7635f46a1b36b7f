"""Weights streamed one tensor at a time (checkpointing/streaming.py) and the export built on it."""
import gc
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from moep_ds.checkpointing import model_dir, model_state, streaming
from moep_ds.checkpointing.streaming import TensorEntry, write_safetensors
from moep_ds.config import config_from_dict, dump_config
from moep_ds.cli import convert as convert_cli, export as export_cli
from moep_ds.evaluation import export
from moep_ds.models.causal_lm import CausalLM

from test_model_state import RECIPE, save_whole, tiny


def test_streamed_file_reads_back_with_safetensors(tmp_path):
    tensors = {
        "a.weight": torch.randn(3, 5), "b": torch.randn(7, dtype=torch.float64), "h": torch.randn(2, 3).bfloat16(),
        "steps": torch.tensor(12345678901, dtype=torch.int64), "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4), "u8": torch.arange(5, dtype=torch.uint8),
    }
    reads = []

    def entry(name, t):
        return TensorEntry(name, t.dtype, tuple(t.shape), lambda: reads.append(name) or t)

    path = tmp_path / "w.safetensors"
    write_safetensors(path, [entry(n, t) for n, t in tensors.items()], metadata={"format": "pt"})
    assert reads == list(tensors)  # each read once, in order
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    announced = r"a\.weight: read torch\.float32 \(3, 5\), announced torch\.float32 \(5, 3\)"
    with pytest.raises(AssertionError, match=announced):
        write_safetensors(path, [TensorEntry("a.weight", torch.float32, (5, 3), lambda: tensors["a.weight"])])


def one_at_a_time(monkeypatch):
    """Wrap every entry's read so that a read while an earlier tensor is still alive is recorded."""
    alive: list[weakref.ref] = []
    overlaps = []
    original = streaming.write_safetensors

    def watched(path, entries, metadata=None):
        def wrap(e):
            def read():
                gc.collect()
                overlaps.extend(e.name for ref in alive if ref() is not None)
                t = e.read()
                alive.append(weakref.ref(t))
                return t
            return TensorEntry(e.name, e.dtype, e.shape, read)
        original(path, [wrap(e) for e in entries], metadata)

    monkeypatch.setattr(export, "write_safetensors", watched)
    return alive, overlaps


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("hf", [False, True])
def test_export_of_a_sharded_checkpoint_holds_one_tensor_at_a_time(tmp_path, monkeypatch, hf):
    source = tiny(0)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_whole(source, ckpt)
    (ckpt / model_dir.CONFIG_FILE).write_text(dump_config(config_from_dict(RECIPE)))
    built = []  # for every model the export builds: whether it lives on the meta device only
    init = CausalLM.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(all(p.is_meta for p in self.parameters()))

    monkeypatch.setattr(CausalLM, "__init__", recording_init)
    alive, overlaps = one_at_a_time(monkeypatch)
    args = [str(ckpt), "--out", str(tmp_path / "out")] + (["--hf"] if hf else [])
    assert export_cli.main(args) == 0
    assert len(alive) == len(model_state.shapes(source)) and overlaps == [] and built == [True]
    monkeypatch.setattr(CausalLM, "__init__", init)
    stored = load_file(str(tmp_path / "out" / model_dir.WEIGHTS_FILE))
    prefix = "model." if hf else ""
    expected = {k: v for k, v in source.state_dict().items() if isinstance(v, torch.Tensor)}
    expected.pop(model_dir.TIED_HEAD_KEY) if source.cfg.tie_embeddings else None
    assert stored.keys() == {prefix + k for k in expected}
    for name, value in expected.items():
        assert torch.equal(stored[prefix + name], value.float() if value.is_floating_point() else value), name
    assert convert_cli.main([str(tmp_path / "out"), "--out", str(tmp_path / "back")]) == 0
    again = model_dir.load_model_dir(tmp_path / "back")[0]
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, source.eval()(x).logits, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_export_checks_the_checkpoint_against_its_recipe_before_writing(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_whole(tiny(0), ckpt)
    wider = {**RECIPE["model"], "d_model": 32}
    (ckpt / model_dir.CONFIG_FILE).write_text(dump_config(config_from_dict({"model": wider})))
    assert export_cli.main([str(ckpt), "--out", str(tmp_path / "out")]) == 2
    assert f"checkpoint {str(ckpt)!r}: tensor 'embed.weight' has shape [64, 16] there but [64, 32] in this model" \
        in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
