"""Hugging Face config of an exported moep_ds model: the recipe's `model` section, kept as a dict.

Written into the export directory by `moep-export --hf`; `vocab_size`, `hidden_size`, `num_hidden_layers`
and `max_position_embeddings` are copies for tools that read them (lm-eval takes its max length from the
last one).
"""
from transformers import PretrainedConfig


class MoepConfig(PretrainedConfig):
    model_type = "moep"

    def __init__(
        self,
        moep_model: dict | None = None,
        vocab_size: int | None = None,
        hidden_size: int | None = None,
        num_hidden_layers: int | None = None,
        max_position_embeddings: int | None = None,
        **kwargs,
    ):
        self.moep_model = moep_model or {}
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kwargs)
