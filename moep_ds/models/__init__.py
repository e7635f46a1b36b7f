"""CausalLM, parameter/FLOP accounting, and the evaluation rule each router follows (eval_modes.py)."""
