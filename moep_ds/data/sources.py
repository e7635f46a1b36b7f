"""Source specs -> files (or hub datasets) -> one `datasets.Dataset` of documents with a `text` column.

Spec forms are listed in moep_ds/data/config.py. Local files are read by the `datasets` builders
("text" by paragraph/line/document, "json" for .json/.jsonl, "parquet"); invalid UTF-8 in text files is
replaced by U+FFFD, and the invalid bytes are counted (and warned about) while the files are hashed.
"""
from __future__ import annotations

import codecs
import glob
import hashlib
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moep_ds.data import builtin
from moep_ds.data.config import DataConfig
from moep_ds.data.errors import DataError

logger = logging.getLogger(__name__)

BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".train": "text", ".dev": "text", ".test": "text",
            ".json": "json", ".jsonl": "json", ".parquet": "parquet"}  # .train/.dev/.test: BabyLM's text files
DEFAULT_BUILTIN_MB = 4.0
_SURROGATE = re.compile("[\udc80-\udcff]")  # invalid UTF-8 bytes as decoded by 'surrogateescape'
_CHUNK = 4 << 20
# how a recipe whose own corpus is absent (offline, not downloaded) can still run
FALLBACK = "to train on the local corpus instead: --set data.source=shared:corpus"


def shared_data_dir() -> Path:
    """$MOEP_DATA_DIR, default `<repo>/../shared/data`."""
    env = os.environ.get("MOEP_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data"


@dataclass
class Part:
    """A run of local files read by one builder, or one hub dataset (`files` empty) and the split read from it."""

    builder: str
    files: list[Path] = field(default_factory=list)
    hub: tuple[str, str | None] | None = None
    split: str = "train"

    def describe(self) -> str:
        if self.hub:
            return f"hub dataset {self.hub[0]}" + (f" ({self.hub[1]})" if self.hub[1] else "") + \
                (f" ({self.split} split)" if self.split != "train" else "")
        return f"{len(self.files)} {self.builder} file(s) starting with {self.files[0]}"


def resolve_sources(specs: list[str], hub_split: str = "train") -> list[Part]:
    """Expand specs into parts, in order (hub datasets read `hub_split`); raises DataError for anything that
    names no file."""
    parts: list[Part] = []
    for spec in specs:
        if spec.startswith("hf:"):
            name, _, config = spec[3:].partition(":")
            parts.append(Part("hub", hub=(name, config or None), split=hub_split))
            continue
        for path in expand_spec(spec):
            builder = BUILDERS.get(path.suffix.lower(), "text")
            if parts and parts[-1].builder == builder and not parts[-1].hub:
                parts[-1].files.append(path)
            else:
                parts.append(Part(builder, [path]))
    return parts


def expand_spec(spec: str) -> list[Path]:
    if spec == "builtin" or spec.startswith("builtin:"):
        size = spec.partition(":")[2] or str(DEFAULT_BUILTIN_MB)
        try:
            megabytes = float(size)
        except ValueError:
            raise DataError(f"source {spec!r}: size {size!r} is not a number of megabytes") from None
        if not 0 < megabytes <= 64:
            raise DataError(f"source {spec!r}: size must be in (0, 64] megabytes")
        return [builtin.corpus_path(megabytes)]
    if spec.startswith("shared:"):
        path = shared_data_dir() / spec[len("shared:"):]
        if not path.exists():
            raise DataError(f"shared data {spec!r} not found at {path} (set MOEP_DATA_DIR to the folder holding it; "
                            f"README 'Data' says where to download it); {FALLBACK}")
        return expand_path(path)
    if any(ch in spec for ch in "*?["):
        matches = [Path(p) for p in sorted(glob.glob(os.path.expanduser(spec), recursive=True)) if Path(p).is_file()]
        if not matches:
            raise DataError(f"source glob {spec!r} matches no files")
        return matches
    path = Path(spec).expanduser()
    if not path.exists():
        raise DataError(f"source path not found: {spec}")
    return expand_path(path)


def megatron_prefix(prefix: str, field: str) -> Path:
    """The absolute PREFIX of a megatron:PREFIX spec (shared:NAME/x resolves under the shared data folder), after
    checking that PREFIX.bin and PREFIX.idx exist; else one line saying where they are expected."""
    path = shared_data_dir() / prefix[len("shared:"):] if prefix.startswith("shared:") else Path(prefix).expanduser()
    missing = [p for p in (Path(f"{path}.bin"), Path(f"{path}.idx")) if not p.is_file()]
    if missing:
        raise DataError(f"{field}: Megatron data {missing[0]} not found (expected {path}.bin + {path}.idx; README "
                        f"'Pythia's data' says how to download it); {FALLBACK}")
    return path.resolve()


def expand_path(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise DataError(f"source folder {path} holds no {'/'.join(sorted(BUILDERS))} files")
    return files


def scan_file(path: Path, text: bool) -> dict[str, Any]:
    """sha256, size and (for text-like files) the number of invalid UTF-8 bytes, in one pass."""
    digest, invalid, size = hashlib.sha256(), 0, 0
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            if text:
                invalid += len(_SURROGATE.findall(decoder.decode(chunk)))
    if text:
        invalid += len(_SURROGATE.findall(decoder.decode(b"", final=True)))
    return {"path": str(path.resolve()), "bytes": size, "sha256": digest.hexdigest(), "invalid_utf8_bytes": invalid}


def scan_sources(parts: list[Part]) -> list[dict[str, Any]]:
    """Fingerprints of every source (recorded in meta.json); warns about invalid UTF-8; rejects empty input."""
    scans = []
    for part in parts:
        if part.hub:
            scans.append({"hub": part.hub[0], "config": part.hub[1]})
            continue
        for path in part.files:
            scan = scan_file(path, text=part.builder != "parquet")
            if scan["invalid_utf8_bytes"]:
                logger.warning("%s: %d invalid UTF-8 byte(s) replaced by U+FFFD", path, scan["invalid_utf8_bytes"])
            scans.append(scan)
    local = [s for s in scans if "bytes" in s]
    if len(local) == len(scans) and sum(s["bytes"] for s in local) == 0:
        raise DataError(f"empty corpus: {len(local)} source file(s), 0 bytes (first: {local[0]['path']})")
    return scans


def load_documents(parts: list[Part], cfg: DataConfig, cache_dir: Path):
    """All parts as one `datasets.Dataset` with a single string column `text`, in source order."""
    import datasets

    loaded = []
    for part in parts:
        try:
            ds = _load_part(part, cfg, str(cache_dir))
        except DataError:
            raise
        except Exception as err:  # datasets/pyarrow raise many types; report the root cause in one line
            if part.hub:
                raise DataError(f"cannot load {part.describe()} from the hub or, offline, from the Hugging Face cache "
                                f"({root_cause(err)}); {FALLBACK}") from err
            raise DataError(f"cannot read {part.describe()}: {root_cause(err)}") from err
        field_name = "text" if part.builder == "text" else cfg.text_field
        if field_name not in ds.column_names:
            raise DataError(f"{part.describe()} has no column {field_name!r} (columns: {', '.join(ds.column_names)}); "
                            f"set data.text_field")
        check_text_column(ds, field_name, part)
        ds = ds.select_columns([field_name])
        if field_name != "text":
            ds = ds.rename_column(field_name, "text")
        features = datasets.Features({"text": datasets.Value("string")})
        try:
            loaded.append(ds if ds.features == features else ds.cast(features))
        except Exception as err:  # pyarrow's ArrowInvalid: binary text that is not UTF-8
            raise DataError(f"{part.describe()}: column {field_name!r} cannot be read as text: {root_cause(err)}") \
                from None
    return loaded[0] if len(loaded) == 1 else datasets.concatenate_datasets(loaded)


def check_text_column(ds, field_name: str, part: Part) -> None:
    """The text field must hold strings (or nulls, blank documents): casting an object fails deep inside
    `datasets`, and a number column would train a tokenizer on digit strings."""
    import pyarrow as pa

    kind = ds.data.schema.field(field_name).type
    # binary: parquet text written without the UTF8 annotation (some Spark/Hive writers); the cast decodes it
    if not any(is_kind(kind) for is_kind in (pa.types.is_string, pa.types.is_large_string, pa.types.is_null,
                                              pa.types.is_binary, pa.types.is_large_binary)):
        raise DataError(f"{part.describe()}: column {field_name!r} holds {kind}, not text; set data.text_field to "
                        f"a string column (columns: {', '.join(ds.column_names)})")


def _load_part(part: Part, cfg: DataConfig, cache_dir: str):
    import datasets

    if part.hub:
        name, config = part.hub
        return datasets.load_dataset(name, config, split=part.split, cache_dir=cache_dir)
    files = [str(p) for p in part.files]
    if part.builder == "text":
        return datasets.load_dataset("text", data_files=files, split="train", cache_dir=cache_dir,
                                     sample_by=cfg.sample_by, encoding_errors="replace")
    if part.builder == "json":
        # any encoding name but "utf-8" makes the json builder decode with encoding_errors (and -sig drops a BOM)
        return datasets.load_dataset("json", data_files=files, split="train", cache_dir=cache_dir,
                                     encoding="utf-8-sig", encoding_errors="replace")
    return datasets.load_dataset(part.builder, data_files=files, split="train", cache_dir=cache_dir)


def root_cause(err: BaseException) -> str:
    """First line of the innermost exception ('An error occurred while generating the dataset' says little)."""
    while err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__):
        err = err.__cause__ or err.__context__
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
