"""moep-export: consolidated model directories and Hugging Face (trust_remote_code) directories whose logits
equal moep_ds's for every block type."""
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from moep_ds.cli.convert import main as convert_main
from moep_ds.cli.export import main as export_main
from moep_ds.evaluation.generate import generate
from moep_ds.checkpointing.model_dir import load_model_dir, save_model_dir

from eval_models import TINY_LAYERS, export_hf, tiny_model


def load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True)


@pytest.mark.parametrize("name", sorted(TINY_LAYERS))
def test_hf_export_logits_equal_moep_logits(name, tmp_path):
    model, cfg = tiny_model(name)
    hf = load_hf(export_hf(model, cfg, tmp_path / name))
    assert not hf.training
    x = torch.randint(0, cfg.model.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x).logits, rtol=0, atol=1e-5)
    state = dict(hf.model.state_dict())
    for key, value in model.state_dict().items():  # buffers too (expert-choice thresholds)
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)


def test_hf_export_ties_embeddings_and_runs_padded_rows_alone(tmp_path):
    model, cfg = tiny_model("dense_llama_window")
    assert cfg.model.tie_embeddings
    hf = load_hf(export_hf(model, cfg, tmp_path / "hf"))
    assert hf.model.head.weight is hf.model.embed.weight
    x = torch.randint(0, cfg.model.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), x], dim=1).repeat(2, 1)
    padded[1] = torch.cat([x[0], torch.zeros(3, dtype=torch.long)])
    mask = torch.ones_like(padded)
    mask[0, :3] = 0  # left padding
    mask[1, 9:] = 0  # right padding
    with torch.no_grad():
        ours = model(x).logits[0]
        out = hf(padded, attention_mask=mask).logits
    torch.testing.assert_close(out[0, 3:], ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1, :9], ours, rtol=0, atol=1e-5)


def test_hf_export_of_an_untied_model_says_so_and_keeps_its_own_head(tmp_path):
    """config.json's tie_word_embeddings is the recipe's tie_embeddings: transformers ties the head to the
    embedding when it says true (4.x always; 5.x unless both differ in the file, with a warning)."""
    model, cfg = tiny_model("dense_pythia")
    assert not cfg.model.tie_embeddings
    out = export_hf(model, cfg, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    hf = load_hf(out)
    assert hf.model.head.weight is not hf.model.embed.weight
    torch.testing.assert_close(hf.model.head.weight, model.head.weight, rtol=0, atol=0)


def test_hf_generate_matches_moep_generate(tmp_path):
    model, cfg = tiny_model("msit")
    hf = load_hf(export_hf(model, cfg, tmp_path / "hf"))
    prompt = torch.randint(0, cfg.model.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(theirs, generate(model, prompt, 12))


@pytest.mark.slow
def test_hf_export_loads_without_moep_ds_installed(tmp_path):
    model, cfg = tiny_model("ffn_moe_nova")
    out = export_hf(model, cfg, tmp_path / "hf")
    x = torch.randint(0, cfg.model.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.save({"x": x, "logits": model(x).logits}, tmp_path / "expected.pt")
    script = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "moep_ds" or name.startswith("moep_ds."):
            raise ImportError("moep_ds must not be needed: " + name)
sys.meta_path.insert(0, Block())
import torch
from transformers import AutoModelForCausalLM
hf = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)
ref = torch.load({str(tmp_path / "expected.pt")!r})
torch.testing.assert_close(hf(ref["x"]).logits, ref["logits"], rtol=0, atol=1e-5)
assert not any(m == "moep_ds" or m.startswith("moep_ds.") for m in sys.modules)
print("ok")
"""
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_moep_export_cli_writes_both_layouts(tmp_path):
    model, cfg = tiny_model("ffn_moe_nova")
    src = save_model_dir(model, cfg, tmp_path / "ckpt", meta={"step": 7, "tokens": 700})
    assert export_main([str(src), "--out", str(tmp_path / "plain")]) == 0
    assert convert_main([str(tmp_path / "plain"), "--out", str(tmp_path / "back")]) == 0  # moep_ds loads sharded only
    again, cfg2, tokenizer, meta = load_model_dir(tmp_path / "back")
    assert tokenizer is None and meta["step"] == 7 and meta["exported_from"] == str(src.resolve())
    x = torch.randint(0, cfg.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, model(x).logits, rtol=0, atol=0)
    override = "model.layers[1].moe.router.eval_mode=topk"
    assert export_main([str(src), "--out", str(tmp_path / "hf"), "--hf", "--set", override]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_moep.MoepForCausalLM"
    assert config["moep_model"]["layers"][1]["moe"]["router"]["eval_mode"] == "topk"
    assert (tmp_path / "hf" / "modeling_moep.py").is_file() and (tmp_path / "hf" / "moep_ds_blocks_ffn_moe.py").is_file()


def test_moep_export_errors_are_one_line(tmp_path, capsys):
    assert export_main([str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: checkpoint '{tmp_path / 'nope'}' does not exist"
    model, cfg = tiny_model("dense_gpt2")
    src = save_model_dir(model, cfg, tmp_path / "ckpt")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "f").write_text("x")
    assert export_main([str(src), "--out", str(tmp_path / "taken"), "--hf"]) == 2
    assert "exists and is not empty (pass --force to replace it)" in capsys.readouterr().err


def test_vendored_imports_are_flat_and_relative():
    from moep_ds.evaluation.vendor import rewrite_imports

    source = (
        "from moep_ds.layers.norm import (\n    NormConfig,\n    build_norm as bn,\n)  # why\n"
        "from moep_ds.routing import plan, Router\n"
        "def f():\n    from moep_ds.training.trainer import x  # lazy: left alone\n    return x\n"
    )
    assert rewrite_imports(source, "m") == (
        "from .moep_ds_layers_norm import NormConfig, build_norm as bn  # why\n"
        "from .moep_ds_routing import Router\nfrom . import moep_ds_routing_plan as plan\n"
        "def f():\n    from moep_ds.training.trainer import x  # lazy: left alone\n    return x\n"
    )
    with pytest.raises(ValueError, match="m line 1: model code imports moep_ds.training.trainer at module level"):
        rewrite_imports("from moep_ds.training.trainer import x\n", "m")
    with pytest.raises(ValueError, match="cannot be vendored"):
        rewrite_imports("import moep_ds.layers.norm\n", "m")


# ---- bad input: one line, exit status 2, nothing written ---------------------------------------------------


def assert_one_line_error(code, err, message):
    assert code == 2
    assert [line for line in err.splitlines() if line.startswith("error:")] == [f"error: {message}"], err


def snapshot(root):
    """Every path under `root` with its bytes (None for folders): what a refused export must leave alone."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from moep_ds.data.builtin import generate_corpus
    from moep_ds.data.config import TokenizerConfig
    from moep_ds.data.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(generate_corpus(5_000, seed=0).split("\n\n"), TokenizerConfig(kind="bpe", vocab_size=300), out)
    return out


def make_run(run, tokenizer_dir=None, step=4):
    """A run directory whose newest complete checkpoint (step `step`) is a tiny model directory."""
    model, cfg = tiny_model("dense_gpt2")
    ckpt = save_model_dir(model, cfg, run / "checkpoints" / f"step_{step:08d}", tokenizer_dir=tokenizer_dir,
                          meta={"step": step})
    (ckpt / "COMPLETE").touch()
    return ckpt


def test_moep_export_refuses_an_out_that_is_no_folder(tmp_path, capsys):
    ckpt = make_run(tmp_path / "run")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    before = snapshot(tmp_path)
    cases = {
        "afile": "--out ({!r}) exists and is not a directory",
        "afile/sub": f"--out ({{!r}}) cannot be created: '{tmp_path / 'afile'}' is not a directory",
        "link": f"--out ({{!r}}) is a symbolic link (to {str(tmp_path / 'elsewhere')!r}); give the folder itself",
    }
    for out, message in cases.items():
        for force in ([], ["--force"]):
            code = export_main([str(ckpt), "--out", str(tmp_path / out), *force])
            assert_one_line_error(code, capsys.readouterr().err, message.format(str(tmp_path / out)))
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc (a folder nobody can write in)")
def test_moep_export_refuses_an_out_it_cannot_write(tmp_path, capsys):
    ckpt = make_run(tmp_path / "run")
    before = snapshot(tmp_path)
    for out in ("/proc/moep_export", "/proc/moep_export/sub"):
        code = export_main([str(ckpt), "--out", out])
        err = capsys.readouterr().err
        reason = next(r for r in ("No such file or directory", "Permission denied") if r in err)
        assert_one_line_error(code, err, f"--out ({out!r}) cannot be written in /proc: {reason}")
    assert not os.path.exists("/proc/moep_export") and snapshot(tmp_path) == before


def test_moep_export_never_writes_into_a_run(tmp_path, capsys):
    tmp_path = tmp_path.resolve()  # the reasons name resolved paths
    run, other = tmp_path / "run", tmp_path / "other"
    ckpt, old = make_run(run), make_run(run, step=2)
    make_run(other, step=1)
    rule = "an export never writes into a run directory or checkpoint"
    cases = {  # --out -> why
        run: f"contains the checkpoint being exported ({ckpt})",
        run / "checkpoints": f"contains the checkpoint being exported ({ckpt})",
        tmp_path: f"contains the checkpoint being exported ({ckpt})",
        ckpt: "is the checkpoint being exported",
        ckpt / "hf": f"is inside the checkpoint being exported ({ckpt})",
        old: "is a checkpoint",
        old / "hf": f"is inside checkpoint {old}",
        run / "checkpoints" / "step_00000009": f"is inside the checkpoints of run directory {run}",
        other: "is a run directory",
        run / "hf": f"is inside run directory {run}",  # the README's rule; before, only its checkpoints/ were refused
    }
    before = snapshot(tmp_path)
    for source in (run, ckpt):
        for out, why in cases.items():
            code = export_main([str(source), "--out", str(out), "--force", "--hf"])
            assert_one_line_error(code, capsys.readouterr().err, f"--out ({str(out)!r}) {why}: {rule}")
    assert snapshot(tmp_path) == before
    assert export_main([str(run), "--out", str(tmp_path / "hf")]) == 0  # beside the run is fine


def test_moep_export_force_replaces_the_whole_folder(tmp_path, monkeypatch, capsys):
    from moep_ds.errors import UserError
    from moep_ds.evaluation import export

    ckpt = make_run(tmp_path / "run")
    assert export_main([str(ckpt), "--out", str(tmp_path / "plain")]) == 0
    assert export_main([str(ckpt), "--out", str(tmp_path / "out"), "--hf"]) == 0
    assert (tmp_path / "out" / "modeling_moep.py").is_file()
    assert export_main([str(ckpt), "--out", str(tmp_path / "out"), "--force"]) == 0
    assert snapshot(tmp_path / "out").keys() == snapshot(tmp_path / "plain").keys()  # no stale Hugging Face files

    def fail(entries, extra, cfg, out, *args):
        (out / "model.safetensors").write_text("half")
        raise UserError("disk full")

    monkeypatch.setattr(export, "write_model_files", fail)
    before = snapshot(tmp_path)
    for out in (tmp_path / "out", tmp_path / "new" / "deeper" / "out"):
        code = export_main([str(ckpt), "--out", str(out), "--force"])
        assert_one_line_error(code, capsys.readouterr().err, "disk full")
    assert snapshot(tmp_path) == before  # the old export intact, no temporary folder, no new parent folders


def test_moep_export_force_replaces_only_an_earlier_export(tmp_path, capsys):
    """--force deletes the folder it replaces: a folder of other files (a project, a folder of runs) is refused."""
    ckpt = make_run(tmp_path / "run")
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    for layout_args in ([], ["--hf"]):
        code = export_main([str(ckpt), "--out", str(project), "--force", *layout_args])
        assert_one_line_error(code, capsys.readouterr().err, f"--out ('{project}') holds files but no earlier export "
                                                             "(model.safetensors, meta.json and a config): --force "
                                                             "replaces only an export; give an empty or new folder")
    assert snapshot(tmp_path) == before


def test_moep_export_tokenizer_missing_warns_damaged_refused(tmp_path, tokenizer_dir, capsys, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("moep_ds"), "propagate", True)  # a trainer in this process turns it off
    bare = make_run(tmp_path / "bare")
    with caplog.at_level(logging.WARNING, logger="moep_ds"):
        assert export_main([str(tmp_path / "bare"), "--out", str(tmp_path / "out")]) == 0
    assert f"checkpoint {bare} has no tokenizer.json: exporting without a tokenizer" in caplog.text
    assert not (tmp_path / "out" / "tokenizer.json").exists()

    ckpt = make_run(tmp_path / "run", tokenizer_dir)
    text = (ckpt / "tokenizer.json").read_text()
    (ckpt / "tokenizer.json").write_text(text[: len(text) // 2])  # truncated
    before = snapshot(tmp_path)
    for layout in ([], ["--hf"]):
        code = export_main([str(tmp_path / "run"), "--out", str(tmp_path / "new" / "out"), *layout])
        err = capsys.readouterr().err
        line = next(line for line in err.splitlines() if line.startswith("error:"))
        assert line.startswith(f"error: cannot load tokenizer {ckpt / 'tokenizer.json'}: EOF while parsing")
        assert_one_line_error(code, err, line.removeprefix("error: "))
    assert snapshot(tmp_path) == before
