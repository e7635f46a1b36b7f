"""Block types: dense, ffn_moe, msit, paths, ssm_moe."""
