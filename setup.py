"""moep_ds: pre-training sparse Mixture-of-Experts language models under DeepSpeed.

torch is pinned to the CPU wheel this project is developed and tested with; GPU users install their own
build and override the pin, e.g. `MOEP_TORCH_SPEC="torch>=2.4" pip install -e .`.
"""
import os

from setuptools import find_packages, setup

TORCH = os.environ.get("MOEP_TORCH_SPEC", "torch==2.13.0")

setup(
    name="moep_ds",
    version="0.1.0",
    description="Pre-training framework for sparse Mixture-of-Experts language models under DeepSpeed",
    packages=find_packages(include=["moep_ds", "moep_ds.*"]),
    python_requires=">=3.10",
    install_requires=[
        TORCH,
        "deepspeed>=0.19,<0.20",  # the range tested (distributed/deepspeed_adapter.py: the internals read)
        "tokenizers>=0.19",
        "datasets>=2.19",
        "sentencepiece",
        "tensorboard",
        "pyyaml",
        "lm-eval>=0.4.3",
        "transformers>=4.40",
        "tqdm",
        "matplotlib",
        "safetensors",
        "accelerate",  # lm-eval's `--model hf` imports it
        "filelock",
        "numpy",
        "xxhash",  # checkpoint checksums (checkpointing/manifest.py); datasets needs it too
        "psutil",  # the trainer watches its launcher processes
    ],
    extras_require={"test": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3.5", "import-linter>=2.1", "mpi4py>=4"]},
    entry_points={
        "console_scripts": [
            "moep-pretrain = moep_ds.cli.pretrain:main",
            "moep-prepare = moep_ds.cli.prepare:main",
            "moep-eval = moep_ds.cli.eval:main",
            "moep-export = moep_ds.cli.export:main",
            "moep-generate = moep_ds.cli.generate:main",
            "moep-analyze = moep_ds.cli.analyze:main",
            "moep-import = moep_ds.cli.import_model:main",
            "moep-convert = moep_ds.cli.convert:main",
            "moep-plan = moep_ds.cli.plan:main",
        ]
    },
    package_data={"moep_ds.evaluation": ["hf_template/*.py"]},
)
