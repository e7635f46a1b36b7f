"""Weights in and out: Hugging Face import (and the native export), sparse upcycling, `model.init_from`.

    hub.py          SRC: a folder or hf:REPO[@REVISION], resolved through huggingface_hub's cache
    hf_layout.py    the four dense architectures (GPT-2, Llama, Gemma, GPT-NeoX): config.json <-> recipe, names,
                    layouts
    moe_layout.py   the six MoE architectures (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2, DeepSeek-V3), the
                    same both ways
    compare.py      two models compared setting by setting: a source against the recipe (moep-import), a model
                    against its architecture (the native export)
    hf_weights.py   a Hugging Face folder's tensors under our names, streamed (safetensors / .bin, sharded or not)
    upcycle.py      a dense model's weights as an FFN-MoE's (experts copied, routers from the recipe's seed)
    sources.py      source_weights: the one implementation behind moep-import and model.init_from
    weights.py      Weight, and filling what a process holds (its experts, its ZeRO-3 partitions) from weights
    importer.py     what moep-import (moep_ds/cli/import_model.py) writes: a checkpoint of the run-directory format,
                    model only, at step 0 or the revision's
    export_native.py  moep-export --hf --native: a model, dense or MoE, in its architecture's own transformers format
"""
