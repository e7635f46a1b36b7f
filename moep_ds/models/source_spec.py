"""The form of a weights source a recipe names (`model.init_from: hf:REPO[@REVISION]`): parsed here, where the
model's config checks it; resolving it to a folder is interop/hub.py's.
"""
from __future__ import annotations

import re

from moep_ds.errors import UserError

HUB = "hf:"
STEP_REVISION = re.compile(r"step(\d+)")
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def split_hub_spec(spec: str) -> tuple[str, str]:
    """(repo id, revision) of `hf:REPO[@REVISION]`; one line naming the spec when it is malformed."""
    body = spec[len(HUB):]
    repo_id, _, revision = body.partition("@")
    if not REPO_ID.fullmatch(repo_id) or ("@" in body and not revision):
        raise UserError(f"{spec!r} is not hf:ORG/NAME[@REVISION] (e.g. hf:EleutherAI/pythia-1b@step13000)")
    return repo_id, revision or "main"


def revision_step(spec: str | None) -> int | None:
    """N of a source at revision `stepN` (hf:EleutherAI/pythia-1b@step13000 -> 13000), else None."""
    if not spec or not spec.startswith(HUB) or "@" not in spec:
        return None
    match = STEP_REVISION.fullmatch(spec.rpartition("@")[2])
    return int(match.group(1)) if match else None
