"""Evaluation: lm-eval LM wrapper, Hugging Face export, reports."""
