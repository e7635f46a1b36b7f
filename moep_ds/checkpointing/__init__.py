"""The run-directory and checkpoint format, shared by training and evaluation.

    layout.py       run directories: "complete", "newest", atomic directories, umask modes, writable checks
    sharded.py      DCP state in true shapes from flat ranges (FlatShard), planners, damage checks
    model_state.py  a model's tensors under canonical names, expert-parallel offsets, load into a module
    model_dir.py    model directories (a sharded checkpoint + recipe + tokenizer) and their loaders
    convert.py      moep-convert: a consolidated checkpoint (model.safetensors) written once as a sharded one
"""
