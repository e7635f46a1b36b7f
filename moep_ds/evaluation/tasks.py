"""lm-eval task YAMLs for local data: templates in `eval/tasks/` rendered against a data directory.

Rendering (lm-eval resolves `data_files` against the working directory, so paths are made absolute):
  eval/tasks/<family>/*.yaml      ${DATA_DIR} replaced by the absolute data directory; ${SUBTASKS} by the
                                  list of the family's sub-task names (for group YAMLs)
  eval/tasks/<family>/_each.yaml  rendered once per line of subtasks.txt as <family>_<line>.yaml
  eval/tasks/<family>/*.py        copied (helpers named by `!function` in the YAMLs)
  ${TASK_DIR}                     the family's rendered folder, where generated data goes: `grammar_pairs`
                                  writes the embedded grammar's minimal pairs there (GENERATED_DATA)
The rendered folder is what `--include_path` takes, with our `moep_ds` model or with `--model hf`.

Data directory: --data_dir, else the recipe's eval.data_dir, else $MOEP_DATA_DIR, else ../shared/data beside
the checkout.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import string
from pathlib import Path

import yaml

from moep_ds.data.builtin import pairs_per_phenomenon
from moep_ds.errors import SharedUserError, UserError

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "eval" / "tasks"
DEFAULT_DATA_DIR = REPO.parent / "shared" / "data"
# our task names -> lm-eval's built-in (hub) tasks, for `--hub` when the datasets can be downloaded
HUB_TASKS = {
    "blimp_filtered": "blimp",  # the hub has the full (unfiltered) BLiMP only
    "lambada_openai": "lambada_openai",
    "piqa": "piqa",
    "arc_easy": "arc_easy",
    "arc_challenge": "arc_challenge",
    "logiqa": "logiqa",
    "wsc": "wsc",
    "winogrande": "winogrande",
    "sciq": "sciq",
}
GRAMMAR_PAIRS = 1000  # pairs per phenomenon, as in BLiMP
GRAMMAR_PAIRS_SEED = 0


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    name: str
    subtasks: tuple[str, ...] = ()  # a group's member tasks
    data_files: tuple[Path, ...] = ()  # a leaf task's files


@dataclasses.dataclass
class RenderedTasks:
    """A folder of rendered task YAMLs (pass to --include_path) and what each name needs."""

    path: Path
    data_dir: Path
    specs: dict[str, TaskSpec]

    @property
    def top_level(self) -> list[str]:
        """Groups and the tasks that belong to no group: the names worth listing."""
        members = {s for spec in self.specs.values() for s in spec.subtasks}
        return sorted(n for n in self.specs if n not in members)

    def resolve(self, names: list[str]) -> list[str]:
        """Check each name is known and its data files exist; unknown names list the known ones."""
        for name in names:
            if name not in self.specs:
                raise SharedUserError(
                    f"unknown task {name!r}; known: {', '.join(self.top_level)} "
                    f"(and their sub-tasks, e.g. blimp_filtered_anaphor_gender_agreement)"
                )
            for f in self.data_files(name):
                if not f.is_file() and not self.data_dir.is_dir():
                    raise UserError(f"data directory {str(self.data_dir)!r} does not exist (set --data_dir, "
                                    f"eval.data_dir or MOEP_DATA_DIR); task {name!r} reads {f}")
                if not f.is_file():
                    raise UserError(f"task {name!r} needs {f}, which does not exist (data directory {self.data_dir})")
        return names

    def data_files(self, name: str) -> list[Path]:
        spec = self.specs[name]
        return list(spec.data_files) + [f for sub in spec.subtasks for f in self.data_files(sub)]


def resolve_data_dir(data_dir: str | os.PathLike | None = None, must_exist: bool = True) -> Path:
    """--data_dir / recipe value, else $MOEP_DATA_DIR, else ../shared/data beside the checkout. Tasks with
    generated data (grammar_pairs) run without one: `must_exist=False` leaves the check to `resolve`."""
    chosen = data_dir or os.environ.get("MOEP_DATA_DIR") or DEFAULT_DATA_DIR
    path = Path(chosen).expanduser().resolve()
    if must_exist and not path.is_dir():
        raise UserError(f"data directory {str(path)!r} does not exist (set --data_dir, eval.data_dir or MOEP_DATA_DIR)")
    return path


def render_tasks(data_dir: str | os.PathLike, out_dir: str | os.PathLike, templates: Path = TEMPLATES) -> RenderedTasks:
    """Render every template family into `out_dir` (created or refreshed) for the data in `data_dir`."""
    data_dir, out = Path(data_dir).resolve(), Path(out_dir)
    if not templates.is_dir():
        raise UserError(f"task templates not found at {templates} (eval/tasks of the moep_ds checkout)")
    specs: dict[str, TaskSpec] = {}
    for family in sorted(p for p in templates.iterdir() if p.is_dir()):
        dest = out / family.name
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        specs.update(render_family(family, dest, data_dir))
    return RenderedTasks(out, data_dir, specs)


@functools.lru_cache(maxsize=2)
def grammar_pairs_jsonl(num_pairs: int = GRAMMAR_PAIRS, seed: int = GRAMMAR_PAIRS_SEED) -> dict[str, str]:
    """Phenomenon -> JSON lines in BLiMP's fields (sentence_good, sentence_bad, UID, pair_id); a few seconds,
    so generated once per process."""
    return {name: "".join(json.dumps({"sentence_good": p["sentence_good"], "sentence_bad": p["sentence_bad"],
                                      "UID": name, "pair_id": i}) + "\n" for i, p in enumerate(pairs))
            for name, pairs in pairs_per_phenomenon(num_pairs, seed).items()}


def write_grammar_pairs(dest: Path) -> None:
    for name, text in grammar_pairs_jsonl().items():
        (dest / f"{name}.jsonl").write_text(text, encoding="utf-8")


# template family -> writes the data its YAMLs name under ${TASK_DIR}
GENERATED_DATA = {"grammar_pairs": write_grammar_pairs}


def render_family(family: Path, dest: Path, data_dir: Path) -> dict[str, TaskSpec]:
    if family.name in GENERATED_DATA:
        GENERATED_DATA[family.name](dest)
    dirs = {"DATA_DIR": data_dir, "TASK_DIR": dest.resolve()}
    names_file = family / "subtasks.txt"
    subtasks = names_file.read_text().split() if names_file.is_file() else []
    members = [f"{family.name}_{s}" for s in subtasks]
    member_list = "[" + ", ".join(members) + "]"
    outputs: list[tuple[str, str]] = []  # (file name, text)
    for template in sorted(family.glob("*.yaml")):
        text = template.read_text(encoding="utf-8")
        if template.name == "_each.yaml":
            outputs += [(f"{m}.yaml", fill(template, text, **dirs, SUBTASK=s))
                        for m, s in zip(members, subtasks)]
        else:
            outputs.append((template.name, fill(template, text, **dirs, SUBTASKS=member_list)))
    for helper in family.glob("*.py"):
        shutil.copyfile(helper, dest / helper.name)
    specs = {}
    for file_name, text in outputs:
        (dest / file_name).write_text(text, encoding="utf-8")
        spec = task_spec(yaml.load(text, Loader=_TaskLoader))  # noqa: S506 - a SafeLoader subclass
        specs[spec.name] = spec
    return specs


def fill(template: Path, text: str, **values: object) -> str:
    try:
        return string.Template(text).substitute({k: str(v) for k, v in values.items()})
    except (KeyError, ValueError) as err:
        raise UserError(f"task template {template} has an unknown placeholder: {err}") from None


class _TaskLoader(yaml.SafeLoader):
    """Reads lm-eval YAMLs without importing their `!function` helpers."""


_TaskLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def task_spec(cfg: dict) -> TaskSpec:
    if "group" in cfg:
        return TaskSpec(cfg["group"], subtasks=tuple(cfg["task"]))
    files = (cfg.get("dataset_kwargs") or {}).get("data_files") or {}
    return TaskSpec(cfg["task"], data_files=tuple(Path(f) for f in files.values()))


def local_task_manager(data_dir: str | os.PathLike | None, tasks: list[str], tmp: str | os.PathLike):
    """(lm-eval TaskManager over the local task YAMLs rendered into `tmp` for `data_dir` (default: $MOEP_DATA_DIR,
    ../shared/data), the data folder used): an unknown task or missing data fails here, naming it."""
    from lm_eval.tasks import TaskManager

    folder = resolve_data_dir(data_dir, must_exist=False)
    rendered = render_tasks(folder, tmp)
    rendered.resolve(tasks)
    return TaskManager(include_defaults=False, include_path=str(rendered.path)), folder

