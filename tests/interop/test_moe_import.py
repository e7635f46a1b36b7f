"""Published MoE architectures in and out: a tiny random transformers model of each (every weight perturbed,
DeepSeek's selection bias non-zero) -> `moep-import` without --config -> logits equal transformers' (float32,
1e-5) and the same experts chosen per token -> `moep-export --hf --native` -> transformers loads it without
remote code: the source's own tensors, the same logits -> importing that export is bit-identical.

# B batch, T tokens, V vocabulary
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hf_moe_models import CASES, CLASSES, V, hf_choices, hf_model, our_choices, tokens
from moep_ds.checkpointing.model_dir import load_model_dir, load_recipe, stored_weights
from moep_ds.cli.export import main as export_main
from moep_ds.cli.import_model import main as import_main

transformers = pytest.importorskip("transformers")

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # float32


@dataclasses.dataclass(frozen=True)
class Imported:
    case: str
    reference: torch.nn.Module
    folder: Path  # hf/ (the source), run1/ (its import), hf2/ (run1's native export), run2/ (hf2's import)


@pytest.fixture(scope="module", params=CASES)
def imported(request, tmp_path_factory) -> Imported:
    case = request.param
    folder = tmp_path_factory.mktemp(case)
    reference = hf_model(case)
    reference.save_pretrained(folder / "hf")
    assert import_main([str(folder / "hf"), "--out", str(folder / "run1")]) == 0
    assert export_main([str(folder / "run1"), "--out", str(folder / "hf2"), "--hf", "--native"]) == 0
    assert import_main([str(folder / "hf2"), "--out", str(folder / "run2")]) == 0
    return Imported(case, reference, folder)


def stored(run: Path) -> dict[str, torch.Tensor]:
    ckpt, cfg = load_recipe(run)
    entries, _ = stored_weights(ckpt, cfg)
    return {e.name: e.read() for e in entries}


def safetensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_import_without_a_recipe_equals_transformers(imported):
    """Logits within 1e-5 and, in every MoE layer, the same experts for every token."""
    model, cfg, _, meta = load_model_dir(imported.folder / "run1")
    assert meta["step"] == 0 and cfg.model.vocab_size == V
    expected_BTV, hf_chosen = hf_choices(imported.reference, tokens())
    ours_BTV, our_chosen = our_choices(model.eval(), tokens())
    assert float(ours_BTV.std()) > 0.1
    torch.testing.assert_close(ours_BTV, expected_BTV, **TOLERANCE)
    assert len(our_chosen) == len(hf_chosen)
    for layer, (ours, theirs) in enumerate(zip(our_chosen, hf_chosen)):
        assert torch.equal(ours, theirs), f"MoE layer {layer}"
    if imported.case.startswith("deepseek"):  # the selection bias arrived as our loss-free balancing bias
        bias = [m.balancer.bias_E for m in model.modules() if getattr(m, "balancer", None) is not None]
        assert bias and all(float(b.abs().sum()) > 0 for b in bias)


def test_native_export_is_the_architectures_own_format(imported):
    """transformers loads the export without trust_remote_code: the source's tensors exactly (DeepSeek's
    interleaved rotary rows put back), and its logits."""
    config = json.loads((imported.folder / "hf2" / "config.json").read_text())
    assert config["architectures"] == [CLASSES[imported.case]] and "auto_map" not in config
    source, export = safetensors_of(imported.folder / "hf"), safetensors_of(imported.folder / "hf2")
    assert source.keys() == export.keys()
    for key in source:
        assert torch.equal(source[key], export[key]), key
    again = transformers.AutoModelForCausalLM.from_pretrained(imported.folder / "hf2", attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(again.float().eval()(tokens()).logits, imported.reference(tokens()).logits,
                                   **TOLERANCE)


def test_importing_the_export_is_bit_identical(imported):
    first, second = stored(imported.folder / "run1"), stored(imported.folder / "run2")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
