"""CausalLM and parameter/FLOP accounting."""
