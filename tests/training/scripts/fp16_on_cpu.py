"""pretrain.py with DeepSpeed's CPU accelerator told that fp16 is supported (a test-only override).

DeepSpeed refuses fp16 on its CPU accelerator; the arithmetic itself runs, so this exercises our fp16 path
(dynamic loss scaling, skipped steps, scaler state in checkpoints) on machines without a GPU.
"""
from deepspeed.accelerator import get_accelerator

from moep_ds.cli.pretrain import main as pretrain_main

accelerator = get_accelerator()
accelerator.is_fp16_supported = lambda: True
accelerator.supported_dtypes = lambda: [__import__("torch").float32, __import__("torch").float16,
                                        __import__("torch").bfloat16]

if __name__ == "__main__":
    raise SystemExit(pretrain_main())
