"""Paths the tests share: the repository, its recipes, and the shared data folder (MOEP_DATA_DIR overrides).

Import as `from repo_paths import ...` (a module name of its own: every folder's conftest.py is a module
named `conftest`, so importing names from one is ambiguous)."""
import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
SHARED_DATA = pathlib.Path(os.environ.get("MOEP_DATA_DIR", REPO.parent / "shared" / "data"))
