"""Training under DeepSpeed: the loop (trainer.py), its parts (assemble.py, train_module.py, checkpoint.py) and
callbacks (callbacks/). DeepSpeed itself is reached through distributed/ only (distributed/engine.py)."""
