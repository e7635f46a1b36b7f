"""lm-eval's own command line with the `moep_ds` model registered (lm-eval has no plugin lookup for --model).

    python -m moep_ds.evaluation.lm_eval_cli --model moep_ds --model_args pretrained=runs/x --batch_size 16 \
        --tasks blimp_filtered --include_path "$(moep-eval --render_tasks /tmp/moep_tasks)"

Under `torchrun -m` or `deepspeed --module` the model is split over the ranks (evaluation/partitioned.py) and
lm-eval writes its results once.
"""
import sys

import moep_ds.evaluation.harness  # noqa: F401 - registers the model under the name moep_ds


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    from moep_ds.evaluation.partitioned import close_process_group

    sys.argv = [a for a in sys.argv if not a.startswith("--local_rank")]  # the deepspeed launcher's; lm-eval has none
    cli_evaluate()
    close_process_group(finished=True)


if __name__ == "__main__":
    main()
