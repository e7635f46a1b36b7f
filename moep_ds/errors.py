"""Error types for bad input: command-line entry points report them as one line and exit with status 2 (a training
run that failed on its own, `TrainingFailed`, with status 1); and the helpers those lines share when they describe
values read from files."""
from __future__ import annotations

import json
import re
from typing import Any


class UserError(Exception):
    """Bad input (config, data, checkpoint, command line) whose message names the field and the value."""


class SharedUserError(UserError):
    """A UserError that every rank of a distributed run raises alike: from what every rank is given (the command
    line, the recipe, the ds_config) or after the ranks agree on it. Rank 0 reports it; the others exit with the
    same status silently (a launch of N processes would print it N times)."""


def is_number(value: Any) -> bool:
    """A JSON number (bool is an int to Python, not to a JSON reader)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def json_error_reason(err: Exception, *, line: bool = True) -> str:
    """Why a text did not parse as JSON, as json words it (`line`: with the line number, for a whole file; a line
    of a JSON-lines file is already named by its caller); UnicodeDecodeError: the byte."""
    if isinstance(err, json.JSONDecodeError):
        return f"{err.msg}: line {err.lineno} column {err.colno}" if line else f"{err.msg}: column {err.colno}"
    return f"not UTF-8 at byte {err.start + 1}" if isinstance(err, UnicodeDecodeError) else str(err)


def hub_error_reason(err: BaseException) -> str:
    """huggingface_hub's first line without its advice to Python callers (`local_files_only=False`), which a
    command-line user cannot act on."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    sentences = [x for x in re.split(r"(?<=\.) ", first) if "local_files_only" not in x]
    return " ".join(sentences) or type(err).__name__


class TrainingFailed(Exception):
    """Training failed on input it had accepted (a non-finite loss or gradient norm), alike on every rank: the ranks
    agreed on it in a collective and stopped together. Rank 0 reports it in one line; the command exits with status 1,
    a failed run, as Megatron's NaN check ends one (an uncaught error), not 2 (bad input)."""


class ReportedElsewhere(UserError):
    """Another rank failed and reported why (one line); this rank exits with status 2 without a word, where it would
    otherwise end in a collective's traceback ("Connection closed by peer") once the failed rank is gone."""
