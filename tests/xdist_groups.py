"""The suite's scheduling under pytest-xdist (conftest.py's `pytest_xdist_make_scheduler`): the tests of a module or
folder that defines a shared fixture go to one worker."""
import ast
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

SHARED_SCOPES = ("module", "package", "session")


def fixture_groups(tests: Path) -> list[str]:
    """The test modules that define a module-, package- or session-scoped fixture, and the folders whose conftest.py
    does (relative to the repository, as pytest's node ids): their tests share that fixture (a trained run, the SLURM
    cluster). Read with the ast, for the controller of pytest-xdist, which does not collect."""
    groups = []
    for path in sorted(tests.rglob("*.py")):
        if path.parent == tests or not (path.name == "conftest.py" or path.name.startswith("test_")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            decorators = getattr(node, "decorator_list", [])
            if any(isinstance(d, ast.Call) and ast.unparse(d.func) == "pytest.fixture" and any(
                    k.arg == "scope" and isinstance(k.value, ast.Constant) and k.value.value in SHARED_SCOPES
                    for k in d.keywords) for d in decorators):
                where = path.parent if path.name == "conftest.py" else path
                groups.append(where.relative_to(tests.parent).as_posix())
                break
    return groups


class FixtureGroupScheduling(LoadScopeScheduling):
    """pytest-xdist's load scheduling (a test goes to whichever worker is free), except that the tests of a module or
    folder in `groups` go to one worker together, so that their shared fixture is built once (spread over both
    workers, each would build it). xdist hands out the groups first, largest first, then the single tests in
    collection order. (xdist 3.8's own `loadgroup` marks do not take under pytest 9, whose node ids are no longer
    the `_nodeid` xdist rewrites.)"""

    def __init__(self, config, log, groups: list[str]):
        super().__init__(config, log)
        self.groups = groups

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return next((g for g in self.groups if path == g or path.startswith(g + "/")), nodeid)
