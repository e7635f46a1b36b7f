"""Weights in and out: Hugging Face import (and the native export), sparse upcycling, `model.init_from`.

    hub.py          SRC: a folder or hf:REPO[@REVISION], resolved through huggingface_hub's cache
    adapter.py      the protocol every Hugging Face family speaks (Family: recipe, to_hf, rules, ignored, check,
                    hf_config, differences; Inexpressible)
    families/       one module per family (<model_type>.py, listed in FAMILY_MODULES), its ADAPTER found by
                    config.json's model_type (family_of)
    rules.py        weight rules: one of our tensors from a checkpoint's tensors, and back
    hf_layout.py    what the dense families share: Spec, the Expected table's check and recipe, DenseFamily
    moe_layout.py   what the MoE families share: the recipe's sections, tensor rules, config.json keys, MoEFamily
    compare.py      two models compared setting by setting: a source against the recipe (moep-import), a model
                    against its family (the native export)
    hf_weights.py   a Hugging Face folder's tensors under our names, streamed (safetensors / .bin, sharded or not)
    upcycle.py      a dense model's weights as an FFN-MoE's (experts copied, routers from the recipe's seed)
    sources.py      source_weights: the one implementation behind moep-import and model.init_from
    weights.py      Weight, and filling what a process holds (its experts, its ZeRO-3 partitions) from weights
    importer.py     what moep-import (moep_ds/cli/import_model.py) writes: a checkpoint of the run-directory format,
                    model only, at step 0 or the revision's
    export_native.py  moep-export --hf --native: a model, dense or MoE, in its family's own transformers format
"""
