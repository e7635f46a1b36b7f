"""Where imported weights come from: `SRC` of `moep-import SRC` and of `model.init_from: SRC`.

    SRC = FOLDER                  a Hugging Face model folder (config.json + weights), or a moep_ds run directory,
                                  checkpoint or model directory (a dense one to upcycle, or one of the same model)
    SRC = hf:REPO[@REVISION]      a hub repository at a branch, tag or commit (default `main`), e.g.
                                  hf:EleutherAI/pythia-1b@step13000, resolved by huggingface_hub: from its cache
                                  (HF_HUB_CACHE / HF_HOME) when offline (HF_HUB_OFFLINE=1), else downloaded once

A revision named `stepN` (Pythia's checkpoints) is the weights after N optimizer steps: `revision_step` gives N.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from moep_ds.errors import UserError, hub_error_reason
from moep_ds.fsutil import disk_full_reason
from moep_ds.models.source_spec import HUB, revision_step, split_hub_spec

WEIGHT_PATTERNS = ["config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
                   "pytorch_model.bin.index.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json"]


@dataclasses.dataclass(frozen=True)
class Source:
    """A resolved SRC: the local folder, and for a hub repository its id, revision and commit hash."""

    spec: str
    folder: Path
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None

    @property
    def step(self) -> int | None:
        return revision_step(self.spec)

    def describe(self) -> dict[str, object]:
        """What meta.json records about where the weights came from."""
        out: dict[str, object] = {"imported_from": self.spec}
        if self.repo_id is not None:
            out.update(hf_repo=self.repo_id, hf_revision=self.revision, hf_commit=self.commit)
        return out


def resolve(spec: str, what: str = "SRC") -> Source:
    """The local folder of `spec`; one line when it does not exist or the revision is not to be had."""
    if spec.startswith(HUB):
        return resolve_hub(spec, what)
    folder = Path(spec)
    if not folder.is_dir():
        raise UserError(f"{what} ({spec!r}) is not a folder (a Hugging Face model folder or moep_ds checkpoint) "
                        f"nor hf:REPO[@REVISION]")
    return Source(spec, folder)


def resolve_hub(spec: str, what: str) -> Source:
    """huggingface_hub's own resolution (refs/REVISION -> snapshots/HASH/), from its cache when offline."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    repo_id, revision = split_hub_spec(spec)
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=WEIGHT_PATTERNS,
                                        local_files_only=constants.HF_HUB_OFFLINE))
    except HFValidationError as err:
        raise UserError(f"{what} ({spec!r}): {first_line(err)}") from None
    except (OSError, ValueError) as err:  # not cached offline, no such repository or revision
        full = disk_full_reason(err, Path(constants.HF_HUB_CACHE))
        if full is not None:  # the download, not the revision
            raise UserError(f"{what} ({spec!r}): downloading {repo_id}@{revision} into the Hugging Face cache "
                            f"failed: {full}") from None
        if constants.HF_HUB_OFFLINE:  # huggingface_hub's advice (local_files_only=False) is for its Python API
            raise UserError(f"{what} ({spec!r}): revision {revision!r} of {repo_id} is not in the Hugging Face cache "
                            f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 forbids downloading it: run "
                            f"`hf download {repo_id} --revision {revision}` where the hub can be "
                            "reached (into this cache), or unset HF_HUB_OFFLINE") from None
        raise UserError(f"{what} ({spec!r}): revision {revision!r} of {repo_id} is not on the hub or in the cache "
                        f"({constants.HF_HUB_CACHE}): {hub_error_reason(err)}") from None
    return Source(spec, folder, repo_id, revision, folder.name)


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


__all__ = ["HUB", "Source", "resolve", "revision_step", "split_hub_spec"]
