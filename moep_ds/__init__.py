"""moep_ds: pre-training sparse Mixture-of-Experts language models under DeepSpeed."""
from moep_ds.config import Config, load_config
from moep_ds.models.causal_lm import CausalLM, CausalLMOutput, build_model

__all__ = ["Config", "CausalLM", "CausalLMOutput", "build_model", "load_config"]
__version__ = "0.1.0"
