import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from moep_ds import build_model, load_config
from moep_ds.config import config_from_dict
from moep_ds.models.accounting import count_params, meta_param_report

from repo_paths import CONFIGS, REPO

RECIPES = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
FLAVOURS = ["gpt2", "llama", "gemma", "pythia"]


def tiny(flavour: str, **model):
    raw = {"model": {"flavour": flavour, "vocab_size": 64, "d_model": 32, "max_seq_len": 32,
                     "layers": [{"type": "dense", "repeat": 2, "attention": {"num_heads": 4, "num_kv_heads": 2}}],
                     **model}}
    return config_from_dict(raw).model


def small_enough(recipe: str):
    """The recipe itself if it is small; otherwise the same architecture with one layer per entry, short paths and a
    small vocabulary (the 1B recipes), so causality is still checked on every recipe's block types."""
    cfg = load_config(CONFIGS / f"{recipe}.yaml")
    if meta_param_report(cfg.model).params_total <= 60_000_000:
        return cfg.model
    shrink = ["model.vocab_size=512", *shrunk_layers(cfg.model.layers, "model.layers")]
    return load_config(CONFIGS / f"{recipe}.yaml", shrink).model


def shrunk_layers(layers: list, path: str) -> list[str]:
    """Overrides: every entry (and the entries of a group) once, narrow FFNs and experts (the full-size MoE
    recipes), MoEP paths of 2 layers with narrow FFNs (the 1B paths recipe: 810M parameters else)."""
    out = []
    for i, layer in enumerate(layers):
        at = f"{path}[{i}]"
        out.append(f"{at}.repeat=1")
        if layer.type == "group":
            out += shrunk_layers(layer.layers, f"{at}.layers")
        if layer.type == "dense":
            out.append(f"{at}.ffn.hidden_size=16")
        if layer.type == "ffn_moe":
            out.append(f"{at}.moe.expert.hidden_size=16")
            if layer.moe.shared_expert is not None:
                out.append(f"{at}.moe.shared_expert.hidden_size=16")
        if layer.type == "paths":
            out += [f"{at}.path_depth=2", f"{at}.path_ffn.hidden_size=16"]
    return out


def test_exact_parameter_counts_on_meta_device():
    nova = meta_param_report(load_config(CONFIGS / "nova_dense.yaml").model)
    assert nova.params_total == 34_513_408 == nova.params_active
    pythia_cfg = load_config(CONFIGS / "pythia_1b_dense.yaml").model
    with torch.device("meta"):
        pythia = build_model(pythia_cfg)
    assert all(p.is_meta for p in pythia.parameters())
    report = count_params(pythia)
    assert report.params_total == 1_011_781_632
    assert report.params_non_embedding == 805_736_448  # embed_in and embed_out excluded, as Pythia reports
    for recipe, expected in [("gpt2_small", 27_566_080), ("llama_small", 27_294_208), ("gemma_small", 27_294_208)]:
        assert meta_param_report(load_config(CONFIGS / f"{recipe}.yaml").model).params_total == expected


def test_init_scales_every_residual_output_projection_in_every_block_type():
    """GPT-2 init over dense, FFN-MoE and MoEP-paths blocks: every matrix (routers, stacked experts and paths
    included) is Normal(0, 0.02); the outputs added to the residual stream (attention w_o, FFN w2, expert w2,
    path layers' w_o / w2, the expansion experts) get 0.02 / sqrt(2 x blocks); norms start at 1."""
    raw = {"model": {"flavour": "llama", "vocab_size": 256, "d_model": 128, "max_seq_len": 16, "layers": [
        {"type": "dense", "attention": {"num_heads": 4}},
        {"type": "ffn_moe", "attention": {"num_heads": 4},
         "moe": {"num_experts": 4, "expert": {"hidden_size": 256}, "router": {"type": "topk", "k": 2}}},
        {"type": "paths", "attention": {"num_heads": 4}, "d_path": 64, "num_paths": 2, "num_projection_experts": 2}]}}
    torch.manual_seed(0)
    model = build_model(config_from_dict(raw).model)
    residual_outputs = ("w_o.weight", "w2.weight", "w2_EFD", "expand.w_EOI")
    std, out_std = 0.02, 0.02 / 6**0.5
    checked = set()
    for name, p in model.named_parameters():
        p = p.detach()
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        expected = out_std if name.endswith(residual_outputs) else std
        assert float(p.std()) == pytest.approx(expected, rel=0.1), name
        assert abs(float(p.mean())) < 5 * expected / p.numel() ** 0.5, name  # zero mean, within 5 sigma
        checked.add(name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1])
    assert {"router", "contract_router", "w2_EFD", "w_EOI", "w2", "w_o"} <= checked


def test_dry_run_prints_one_json_line_for_1b_recipe():
    proc = subprocess.run([sys.executable, "pretrain.py", "--config", "configs/pythia_1b_dense.yaml", "--dry_run"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert set(report) == {"params_total", "params_non_embedding", "params_active", "flops_per_token"}
    assert report["params_total"] == 1_011_781_632
    # 6N for the matmuls (embedding lookup excluded, untied head included) + 12 * L * H * Dh * T attention
    matmul = 1_011_781_632 - 50304 * 2048
    assert report["flops_per_token"] == 6 * matmul + 12 * 16 * 2048 * 2048


def test_flops_of_a_tied_head_count_the_head_matmul():
    """Tied embeddings: the lookup is free but the LM head (the same table) is a [D, V] matmul per token."""
    report = count_params(build_model(tiny("llama")))  # tied: the embedding is counted once in params_total
    attention = 2 * 12 * 4 * 8 * 32  # 2 layers, 12 H Dh T with T = max_seq_len
    lookup = head = 64 * 32  # the one table: subtract the lookup, add the head matmul
    assert report.flops_per_token == 6 * (report.params_total - lookup + head) + attention


def test_flavours_fill_in_their_architecture():
    """gpt2: LayerNorm, tanh-GELU MLP with biases, learned positions; llama: RMSNorm, SwiGLU, RoPE; gemma: (1+w)
    RMSNorm of eps 1e-6, GeGLU, RoPE, embeddings x sqrt(d); pythia: parallel residual, 25% rotary, tanh-GELU,
    untied; norms' eps 1e-5 but Gemma's."""
    from moep_ds.layers.ffn import GeGLU, GeluTanhMLP, SwiGLU
    from moep_ds.layers.norm import GemmaRMSNorm, LayerNorm, RMSNorm

    expected = {  # norm, ffn, rotary share of the head dim (8), learned positions, tied, embedding scale, parallel
        "gpt2": (LayerNorm, GeluTanhMLP, 0, True, True, False, False),
        "llama": (RMSNorm, SwiGLU, 8, False, True, False, False),
        "gemma": (GemmaRMSNorm, GeGLU, 8, False, True, True, False),
        "pythia": (LayerNorm, GeluTanhMLP, 2, False, False, False, True),
    }
    for flavour, (norm, ffn, rot, learned, tied, scale, parallel) in expected.items():
        model = build_model(tiny(flavour))
        block = model.blocks[0]
        assert type(block.attention.norm) is norm and type(model.norm) is norm, flavour
        assert type(block.ffn) is ffn and block.attention.attn.rot_dim == rot, flavour
        assert (model.pos_embed is not None, model.head.weight is model.embed.weight) == (learned, tied), flavour
        assert (model.cfg.embedding_scale, block.parallel_residual) == (scale, parallel), flavour
        eps = 1e-6 if flavour == "gemma" else 1e-5
        assert block.attention.norm.eps == model.norm.eps == block.ffn_norm.eps == eps, flavour
        if flavour in ("gpt2", "pythia"):
            assert block.ffn.w_in.bias is not None and block.attention.attn.w_qkv.bias is not None, flavour


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_is_causal(recipe):
    torch.manual_seed(0)
    model = build_model(small_enough(recipe)).eval()
    vocab = model.cfg.vocab_size
    ids = torch.randint(0, vocab - 1, (2, 12))
    changed = ids.clone()
    changed[0, 7] = (ids[0, 7] + 1) % (vocab - 1)
    changed[1, 3] = (ids[1, 3] + 1) % (vocab - 1)
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[0, :7], b[0, :7], rtol=0, atol=1e-5)
    torch.testing.assert_close(a[1, :3], b[1, :3], rtol=0, atol=1e-5)
    assert not torch.allclose(a[0, 7:], b[0, 7:])


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_kv_cache_decoding_equals_full_forward(flavour):
    torch.manual_seed(0)
    model = build_model(tiny(flavour)).double().eval()
    ids = torch.randint(0, 64, (2, 11))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        steps = [model(ids[:, :5], cache=cache).logits]
        steps += [model(ids[:, t:t + 1], cache=cache).logits for t in range(5, 11)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


def test_sliding_window_kv_cache():
    torch.manual_seed(0)
    cfg = config_from_dict({"model": {"flavour": "llama", "vocab_size": 64, "d_model": 32, "max_seq_len": 32,
                                      "layers": [{"type": "dense", "repeat": 2,
                                                  "attention": {"num_heads": 4, "window": 3}}]}}).model
    model = build_model(cfg).double().eval()
    ids = torch.randint(0, 64, (1, 10))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        steps = [model(ids[:, t:t + 1], cache=cache).logits for t in range(10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


def test_tied_embeddings_share_storage_and_untied_do_not():
    tied = build_model(tiny("llama"))
    assert tied.head.weight is tied.embed.weight
    assert tied.head.weight.data_ptr() == tied.embed.weight.data_ptr()
    untied = build_model(tiny("pythia"))
    assert untied.head.weight.data_ptr() != untied.embed.weight.data_ptr()


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_forward_output_and_loss(flavour):
    torch.manual_seed(0)
    model = build_model(tiny(flavour))
    ids = torch.randint(0, 64, (3, 9))
    labels = torch.randint(0, 64, (3, 9))
    labels[0, :4] = -100
    out = model(ids, labels=labels)
    assert out.logits.shape == (3, 9, 64)
    keep = labels != -100
    expected = F.cross_entropy(out.logits[keep].float(), labels[keep])
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(out.ce_loss, expected)
    assert out.aux_losses == {} and out.stats == {}
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_gemma_scales_embeddings_pythia_uses_parallel_residual_and_llama_sequential():
    gemma = build_model(tiny("gemma"))
    ids = torch.randint(0, 64, (1, 4))
    pos = torch.arange(4)[None]
    torch.testing.assert_close(gemma.embed_tokens(ids, pos), gemma.embed(ids) * 32**0.5)
    pythia = build_model(tiny("pythia"))
    block = pythia.blocks[0]
    x = torch.randn(1, 4, 32)
    expected = x + block.attention(x, pos, None) + block.ffn(block.ffn_norm(x))
    torch.testing.assert_close(block(x, positions_BT=pos).x, expected)
    llama = build_model(tiny("llama")).blocks[0]  # sequential: the FFN reads the attention's output
    h = x + llama.attention(x, pos, None)
    torch.testing.assert_close(llama(x, positions_BT=pos).x, h + llama.ffn(llama.ffn_norm(h)))
