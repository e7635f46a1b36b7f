"""Evaluation: lm-eval LM wrapper, Hugging Face export, generation, reports. The commands (moep-eval, moep-export, moep-generate, lm-eval under a launcher) are in moep_ds/cli/.

    (the model directory layout and its loaders are in moep_ds/checkpointing/, shared with training)
    harness.py     lm-eval model `moep_ds` (loglikelihood, loglikelihood_rolling, generate_until)
    partitioned.py under a launcher: the model split over the ranks (ZeRO-3 inference), none holding it whole
    tasks.py       eval/tasks/ YAML templates rendered against a data directory
    generate.py    generate() with the decoding cache (behind `moep-generate`)
    export.py      the exports behind `moep-export` (consolidated / Hugging Face), vendor.py copies the model code for the latter
    report.py      results tables and the run comparison behind eval/compare.py
"""
