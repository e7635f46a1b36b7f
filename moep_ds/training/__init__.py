"""Training under DeepSpeed: the only package that imports deepspeed (lazily, inside its modules)."""
