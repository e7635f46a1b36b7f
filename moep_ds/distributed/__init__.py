"""The floor both training and evaluation stand on: process groups, the launcher / MPI environment, rank agreement,
expert-parallel groups, ZeRO-3 construction and splitting a model for inference.

DeepSpeed is imported here (lazily, inside functions) only where no alternative exists: ZeRO-3 construction
(`deepspeed.zero.Init`), DeepSpeed's expert-parallel groups and MoE marks, and the ZeRO-3 inference engine.
What it relies on beyond DeepSpeed's public API is in one module, `deepspeed_adapter.py`, with the list."""
