"""Gemma (GemmaForCausalLM): Llama's layout (llama.py) with (1 + w) RMSNorm, GeGLU, embeddings x sqrt(D), a tied
head and head_dim 256 unless config.json says otherwise.

# D model dim
"""
from __future__ import annotations

from typing import Any

from moep_ds.interop.adapter import Raw
from moep_ds.interop.families.llama import Llama
from moep_ds.interop.hf_layout import Spec


class Gemma(Llama):
    model_type = "gemma"
    hf_class = "GemmaForCausalLM"
    norm = "gemma_rmsnorm"
    tied = True
    scaled = True
    activation_key = "hidden_activation"

    def activation_of(self, hf: Raw) -> tuple[Any, str]:
        # older Gemma configs leave hidden_activation null: transformers then uses the tanh GELU
        return hf.get("hidden_activation") or "gelu_pytorch_tanh", "hidden_activation"

    def default_head_dim(self, d: int, heads: int) -> int:
        return 256

    def extra_config(self, s: Spec) -> Raw:
        return {}  # GemmaConfig has no mlp_bias


ADAPTER = Gemma()
