"""Published MoE architectures in and out: a tiny random transformers model of each (every weight perturbed,
DeepSeek's selection bias non-zero) -> `moep-import` without --config -> logits equal transformers' (float32,
1e-5) and the same experts chosen per token -> `moep-export --hf --native` -> transformers loads it without
remote code: the source's own tensors, the same logits, the source's special tokens in config.json and
generation_config.json -> importing that export is bit-identical.

# B batch, T tokens, V vocabulary
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hf_moe_models import (CASES, CLASSES, SOURCE_GENERATION, SOURCE_TOKENS, V, hf_choices, hf_source, our_choices,
                            tokens)
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
    reference = hf_source(case, folder / "hf")
    assert import_main([str(folder / "hf"), "--out", str(folder / "run1")]) == 0
    assert export_main([str(folder / "run1"), "--out", str(folder / "hf2"), "--hf", "--native"]) == 0
    assert import_main([str(folder / "hf2"), "--out", str(folder / "run2")]) == 0
    return Imported(case, reference, folder)


def stored(run: Path) -> dict[str, torch.Tensor]:
    ckpt, cfg = load_recipe(run)
    entries, _ = stored_weights(ckpt, cfg)
    return {e.name: e.read() for e in entries}


def experts_of(keys: list[str | tuple[str, int, int]]) -> list[int]:
    """The experts whose tensors `keys` name (model.layers.1.mlp.experts.5.up_proj.weight: 5), or whose rows they
    are ((model.layers.1.mlp.experts.gate_up_proj, 2, 4): 2, 3; an [E, ...] tensor read by rows)."""
    out: set[int] = set()
    for key in keys:
        if isinstance(key, tuple) and ".experts." in key[0]:
            out.update(range(key[1], key[2]))
        elif isinstance(key, str) and ".experts." in key:
            out.add(int(key.split(".experts.")[1].split(".")[0]))
    return sorted(out)


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
    if imported.case.startswith(("deepseek_v3", "glm4_moe")):  # the selection bias, as our loss-free balancing bias
        bias = [m.balancer.bias_E for m in model.modules() if getattr(m, "balancer", None) is not None]
        assert bias and all(float(b.abs().sum()) > 0 for b in bias)


def test_native_export_is_the_architectures_own_format(imported):
    """transformers loads the export without trust_remote_code: the source's tensors exactly (DeepSeek's
    interleaved rotary rows put back; gpt-oss's MXFP4 experts as transformers dequantises them, with no
    quantization_config), and its logits."""
    config = json.loads((imported.folder / "hf2" / "config.json").read_text())
    assert config["architectures"] == [CLASSES[imported.case]] and "auto_map" not in config
    assert "quantization_config" not in config
    assert {k: config[k] for k in SOURCE_TOKENS} == SOURCE_TOKENS  # the source's, not our tokenizer's
    generation = json.loads((imported.folder / "hf2" / "generation_config.json").read_text())
    assert {k: generation[k] for k in SOURCE_GENERATION} == SOURCE_GENERATION
    source, export = safetensors_of(imported.folder / "hf"), safetensors_of(imported.folder / "hf2")
    if imported.case.endswith("_mxfp4"):
        source = imported.reference.state_dict()
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


@pytest.mark.parametrize("imported", ["qwen3_next"], indirect=True)
def test_generation_with_the_decoding_caches_emits_what_full_forwards_emit(imported):
    """Qwen3-Next decodes through Gated DeltaNet's recurrent and convolution states and the gated attention's
    keys and values: a prefill, then one token at a time. Greedily, the tokens of one full forward per step, and
    transformers' (its generate, with its own caches)."""
    from moep_ds.evaluation.generate import generate

    model, _, _, _ = load_model_dir(imported.folder / "run1")
    prompt_BT = tokens()[:, :5]
    cached = generate(model, prompt_BT, 8, use_cache=True)
    assert torch.equal(cached, generate(model, prompt_BT, 8, use_cache=False))
    assert torch.equal(cached, imported.reference.generate(prompt_BT, max_new_tokens=8, do_sample=False))


@pytest.mark.parametrize("imported", ["deepseek_v3"], indirect=True)
def test_a_large_export_is_sharded_as_save_pretrained_shards(imported, tmp_path):
    """Above --max_shard_size: model-0000i-of-0000n.safetensors and the index; transformers loads it, and its import
    is bit-identical."""
    out = tmp_path / "sharded"
    assert export_main([str(imported.folder / "run1"), "--out", str(out), "--hf", "--native",
                        "--max_shard_size", "40KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    tensors = safetensors_of(out)
    for f in files:  # at most the limit of tensor bytes per shard (or one larger tensor alone)
        held = [tensors[k].numel() * 4 for k, g in index["weight_map"].items() if g == f]
        assert sum(held) <= 40_000 or len(held) == 1, f
    assert set(index["weight_map"]) == set(tensors) == set(safetensors_of(imported.folder / "hf"))
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(again.float().eval()(tokens()).logits, imported.reference(tokens()).logits,
                                   **TOLERANCE)
    assert import_main([str(out), "--out", str(tmp_path / "run")]) == 0
    first, second = stored(imported.folder / "run1"), stored(tmp_path / "run")
    assert all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.parametrize("imported", ["deepseek_v3"], indirect=True)
def test_an_expert_parallel_rank_reads_only_its_own_experts(imported, tmp_path, monkeypatch):
    """Rank 1 of 2 fills its model (experts 4-7 of 8) from a sharded source: of the expert tensors it reads only
    those of its experts, and it gets the values rank-agnostic import gets."""
    from moep_ds.checkpointing import model_state
    from moep_ds.interop.hf_weights import TensorFiles
    from moep_ds.interop.sources import source_weights
    from moep_ds.interop.weights import fill_pieces
    from moep_ds.models.causal_lm import build_model
    from moep_ds.models.plan import plan_for

    assert export_main([str(imported.folder / "run1"), "--out", str(tmp_path / "hf"), "--hf", "--native",
                        "--max_shard_size", "40KB"]) == 0
    _, cfg = load_recipe(imported.folder / "run1")
    read: list[str] = []
    original = TensorFiles.read
    monkeypatch.setattr(TensorFiles, "read", lambda self, key: read.append(key) or original(self, key))
    plan = plan_for(cfg.model, size=2, rank=1)
    model = build_model(cfg.model, plan=plan, initialise=False)
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.allreduce = False  # DeepSpeed's mark of an expert parameter, as the engine sets it
    weights, keep, _ = source_weights(str(tmp_path / "hf"), cfg.model)
    fill_pieces(model_state.module_pieces(model, plan), weights, keep)
    assert experts_of(read) == [4, 5, 6, 7]
    assert sum(".experts." in key for key in read) == 2 * 4 * 3  # 2 MoE layers, 4 experts, gate / up / down
    full = stored(imported.folder / "run1")
    for name, p in model.named_parameters():
        expected = full[name][4:] if "experts." in name else full[name]
        assert torch.equal(p.detach(), expected), name


@pytest.fixture
def damaged(imported, tmp_path) -> Path:
    """A copy of the source folder to damage."""
    import shutil

    return Path(shutil.copytree(imported.folder / "hf", tmp_path / "damaged"))


def refused(src: Path, tmp_path: Path, capsys) -> str:
    """moep-import's one error line; nothing written."""
    assert import_main([str(src), "--out", str(tmp_path / "run")]) == 2
    assert not (tmp_path / "run").exists()
    return capsys.readouterr().err.strip().splitlines()[-1]


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("imported", ["olmoe"], indirect=True)
def test_bad_sources_fail_in_one_line(damaged, tmp_path, capsys):
    edit_config(damaged, model_type="jamba")
    assert refused(damaged, tmp_path, capsys) == (
        f"error: SRC ({str(damaged)!r}): config.json has model_type 'jamba'; moep-import reads deepseek_v2, deepseek_v3, "
        "gemma, glm4_moe, gpt2, gpt_neox, gpt_oss, llama, mixtral, olmoe, qwen2_moe, qwen3_moe, qwen3_next")
    edit_config(damaged, model_type="olmoe", clip_qkv=8.0)  # OLMoE clamps q, k and v: a function we do not compute
    assert refused(damaged, tmp_path, capsys) == (
        "error: config.json: clip_qkv = 8.0 (olmoe) has no moep_ds counterpart (supported: None)")
    edit_config(damaged, clip_qkv=None, partial_rotary_factor=0.5)  # older configs keep it beside the rope keys
    assert refused(damaged, tmp_path, capsys) == (
        "error: config.json: partial_rotary_factor = 0.5 (olmoe) has no moep_ds counterpart (supported: 1.0)")
    edit_config(damaged, partial_rotary_factor=None)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    assert refused(damaged, tmp_path, capsys).startswith(
        f"error: {str(weights)!r} cannot be read as safetensors (")


@pytest.mark.parametrize("imported", ["deepseek_v2"], indirect=True)
def test_deepseek_v2_routing_we_do_not_compute_is_refused(damaged, tmp_path, capsys):
    """transformers' V2 router renormalises never and knows two top-k methods; a config saying otherwise is
    refused, naming the field."""
    edit_config(damaged, norm_topk_prob=True)
    assert refused(damaged, tmp_path, capsys) == (
        "error: config.json: norm_topk_prob = True (deepseek_v2) has no moep_ds counterpart (supported: False)")
    edit_config(damaged, norm_topk_prob=False, topk_method="noaux_tc")
    assert refused(damaged, tmp_path, capsys) == (
        "error: config.json: topk_method = 'noaux_tc' (deepseek_v2) has no moep_ds counterpart (supported: greedy, "
        "group_limited_greedy)")


@pytest.mark.parametrize("imported", ["qwen3_next"], indirect=True)
def test_a_qwen3_next_layer_we_cannot_build_is_refused(damaged, tmp_path, capsys):
    """A layer type other than Gated DeltaNet and full attention, or another activation (Qwen3-Next's convolution
    uses hidden_act too): one line naming the field and the value."""
    kinds = json.loads((damaged / "config.json").read_text())["layer_types"]
    edit_config(damaged, layer_types=[kinds[0], "sliding_attention", *kinds[2:]])
    assert refused(damaged, tmp_path, capsys) == (
        "error: config.json: layer_types[1] = 'sliding_attention' (qwen3_next) has no moep_ds counterpart "
        "(supported: full_attention, linear_attention)")
    edit_config(damaged, layer_types=kinds, hidden_act="gelu")
    assert refused(damaged, tmp_path, capsys) == (
        "error: config.json: hidden_act = 'gelu' (qwen3_next) has no moep_ds counterpart (supported: 'silu')")


@pytest.mark.parametrize("imported", ["qwen3_next"], indirect=True)
def test_qwen3_next_multi_token_prediction_weights_are_skipped(damaged, imported, tmp_path):
    """The released checkpoints hold a multi-token-prediction layer (mtp.*) that transformers does not load: the
    import skips it and reads the model as without it."""
    from safetensors.torch import save_file

    tensors = safetensors_of(damaged)
    save_file({**tensors, "mtp.fc.weight": torch.ones(4, 8), "mtp.layers.0.input_layernorm.weight": torch.ones(8)},
              str(damaged / "model.safetensors"), metadata={"format": "pt"})
    assert import_main([str(damaged), "--out", str(tmp_path / "run")]) == 0
    first, again = stored(imported.folder / "run1"), stored(tmp_path / "run")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


@pytest.mark.parametrize("imported", ["glm4_moe"], indirect=True)
def test_multi_token_prediction_layers_are_skipped_as_transformers_skips_them(damaged, imported, tmp_path, capsys):
    """GLM-4.5's (as DeepSeek-V3's) num_nextn_predict_layers after the last layer: no weights of the model; the same
    tensors under a config.json without them are refused, named."""
    from safetensors.torch import save_file

    tensors = safetensors_of(damaged)
    mtp = {"model.layers.3.eh_proj.weight": torch.ones(4, 8),
           "model.layers.3.mlp.experts.0.up_proj.weight": torch.ones(2)}
    save_file({**tensors, **mtp}, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    edit_config(damaged, num_nextn_predict_layers=1)
    assert import_main([str(damaged), "--out", str(tmp_path / "run")]) == 0
    first, second = stored(imported.folder / "run1"), stored(tmp_path / "run")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    edit_config(damaged, num_nextn_predict_layers=0)
    assert refused(damaged, tmp_path / "again", capsys) == (
        f"error: SRC ({str(damaged)!r}) has 2 tensor(s) that Glm4MoeForCausalLM of this recipe has no place for: "
        f"{sorted(mtp)}")


@pytest.mark.parametrize("imported", ["qwen3_moe"], indirect=True)
def test_a_shard_the_index_names_is_missing(imported, tmp_path, capsys):
    assert export_main([str(imported.folder / "run1"), "--out", str(tmp_path / "hf"), "--hf", "--native",
                        "--max_shard_size", "40KB"]) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / "hf" / shard).unlink()
    key = min(k for k, f in index["weight_map"].items() if f == shard)
    assert refused(tmp_path / "hf", tmp_path, capsys) == (
        f"error: {str(tmp_path / 'hf' / 'model.safetensors.index.json')!r} names shard {shard!r} (holding {key!r}), "
        f"which is missing from {str(tmp_path / 'hf')!r}")


def import_on_rank(src: str, out: str, way: str) -> tuple[int, list[int]]:
    """One rank of a 2-process `moep-import` (ZeRO-3, or --expert_parallel): its exit status and the experts whose
    tensors it read."""
    from moep_ds.cli.import_model import main as import_cli
    from moep_ds.interop.hf_weights import TensorFiles

    read: list[str | tuple[str, int, int]] = []
    original, rows = TensorFiles.read, TensorFiles.read_rows
    TensorFiles.read = lambda self, key: read.append(key) or original(self, key)
    TensorFiles.read_rows = lambda self, key, a, b: read.append((key, a, b)) or rows(self, key, a, b)
    code = import_cli([src, "--out", out, *(["--expert_parallel"] if way == "expert_parallel" else [])])
    return code, experts_of(read)


def score_on_rank(run: str, way: str) -> dict:
    """The run directory split over 2 ranks as moep-eval splits it: the logits and the experts every MoE layer
    chose."""
    from hf_moe_models import our_choices
    from moep_ds.evaluation.partitioned import load_partitioned_model_dir

    model, _, _, _, engine = load_partitioned_model_dir(run, expert_parallel=way == "expert_parallel")
    logits, chosen = our_choices(model, tokens())
    del engine
    return {"logits": logits, "chosen": chosen}


def import_then_score_on_rank(src: str, out: str, way: str) -> dict:
    """One rank of a 2-process `moep-import` (import_on_rank), then of the imported run directory scored as moep-eval
    splits it (score_on_rank), in one launch: the ranks stay in the import's process group (where the command
    would leave it at its end) to score, as a second launch would join a new one; the scoring reads the run
    directory from disk. {"import": import_on_rank's result, "logits", "chosen": score_on_rank's, absent where the
    import failed}."""
    from moep_ds.distributed import process_group
    from moep_ds.interop.hf_weights import TensorFiles

    leave, read, rows = process_group.leave_process_group, TensorFiles.read, TensorFiles.read_rows
    process_group.leave_process_group = torch.distributed.barrier
    try:
        imported = import_on_rank(src, out, way)
    finally:
        process_group.leave_process_group, TensorFiles.read, TensorFiles.read_rows = leave, read, rows
    return {"import": imported, **(score_on_rank(out, way) if imported[0] == 0 else {})}


@pytest.mark.slow
@pytest.mark.parametrize("imported,way", [("deepseek_v3", "expert_parallel"), ("deepseek_v3", "zero3"),
                                          ("olmoe", "expert_parallel"), ("qwen3_next", "expert_parallel"),
                                          ("qwen3_next", "zero3"), ("glm4_moe", "expert_parallel"),
                                          ("glm4_moe", "zero3"), ("gpt_oss_mxfp4", "expert_parallel"),
                                          ("gpt_oss", "zero3")], indirect=["imported"])
def test_an_import_on_two_processes_is_the_one_process_import(imported, way, tmp_path):
    """`moep-import` on 2 ranks, no rank holding the whole model (each its experts and the rest whole, or its ZeRO-3
    partitions): the run directory a single process writes, tensor for tensor and recipe for recipe (so its export
    and re-import are as tested above); the model split over the 2 ranks gives transformers' logits (1e-5) and
    chooses the experts transformers' routers choose."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ranks import run_ranks

    out = tmp_path / "run"
    ranks = [r.result for r in run_ranks(2, import_then_score_on_rank, str(imported.folder / "hf"), str(out), way)]
    # each rank read its own half of the experts (under ZeRO-3 the halves of each stack's flat partitions)
    assert [r["import"] for r in ranks] == [(0, [0, 1, 2, 3]), (0, [4, 5, 6, 7])]
    one, two = stored(imported.folder / "run1"), stored(out)
    assert one.keys() == two.keys()
    for name in one:
        assert torch.equal(one[name], two[name]), name
    ckpt = next((out / "checkpoints").iterdir())
    assert (ckpt / "COMPLETE").is_file() and not list(tmp_path.glob(".*"))
    single = next((imported.folder / "run1" / "checkpoints").iterdir())
    assert (ckpt / "config.yaml").read_text() == (single / "config.yaml").read_text()
    expected_BTV, hf_chosen = hf_choices(imported.reference, tokens())
    for rank in ranks:
        torch.testing.assert_close(rank["logits"], expected_BTV, **TOLERANCE)
        assert all(torch.equal(ours, theirs) for ours, theirs in zip(rank["chosen"], hf_chosen, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("imported", ["olmoe"], indirect=True)
def test_an_import_on_two_processes_into_a_used_directory_fails_in_one_line(imported, tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ranks import joined, run_ranks

    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    proc = joined(run_ranks(2, import_on_rank, str(imported.folder / "hf"), str(out), "zero3", check=False))
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [f"error: --out ({str(out)!r}) exists and is not empty: moep-import writes a new run directory"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and [p.name for p in out.iterdir()] == ["notes.txt"]


def import_on_a_full_disk(src: str, out: str) -> int:
    """One rank of a 2-process `moep-import` whose tensor writes find the disk full (3 MiB left)."""
    import errno
    import os

    from torch.distributed.checkpoint import filesystem

    from moep_ds import fsutil
    from moep_ds.cli.import_model import main as import_cli

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    filesystem._write_item = full_disk
    fsutil.free_bytes = lambda path: 3 << 20
    return import_cli([src, "--out", out])


@pytest.mark.slow
@pytest.mark.parametrize("imported", ["olmoe"], indirect=True)
def test_an_import_on_two_processes_onto_a_full_disk_fails_in_one_line(imported, tmp_path):
    """Issue 46 item 6: DCP's error was "writing RUN_DIR failed: OSError: [Errno 28] ...", without the space left."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ranks import joined, run_ranks

    out = tmp_path / "run"
    proc = joined(run_ranks(2, import_on_a_full_disk, str(imported.folder / "hf"), str(out), check=False))
    assert proc.returncode == 2
    assert [line for line in proc.stderr.splitlines() if "error" in line] == [
        f"error: disk full (No space left on device) writing {str(out)!r}, 3 MiB free there"], proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("imported", ["gpt_oss_mxfp4"], indirect=True)
def test_gpt_oss_sources_we_cannot_read_are_refused(damaged, tmp_path, capsys):
    """An attention kind we do not build, a quantization other than MXFP4, MXFP4 blocks of another shape than
    config.json gives them: one line naming the field or the tensor, nothing written."""
    from safetensors.torch import load_file, save_file

    edit_config(damaged, layer_types=["sliding_attention", "chunked_attention"])
    assert refused(damaged, tmp_path, capsys) == (
        "error: config.json: layer_types[1] = 'chunked_attention' (gpt_oss) has no moep_ds counterpart (supported: "
        "full_attention, sliding_attention)")
    edit_config(damaged, layer_types=["sliding_attention", "full_attention"],
                quantization_config={"quant_method": "bitsandbytes"})
    assert refused(damaged, tmp_path, capsys) == (
        "error: config.json: quantization_config.quant_method = 'bitsandbytes' (gpt_oss) has no moep_ds counterpart "
        "(supported: mxfp4)")
    edit_config(damaged, quantization_config={"quant_method": "mxfp4"})
    state = load_file(damaged / "model.safetensors")
    key = "model.layers.1.mlp.experts.gate_up_proj_blocks"
    state[key] = state[key].reshape(8, 64, 2, 8)  # the same bytes, blocks of 8 for a hidden size of 32
    save_file(state, damaged / "model.safetensors")
    assert refused(damaged, tmp_path, capsys) == (
        f"error: {key} has shape [8, 64, 2, 8]; config.json's num_local_experts 8, hidden_size 32, intermediate_size "
        "32 make it [8, 64, 1, 16]")


def test_gpt_oss_export_names_what_gpt_oss_cannot_express():
    """gpt_oss has one sliding window, clamped-SwiGLU experts and a renormalised router: a model otherwise is
    Inexpressible, or differs from its config.json's round trip, naming the setting (configs/gpt_oss_tiny.yaml)."""
    from moep_ds.config import load_config
    from moep_ds.interop.adapter import Inexpressible
    from moep_ds.interop.families import families

    from repo_paths import CONFIGS

    def model(*sets: str):
        return load_config(CONFIGS / "gpt_oss_tiny.yaml", list(sets)).model

    gpt_oss = families()["gpt_oss"]
    assert gpt_oss.differences(model()) == []
    with pytest.raises(Inexpressible, match=r"^model\.layers\[\*\]\.attention\.window: \[4, 16\] in the model; "
                                            r"gpt_oss has one sliding_window$"):
        gpt_oss.to_hf(model("model.layers[1].attention.window=4"))
    with pytest.raises(Inexpressible, match=r"^model\.layers\[\*\]\.moe\.expert\.type: 'swiglu' in the model; "):
        gpt_oss.to_hf(model("model.layers[0].moe.expert.type=swiglu", "model.layers[0].moe.expert.limit=null",
                            "model.layers[1].moe.expert.type=swiglu", "model.layers[1].moe.expert.limit=null"))
    assert gpt_oss.differences(model("model.layers[1].moe.router.renormalize=false")) == [
        "model.layers[1].moe.router.renormalize: True in GptOssForCausalLM, False in the model"]
