"""Hugging Face `AutoModelForCausalLM` wrapper of an exported moep_ds CausalLM.

# B batch, T tokens, V vocabulary

Written into the export directory by `moep-export --hf`; the model code itself is the `moep_ds_*.py` files
beside this one (flat copies of moep_ds, imported relatively), so loading needs torch and transformers only:

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

Padding: the moep_ds model takes no attention mask. Rows whose `attention_mask` has zeros (left or right
padding) are run one at a time on their unmasked tokens, so a padded batch scores exactly as its rows alone.
`generate()` recomputes the whole sequence at each step (the moep_ds decoding cache is not a transformers
Cache); use `moep-generate` for cached decoding.
"""
import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_moep import MoepConfig
from .moep_ds_components import REGISTERED  # noqa: F401 - fills the block/router/... registries
from .moep_ds_models_causal_lm import CausalLM
from .moep_ds_models_config import ModelConfig
from .moep_ds_schema import parse


class MoepForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MoepConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _tied_weights_keys = {"model.head.weight": "model.embed.weight"}  # applied when config.tie_word_embeddings
    _no_split_modules = []
    _supports_cache_class = False

    def __init__(self, config: MoepConfig):
        super().__init__(config)
        self.model = CausalLM(parse(ModelConfig, config.moep_model, "model"))
        self.post_init()

    def _init_weights(self, module) -> None:
        pass  # every weight comes from model.safetensors; CausalLM initialises its own when built from scratch

    def state_dict(self, *args, **kwargs):
        """Tensors only: transformers treats every state-dict entry as a tensor, and the non-tensor extra
        state (the expert lifecycle's event log) is training history that inference does not need."""
        state = super().state_dict(*args, **kwargs)
        for key in [k for k, v in state.items() if not isinstance(v, torch.Tensor)]:
            del state[key]
        return state

    def get_input_embeddings(self):
        return self.model.embed

    def get_output_embeddings(self):
        return self.model.head

    def forward(self, input_ids=None, attention_mask=None, labels=None, return_dict=None, **unused):
        """input_ids [B, T] -> logits [B, T, V]; labels [B, T] as transformers' causal LMs take them (the
        model shifts them), -100 to skip. Padded positions get zero logits."""
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            logits = self.forward_rows(input_ids, attention_mask.bool())
        else:
            logits = self.model(input_ids).logits
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def forward_rows(self, input_ids: torch.Tensor, keep_BT: torch.Tensor) -> torch.Tensor:
        logits = None
        for b in range(input_ids.shape[0]):
            row = self.model(input_ids[b, keep_BT[b]][None]).logits[0]
            if logits is None:
                logits = row.new_zeros(*input_ids.shape, row.shape[-1])
            logits[b, keep_BT[b]] = row
        return logits

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **unused):
        return {"input_ids": input_ids, "attention_mask": attention_mask}
