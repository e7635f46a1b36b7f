"""Layers: norms, RoPE, attention (causal, GQA, sliding window, routed-subset), FFNs, SSM."""
