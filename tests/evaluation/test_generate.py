"""generate(): sampling filters against naive references, and cached decoding against full recomputation for
every block type."""

import pytest
import torch

from moep_ds.errors import UserError
from moep_ds.evaluation.generate import filter_top_k, filter_top_p, generate, sample_next
from moep_ds.registry import BLOCKS

from eval_models import BLOCK_TYPES_COVERED, TINY_LAYERS, consolidated_export, tiny_model, truncated_model_dir


def test_every_block_type_is_covered():
    import moep_ds.components  # noqa: F401

    missing = set(BLOCKS.names()) - {"group"} - BLOCK_TYPES_COVERED
    assert not missing, f"add a tiny config for block type(s) {sorted(missing)} to tests/evaluation/eval_models.py"


def naive_top_k(row, k):
    keep = sorted(range(len(row)), key=lambda i: -row[i])[:k]
    kth = row[keep[-1]]
    return [x if x >= kth else float("-inf") for x in row]


def naive_top_p(row, p):
    probs = torch.tensor(row).softmax(-1).tolist()
    order = sorted(range(len(row)), key=lambda i: -row[i])
    keep, mass = set(), 0.0
    for i in order:
        keep.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return [x if i in keep else float("-inf") for i, x in enumerate(row)]


def test_filters_match_naive_references():
    torch.manual_seed(0)
    logits = torch.randn(5, 11, dtype=torch.float64)
    for k in (1, 3, 11):
        assert filter_top_k(logits, k).tolist() == [naive_top_k(r, k) for r in logits.tolist()]
    for p in (0.05, 0.5, 0.9, 1.0):
        assert filter_top_p(logits, p).tolist() == [naive_top_p(r, p) for r in logits.tolist()]


def test_sampling_is_greedy_at_zero_temperature_and_seeded_otherwise():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    assert torch.equal(sample_next(logits, temperature=0.0), logits.argmax(-1))
    draw = [sample_next(logits, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(draw[0], draw[1])
    top5 = logits.topk(5, dim=-1).indices
    many = torch.stack([sample_next(logits, temperature=2.0, top_k=5, generator=torch.Generator().manual_seed(s))
                        for s in range(50)], dim=1)
    assert all(set(many[b].tolist()) <= set(top5[b].tolist()) for b in range(4))
    assert len(set(many[0].tolist())) > 1  # it does sample


@pytest.mark.parametrize("name", sorted(TINY_LAYERS))
def test_greedy_generation_with_cache_equals_full_recompute(name):
    model, cfg = tiny_model(name)
    prompt = torch.randint(0, cfg.model.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    n = cfg.model.max_seq_len - 6  # up to the context limit (sliding windows, MSIT windows all wrap)
    cached = generate(model, prompt, n, use_cache=True)
    full = generate(model, prompt, n, use_cache=False)
    assert cached.shape == (2, cfg.model.max_seq_len)
    assert torch.equal(cached, full)
    # the cached step logits are the full forward's logits at every position, not just the same argmax
    with torch.no_grad():
        reference = model(cached).logits
        cache = model.new_cache()
        steps = [model(cached[:, :6], cache=cache).logits]
        steps += [model(cached[:, t:t + 1], cache=cache).logits for t in range(6, cached.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), reference, rtol=1e-5, atol=1e-5)


def test_generation_restores_training_mode_and_stops_at_eos():
    model, cfg = tiny_model("dense_llama_window")
    prompt = torch.randint(0, cfg.model.vocab_size, (1, 4), generator=torch.Generator().manual_seed(0))
    free = generate(model, prompt, 10)
    eos = int(free[0, 6])  # the third generated token
    model.train()
    stopped = generate(model, prompt, 10, eos_id=eos)
    assert model.training
    first = free[0, 4:].tolist().index(eos)
    assert stopped[0, 4:].tolist() == free[0, 4:5 + first].tolist()


def test_generation_refuses_to_run_past_max_seq_len():
    model, cfg = tiny_model("dense_gpt2")  # learned positions: a hard limit
    with pytest.raises(ValueError, match=r"prompt \(40 tokens\) \+ max_new_tokens \(9\) exceeds max_seq_len \(48\)"):
        generate(model, torch.zeros(1, 40, dtype=torch.long), 9)


def test_moep_generate_cli(tmp_path, capsys):
    from moep_ds.data.builtin import generate_corpus
    from moep_ds.data.config import TokenizerConfig
    from moep_ds.data.tokenizer import train_tokenizer
    from moep_ds.cli.generate import main as generate_main
    from moep_ds.checkpointing.model_dir import save_model_dir

    tok = train_tokenizer(generate_corpus(20_000).split("\n\n"), TokenizerConfig(vocab_size=300), tmp_path / "tok")
    model, cfg = tiny_model("ssm_moe", vocab_size=tok.vocab_size)
    ckpt = save_model_dir(model, cfg, tmp_path / "m", tokenizer_dir=tmp_path / "tok")
    args = [str(ckpt), "--prompt", "The cat", "--max_new_tokens", "12", "--seed", "3", "--num_samples", "2"]
    assert generate_main(args) == 0
    first = capsys.readouterr().out.splitlines()
    assert generate_main(args) == 0
    assert capsys.readouterr().out.splitlines() == first  # seeded
    assert len(first) >= 2 and first[0].startswith("The cat")
    assert generate_main(args + ["--temperature", "0"]) == 0
    prompt = [tok.eot_id] + tok.encode("The cat")
    greedy = generate(model, torch.tensor([prompt]), 12, eos_id=tok.eot_id)[0, len(prompt):].tolist()
    greedy = greedy[: greedy.index(tok.eot_id)] if tok.eot_id in greedy else greedy
    assert capsys.readouterr().out.split("\n")[0] == "The cat" + tok.decode(greedy)
    for extra, message in [(["--top_p", "1.5"], "--top_p (1.5) must be in (0, 1]")]:  # past the context: below
        assert generate_main([str(ckpt)] + extra) == 2
        assert capsys.readouterr().err == f"error: {message}\n"
    bare = save_model_dir(model, cfg, tmp_path / "bare")
    assert generate_main([str(bare)]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err


def files_under(root):
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


@pytest.mark.parametrize("extra, message", [
    (["--num_samples", "0"], "--num_samples (0) must be >= 1"),
    (["--num_samples", "-1"], "--num_samples (-1) must be >= 1"),
    (["--device", "gpu0"], "--device ('gpu0') is not a torch device (e.g. cpu, cuda, cuda:1)"),
    (["--temperature", "nan"], "--temperature (nan) must be a finite number >= 0"),
    (["--temperature", "-1"], "--temperature (-1.0) must be a finite number >= 0"),
    # argv bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape); tokenizers raised TypeError
    (["--prompt", b"\xff\xfe bad".decode("utf-8", "surrogateescape")],
     "--prompt (b'\\xff\\xfe bad') is not UTF-8 text"),
])
def test_moep_generate_refuses_bad_arguments_before_loading(tmp_path, capsys, monkeypatch, extra, message):
    import moep_ds.cli.generate as generate_cli
    from moep_ds.checkpointing.model_dir import save_model_dir

    model, cfg = tiny_model("dense_gpt2")
    ckpt = save_model_dir(model, cfg, tmp_path / "m")
    before = files_under(tmp_path)
    monkeypatch.setattr(generate_cli, "load_eval_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert generate_cli.main([str(ckpt), "--prompt", "x", "--max_new_tokens", "5", *extra]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert files_under(tmp_path) == before


def test_the_default_device_is_the_gpu_when_there_is_one(monkeypatch, caplog):
    from moep_ds.evaluation.generate import pick_device

    for available, default in ((True, "cuda"), (False, "cpu")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        assert pick_device(None) == torch.device(default) and pick_device("cpu") == torch.device("cpu")
    assert pick_device("cuda:1") == torch.device("cpu")  # still without a GPU: falls back, with a warning
    assert "device cuda:1 requested but CUDA is not available: evaluating on cpu" in caplog.text
    with pytest.raises(UserError, match=r"^--device \('cuda:x'\) is not a torch device"):
        pick_device("cuda:x")  # malformed: refused, not taken for a cuda device to fall back from


@pytest.mark.parametrize("damage", [truncated_model_dir, consolidated_export])
def test_moep_generate_names_a_damaged_model_directory(tmp_path, capsys, damage):
    """A damaged checkpoint and a consolidated directory are one line each; nothing is written."""
    from moep_ds.cli.generate import main as generate_main

    ckpt, message = damage(tmp_path)
    before = files_under(tmp_path)
    assert generate_main([str(ckpt), "--prompt", "x", "--max_new_tokens", "5"]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert files_under(tmp_path) == before


def test_moep_generate_slides_past_the_context_and_prints_what_it_continued(tmp_path, capsys, caplog):
    """The defaults (64 new tokens) on a model of max_seq_len 48: before, "--max_new_tokens (64) must be <
    max_seq_len"; and with fewer, the prompt was cut to fit but printed whole."""
    from moep_ds.checkpointing.model_dir import save_model_dir
    from moep_ds.data.builtin import generate_corpus
    from moep_ds.data.config import TokenizerConfig
    from moep_ds.data.tokenizer import train_tokenizer
    from moep_ds.cli.generate import main as generate_main
    from moep_ds.evaluation.generate import generate_sliding

    tok = train_tokenizer(generate_corpus(20_000).split("\n\n"), TokenizerConfig(vocab_size=300), tmp_path / "tok")
    model, cfg = tiny_model("ssm_moe", vocab_size=tok.vocab_size)
    ckpt = save_model_dir(model, cfg, tmp_path / "m", tokenizer_dir=tmp_path / "tok")
    assert generate_main([str(ckpt), "--prompt", "the dog"]) == 0
    assert capsys.readouterr().out.startswith("the dog")
    max_len, keep = cfg.model.max_seq_len, cfg.model.max_seq_len // 2
    prompt = torch.tensor([[tok.eot_id] + tok.encode("the dog")])
    out = generate_sliding(model, prompt, 100)  # greedy, no eos
    assert out.shape == (1, prompt.shape[1] + 100)
    assert torch.equal(out[:, :max_len], generate(model, prompt, max_len - prompt.shape[1]))
    # then from the newest half of the context, cache rebuilt
    assert torch.equal(out[:, max_len:max_len + keep], generate(model, out[:, max_len - keep:max_len], keep)[:, keep:])
    # a prompt longer than the context: what is printed of it is what the model continued
    long_prompt = " ".join(["the cat sees the dog ."] * 30)
    assert len(tok.encode(long_prompt)) > max_len
    assert generate_main([str(ckpt), "--prompt", long_prompt, "--temperature", "0", "--max_new_tokens", "5"]) == 0
    seen = ([tok.eot_id] + tok.encode(long_prompt))[-keep:]
    printed = capsys.readouterr().out.split("\n")[0]
    assert printed.startswith("..." + tok.decode(seen)) and not printed.startswith("the cat")
    assert "continuing its last 24 tokens" in caplog.text
